"""A pool of worker processes for Python-heavy per-sample code (`worker_mode="process"`).

Processes are started with the "spawn" method, as `torch.utils.data` workers can be: nothing of
the parent's state (threads, CUDA contexts, DALI pipelines, open files) is inherited, so the task
function must be picklable (a module-level function or a `functools.partial` of one; not a lambda
or a closure), and a script that starts a loader must guard its entry point with
`if __name__ == "__main__":`.

Protocol: one shared inbox of `(task_id, payload)` and one outbox of pickled
`(task_id, ok, value)`; a collector thread in the parent resolves one `Future` per task. Results
are pickled in the worker itself, so a result (or exception) that cannot be pickled comes back as
a `GdsloadError` instead of being lost in a queue's feeder thread.

Shutdown: `close()` sends one stop per worker, joins them (then terminates stragglers), and ends
the collector and queue threads; pending futures fail with `PoolClosed`. No worker outlives its
parent: on Linux each worker asks the kernel for SIGKILL when its parent dies (PR_SET_PDEATHSIG),
so a parent killed by SIGTERM or SIGKILL leaves no orphan; elsewhere a worker also polls its
parent id every `_POLL_S`. Workers ignore SIGINT (Ctrl-C reaches the parent, which closes them).
"""

from __future__ import annotations

import itertools
import os
import pickle
import queue
import signal
import sys
import threading
import traceback
from concurrent.futures import Future
from typing import Any, Callable

from gdsload.errors import PoolClosed, WorkerDied, WorkerTimeout  # noqa: F401 (re-exported: defined in errors.py)
from gdsload.errors import GdsloadError

_POLL_S = 0.5  # how often an idle worker checks that its parent lives, and the collector its workers
_JOIN_S = 5.0  # how long close() waits for a worker before terminating it


def _die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)


def _portable(exc: BaseException) -> BaseException:
    """`exc` with the worker's traceback as a note, or a GdsloadError saying what it was when it
    cannot be pickled."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        exc.add_note(f"traceback in the worker process {os.getpid()}:\n{tb}")
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        err = GdsloadError(f"{type(exc).__name__}: {exc} (in worker process {os.getpid()}; the "
                           f"exception could not be pickled)")
        for note in getattr(exc, "__notes__", ()):
            err.add_note(note)
        return err


def _worker_main(fn: Callable[[Any], Any], inbox: Any, outbox: Any, parent_pid: int,
                 busy: Any = None, me: int = 0, init: Callable[[int], Any] | None = None) -> None:
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if init is not None:  # torch's worker_init_fn(worker_id); if it raises, the worker dies (WorkerDied)
        init(me)
    while True:
        try:
            item = inbox.get(timeout=_POLL_S)
        except queue.Empty:
            if os.getppid() != parent_pid:
                return
            continue
        if item is None:
            return
        task_id, payload = item
        if busy is not None:
            busy[me] = task_id  # which worker holds which task: named when one times out
        try:
            out = (task_id, True, fn(payload))
            data = pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException as exc:  # delivered to the caller of submit()
            data = pickle.dumps((task_id, False, _portable(exc)), protocol=pickle.HIGHEST_PROTOCOL)
        outbox.put(data)
        if busy is not None:
            busy[me] = -1


class WorkerPool:
    """`n` spawned processes running `fn(payload)` for each `submit(payload)`, after `init(i)` in
    worker i (torch's `worker_init_fn`). Thread-safe."""

    def __init__(self, fn: Callable[[Any], Any], n: int, *, name: str = "gdsload-worker",
                 init: Callable[[int], Any] | None = None):
        import multiprocessing

        try:
            pickle.dumps(fn)
        except Exception as exc:
            raise GdsloadError(
                f"worker_mode='process' runs the function in spawned processes, so it must be "
                f"picklable (a module-level function, not a lambda or closure): {exc}"
            ) from exc
        ctx = multiprocessing.get_context("spawn")
        self._inbox = ctx.Queue()
        self._outbox = ctx.Queue()
        self._ids = itertools.count()
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._closed = False
        self.broken: BaseException | None = None  # why the pool stopped on its own (a worker died)
        self._busy = ctx.Array("q", [-1] * n, lock=False)  # worker i's task id (-1: none)
        self.procs = [ctx.Process(target=_worker_main, args=(fn, self._inbox, self._outbox, os.getpid(),
                                                             self._busy, i, init),
                                  name=f"{name}-{i}", daemon=True) for i in range(n)]
        for p in self.procs:
            p.start()
        self._collector = threading.Thread(target=self._collect, name=f"{name}-collector", daemon=True)
        self._collector.start()

    def submit(self, payload: Any) -> Future:
        fut: Future = Future()
        with self._lock:
            if self.broken is not None:
                raise self.broken
            if self._closed:
                raise PoolClosed("the worker pool is closed")
        if self._worker_died():  # a worker killed while idle: the next batch says so, not the epoch's end
            raise self.broken
        with self._lock:
            task_id = next(self._ids)
            self._pending[task_id] = fut
        fut.task_id = task_id  # type: ignore[attr-defined]
        self._inbox.put((task_id, payload))
        return fut

    def result(self, fut: Future, timeout: float = 0) -> Any:
        """`fut.result()`, waiting at most `timeout` seconds (0: forever); past it a
        `WorkerTimeout` names the worker that holds the task (or says none has taken it)."""
        if not timeout:
            return fut.result()
        from concurrent.futures import TimeoutError as FutureTimeout

        try:
            return fut.result(timeout)
        except FutureTimeout:
            pass
        task_id = getattr(fut, "task_id", None)
        holder = next((i for i in range(len(self.procs)) if self._busy[i] == task_id), None)
        if holder is not None:
            what = f"{self._describe(holder)} has not returned a batch"
        else:  # still in the inbox: every worker is on another batch, or not taking any
            what = (f"no worker process has taken a batch ({', '.join(self._describe(i) for i in range(len(self.procs)))})"
                    if self.procs else "no worker process")
        err = WorkerTimeout(f"{what} within timeout={timeout:g} s (stopped, stuck, or slower than that): the "
                            f"loader stops; a new iter() resumes from the last batch received, or raise timeout=")
        with self._lock:  # the pool is done: close() kills the workers without waiting for them
            if self.broken is None:
                self.broken = err
        raise err

    def _describe(self, i: int) -> str:
        """'worker process NAME (pid N[, stopped])' for messages; the state from /proc on Linux."""
        p = self.procs[i]
        state = ""
        try:
            with open(f"/proc/{p.pid}/stat") as f:
                code = f.read().rsplit(")", 1)[1].split()[0]
            state = {"T": ", stopped", "t": ", stopped by a debugger", "Z": ", dead", "D": ", in uninterruptible I/O"}.get(code, "")
        except (OSError, IndexError):
            pass
        task = self._busy[i]
        return f"worker process {p.name} (pid {p.pid}{state}{'' if task < 0 else f', on batch task {task}'})"

    def _fail_pending(self, exc: BaseException) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for fut in pending.values():
            fut.set_exception(exc)

    def _collect(self) -> None:
        while True:
            try:
                data = self._outbox.get(timeout=_POLL_S)
            except queue.Empty:
                if self._closed or self._worker_died():
                    return
                continue
            except (EOFError, OSError, ValueError):  # the queue was closed under us
                return
            task_id, ok, value = pickle.loads(data)
            with self._lock:
                fut = self._pending.pop(task_id, None)
            if fut is not None:
                fut.set_result(value) if ok else fut.set_exception(value)

    def _worker_died(self) -> bool:
        """Whether a worker died (killed, segfault): then the pool is broken and every pending
        task fails with `WorkerDied` (a worker that died mid-task leaves its task unanswered)."""
        dead = [p for p in self.procs if not p.is_alive()]
        if not dead:
            return False
        with self._lock:
            if self.broken is None:
                self.broken = WorkerDied(
                    f"worker process {dead[0].name} (pid {dead[0].pid}) died with exit code "
                    f"{dead[0].exitcode}; its batch is lost (the loader stops; a new iter() "
                    f"resumes from the last batch received). A worker that cannot import the "
                    f"function's module exits at start: its traceback is on stderr")
            self._closed = True
        self._fail_pending(self.broken)
        return True

    def close(self) -> None:
        """Stop the workers and threads; idempotent. Pending tasks fail with `PoolClosed`."""
        with self._lock:
            if self._closed and not any(p.is_alive() for p in self.procs) and not self._collector.is_alive():
                return
            self._closed = True
        for p in self.procs:
            if p.is_alive():
                try:
                    self._inbox.put(None)
                except (OSError, ValueError):
                    break
        wait_s = _JOIN_S if self.broken is None else 0.5  # a dead worker may hold the inbox lock
        for p in self.procs:
            p.join(wait_s)
            if p.is_alive():
                p.kill()
                p.join()
        if self._collector is not threading.current_thread():
            self._collector.join()
        self._fail_pending(PoolClosed("the worker pool was closed"))
        for q in (self._inbox, self._outbox):
            q.close()
            q.join_thread()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
