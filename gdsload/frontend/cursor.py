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
- `skip(n)` (`PlanCursor.skip`) moves the position `n` global steps on within the epoch, never
  past its end (refused, naming how many steps remain). A live pass over this epoch continues
  from the new position (`Pass.skip_to`: its prefetched batches are dropped and the skipped steps
  are not read); before `iter()` the next pass starts there. Skipping exactly to the epoch's end
  completes the epoch as its last batch does: the cursor moves to (next epoch, 0) and the live
  pass ends (its next `next()` raises StopIteration). A pass that handed out its epoch's last
  batch already is left to end: the skip is the next epoch's, from its start.
"""

from __future__ import annotations

import numbers
import weakref
from collections.abc import Mapping
from typing import Any, Protocol

from gdsload.errors import ConfigError


class Pass(Protocol):
    """What a cursor needs of a pass: `epoch`, the epoch it runs; `stop(why)` closes it (producers
    ended, slots freed) and makes its later `next()` raise `PassStopped` naming `why`;
    `skip_to(position)` drops what it fetched ahead and continues from global `position` of its
    epoch without reading the steps before it (None: the epoch is done, the pass ends and its
    `next()` raises StopIteration). Both are called in the training loop's thread."""

    epoch: int

    def stop(self, why: str) -> None: ...

    def skip_to(self, position: int | None) -> None: ...


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

    def skip(self, position: int, end: int) -> None:
        """Move to `position` of this epoch (`end`: the epoch's end position; reaching it completes
        the epoch: (next epoch, 0)) and move the live pass there with it (see the module's rules)."""
        it = self.live()
        if it is not None and it.epoch != self.epoch:  # it handed out its epoch's last batch: it ends as
            self.detach(it)  # it would have, and the skip is the next epoch's
            it = None
        if position >= end:
            self.epoch, self.position = self.epoch + 1, 0
        else:
            self.position = position
        if it is not None:
            it.skip_to(position if position < end else None)

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

    def skip(self, n: int) -> None:
        """Skip the next `n` global steps of this epoch, the same steps on every rank (each rank
        drops its batch of each): nothing of them is read or decoded. During a pass the loop's next
        batch is the one after them (batches fetched ahead are dropped); before `iter()` the next
        pass starts after them. `state_dict()` then holds the advanced position. It does not cross
        the epoch's end: `n` over the steps that remain is refused (`ConfigError`, naming them);
        skipping exactly the rest completes the epoch, as its last batch does (the state is the next
        epoch's start). `n=0` changes nothing. Call it from the training loop's thread, between
        batches (as `load_state_dict`)."""
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
            raise ConfigError(f"skip(n) takes a whole number of global steps >= 0, got {n!r}")
        c, plan = self._cursor(), self.plan
        g, end = plan.global_batch, plan.end_position
        remaining = (end - c.position) // g
        if n > remaining:
            raise ConfigError(f"skip({n}) crosses the end of epoch {c.epoch}: {remaining} of its {plan.num_steps} "
                              f"steps remain (position {c.position} of {end}); skip at most {remaining}, or "
                              f"set_epoch()/load_state_dict() to move to another epoch")
        if n:
            c.skip(c.position + int(n) * g, end)
