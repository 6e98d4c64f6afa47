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



class ConfigError(GdsloadError, ValueError):
    """An invalid loader option (`DataLoader`, `RemoteLoader`, a feed request): the message names
    the option, the value and what is valid. A `ValueError` too, so `except ValueError` works."""


class SizeError(GdsloadError, ValueError):
    """A size that is not a positive number of bytes with a known unit."""


# -- plan ---------------------------------------------------------------------------------------
class PlanError(GdsloadError, ValueError):
    """An argument of the plan is invalid (a batch size of 0, a rank outside the world, ...)."""


class StateError(PlanError):
    """A saved loader state is malformed or does not belong to this plan."""


# -- ring ---------------------------------------------------------------------------------------
class RingError(GdsloadError):
    """The ring protocol was misused: a seq out of order or twice, a slot not held, a bad spec."""


class RingClosed(RingError):
    """The ring was closed; producers and the consumer should stop."""


class RingTimeout(RingError, TimeoutError):
    """A blocking ring call ran out of time (`timeout` seconds; 0 means do not block)."""


class PassStopped(GdsloadError):
    """`next()` on a pass that `load_state_dict()` or `set_epoch()` stopped: the loader's next
    `iter()` starts from the loaded (or set) state; the stopped pass hands out nothing more."""


# -- decode, cache, user code ---------------------------------------------------------------------
class DecodeError(GdsloadError):
    """An image could not be decoded; the message names its shard and key.

    `reason` is the message without its `remedy` (how to skip such samples), so that the feed
    server can word the remedy in protocol terms instead of Python arguments."""

    def __init__(self, reason: str, *, remedy: str = ""):
        super().__init__(f"{reason}; {remedy}" if remedy else reason)
        self.reason = reason
        self.remedy = remedy


class CacheFullError(GdsloadError):
    """The cache limit cannot hold the shards the loader needs at once."""


class PoolClosed(GdsloadError):
    """The pool was closed while a task was pending."""


class WorkerDied(GdsloadError):
    """A worker process ended without being asked (killed, out of memory, a crash in C code)."""


class WorkerTimeout(GdsloadError, TimeoutError):
    """A worker process did not return a batch within the loader's `timeout=` (stopped, stuck,
    or slower than the limit); the message names the worker."""


# -- the feed -------------------------------------------------------------------------------------
class ProtocolError(GdsloadError):
    """The server sent chunks that do not form a batch (a bug or a broken stream)."""


class ServiceError(GdsloadError):
    """An error the feed server reports on purpose; subclasses pick the status code."""


class UnknownDataset(ServiceError):
    """No dataset of that name below the server's roots."""


class BadRequest(ServiceError):
    """The request is malformed (a missing name, an unknown field, a bad transform)."""


class OverLimit(ServiceError):
    """The request is valid but over one of the server's `Limits`."""


class DatasetChanged(ServiceError):
    """The client planned with another version of the dataset than the server has now."""


class Unavailable(ServiceError):
    """The server cannot take the call now (at capacity, shutting down); retry later or elsewhere."""


class Unauthenticated(ServiceError):
    """Missing or wrong bearer token."""


class PermissionDenied(ServiceError):
    """The caller's credentials do not allow what it asked (a priority over its limit)."""


class RemoteError(GdsloadError):
    """A feed call failed; `code` is the gRPC status code name, `address` the server."""

    def __init__(self, message: str, *, code: str, address: str | None = None):
        super().__init__(message)
        self.code = code
        self.address = address

    def __reduce__(self):
        # keyword-only arguments: the default (positional args) cannot rebuild it when it travels
        # from a worker process (a Pool task, a torch DataLoader worker) to its parent
        return _remote_error, (type(self), self.args[0], self.code, self.address)


def _remote_error(cls: type[RemoteError], message: str, code: str, address: str | None) -> RemoteError:
    return cls(message, code=code, address=address)


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
