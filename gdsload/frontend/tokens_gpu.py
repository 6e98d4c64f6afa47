"""`gdsload.TokenLoader`'s GPU path: each step's token bytes read by KvikIO straight into device
memory, the batch assembled there.

Taken with ``device="cuda"`` (or ``"cuda:N"``) when KvikIO is usable (`gdsload.io.kvikio_usable`)
for a pre-tokenized dataset (or a `gdsload.Mix` of them) on local storage opened without
``verify="full"``; otherwise the loader reads, checks and assembles on the host and copies the batch
to the device (its behaviour before this path).

Per step (one ring slot, `gdsload.ring.ring`): the packer's pieces of this rank's rows become one
extent each (the piece's tokens that are in the file: a document's end-of-document token is not),
read by `gdsload.io.kvikio_backend.KvikioBackend` into the slot's private ``__tokens__`` area on the
device (adjacent pieces coalesced; no host staging of token bytes). A small host table of the pieces
(each piece's flat start in the batch, its start in its document, its tokens in the file, its byte
offset in ``__tokens__``, its token size, real or padding) is copied to the device once, and CuPy
builds ``input_ids``, ``labels``, ``position_ids``, ``attention_mask`` and ``cu_seqlens`` from it
into the slot's fields: the same values as `gdsload.plan.pack.assemble` on the host. Batches are
handed out as the image path's are (`gdsload.frontend.output.as_output`: DLPack to torch, or CuPy).

Streams and lifetime are the image ring's (`gdsload.host.gpu`): reads ordered on the loader's
private stream (`KvikioBackend.order_on`), the assembly on that stream with a ready event the
consumer's stream waits for, a release fence recorded on the consumer's stream when it moves on
(and a drop fence when a kept field is let go) that a producer waits for before the slot is
written again; a batch the caller keeps is never written over (the ring gives its slot other
memory). Slots: ``prefetch + 2`` (the steps made ahead, the one being made, the one handed out),
at least 3: with ``prefetch=0`` the caller's thread makes each step, and the slot it writes must not
be the one it released last (the ring waits for that batch to be let go, or for another release:
from the same thread, a wait without end when the caller keeps its batches).

Verify, as the image GPU path does for tensors read into device memory: the CRC32s are not
checked on this path (there is no CRC32 on the GPU, and a piece is often part of a document while
the CRC covers the whole document); sizes are (an extent outside its shard, or a short read, is an
error). ``verify="full"`` keeps the host path, where every document is checked against its CRC32;
`gdsload verify` checks the whole dataset.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import numpy as np

from gdsload.frontend.output import as_output
from gdsload.plan import pack as pk

FIELDS = ("input_ids", "labels", "position_ids", "attention_mask")


def device_path(loader: Any) -> "DevicePath | None":
    """The GPU path for `loader` (module docstring), or None where it does not apply."""
    from gdsload.host.gpu import parse_device

    kind, index = parse_device(loader.device)
    if kind != "cuda" or loader.meta is None or loader._served is not None or loader._verify_full:
        return None
    from gdsload.io import is_remote, kvikio_usable

    if any(is_remote(p.root) for p in loader.docs.parts) or not kvikio_usable():
        return None
    from gdsload.host.gpu import resolve_ordinal

    return DevicePath(loader, resolve_ordinal(index))


class DeviceBatch:
    """A step made on the device: its ring seq (the consumer takes the slot with `hand_out`)."""

    __slots__ = ("seq",)

    def __init__(self, seq: int):
        self.seq = seq


class DevicePath:
    """The ring, streams and KvikIO backend of one TokenLoader's GPU path (module docstring)."""

    def __init__(self, loader: Any, ordinal: int):
        self._lo = weakref.proxy(loader)
        self.ordinal = ordinal
        self.ring: Any = None
        self.streams: Any = None
        self.backend: Any = None
        self._made = self._out = 0
        self._held: Any = None  # the slot of the batch handed out last
        self.producer: Any = None  # the live pass's prefetch thread (`begin_pass` joins it)
        self._item = max(dt.itemsize for dt in loader.docs.dtypes)

    def _open(self) -> None:
        import cupy

        from gdsload.host.gpu import CopyStreams
        from gdsload.io import open_backend
        from gdsload.ring.ring import Ring, SlotSpec

        lo = self._lo
        b, s = lo.batch_size, lo.seq_len
        spec = SlotSpec({"__tokens__": ((b * s * self._item,), "uint8"),
                         **{f: ((b, s), "int64") for f in FIELDS}, "cu_seqlens": ((b * s + 1,), "int32")})
        self.streams = CopyStreams(self.ordinal, consumer=lo.output)
        ref = weakref.ref(self)

        def drop_fence() -> Any:  # a kept batch let go: the consumer's work on it so far
            streams = getattr(ref(), "streams", None)
            return streams.release_fence(same_thread=False) if streams is not None else None

        with cupy.cuda.Device(self.ordinal):
            self.ring = Ring(spec, max(3, lo.prefetch + 2), device=f"cuda:{self.ordinal}", flat={"__tokens__"},
                             private={"__tokens__"}, drop_fence=drop_fence)
        self.backend = open_backend("kvikio", device_id=self.ordinal)
        self.backend.register(self.ring.arena)
        self.backend.order_on(self.streams.stream.ptr)  # reads on the private stream, not behind training
        self._base = spec.layout()["__tokens__"][0]

    def begin_pass(self) -> None:
        """A new pass: the ring's slots free, seq from 0 (the last batch handed out stays valid).
        The last pass's producer thread is woken and joined first: a pass dropped without a close
        (garbage, its cursor's weak reference gone) only had its halt set, and its producer, still
        making a step, must not write into the ring of the next one."""
        if self.ring is None:
            self._open()
        self.end_pass()
        old, self.producer = self.producer, None
        if old is not None and old is not threading.current_thread():
            old.join()
        self.ring.reset()
        self._made = self._out = 0

    def end_pass(self) -> None:
        """Wake a producer waiting for a slot (it ends with `RingClosed`) and hand back the slot
        of the batch handed out last, with a release fence on the consumer's stream."""
        if self.ring is None:
            return
        self.ring.close()
        held, self._held = self._held, None
        if held is not None:
            self.ring.release(held, fence=self.streams.release_fence())

    # -- the producer ----------------------------------------------------------------------------
    def plan(self, rows: list[list[pk.Piece]]) -> tuple[list[Any], list[int], np.ndarray]:
        """(extents, their offsets in ``__tokens__``, the piece table [6, pieces + 1]): rows
        flat start (the batch's size appended: ``cu_seqlens``), start in the document, tokens in
        the file, byte offset in ``__tokens__``, token size, 1 for a document's piece / 0 for padding."""
        from gdsload.io.base import Extent

        lo = self._lo
        s = lo.seq_len
        extents, outs, cols = [], [], []
        cursor = 0
        for r, row in enumerate(rows):
            at = 0
            for doc, start, n in row:
                shard = int(lo.docs.shard_of(np.asarray([doc]))[0])
                part, local = lo.docs.shards[shard]
                item = lo.docs.dtypes[part].itemsize
                table, offsets = lo.docs.table(shard)
                d = doc - int(lo.docs.doc_start[shard])
                in_file = max(0, min(n, int(table.ntokens[d]) - start))
                if in_file:
                    extents.append(Extent(lo.docs.parts[part].shard_path(local), int(offsets[d]) + start * item,
                                          in_file * item))
                    outs.append(cursor)
                cols.append((r * s + at, start, in_file, cursor, item, 1))
                cursor += in_file * item
                at += n
            if at < s:
                cols.append((r * s + at, 0, 0, 0, 0, 0))
        table = np.zeros((6, len(cols) + 1), np.int64)
        if cols:
            table[:, :-1] = np.asarray(cols, np.int64).T
        table[0, -1] = len(rows) * s
        return extents, outs, table

    def make(self, planned: tuple[list[Any], list[int], np.ndarray]) -> DeviceBatch:
        """Read and assemble a step `plan` made into the next ring slot (on the producer's thread,
        outside the loader's lock: it may wait for a slot the consumer holds)."""
        import cupy

        seq = self._made
        self._made += 1
        with cupy.cuda.Device(self.ordinal):  # a fresh thread starts on device 0 with no context
            slot = self.ring.acquire(seq)
            try:
                slot.wait_fence()  # the consumer's queued work on the slot's last batch is done
                extents, outs, table = planned
                if extents:
                    self.backend.read(extents, slot.flat, [self._base + o for o in outs]).result()
                with self.streams.producing():
                    self._assemble(slot, table)
                    slot.meta["ready"] = self.streams.ready()
                slot.meta["cu"] = table.shape[1]
                self.ring.publish(slot)
            except BaseException as exc:
                self.ring.fail(slot, exc)
                raise
        return DeviceBatch(seq)

    def _assemble(self, slot: Any, table: np.ndarray) -> None:
        """`gdsload.plan.pack.assemble`'s arrays, on the device, from the piece table (one copy)."""
        import cupy

        lo = self._lo
        b, s = lo.batch_size, lo.seq_len
        tab = cupy.asarray(table)
        p = table.shape[1] - 1
        t0 = tab[0, :p]
        flat = cupy.arange(b * s, dtype=np.int64)
        pid = cupy.searchsorted(t0, flat, side="right") - 1
        k = flat - t0.take(pid)
        start, in_file, boff, item, real = (tab[i, :p].take(pid) for i in range(1, 6))
        inf = (k < in_file).astype(np.int64)
        at = (boff + k * item) * inf
        raw = slot.buffers["__tokens__"]
        val = cupy.zeros(b * s, dtype=np.int64)
        for byte in range(self._item):  # little-endian token ids from their bytes
            m = (item > byte).astype(np.int64) * inf
            val = val + ((raw.take((at + byte) * m).astype(np.int64) * m) << (8 * byte))
        eos = lo.eos_id if lo.eos_id is not None else 0
        ids = inf * val + (1 - inf) * (real * eos + (1 - real) * lo.pad_id)
        keep = real * (1 - (k == 0).astype(np.int64) * (start == 0).astype(np.int64))
        out = {"input_ids": ids, "labels": keep * ids + (1 - keep) * pk.IGNORE, "position_ids": real * (start + k),
               "attention_mask": real}
        bufs = slot.buffers
        for f in FIELDS:
            bufs[f][...] = out[f].reshape(b, s)
        cu = bufs["cu_seqlens"]
        cu[:p + 1] = tab[0].astype(np.int32)

    # -- the consumer ----------------------------------------------------------------------------
    def hand_out(self, batch: DeviceBatch) -> dict[str, Any]:
        """The batch of `batch`'s slot, as the loader's output on its device; the slot handed out
        before goes back to the ring with a release fence on the consumer's stream."""
        lo = self._lo
        seq = self._out
        if batch.seq != seq:
            raise RuntimeError(f"device batch {batch.seq} handed out where {seq} was next")
        slot = self.ring.get(seq)
        self._out += 1
        held, self._held = self._held, slot
        if held is not None:
            self.ring.release(held, fence=self.streams.release_fence())
        self.streams.consumer_wait(slot.meta["ready"])
        dev = f"cuda:{self.ordinal}"
        bufs = slot.buffers
        out = {f: as_output(bufs[f], lo.output, dev) for f in FIELDS}
        out["cu_seqlens"] = as_output(bufs["cu_seqlens"][:slot.meta["cu"]], lo.output, dev)
        return out
