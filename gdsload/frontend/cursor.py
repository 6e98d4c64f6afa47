"""Where a loader stands in its plan: the epoch and the global position the training loop consumed.

Both loaders keep one `Cursor` and expose it through `PlanCursor` (`len()`, `set_epoch()`,
`epoch`, `state_dict()`, `load_state_dict()`). The iterator of a pass is the only thing that moves
it (`advance`, `end`), and only while it is the cursor's live pass:

- `set_epoch(n)` while a pass is live applies to the **next** `iter()`: the live pass keeps its
  epoch and goes on advancing the cursor, so `state_dict()` always describes what the loop
  consumed (resuming it continues that pass). Without a live pass (before the first `iter()`,
  after a pass ended, or after a `break` dropped it) it applies at once, as `DistributedSampler`'s.
- `load_state_dict()` detaches the live pass (it no longer moves the cursor); the next `iter()`
  starts from the loaded state.
- A pass that ran to its end moves the cursor to the next epoch, position 0.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any


class Cursor:
    def __init__(self, epoch: int = 0, position: int = 0):
        self.epoch = epoch
        self.position = position  # global samples consumed in `epoch` (a multiple of the global batch)
        self.pending: int | None = None  # set_epoch() during a live pass, for the next one
        self._live: weakref.ref | None = None

    def __getstate__(self) -> dict[str, Any]:  # a copy (another process) has no live pass
        return {**self.__dict__, "_live": None}

    def live(self) -> Any:
        return self._live() if self._live is not None else None

    def set_epoch(self, epoch: int) -> None:
        if self.live() is not None:
            self.pending = epoch
        elif epoch != self.epoch:
            self.epoch, self.position, self.pending = epoch, 0, None

    def begin(self, it: Any) -> tuple[int, int]:
        """A new pass `it` starts: the (epoch, position) it starts from (a pending `set_epoch` first)."""
        if self.pending is not None:
            if self.pending != self.epoch:
                self.epoch, self.position = self.pending, 0
            self.pending = None
        self._live = weakref.ref(it)
        return self.epoch, self.position

    def advance(self, it: Any, epoch: int, position: int) -> None:
        """Pass `it` handed out the batch that ends at `position` of `epoch`."""
        if self.live() is it:
            self.epoch, self.position = epoch, position

    def end(self, it: Any, epoch: int) -> None:
        """Pass `it` over `epoch` ran to its end: the next pass is the next epoch."""
        if self.live() is it:
            self.epoch, self.position = epoch + 1, 0
        self.detach(it)

    def detach(self, it: Any) -> None:
        if self.live() is it:
            self._live = None

    def load(self, epoch: int, position: int) -> None:
        self.epoch, self.position, self.pending, self._live = epoch, position, None, None


class PlanCursor:
    """The torch-like epoch/state surface of both loaders, over `self.cursor` and `self.plan`."""

    cursor: Cursor

    # the remote loader's receiver still reads and writes these two by name
    @property
    def _epoch(self) -> int:
        return self._cursor().epoch

    @_epoch.setter
    def _epoch(self, value: int) -> None:
        self._cursor().epoch = value

    @property
    def _position(self) -> int:
        return self._cursor().position

    @_position.setter
    def _position(self, value: int) -> None:
        self._cursor().position = value

    def _cursor(self) -> Cursor:
        c = self.__dict__.get("cursor")
        if c is None:
            c = self.__dict__["cursor"] = Cursor()
        return c

    def __len__(self) -> int:
        c = self._cursor()
        return self.plan.num_batches(c.pending if c.pending is not None else c.epoch)

    def set_epoch(self, epoch: int) -> None:
        self._cursor().set_epoch(epoch)

    @property
    def epoch(self) -> int:
        return self._cursor().epoch

    def state_dict(self) -> dict[str, Any]:
        c = self._cursor()
        return dict(self.plan.state(c.epoch, c.position))

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._cursor().load(*self.plan.resume(state))
