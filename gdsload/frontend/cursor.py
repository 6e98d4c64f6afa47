"""Where a loader stands in its plan: the epoch and the global position the training loop consumed.

Both loaders keep one `Cursor` and expose it through `PlanCursor` (`len()`, `set_epoch()`,
`epoch`, `state_dict()`, `load_state_dict()`). A pass (the iterator of one `iter()`) registers
with `begin` and is the cursor's live pass until it ends, closes or is stopped; only the live pass
moves the cursor (`advance`, `end`). The rules (DESIGN.md, "Prefetch ring": a pass is owned by one
iterator):

- `state_dict()` always says what the next `iter()` will do: while a pass is live, that is to
  continue it after the last batch it handed out.
- `load_state_dict()` and a `set_epoch(n)` that changes the epoch **stop** the live pass first
  (`stop`): its producers end and its slots are freed before the call returns, so no thread of
  the old pass can write into the slots of the next one (Lightning loads a checkpoint's state
  after it called `iter()`). A `next()` on the stopped iterator raises `PassStopped`; the next
  `iter()` starts from the loaded state, or at position 0 of epoch n. `set_epoch` with the epoch
  the cursor is at changes nothing (a trainer that sets the epoch each time it starts one does
  not restart a resumed pass).
- A new `iter()` while a pass is live closes that pass (its iterator then ends with
  `StopIteration`) and continues from the cursor.
- A pass that handed out its epoch's last batch has moved the cursor to the next epoch, position
  0, whether or not its StopIteration was asked for (Lightning and the HF Trainer take `len()`
  batches and call `iter()` again for the next epoch).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any, Protocol


class Pass(Protocol):
    """What a cursor needs of a pass: `stop(why)` closes it (producers ended, slots freed) and
    makes its later `next()` raise `PassStopped` naming `why`."""

    def stop(self, why: str) -> None: ...


class Cursor:
    def __init__(self, epoch: int = 0, position: int = 0):
        self.epoch = epoch
        self.position = position  # global samples consumed in `epoch` (a multiple of the global batch)
        self._live: weakref.ref | None = None

    def __getstate__(self) -> dict[str, Any]:  # a copy (another process) has no live pass
        return {**self.__dict__, "_live": None}

    def live(self) -> Any:
        return self._live() if self._live is not None else None

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.stop(f"set_epoch({epoch})")
            self.epoch, self.position = epoch, 0

    def load(self, epoch: int, position: int) -> None:
        self.stop("load_state_dict()")
        self.epoch, self.position = epoch, position

    def stop(self, why: str) -> None:
        """Stop the live pass, if any (it detaches itself; detached here too if it did not)."""
        it = self.live()
        if it is not None:
            it.stop(why)
        self._live = None

    def begin(self, it: Pass) -> tuple[int, int]:
        """A new pass `it` starts: the (epoch, position) it starts from."""
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


class PlanCursor:
    """The torch-like epoch/state surface of both loaders, over `self.cursor` and `self.plan`."""

    cursor: Cursor

    def _cursor(self) -> Cursor:
        c = self.__dict__.get("cursor")
        if c is None:
            c = self.__dict__["cursor"] = Cursor()
        return c

    def __len__(self) -> int:
        return self.plan.num_batches(self._cursor().epoch)

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
