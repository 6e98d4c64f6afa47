"""SIGTERM as an interrupt for the commands that must unwind on it (`convert`, `process`): the
handler raises `Terminated`, a KeyboardInterrupt, so open work is dropped and workers stopped as on
Ctrl-C; `gdsload.cli.run` exits 143 for it. Its own module so that command modules imported by
`gdsload.cli` use it without importing `gdsload.cli` back."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager


class Terminated(KeyboardInterrupt):
    """SIGTERM, delivered as an interrupt so that it unwinds (and stops workers) as Ctrl-C does."""

    signum = signal.SIGTERM


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Within: SIGTERM raises `Terminated` in the main thread (elsewhere: left as it is)."""
    def handler(signum: int, frame: object) -> None:
        raise Terminated

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
