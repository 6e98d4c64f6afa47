"""One pass over a loader's plan: producer threads fill ring slots, the consumer gets batches.

`Epoch` starts `num_workers` producer threads. Each claims the next batch number, waits for its
ring slot (`Ring.acquire`: at most `prefetch_factor` batches ahead of the one in use), fills it
(`gdsload.loader.fill`) and publishes it; a failure is published in its place and raised to the
consumer in order. `__next__` releases the previous batch's slot, waits for the next in plan
order, hands out views of it (`_make_batch`) and counts it (`Progress`, what `stats()` reports).
With `"auto"` settings it asks `gdsload.loader.autotune` whether to add a slot or a reader.

The epoch holds the loader; its threads hold the epoch only weakly while they wait, so an epoch
the training loop dropped (a `break`) is collected, and closing it ends the threads.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from gdsload.frontend import fields as _fieldkinds
from gdsload.loader.gather import distinct
from gdsload.loader.fill import UNSET, BatchInfo, SlotFill
from gdsload.frontend.usercode import host_copy
from gdsload.frontend.output import as_output
from gdsload.loader.decoding import DecodeTurns

if TYPE_CHECKING:
    from gdsload.loader.dataloader import DataLoader


@dataclass
class Progress:
    """One pass's counters, kept by its consumer per batch; `DataLoader.stats()` reports them."""

    epoch: int
    t0: float  # when the pass started
    wait0: float  # the ring's total consumer wait then
    batches: int = 0
    samples: int = 0  # delivered (corrupt ones skipped are not)
    skipped: int = 0
    bytes_read: int = 0
    t_last: float = 0.0  # when the last batch was handed out


class Epoch(SlotFill):
    """One pass: producer threads fill ring slots in plan order; `__next__` hands out views."""

    def __init__(self, loader: DataLoader, epoch: int, position: int):
        self.loader = loader
        self.epoch = epoch
        self.pid = os.getpid()  # the producer threads and the ring state exist in this process only
        self._successor: Iterator[Any] | None = None
        self.G = loader.plan.global_batch
        self.batches = list(loader.plan.batches(epoch, position))
        self.ring = loader._ring
        self.ring.reset()
        if loader._cache is not None:  # the shards of every batch, so the cache can fetch ahead
            ends = np.cumsum(loader.dataset.shard_sizes)
            needs = [distinct(np.searchsorted(ends, b, side="right")) for b in self.batches]
            loader._cache.start_epoch(needs)
            # their indexes too (one request each at the URL), in order of first use
            loader.dataset.shards.load_indexes(s for b in needs for s in b)
        self.next_seq = 0
        self.handed = None
        self._consumer: int | None = None  # the consumer's thread (its current stream is the fence's)
        self._claim = 0
        self._claim_lock = threading.Lock()
        # Held by a reader for the Python-heavy parts of a batch (planning, per-sample values,
        # CRC32s member by member), never across its reads or decodes: readers that interleave those parts
        # convoy on the GIL (a thread back from a GIL-free `crc32` call waits up to the 5 ms
        # switch interval for one busy in Python), which measured at half the samples/s of one
        # reader on 2 cores; serialised, one reader's CPU part overlaps the others' reads.
        self._cpu = threading.Lock()
        self._closed = False
        self.n_images = sum(fp.kind == "image" for fp in loader._fields)  # decode turns per batch
        self.turns = DecodeTurns(self.n_images)
        if loader._tuner is not None:
            loader._tuner.restart()
        self.stage = loader._stage.start(loader.num_workers) if loader._stage is not None else None
        self._layout = {name: off for name, (off, _) in self.ring.spec.layout().items()}
        hs = self.ring.host_spec
        self._host_layout = {name: off for name, (off, _) in hs.layout().items()} if hs else None
        self.progress = Progress(epoch, time.perf_counter(), self.ring.stats()["wait_s"])
        self.threads = [
            threading.Thread(target=Epoch._produce, args=(weakref.ref(self),),
                             name=f"gdsload-reader-{i}", daemon=True)
            for i in range(min(loader.num_workers, max(1, len(self.batches))))
        ]
        for t in self.threads:
            t.start()

    # producers --------------------------------------------------------------------------------
    @staticmethod
    def _produce(ref: weakref.ref) -> None:
        # The thread holds its epoch only while claiming and filling, never while blocked in
        # `acquire`: an epoch its consumer dropped is then collected, `__del__` closes the ring,
        # and the blocked `acquire` raises RingClosed.
        from gdsload.ring.ring import RingClosed

        first = ref()
        ordinal = first.loader.device_ordinal if first is not None else None
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
            try:
                slot = ring.acquire(seq)
            except RingClosed:
                return
            self = ref()
            if self is None:
                return
            cache = self.loader._cache
            try:
                self._fill(slot, seq, self.batches[seq])
            except RingClosed:
                return
            except BaseException as exc:  # delivered to the consumer, in order
                self.ring.fail(slot, exc)
                continue
            finally:
                if cache is not None:
                    cache.release(seq)
                if self.n_images:  # turns not taken (a failure before or between decodes)
                    self.turns.skip_batch(seq)
            self.ring.publish(slot)

    # consumer ---------------------------------------------------------------------------------
    def __iter__(self) -> "Epoch":
        return self

    def __next__(self) -> Any:
        if self.pid != os.getpid():
            return self._next_in_forked_child()
        if self._closed:  # finished, failed, closed, or replaced by a newer iter(): the ring
            raise StopIteration  # may carry another epoch now, never touch it again
        if self.handed is not None:
            self._release(self.handed)
            self.handed = None
        if self.next_seq >= len(self.batches):
            self._finish()
            raise StopIteration
        try:
            slot = self.ring.get(self.next_seq)
        except BaseException:
            self.close()
            raise
        self.next_seq += 1
        self.handed = slot
        self._consumer = threading.get_ident()
        streams = self.loader._streams
        if streams is not None:  # the consumer's stream waits for the batch's copies (GPU-side)
            streams.consumer_wait(slot.meta["batch"].ready)
        tuner = self.loader._tuner
        if tuner is not None:
            rs = self.ring.stats()
            action = tuner.observe(time.perf_counter(), rs["wait_s"], rs["producer_wait_s"])
            if action is not None:
                self._tune(action)
        batch = self._make_batch(slot)
        self.loader._position += self.G
        info = slot.meta["batch"]
        p = self.progress
        p.batches = self.next_seq
        p.samples += info.n - info.skipped
        p.skipped += info.skipped
        p.bytes_read += info.nbytes
        p.t_last = time.perf_counter()
        self.loader._progress = p  # what `stats()` reports from now on
        return batch

    def _tune(self, action: str) -> None:
        """Carry out a `gdsload.loader.autotune` decision: one more ring slot, or one more reader."""
        from gdsload.loader import autotune

        L, tuner = self.loader, self.loader._tuner
        if action == "worker":
            t = threading.Thread(target=Epoch._produce, args=(weakref.ref(self),),
                                 name=f"gdsload-reader-{len(self.threads)}", daemon=True)
            self.threads.append(t)
            t.start()
            L.num_workers = tuner.workers = tuner.workers + 1
            return
        from gdsload.host.memory import available_device_bytes, available_host_bytes

        ring = self.ring
        ok = autotune.fits(ring.host_nbytes_per_slot + (0 if ring.host_spec else ring.nbytes_per_slot),
                           available_host_bytes())
        if ring.host_spec is not None:  # a device ring: its batch tensors are on the GPU
            import cupy

            with cupy.cuda.Device(L.device_ordinal):
                ok = ok and autotune.fits(ring.nbytes_per_slot, available_device_bytes())
        if not ok:  # memory does not allow it: stay at this depth
            tuner.auto_prefetch = False
            return
        ring.grow(1)
        register = getattr(L._backend, "register", None)
        if L._host_backend is not None and register is not None:  # KvikIO reads into the new arena
            register(ring.arenas[-1])
        L.prefetch_factor = tuner.prefetch = tuner.prefetch + 1

    def _next_in_forked_child(self) -> Any:
        """The parent's iterator, used in a forked child: its threads are not here and its ring
        must not be touched, so continue with a new iteration of the child's copy of the loader,
        which starts at the loader's position (the batch after the last one handed out)."""
        if self._successor is None:
            if self._closed:
                raise StopIteration
            self._closed = True
            self._successor = iter(self.loader)
        return next(self._successor)

    def __reduce__(self):
        raise TypeError("a gdsload.DataLoader iterator cannot be pickled: pickle the loader itself, whose copy "
                        "continues from the loader's state_dict()")

    def _release(self, slot, *, same_thread: bool = True) -> None:
        """Hand the slot back, with a fence on the consumer's stream when the ring is on the GPU."""
        streams = self.loader._streams
        fence = streams.release_fence(same_thread=same_thread) if streams is not None else None
        self.ring.release(slot, fence=fence)

    def _make_batch(self, slot, *, host: bool = False) -> Any:
        info: BatchInfo = slot.meta["batch"]
        if info.mapped is not UNSET:
            return info.mapped
        L = self.loader
        n = info.n
        keep = info.keep
        out: dict[str, Any] = {}
        for fp in L._fields:
            if fp.kind == "bytes":  # a BytesColumn owning its buffer (never a view of the ring)
                col = info.extra[fp.name]
                col = col.take(keep) if keep is not None else col
                out[fp.name] = col.tolist() if host else col  # `map`/`collate_fn` get bytes per sample
                continue
            if fp.kind in _fieldkinds.LIST_KINDS:
                vals = info.extra[fp.name]
                vals = [vals[k] for k in keep] if keep is not None else vals
                out[fp.name] = [self._convert(v, copy=False) for v in vals] if fp.kind == "ragged" and not host else vals
                continue
            arr = slot.buffers[fp.name]
            if keep is not None and fp.kind != "image":
                arr = arr[np.asarray(keep, dtype=np.intp)] if not hasattr(arr, "__cuda_array_interface__") else arr[keep]
                view = arr
            else:
                view = arr[: len(keep) if keep is not None else n]
            out[fp.name] = host_copy(view) if host else self._convert(view, copy=L.copy or keep is not None and fp.kind != "image")
        keys = info.keys
        out["__key__"] = [keys[k] for k in keep] if keep is not None else list(keys)
        if info.sources is not None:
            sources = info.sources
            out["__source__"] = [sources[k] for k in keep] if keep is not None else sources
        if L.tuple_fields is not None and not host:
            return tuple(out[f] for f in L.tuple_fields)
        return out

    def _convert(self, arr, *, copy: bool):
        """A slot view as the output type, on the loader's device (zero copy where it is there)."""
        L = self.loader
        return as_output(arr, L.output, f"cuda:{L.device_ordinal}" if L.device == "cuda" else "cpu", copy=copy)

    def _finish(self) -> None:
        self.close()
        L = self.loader
        L._epoch = self.epoch + 1
        L._position = 0

    def close(self) -> None:
        if self._closed:
            return
        if self.pid != os.getpid():  # the parent's iterator in a forked child: touch nothing
            self._closed = True
            return
        self._closed = True
        self.turns.close()
        if self.handed is not None:  # keep the fence: the next pass may refill this slot
            try:
                self._release(self.handed, same_thread=threading.get_ident() == self._consumer)
            except Exception:
                pass
            self.handed = None
        if self.stage is not None:  # worker processes end with their epoch
            self.stage.close()
        self.ring.close()
        for t in self.threads:
            if t is not threading.current_thread():  # `__del__` may run in a producer
                t.join()
        if self.loader._streams is not None and self.next_seq < len(self.batches):
            self.loader._streams.synchronize()  # stopped early: unconsumed batches' copies may be queued
        if self.loader._active is self:
            self.loader._active_ref = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
