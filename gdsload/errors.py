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


class StorageError(GdsloadError):
    """Stored bytes could not be read: a disk, file-system or network fault (an I/O error, a file
    that vanished or cannot be opened, a reset connection), not a bad request.

    `transient` is True here: the data may well be intact, and a later try or another copy (another
    server of the same dataset) may succeed. `CorruptDataError` is the kind where it is False."""

    transient = True


class CorruptDataError(StorageError, FormatError):
    """Storage answered, but with bytes that cannot be right (a shard shorter than its index
    says): this copy is corrupt. Retrying it does not help; another copy may be intact."""

    transient = False


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
