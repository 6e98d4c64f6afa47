"""One pass over a loader's plan: reader threads fill ring slots, the consumer gets batches.

`Epoch` is given what it uses: the plan's batches from the cursor's position, the `Cursor` it
advances, the loader's `Resources` (ring, cache, streams), the `BatchLayout`, the source, a
`BatchAssembler` and the user-code stage. It starts `resources.num_workers` reader threads, each
claiming the next batch number, waiting for its ring slot (`Ring.acquire`: at most `prefetch`
batches ahead of the one in use), filling it (`SlotFiller.fill`) and publishing it; a failure is
published in its place and raised to the consumer in order. `__next__` releases the previous
batch's slot, waits for the next in plan order, hands out `BatchAssembler.make(slot)` and
advances the cursor (`Progress` and `StageTimes` count it for `stats()`). With `"auto"` settings
it asks the tuner (`gdsload.loader.autotune`) whether to add a slot or a reader, and the
`Resources` carry it out. The loader's `skip(n)` restarts the pass from the new position behind
the same iterator (`skip_to`).

The epoch holds its collaborators; its threads hold the epoch only weakly while they wait, so an
epoch the training loop dropped (a `break`) is collected, and closing it ends the threads.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from gdsload.errors import PassStopped, RingClosed
from gdsload.loader.assemble import UNSET
from gdsload.loader.decoding import OrderedDecoder
from gdsload.loader.fill import SlotFiller
from gdsload.loader.gather import distinct
from gdsload.loader.stats import Progress, StageTimes
from gdsload.plan.plan import BlockSteps


class ShardNeeds(Sequence[list[int]]):
    """The shards (ascending) each of `batches` (sample positions) reads, given the shards' end
    positions `ends`; computed when indexed, so the shard cache reads only its window of them."""

    def __init__(self, batches: Sequence[Any], ends: np.ndarray):
        self.batches, self.ends = batches, ends

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return distinct(np.searchsorted(self.ends, self.batches[i], side="right"))


class Epoch:
    """One pass: reader threads fill ring slots in plan order; `__next__` hands out batches."""

    def __init__(self, *, plan: Any, cursor: Any, resources: Any, layout: Any, source: Any, assembler: Any,
                 stage: Any, tuner: Any, restart: Any, max_batches: int | None = None,
                 steps: Sequence[int] | None = None, first: Any = None):
        self.cursor = cursor
        self.first = first  # the loader's `FirstBatch` (`stats()["first_batch"]`), or None
        self.max_batches = max_batches
        self.steps = None if steps is None else steps if isinstance(steps, BlockSteps) else list(steps)
        self.res = resources
        self.tuner = tuner
        self._restart = restart  # the loader's `iter`, for the parent's iterator in a forked child
        self.pid = os.getpid()  # the reader threads and the ring state exist in this process only
        self._successor: Iterator[Any] | None = None
        self._closed = True  # until the readers start: `close()` has nothing to stop
        self._stopped_by: str | None = None  # `stop(why)`: the loader's call that ended this pass
        self._parts = (plan, resources, layout, source, assembler, stage, tuner)  # `_start` again: `skip_to`
        self.times = StageTimes()  # the pass's stage times and counters (`stats()`), kept across a `skip_to`
        self.progress: Progress | None = None
        self.epoch, position = cursor.begin(self)
        try:
            self._start(position)
        except BaseException:
            cursor.detach(self)
            raise

    def _start(self, position: int) -> None:
        """Start the pass's readers from global `position` of its epoch, over a reset ring."""
        plan, resources, layout, source, assembler, stage, tuner = self._parts
        self.position = position
        self.G = plan.global_batch
        # the pass's batches, each computed when a reader claims it (`Plan.batches_at`): none is
        # kept, so a pass over an epoch of 10^10 samples starts at once
        if self.steps is not None:  # these steps of the epoch, in this order (a server's blocks of a stripe)
            self.batches = plan.batches_at(self.epoch, self.steps)
            self.ends_epoch = bool(self.steps) and self.steps[-1] + 1 >= plan.num_steps
        else:
            # with `max_batches`, a part of the epoch (a server's stream of one block): nothing past it is read
            first = position // self.G
            stop = plan.num_steps if self.max_batches is None else min(plan.num_steps, first + self.max_batches)
            self._stop_step = stop
            self.batches = plan.batches_at(self.epoch, range(first, stop))
            self.ends_epoch = self.max_batches is None or position + self.max_batches * self.G >= plan.end_position
        self.ring = resources.ring
        self.ring.reset()
        if resources.cache is not None:  # the shards of every batch, so the cache can fetch ahead
            # computed as the cache's window reaches them (a bounded number of batches ahead), from
            # a second lazy view: its chunks are not the readers' (neither evicts the other's);
            # their indexes too (one request each at the URL), as shards enter the window
            ahead = plan.batches_at(self.epoch, self.steps if self.steps is not None else range(first, stop))
            resources.cache.start_epoch(ShardNeeds(ahead, np.cumsum(source.shard_sizes)),
                                        source.shards.load_indexes)
        self.next_seq = 0
        self.handed = None
        self._consumer: int | None = None  # the consumer's thread (its current stream is the fence's)
        self._claim = 0
        self._claim_lock = threading.Lock()
        self.assembler = assembler
        assembler.times = self.times
        self.decoder = OrderedDecoder(resources, layout.n_images, self.times)
        if tuner is not None:
            tuner.restart()
        self.stage = stage.start(resources.num_workers) if stage is not None else None
        self.filler = SlotFiller(resources, layout, source, self.decoder, assembler, self.stage, self.times)
        self.filler.first = self.first
        self.filler.draw_key = (plan.seed, self.epoch)  # clip and crop positions: the plan's, per sample
        if self.progress is None:
            self.progress = Progress(self.epoch, time.perf_counter(), self.ring.stats()["wait_s"], stages=self.times)
        # num_workers=0: no reader thread, `__next__` reads each batch itself (`_fill_here`)
        self.threads = [self._reader(i) for i in range(min(resources.num_workers, max(1, len(self.batches))))]
        self._closed = False
        if self.first is not None:
            self.first.readers_starting()
        for t in self.threads:
            t.start()

    def _reader(self, i: int) -> threading.Thread:
        return threading.Thread(target=Epoch._produce, args=(weakref.ref(self),), name=f"gdsload-reader-{i}",
                                daemon=True)

    # readers ----------------------------------------------------------------------------------
    @staticmethod
    def _produce(ref: weakref.ref) -> None:
        # The thread holds its epoch only while claiming and filling, never while blocked in
        # `acquire`: an epoch its consumer dropped is then collected, `__del__` closes the ring,
        # and the blocked `acquire` raises RingClosed.
        first = ref()
        ordinal = first.res.device_ordinal if first is not None else None
        first = None
        if ordinal is not None:  # the current device is per thread; new threads start on GPU 0
            from gdsload.host.gpu import use_device

            use_device(ordinal)
        while True:
            self = ref()
            if self is None or self._closed:
                return
            ring = self.ring
            with self._claim_lock:
                seq = self._claim
                self._claim += 1
            if seq >= len(self.batches):
                return
            self = None
            if ref() is None:  # this thread held the pass last and closed it just now (`__del__`), which
                return  # close() cannot join: a new pass may own the ring already, touch nothing
            try:  # `defer`: the slot the loop variable still names is read into before it lets go (fill)
                slot = ring.acquire(seq, defer=True)
            except RingClosed:
                return
            self = ref()
            if self is None:
                return
            try:
                self._fill(slot, seq)
            except RingClosed:
                return

    def _fill_here(self, seq: int) -> None:
        """`num_workers=0`: batch `seq` read into its slot by the caller of `next()`, as a reader
        would (a failure is published in the slot and raised by `ring.get`, in order)."""
        self._claim = seq + 1
        try:
            self._fill(self.ring.acquire(seq), seq)
        except RingClosed:
            return

    def _fill(self, slot: Any, seq: int) -> None:
        """Batch `seq` into `slot`, published; a failure other than the ring closing (raised) is
        published in its place, delivered to the consumer in order."""
        cache = self.res.cache
        first = self.first if self.first is not None and self.first.claim(seq) else None
        try:
            t0 = time.perf_counter()
            ids = self.batches[seq]  # computed now (order 2: a chunk of the plan's positions)
            if first is not None:
                first.add("plan", time.perf_counter() - t0)
            self.filler.fill(slot, seq, ids)
        except RingClosed:
            raise
        except BaseException as exc:
            self.ring.fail(slot, exc)
            return
        finally:
            if cache is not None:
                cache.release(seq)
            if self.filler.n_images:  # turns not taken (a failure before or between decodes)
                self.decoder.skip_batch(seq)
        self.ring.publish(slot)

    # consumer ---------------------------------------------------------------------------------
    def __iter__(self) -> "Epoch":
        return self

    def __next__(self) -> Any:
        if self.pid != os.getpid():
            return self._next_in_forked_child()
        if self._closed:  # finished, failed, closed, stopped or replaced by a newer iter(): the
            if self._stopped_by is not None:  # ring may carry another epoch now, never touch it again
                raise PassStopped(f"this pass was stopped by the loader's {self._stopped_by}: call "
                                  "iter(loader) again for the pass it set up")
            raise StopIteration
        if self.handed is not None:
            self._release(self.handed)
            self.handed = None
        if self.next_seq >= len(self.batches):
            if self.ends_epoch:
                self.cursor.end(self, self.epoch)  # the next pass is the next epoch
            self.close()
            raise StopIteration
        t0 = time.perf_counter()
        if not self.threads:  # num_workers=0: this batch is read here, in the loop's thread
            self._fill_here(self.next_seq)
        try:
            slot = self.ring.get(self.next_seq)
        except BaseException:
            self.close()
            raise
        self.times.add("wait", time.perf_counter() - t0)
        self.next_seq += 1
        self.handed = slot
        self._consumer = threading.get_ident()
        streams = self.res.streams
        if streams is not None:  # the consumer's stream waits for the batch's copies (GPU-side)
            streams.consumer_wait(slot.meta["batch"].ready)
        if self.tuner is not None:
            rs = self.ring.stats()
            action = self.tuner.observe(time.perf_counter(), rs["wait_s"], rs["producer_wait_s"])
            if action is not None:
                self._tune(action)
        batch = self.assembler.make(slot)
        if streams is not None and slot.meta["batch"].mapped is not UNSET:  # map's tensors: the consumer's now
            streams.record_consumer(batch)
        self.position = (self.steps[self.next_seq - 1] + 1) * self.G if self.steps is not None else self.position + self.G
        if self.ends_epoch and self.next_seq == len(self.batches):
            # the epoch's last batch completes the epoch: the next iter() runs the next one, also for a
            # trainer that counts batches and never asks for the StopIteration (Lightning, HF Trainer)
            self.cursor.advance(self, self.epoch + 1, 0)
        else:
            self.cursor.advance(self, self.epoch, self.position)
        info = slot.meta["batch"]
        p = self.progress
        p.batches += 1
        p.samples += info.n - info.skipped
        p.skipped += info.skipped
        p.bytes_read += info.nbytes
        p.t_last = time.perf_counter()
        if self.first is not None and self.first.total_s is None:
            self.first.done()
        return batch

    def _tune(self, action: str) -> None:
        """Carry out a `gdsload.loader.autotune` decision: one more reader, or one more ring slot."""
        tuner = self.tuner
        if action == "worker":
            t = self._reader(len(self.threads))
            self.threads.append(t)
            t.start()
            self.res.add_worker()
            tuner.workers = self.res.num_workers
        elif self.res.add_slot():
            tuner.prefetch = self.res.prefetch
        else:  # memory does not allow it: stay at this depth
            tuner.auto_prefetch = False

    def _next_in_forked_child(self) -> Any:
        """The parent's iterator, used in a forked child: its threads are not here and its ring
        must not be touched, so continue with a new iteration of the child's copy of the loader,
        which starts at the loader's position (the batch after the last one handed out)."""
        if self._successor is None:
            if self._closed:
                raise StopIteration
            self._closed = True
            self._successor = self._restart()
        return next(self._successor)

    def __reduce__(self):
        raise TypeError("a gdsload.DataLoader iterator cannot be pickled: pickle the loader itself, whose copy "
                        "continues from the loader's state_dict()")

    def _release(self, slot, *, same_thread: bool = True) -> None:
        """Hand the slot back, with a fence on the consumer's stream when the ring is on the GPU."""
        streams = self.res.streams
        fence = streams.release_fence(same_thread=same_thread) if streams is not None else None
        self.ring.release(slot, fence=fence)

    def stop(self, why: str) -> None:
        """`load_state_dict()` or `set_epoch()` while this pass is live (`gdsload.frontend.cursor`):
        close it now (readers joined, slots released) and make a later `next()` say why."""
        if not self._closed:
            self._stopped_by = why
        self.close()

    def skip_to(self, position: int | None) -> None:
        """The loader's `skip()` moved the cursor to global `position` of this pass's epoch (None:
        to its end; `gdsload.frontend.cursor`). The pass restarts there behind this same iterator,
        so the training loop's `for` goes on with the batch after the skipped steps: the readers
        are stopped and joined and the batches they filled ahead are dropped (their slots freed),
        then `_start` runs again as a new pass over the same ring would (ring reset, seq numbering
        from 0, readers claiming the batches from `position`), so no skipped step is read. The
        batch last handed out stays valid while the loop references it, as across passes (the
        ring's "Slot lifetime"); `stats()` keeps counting. Process workers (`worker_mode=
        "process"`) start again, as with each pass. A `steps` or `max_batches` pass keeps the end
        of its window and drops the steps before `position`. None: the pass closes, and its next
        `next()` raises StopIteration."""
        if self._closed or self.pid != os.getpid():  # (a forked child's copy restarts from the cursor)
            return
        if position is None:
            self.close()
            return
        self._halt()
        first = position // self.G
        if isinstance(self.steps, BlockSteps):  # a server's stream: the tail, never listed (O(log n))
            i = bisect.bisect_left(self.steps, first)
            n = len(self.steps) - i
            plan = self._parts[0]
            self.steps = BlockSteps(self.steps[i], plan.num_steps, self.steps.block, self.steps.stride,
                                    limit=n) if n else []
        elif self.steps is not None:
            self.steps = [s for s in self.steps if s >= first]
        elif self.max_batches is not None:
            self.max_batches = max(0, self._stop_step - first)
        try:
            self._start(position)
        except BaseException:
            self.cursor.detach(self)
            raise

    def close(self) -> None:
        if self._closed:  # closed already, maybe still closing in a reader (`__del__`): its readers end
            if self.pid == os.getpid():  # before this returns, so the caller may start a new pass
                self._join()
            return
        if self.pid != os.getpid():  # the parent's iterator in a forked child: touch nothing
            self._closed = True
            return
        self._halt()
        self.cursor.detach(self)

    def _halt(self) -> None:
        """End the readers (joined) and free the slots, as closing does; the cursor is not told."""
        self._closed = True
        self.decoder.close()
        if self.handed is not None:  # keep the fence: the next pass may refill this slot
            try:
                self._release(self.handed, same_thread=threading.get_ident() == self._consumer)
            except Exception:
                pass
            self.handed = None
        if self.stage is not None:  # worker processes end with their epoch
            self.stage.close()
        self.ring.close()
        self._join()
        if self.res.streams is not None and self.next_seq < len(self.batches):
            self.res.streams.synchronize()  # stopped early: unconsumed batches' copies may be queued

    def _join(self) -> None:
        for t in getattr(self, "threads", ()):
            if t is not threading.current_thread():  # `__del__` may run in a producer
                t.join()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
