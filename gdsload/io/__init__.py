"""Storage backends behind one interface (`Backend`): read byte extents into caller-owned buffers.

| name            | module                          | memory            | needs                    |
| --------------- | ------------------------------- | ----------------- | ------------------------ |
| `posix`         | `gdsload.io.posix`              | host              | nothing (preadv)         |
| `posix-odirect` | `gdsload.io.posix` (O_DIRECT)   | host              | a filesystem allowing it |
| `fsspec`        | `gdsload.io.fsspec_backend`     | host              | fsspec (+ aiohttp, s3fs) |
| `kvikio`        | `gdsload.io.kvikio_backend`     | device or host    | KvikIO, a CUDA device    |

Backends are registered by import path and loaded on first use (fsspec-style), so `import
gdsload.io` costs the standard library and NumPy only. `choose_backend` makes the automatic
choice and `open_backend` builds one; the instance's `name` then says which path is really in use
("kvikio-gds", "kvikio-posix" (KvikIO's POSIX shortcut for small reads and host buffers),
"kvikio-compat", "posix" after an O_DIRECT refusal).

KvikIO that is installed but does not load (on CUDA 13 wheels typically a missing `rapids-logger`:
libkvikio.so is linked against librapids_logger.so, and `libkvikio.load_library()` swallows the
ModuleNotFoundError of `import rapids_logger`) is not the same as KvikIO absent: when device
memory is asked for, `choose_backend` warns once, saying why (`kvikio_import_error()`), before it
falls back to POSIX. An absent KvikIO falls back silently.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import re
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gdsload.host.driver import cuda_device_count  # noqa: F401 (re-exported)
from gdsload.errors import GdsloadError, MissingDependencyError
from gdsload.io.base import PAGE, Backend, Extent, Piece, ReadGroup, coalesce

__all__ = [
    "PAGE",
    "REGISTRY",
    "Backend",
    "BackendSpec",
    "Extent",
    "Piece",
    "ReadGroup",
    "available_backends",
    "choose_backend",
    "coalesce",
    "is_remote",
    "kvikio_import_error",
    "kvikio_usable",
    "local_path",
    "open_backend",
]


@dataclass(frozen=True)
class BackendSpec:
    """Where a backend lives and what it needs: `target` is "module:Class"; `requires` are the
    modules that must import; `hint` says how to install them; `defaults` are constructor kwargs."""

    target: str
    requires: tuple[str, ...] = ()
    hint: str = ""
    defaults: dict[str, Any] = field(default_factory=dict)


REGISTRY: dict[str, BackendSpec] = {
    "posix": BackendSpec("gdsload.io.posix:PosixBackend"),
    "posix-odirect": BackendSpec("gdsload.io.posix:PosixBackend", defaults={"o_direct": True}),
    "fsspec": BackendSpec(
        "gdsload.io.fsspec_backend:FsspecBackend",
        requires=("fsspec",),
        hint="pip install fsspec (plus aiohttp for http(s)://, s3fs for s3://, gcsfs for gs://)",
    ),
    "kvikio": BackendSpec(
        "gdsload.io.kvikio_backend:KvikioBackend",
        requires=("kvikio",),
        hint="pip install 'gdsload[cuda12]' (or 'gdsload[cuda13]' on a CUDA 13 host)",
    ),
}

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_remote(path: str | os.PathLike[str]) -> bool:
    """Where is this? The one answer of the storage layer, used everywhere a path or URL is taken:
    True for a URL read and written through fsspec (`scheme://...`: s3://, gs://, http(s)://,
    memory://, ...); False for a local path, `file://` URLs included (`local_path` strips the
    scheme, and the local file APIs read them)."""
    path = os.fspath(path)
    return bool(_SCHEME.match(path)) and not path.startswith("file://")


def local_path(path: str | os.PathLike[str]) -> Path:
    """A local path, or a `file://` URL, as a `Path` (`is_remote(path)` is False)."""
    return Path(os.fspath(path).removeprefix("file://"))


@functools.cache
def _kvikio_probe() -> tuple[bool, str | None]:
    """(usable, why not when KvikIO is installed but broken); cached for the process."""
    if cuda_device_count() < 1:
        return False, None
    try:
        importlib.import_module("kvikio")
    except ModuleNotFoundError as exc:
        if exc.name == "kvikio":
            return False, None  # not installed
        return False, f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # ImportError/OSError from a native library, or anything else
        return False, f"{type(exc).__name__}: {exc}"
    return True, None


def kvikio_usable() -> bool:
    """KvikIO imports, libcuda.so.1 loads and a CUDA device exists (cached for the process).

    The driver is probed first, so a CPU-only host never imports KvikIO here.
    """
    return _kvikio_probe()[0]


kvikio_usable.cache_clear = _kvikio_probe.cache_clear  # type: ignore[attr-defined]


def kvikio_import_error() -> str | None:
    """Why an installed KvikIO does not load on this GPU host (None: it loads, or is absent)."""
    return _kvikio_probe()[1]


_warned_lock = threading.Lock()
_warned: set[str] = set()


def _warn_once(message: str) -> None:
    with _warned_lock:
        if message in _warned:
            return
        _warned.add(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def choose_backend(path: str, *, device: bool) -> str:
    """The registry name to use for `path`: "fsspec" for URLs (`is_remote`: a `file://` URL is a
    local path); "kvikio" when device buffers are wanted and KvikIO is usable on this host; "posix"
    otherwise (with one warning per process when KvikIO is installed but broken)."""
    if is_remote(path):
        return "fsspec"
    if device:
        if kvikio_usable():
            return "kvikio"
        why = kvikio_import_error()
        if why:
            _warn_once(f"KvikIO is installed but does not load ({why}); device reads fall back to "
                       f"POSIX into pinned host memory plus a host-to-device copy. On CUDA 13 "
                       f"wheels check that rapids-logger is installed (libkvikio needs "
                       f"librapids_logger.so); `gdsload doctor` shows the details")
    return "posix"


def _load(name: str) -> type:
    try:
        spec = REGISTRY[name]
    except KeyError:
        raise GdsloadError(
            f"unknown I/O backend {name!r}; valid names: {', '.join(['auto', *REGISTRY])}"
        ) from None
    for module in spec.requires:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise MissingDependencyError(
                f"the {name!r} I/O backend needs the Python module {module!r}, which is not "
                f"installed or does not load ({exc}); install it with: {spec.hint}"
            ) from exc
    module_name, _, attr = spec.target.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def open_backend(
    name: str = "auto", *, path: str | None = None, device: bool = False, **kwargs: Any
) -> Backend:
    """Build the backend `name` (a REGISTRY key), or the one `choose_backend(path, device=...)`
    picks for "auto" (a local path when `path` is None). `kwargs` go to its constructor."""
    if name == "auto":
        name = choose_backend(path or os.curdir, device=device)
    cls = _load(name)
    return cls(**{**REGISTRY[name].defaults, **kwargs})


def available_backends() -> list[str]:
    """Registry names that can work on this host now."""
    names = ["posix"]
    if hasattr(os, "O_DIRECT"):
        names.append("posix-odirect")
    if importlib.util.find_spec("fsspec") is not None:
        names.append("fsspec")
    if kvikio_usable():
        names.append("kvikio")
    return names
