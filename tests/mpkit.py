"""Helpers of the multiprocess tests: gdsload loaders handed to `torch.utils.data.DataLoader`
workers and to a `multiprocessing.Pool` under one start method, every wait bounded by a
timeout, and the check that no child process is left behind.

The loaders go to the workers as they are: inherited under "fork", pickled under "spawn" and
"forkserver" (and always pickled as `Pool` task arguments). Worker w of n yields the batches
i = w, w + n, ... of the loaders chained, tagged with i, so the parent can check that together
they deliver every batch once, in order, with the values its own loaders give.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Iterator, Sequence
from multiprocessing import forkserver, resource_tracker
from typing import Any

import numpy as np
import torch

METHODS = ("fork", "spawn", "forkserver")
TIMEOUT_S = 90  # per batch for torch's workers, per map for the pool: a hang fails, never blocks CI


def numpy_batch(batch: dict[str, Any]) -> dict[str, Any]:
    return {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def assert_same(got: dict[str, Any], want: dict[str, Any], where: str) -> None:
    got, want = numpy_batch(got), numpy_batch(want)
    assert list(got) == list(want), f"{where}: fields {list(got)} != {list(want)}"
    for k, w in want.items():
        g = got[k]
        if isinstance(w, np.ndarray):
            assert g.dtype == w.dtype and g.shape == w.shape, f"{where} {k}: {g.dtype}{g.shape} != {w.dtype}{w.shape}"
            assert g.tobytes() == w.tobytes(), f"{where} {k}: values differ"
        else:
            assert g == w, f"{where} {k}: {g!r} != {w!r}"


def _part(loaders: Sequence[Any], w: int, n: int) -> Iterator[tuple[int, Any]]:
    i = 0
    for loader in loaders:
        for batch in loader:
            if i % n == w:
                yield i, batch
            i += 1


class Split(torch.utils.data.IterableDataset):
    """torch worker w of n takes the batches i = w, w + n, ... (torch hands them out round-robin)."""

    def __init__(self, loaders: Sequence[Any]):
        self.loaders = list(loaders)

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        info = torch.utils.data.get_worker_info()
        n, w = (info.num_workers, info.id) if info is not None else (1, 0)
        return _part(self.loaders, w, n)


def via_torch(loaders: Sequence[Any], method: str, workers: int = 2) -> list[tuple[int, dict[str, Any]]]:
    """What `torch.utils.data.DataLoader(num_workers=workers)` delivers, in its order; its workers
    must then exit by themselves (torch terminates one that does not, exit code -15)."""
    dl = torch.utils.data.DataLoader(Split(loaders), batch_size=None, num_workers=workers,
                                     multiprocessing_context=method, timeout=TIMEOUT_S)
    it = iter(dl)
    got = [(i, numpy_batch(b)) for i, b in it]
    codes = [w.exitcode for w in it._workers]
    assert codes == [0] * workers, f"torch workers' exit codes: {codes}"
    return got


def _pool_part(args: tuple[Sequence[Any], int, int]) -> tuple[int, list[tuple[int, dict[str, Any]]]]:
    loaders, w, n = args
    return os.getpid(), [(i, numpy_batch(b)) for i, b in _part(loaders, w, n)]


def via_pool(loaders: Sequence[Any], method: str, workers: int = 2) -> list[tuple[int, dict[str, Any]]]:
    """What `multiprocessing.Pool(workers)` tasks deliver, one task per part, sorted by batch; each
    part's batches must come in order, and the workers must exit by themselves after `close()`."""
    pool = mp.get_context(method).Pool(workers)
    try:
        results = pool.map_async(_pool_part, [(loaders, w, workers) for w in range(workers)],
                                 chunksize=1).get(TIMEOUT_S)
        pool.close()
        pids = {pid for pid, _ in results}
        deadline = time.monotonic() + TIMEOUT_S
        while (stuck := pids & _running(child_pids())) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        pool.terminate()
        pool.join()
    assert not stuck, f"pool workers {sorted(stuck)} did not exit after close()"
    for w, (_, part) in enumerate(results):
        indices = [i for i, _ in part]
        assert indices == sorted(indices) and all(i % workers == w for i in indices), (w, indices)
    return sorted((x for _, part in results for x in part), key=lambda x: x[0])


def _running(pids: set[int]) -> set[int]:
    """The pids that are not zombies (a zombie has exited; its parent has yet to reap it)."""
    alive = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    alive.add(pid)
        except OSError:
            pass
    return alive


def child_pids() -> set[int]:
    """This process's children (zombies too), less multiprocessing's session-long helpers (the
    forkserver and the resource tracker)."""
    me, pids = os.getpid(), set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == me:
                pids.add(int(entry))
    helpers = {getattr(forkserver._forkserver, "_forkserver_pid", None),
               getattr(resource_tracker._resource_tracker, "_pid", None)}
    return pids - helpers


def assert_no_new_children(before: set[int], wait_s: float = 10.0) -> None:
    deadline = time.monotonic() + wait_s
    while (left := child_pids() - before) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes left behind: {sorted(left)}"
