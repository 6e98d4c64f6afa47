"""`gdsload.process(..., engine="ray")`: the pass's units as Ray tasks.

As `gdsload convert --engine ray` (`gdsload.convert.ray_engine`, whose `RaySession` this uses):
the driver checks the options, prepares DST and writes the manifest; each unit (an input shard's
windows into its own output shards, `gdsload.preprocess.unit.run_unit`) is one Ray task, scheduled by
Ray, retried by Ray where its worker dies (`MAX_RETRIES`; the retry finds the unit's recorded
shards and continues after them). The output bytes are those of a local pass. `fn` travels to the
workers with the task (cloudpickle); a class is instantiated once per worker process.
Tasks read the source and write DST by the path the driver was given (absolute), so on more than
one node both must be on a filesystem every node mounts at the same path, or fsspec URLs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gdsload.convert.ray_engine import RaySession, import_ray
from gdsload.preprocess.options import PassOptions

MAX_RETRIES = 3
IN_FLIGHT_PER_CPU = 2


def dst_path(path: str) -> str:
    """A local path made absolute (tasks run in other working directories); a URL as it is."""
    from pathlib import Path

    from gdsload.io import is_remote

    return path if is_remote(path) else str(Path(path).absolute())


def _task(src: str, dst: str, unit: int, opts: PassOptions, fields: list[str], fn: Any) -> dict[str, Any]:
    from gdsload.dataset.sharded import ShardedDataset
    from gdsload.io.store import open_store
    from gdsload.preprocess.unit import run_unit

    with ShardedDataset(src) as ds:
        return run_unit(ds, open_store(dst), unit, opts, fields, fn, threads=1)  # a task holds one CPU


def run_ray(src: str, dst: str, todo: list[int], opts: PassOptions, fields: list[str], fn: Any,
            workers: int | None, address: str | None, on_unit: Callable[[dict[str, Any]], None]) -> list[dict[str, Any]]:
    """Run `todo`'s units as Ray tasks (a local instance of `workers` CPUs, default all cores,
    unless `address` or `$RAY_ADDRESS` names a cluster); results in unit order."""
    import os

    import_ray()
    if not todo:
        return []
    session = RaySession(address, workers or os.cpu_count() or 1)
    try:
        ray = session.ensure()
        task = ray.remote(max_retries=MAX_RETRIES, retry_exceptions=[OSError])(_task)
        cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
        src_abs, dst_abs = dst_path(src), dst_path(dst)
        fn_ref = ray.put(fn)
        queue = list(reversed(todo))
        pending: dict[Any, int] = {}
        results: dict[int, dict[str, Any]] = {}
        try:
            while queue or pending:
                while queue and len(pending) < IN_FLIGHT_PER_CPU * cpus:
                    u = queue.pop()
                    pending[task.remote(src_abs, dst_abs, u, opts, fields, fn_ref)] = u
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)
                for ref in ready:
                    u = pending.pop(ref)
                    try:
                        results[u] = ray.get(ref)
                    except ray.exceptions.RayTaskError as exc:
                        cause = exc.cause if isinstance(exc.cause, BaseException) else exc
                        if hasattr(cause, "add_note"):
                            cause.add_note(f"while processing input shard {u} in a Ray task")
                        raise cause from None
                    on_unit(results[u])
        finally:
            for ref in pending:
                ray.cancel(ref)
    finally:
        session.close()
    return [results[u] for u in todo]
