"""Loaders across processes: pickled to their configuration and cursor, rebuilt after a fork.

A loader's threads, ring, open files, gRPC channels and DALI pipeline belong to the process that
made them. `ProcessLocal` names those attributes: pickling leaves them out (the copy builds them
lazily where it is iterated), and a forked child finds the parent's by a pid check at the
loader's entry points and starts afresh instead of waiting on threads that exist only in the
parent. The check runs before any of the loader's locks is taken: a parent thread may have held
one at the moment of the fork, and in the child nobody would ever release it.

The parent's objects are kept alive in the child and never used or finalized (`_INHERITED`):
their destructors would join those threads, take those locks, or tear down a DALI pipeline whose
worker threads are not there. They cost the child nothing while untouched (copy-on-write pages).
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

# The parent's process-local objects, as a forked child found them: held, never touched.
_INHERITED: list[Any] = []


class ProcessLocal:
    """Mix-in: `_PROCESS_LOCAL` attributes live in one process only (`_pid`).

    A subclass lists them, sets them to their fresh (not yet built) values in
    `_init_process_local()`, calls `_start_process()` in `__init__`, and calls `_check_process()`
    at every entry point that would use them. Everything else in `__dict__` is configuration and
    cursor, and is what pickling carries.
    """

    _PROCESS_LOCAL: ClassVar[tuple[str, ...]] = ()
    _pid: int

    def _init_process_local(self) -> None:
        """Set every `_PROCESS_LOCAL` attribute to its fresh value (built lazily on use)."""
        raise NotImplementedError

    def _start_process(self) -> None:
        self._pid = os.getpid()
        self._init_process_local()

    def _check_process(self) -> dict[str, Any] | None:
        """In a forked child, set the parent's process-local objects aside and start afresh.

        Returns what was set aside (attribute -> object) when this call found a fork, else None.
        """
        if self._pid == os.getpid():
            return None
        inherited = {k: self.__dict__.get(k) for k in self._PROCESS_LOCAL}
        _INHERITED.append(inherited)
        self._start_process()
        return inherited

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for k in (*self._PROCESS_LOCAL, "_pid"):
            state.pop(k, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._start_process()
