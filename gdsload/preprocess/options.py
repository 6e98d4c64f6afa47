"""A pass's options, checked once, and the user's `fn`: named, loaded, instantiated per process.

`PassOptions.record()` is what decides the output bytes (with the source and `fn`'s name): it is
kept in the resume record and compared by `resume=True`. `workers`, `engine`, `feed` and
`priority` decide where the pass runs, not what it writes, and are not in it.
"""

from __future__ import annotations

import importlib
from dataclasses import asdict, dataclass
from typing import Any, Literal

from gdsload.errors import InputError
from gdsload.sizes import parse_size

MAX_HOURS = 24.0  # default limit on one member's length (hours, from the index); longer: on_error


@dataclass(frozen=True)
class PassOptions:
    mode: Literal["frames", "speech"]
    fps: float | None = None
    window: int | None = None
    chunk_s: float | None = None
    fields: tuple[str, ...] | None = None
    size: int | None = None
    batch_size: int = 16
    shard_size: int = 1 << 30
    on_error: Literal["raise", "skip"] = "raise"
    max_hours: float = MAX_HOURS

    def record(self) -> dict[str, Any]:
        d = asdict(self)
        d["fields"] = list(self.fields) if self.fields is not None else None
        return d


def _positive(name: str, v: Any, kind: type = float) -> Any:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
    if kind is int:
        ok = ok and float(v).is_integer()
    if not ok:
        raise InputError(f"process({name}={v!r}): a positive {'integer' if kind is int else 'number'} is needed")
    return kind(v)


def make_options(*, frames: Any, speech: Any, fields: Any, size: Any, batch_size: Any, shard_size: Any,
                 on_error: Any, max_hours: Any) -> PassOptions:
    """The checked options; each bad value is named with what would be valid."""
    if (frames is None) == (speech is None):
        raise InputError("process: give exactly one of frames=(fps, window) and speech=chunk_s")
    fps = window = chunk = None
    if frames is not None:
        if not isinstance(frames, (tuple, list)) or len(frames) != 2:
            raise InputError(f"process(frames={frames!r}): a pair (fps, window), e.g. (1.0, 8)")
        fps, window = _positive("frames fps", frames[0]), _positive("frames window", frames[1], int)
    else:
        chunk = _positive("speech", speech)
    if fields is not None:
        if isinstance(fields, str):
            fields = [f for f in fields.split(",") if f]
        fields = tuple(fields)
        if not fields or not all(isinstance(f, str) and f for f in fields):
            raise InputError(f"process(fields={fields!r}): a list of field names, or None for every media field")
    if size is not None:
        size = _positive("size", size, int)
    if on_error not in ("raise", "skip"):
        raise InputError(f"process(on_error={on_error!r}): 'raise' or 'skip'")
    nbytes = parse_size(shard_size) if isinstance(shard_size, str) else int(shard_size)
    if nbytes < 16 << 10:
        raise InputError(f"process(shard_size={shard_size!r}): at least 16 KiB")
    return PassOptions(mode="frames" if frames is not None else "speech", fps=fps, window=window, chunk_s=chunk,
                       fields=fields, size=size, batch_size=_positive("batch_size", batch_size, int),
                       shard_size=nbytes, on_error=on_error, max_hours=_positive("max_hours", max_hours))


def fn_name(fn: Any) -> str:
    """`module:qualname` of `fn` (a function, a class, or an instance of a class with `__call__`)."""
    target = fn if isinstance(fn, type) or hasattr(fn, "__qualname__") else type(fn)
    return f"{getattr(target, '__module__', '?')}:{getattr(target, '__qualname__', type(fn).__name__)}"


def load_fn(spec: str) -> Any:
    """`MODULE:FUNC` (FUNC may be dotted: `mod:Class.method`) imported."""
    mod, sep, name = spec.partition(":")
    if not sep or not mod or not name:
        raise InputError(f"--fn {spec!r}: MODULE:FUNC is needed, e.g. mypkg.models:ocr")
    try:
        obj: Any = importlib.import_module(mod)
    except ImportError as exc:
        raise InputError(f"--fn {spec!r}: cannot import {mod!r} ({exc})") from None
    for part in name.split("."):
        if not hasattr(obj, part):
            raise InputError(f"--fn {spec!r}: module {mod!r} has no {name!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise InputError(f"--fn {spec!r}: {name!r} is not callable")
    return obj


_INSTANCES: dict[str, Any] = {}  # fn name -> its instance in this process (a class given as fn)


def callable_of(fn: Any) -> Any:
    """What is called per batch: `fn`, or for a class its one instance in this process (a model
    loads once per process)."""
    if not isinstance(fn, type):
        return fn
    key = fn_name(fn)
    inst = _INSTANCES.get(key)
    if inst is None:
        inst = _INSTANCES[key] = fn()
    return inst
