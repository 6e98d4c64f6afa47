"""`worker_mode="process"`: `map` in spawned worker processes keeps the plan order, rank slicing,
`state_dict()` resume and error reporting, and leaves no process or thread behind (after a
`break`, an exception in `map`, or SIGTERM of the parent). Spawning is slow (each worker imports
gdsload and NumPy), so the tests are few and share one dataset; image fields are left out where
they are not the point, so neither the workers nor the SIGTERM child import DALI."""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import fieldsample as fs
from gdsload.loader.dataloader import DataLoader

FIELDS = ("txt", "json", "cls", "tokens.npy", "emb.npy", "__key__")


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("procs")
    fs.make_source(root / "src")
    fs.convert_source(root / "src", root / "ds")
    return root / "ds"


def loader(path, **kw) -> DataLoader:
    kw.setdefault("batch_size", 3)
    kw.setdefault("num_workers", 2)
    kw.setdefault("device", "cpu")
    kw.setdefault("decode", True)
    return DataLoader(str(path), **kw)


def as_numpy(batch: dict) -> dict:
    return {k: (v.numpy() if hasattr(v, "numpy") else v) for k, v in batch.items()}


def same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        x, y = as_numpy(x), as_numpy(y)
        assert x.keys() == y.keys()
        for k in x:
            if isinstance(x[k], np.ndarray):
                assert np.array_equal(x[k], y[k]), k
            else:
                assert x[k] == y[k], k


def nothing_left(before_threads: set, timeout_s: float = 15.0) -> tuple[list, list]:
    deadline = time.monotonic() + timeout_s
    while True:
        gc.collect()
        procs = multiprocessing.active_children()
        threads = [t.name for t in threading.enumerate() if t not in before_threads and t.is_alive()]
        if (not procs and not threads) or time.monotonic() > deadline:
            return procs, threads
        time.sleep(0.1)


def test_process_map_equals_thread_map_on_a_rank_slice_in_order(path):
    kw = dict(shuffle=True, seed=11, rank=1, world_size=2, fields=FIELDS)
    threads = list(loader(path, map=fs.caption_map, **kw))
    procs = list(loader(path, map=fs.caption_map, worker_mode="process", **kw))
    same(procs, threads)
    keys = [k for b in procs for k in b["__key__"]]
    rank0 = [k for b in loader(path, **kw | {"rank": 0}) for k in b[-1]]  # no map: tuples
    assert sorted(keys + rank0) == sorted(f"s{i:03d}" for i in range(fs.N))  # disjoint slices


def test_process_collate_fn_equals_thread_collate_fn_in_order(path):
    """A user `collate_fn` (padding ragged token rows) gives the same batches in worker processes
    as in threads."""
    kw = dict(shuffle=True, seed=3, fields=FIELDS, collate_fn=fs.pad_collate)
    threads = list(loader(path, **kw))
    procs = list(loader(path, worker_mode="process", **kw))
    assert len(threads) == -(-fs.N // 3) and all(isinstance(b, dict) for b in threads)
    same(procs, threads)


def test_resume_mid_epoch_gives_exactly_the_remaining_batches(path):
    kw = dict(shuffle=True, seed=4, fields=FIELDS, map=fs.caption_map, collate_fn=None)
    reference = list(loader(path, **kw))  # threads
    before = set(threading.enumerate())
    lo = loader(path, worker_mode="process", **kw)
    head = []
    for b in lo:
        head.append(b)
        if len(head) == 3:
            break
    state = lo.state_dict()
    del lo, b
    procs, threads = nothing_left(before)
    assert procs == [] and threads == []  # a `break` ends the workers
    lo = loader(path, worker_mode="process", **kw)
    lo.load_state_dict(state)
    rest = list(lo)
    same(head + rest, reference)
    del lo
    assert nothing_left(before) == ([], [])


def test_exception_in_map_reaches_the_caller_with_shard_key_and_worker_traceback(path):
    before = set(threading.enumerate())
    lo = loader(path, fields=FIELDS, map=fs.failing_map, worker_mode="process")
    with pytest.raises(fs.MapBoom, match="bad sample") as info:
        list(lo)
    notes = "\n".join(info.value.__notes__)
    assert ".tar:s010" in notes and "traceback in the worker process" in notes and "failing_map" in notes
    del lo, info
    assert nothing_left(before) == ([], [])


def test_sigterm_of_the_parent_leaves_no_worker_process(path, tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import multiprocessing, sys, time
        import fieldsample as fs
        from gdsload.loader.dataloader import DataLoader

        if __name__ == "__main__":
            lo = DataLoader({str(path)!r}, batch_size=2, num_workers=2, device="cpu", output="numpy",
                            fields={FIELDS!r}, map=fs.slow_map, worker_mode="process")
            for i, b in enumerate(lo):
                if i == 0:
                    print(" ".join(str(p.pid) for p in multiprocessing.active_children()), flush=True)
                time.sleep(0.5)
    """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1]), *sys.path]))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, env=env, text=True)
    try:
        line = proc.stdout.readline()
        pids = [int(p) for p in line.split()]
        assert len(pids) == 2, line
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == -signal.SIGTERM
        deadline = time.monotonic() + 10
        alive = pids
        while alive and time.monotonic() < deadline:
            alive = [p for p in alive if _running(p)]
            time.sleep(0.1)
        assert alive == [], f"worker processes {alive} outlived their parent"
    finally:
        proc.kill()
        proc.wait()


def _running(pid: int) -> bool:
    """Whether `pid` is a live (not zombie) process, from /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


@pytest.mark.dali
def test_clip_style_example_runs_tiny(tmp_path):
    example = Path(__file__).parents[2] / "examples" / "train_clip_style.py"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[2]), *sys.path]),
               TMPDIR=str(tmp_path))
    out = subprocess.run([sys.executable, str(example), "--tiny"], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    import json

    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["steps"] == 2 * (48 // 8) and np.isfinite(result["last_loss"])


def test_a_killed_worker_fails_the_loop_instead_of_hanging(path):
    from gdsload.frontend.workers import WorkerDied

    before = set(threading.enumerate())
    others = set(multiprocessing.active_children())  # an earlier test's child may still be exiting
    lo = loader(path, fields=FIELDS, map=fs.slow_map, worker_mode="process", batch_size=2)
    it = iter(lo)
    next(it)
    ours = [p for p in multiprocessing.active_children() if p not in others]
    assert ours, "the loader started no worker process"
    os.kill(ours[0].pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerDied, match="died with exit code -9"):
        for _ in it:
            pass
    assert time.monotonic() - t0 < 30
    del it, lo
    assert nothing_left(before) == ([], [])


def test_a_worker_killed_while_idle_fails_the_next_submit():
    """Before: a worker killed between tasks went unnoticed while the other one kept answering
    (death was looked for only when no result came for a while), so the loop went on with half
    its workers, or ended without a word. Now the next submit raises WorkerDied."""
    from gdsload.frontend.workers import WorkerDied, WorkerPool

    pool = WorkerPool(abs, 2)
    try:
        assert pool.submit(-3).result(timeout=60) == 3
        victim = pool.procs[0]
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(10)
        with pytest.raises(WorkerDied, match="died with exit code -9"):
            pool.submit(-4)
    finally:
        pool.close()


def test_a_stopped_worker_times_out_naming_it(path):
    """Before: a worker SIGSTOPped mid-epoch left the training loop waiting forever. Now
    `timeout=` (seconds to wait for a batch from a worker, as in torch; 0 waits forever) raises
    `WorkerTimeout` naming the worker that holds the batch, and the epoch's workers are gone."""
    from gdsload.errors import GdsloadError, WorkerTimeout

    before = set(threading.enumerate())
    others = set(multiprocessing.active_children())
    lo = loader(path, fields=FIELDS, map=fs.slow_map, worker_mode="process", batch_size=2, timeout=1.5,
                num_workers=1)
    it = iter(lo)
    next(it)
    ours = [p for p in multiprocessing.active_children() if p not in others]
    assert len(ours) == 1
    os.kill(ours[0].pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        with pytest.raises(WorkerTimeout, match=r"within timeout=1.5 s") as info:
            for _ in it:
                pass
        assert f"worker process {ours[0].name} (pid {ours[0].pid}, stopped" in str(info.value)
        assert isinstance(info.value, GdsloadError) and isinstance(info.value, TimeoutError)
        assert time.monotonic() - t0 < 15
        del it, lo
        assert nothing_left(before) == ([], [])
    finally:
        try:
            os.kill(ours[0].pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    with pytest.raises(GdsloadError, match="timeout must be a number of seconds >= 0"):
        loader(path, map=fs.slow_map, worker_mode="process", timeout=-1)
