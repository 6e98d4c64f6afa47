"""The user-code stage: `map(sample) -> sample` per sample, then `collate_fn(samples) -> batch`.

Meaning as in PyTorch and webdataset: `map` runs on each decoded sample (a dict: every field of
the table in `gdsload.frontend.fields`, as NumPy arrays / str / objects / bytes, plus "__key__" and, in a
mix, "__source__"; with `fields=[...]`, only those fields are read and the batch is not made a
tuple: it is what the collate makes); `collate_fn` receives the list of (mapped) samples of one batch, in plan
order, and its result is the batch, returned as it is. Without `collate_fn`, `default_collate`
stacks arrays of one shape and numbers into one array (lists otherwise), and the loader then
turns arrays into its output type (torch tensors on its device), as without a map.

Cost: the stage sees host copies. The batch is copied once out of the ring slot (device to host
on a GPU host), split into per-sample dicts, mapped in Python, and stacked again by the collate
(a second copy), then moved to the device. Without `map` and `collate_fn` the stage does not
exist and the fast paths (DALI decode into the ring, `.npy` straight into the ring) stay
zero-copy.

Where it runs: `worker_mode="thread"` (default) in the loader's producer threads, so `map` must be
thread-safe and pure-Python work is held to one core by the GIL; `worker_mode="process"` in
`num_workers` spawned processes (`gdsload.frontend.workers`): a batch's columns are pickled to a worker,
which maps and collates there and pickles the batch back. Both keep the plan order, resume,
rank slicing and `on_error` (corrupt images are dropped before the stage).

Errors: an exception raised by `map` (or `collate_fn`) reaches the consumer at that batch with a
note naming the sample's shard and key; it is never skipped (`on_error` is about corrupt data,
not about bugs in user code).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import numpy as np

from gdsload.errors import GdsloadError

WORKER_MODES = ("thread", "process")


def default_collate(samples: Sequence[Any]) -> Any:
    """Stack a list of samples: dicts and tuples by element, same-shape arrays (NumPy or torch)
    with `stack`, numbers into one array; anything else (str, bytes, objects, arrays of several
    shapes) as a list."""
    first = samples[0]
    if isinstance(first, Mapping):
        return {k: default_collate([s[k] for s in samples]) for k in first}
    if isinstance(first, tuple):
        return tuple(default_collate(list(c)) for c in zip(*samples))
    if isinstance(first, (str, bytes)):
        return list(samples)
    if isinstance(first, np.ndarray):
        if all(isinstance(s, np.ndarray) and s.shape == first.shape and s.dtype == first.dtype for s in samples):
            return np.stack(samples)
        return list(samples)
    if isinstance(first, (np.generic, int, float)):
        return np.asarray(samples)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(first, torch.Tensor):
        if all(isinstance(s, torch.Tensor) and s.shape == first.shape for s in samples):
            return torch.stack(list(samples))
    return list(samples)


def host_copy(view: Any) -> np.ndarray:
    """A NumPy copy of a ring view (device views through CuPy's `.get()`)."""
    return view.get() if hasattr(view, "__cuda_array_interface__") else np.array(view)


def to_samples(columns: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A batch dict of columns (arrays or lists, one row per sample) as a list of sample dicts."""
    n = len(columns["__key__"])
    return [{k: col[i] for k, col in columns.items()} for i in range(n)]


def apply(map_fn: Callable | None, collate_fn: Callable | None, task: tuple[dict[str, Any], list[str]]) -> Any:
    """Map each sample of a batch, then collate; `task` is (columns, "shard:key" per sample).
    Runs in a producer thread or a worker process."""
    columns, names = task
    samples = to_samples(columns)
    if map_fn is not None:
        for i, (s, name) in enumerate(zip(samples, names)):
            try:
                samples[i] = map_fn(s)
            except Exception as exc:
                exc.add_note(f"gdsload: raised by map() on sample {name}")
                raise
    if collate_fn is not None:
        try:
            return collate_fn(samples)
        except Exception as exc:
            exc.add_note(f"gdsload: raised by collate_fn() on the batch of samples {names[0] if names else '(empty)'}"
                         f" .. {names[-1] if names else ''}")
            raise
    return default_collate(samples) if samples else columns


def _to_output(obj: Any, convert: Callable[[np.ndarray], Any]) -> Any:
    if isinstance(obj, np.ndarray) and obj.dtype.kind in "biufc":
        return convert(obj)
    if isinstance(obj, dict):
        return {k: _to_output(v, convert) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_output(v, convert) for v in obj)
    return obj


class MapStage:
    """The loader's `map` / `collate_fn` / `worker_mode` settings; `start` begins one epoch's run."""

    def __init__(self, map_fn: Callable | None, collate_fn: Callable | None,
                 worker_mode: Literal["thread", "process"]):
        for name, fn in (("map", map_fn), ("collate_fn", collate_fn)):
            if fn is not None and not callable(fn):
                raise GdsloadError(f"{name} must be a callable or None, got {type(fn).__name__}")
        self.fn = functools.partial(apply, map_fn, collate_fn)
        self.collate_fn = collate_fn
        self.worker_mode = worker_mode
        if worker_mode == "process":
            import pickle

            try:
                pickle.dumps(self.fn)
            except Exception as exc:
                raise GdsloadError(
                    f"worker_mode='process' runs map and collate_fn in spawned processes, so they "
                    f"must be picklable (module-level functions, not lambdas or closures): {exc}"
                ) from exc

    @classmethod
    def create(cls, map_fn: Callable | None, collate_fn: Callable | None, worker_mode: str) -> MapStage | None:
        """The stage, or None when there is no user code (the zero-copy fast paths)."""
        if worker_mode not in WORKER_MODES:
            raise GdsloadError(f"worker_mode must be 'thread' or 'process', not {worker_mode!r}")
        if map_fn is None and collate_fn is None:
            if worker_mode == "process":
                raise GdsloadError("worker_mode='process' runs map / collate_fn in worker processes; "
                                   "give map= or collate_fn= (reading and decoding use threads)")
            return None
        return cls(map_fn, collate_fn, worker_mode)

    timeout: float = 0  # seconds a batch may take in a worker process (the loader's `timeout=`)
    worker_init_fn: Callable[[int], Any] | None = None  # called with the worker's index in each process

    def start(self, workers: int) -> MapRun:
        return MapRun(self, workers, timeout=self.timeout)


class MapRun:
    """One epoch of the stage: in process mode it owns the worker pool (closed with the epoch).
    `timeout` (seconds, 0 = forever): how long a batch may take in a worker process."""

    def __init__(self, stage: MapStage, workers: int, *, timeout: float = 0):
        self.stage = stage
        self.timeout = timeout
        self.pool = None
        if stage.worker_mode == "process" and workers > 0:  # 0 workers: in the reading thread, as torch's 0
            from gdsload.frontend.workers import WorkerPool

            self.pool = WorkerPool(stage.fn, workers, name="gdsload-map", init=stage.worker_init_fn)

    def run(self, columns: dict[str, Any], names: list[str], convert: Callable[[np.ndarray], Any]) -> Any:
        """The batch of `columns` (host copies) after map and collate; raises RingClosed when the
        run was closed meanwhile."""
        if self.pool is None:
            out = self.stage.fn((columns, names))
        else:
            from gdsload.errors import RingClosed
            from gdsload.frontend.workers import PoolClosed

            try:
                out = self.pool.result(self.pool.submit((columns, names)), self.timeout)
            except PoolClosed as exc:
                raise RingClosed("loader closed") from exc
        if self.stage.collate_fn is not None:
            return out
        return _to_output(out, convert)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
