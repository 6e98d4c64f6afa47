"""The one error hierarchy of gdsload.

Every error a user can cause (bad input, a wrong path, a state from another dataset) is a
`GdsloadError`; its message names the bad value and, where it helps, what would be valid. The CLI
prints the message and exits non-zero; library callers catch the specific subclass.
"""

from __future__ import annotations


class GdsloadError(Exception):
    """Base class of every error gdsload raises on purpose."""


class FormatError(GdsloadError):
    """A shard, index or manifest is malformed, truncated or does not match its contents."""


class InputError(GdsloadError):
    """Conversion input is unusable: hostile or truncated tars, duplicate keys, unknown layout."""


class DestinationError(GdsloadError):
    """The conversion destination already holds a dataset or an interrupted conversion."""


class MissingDependencyError(GdsloadError, ImportError):
    """An optional library is needed for this feature; the message says what to install."""


def require(module: str, *, extra: str, purpose: str):
    """Import `module` on first use, or raise `MissingDependencyError` with an install hint."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:  # pragma: no cover - message path tested via a fake module name
        raise MissingDependencyError(
            f"{purpose} needs the Python module {module!r}, which is not installed; "
            f"install it with: pip install 'gdsload[{extra}]'"
            + (" (or 'gdsload[cuda13]' on a CUDA 13 host)" if extra == "cuda12" else "")
        ) from exc
