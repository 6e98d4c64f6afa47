"""The prefetch ring: N batch slots, allocated once, filled ahead by producers, consumed in order.

This is the only place in gdsload that allocates batch memory; I/O backends and decoders write
into the buffers of a slot they were handed and never allocate their own.

Memory layout
    One arena per ring, allocated eagerly in `Ring.__init__`: `(num_slots + spares) *
    nbytes_per_slot` bytes, its start aligned to `ALIGN` (4096 bytes, the O_DIRECT and GDS rule).
    Slot `i` starts as the byte range `[i * nbytes_per_slot, (i + 1) * nbytes_per_slot)`; `spares`
    blocks of the same size follow (see "Slot lifetime"). Inside a slot the fields of the
    `SlotSpec` follow in mapping order, each at an offset that is a multiple of 4096 and padded up
    to the next one, so every field buffer starts 4 KiB-aligned and
    `nbytes_per_slot = sum(round_up(field nbytes, 4096))`. The arena lives in:
      - device="cpu": pageable NumPy memory (over-allocated by 4096 bytes and offset);
      - device="cpu", pin=True: page-locked host memory from CuPy (`cupy.cuda.alloc_pinned_memory`),
        viewed as NumPy; without CuPy or a CUDA driver the ring falls back to pageable memory and
        reports `pinned=False`;
      - device="cuda:N": CuPy device memory on GPU N; "cuda" means the calling thread's current
        device (CUDA's current device is per host thread), not GPU 0. `pin` is ignored there.
    Contents are uninitialised. CuPy is imported on first use only.

Invariant
    Slot `i` carries batches `i, i + N, i + 2N, ...` (round-robin, N = num_slots; after a
    `reset()` the count starts one past the slot the consumer released last). A slot is
    FREE (waiting for its next seq) -> FILLING (held by exactly one producer, between `acquire`
    and `publish`/`fail`) -> READY (published, untouched) -> HELD (read by the one consumer,
    between `get` and `release`) -> FREE for seq + N. So a slot is written only by the producer
    holding it and read only by the consumer between `get` and `release`; at most N batches are in
    flight, and a producer is never more than N batches ahead of the consumer. Producers must not
    touch a slot after `publish`; the ring cannot enforce that.

Growth
    `grow(k)` adds k slots in a new allocation (for `prefetch_factor="auto"`): producers may then
    run k batches further ahead. Batch seq goes to its slot when that slot is free, else to a free
    one (a producer also waits for a free slot). Without a `grow()` the slot is always the one
    batch `seq - N` has left.

Backpressure policy
    Producers block in `acquire(seq)` until the slot has been released for batch `seq - N`;
    nothing is dropped and no memory is added. The consumer blocks in `get(seq)` until batch `seq`
    is published; that time is the data stall (`stats()["wait_s"]`). `get` must be called in plan
    order (0, 1, 2, ...), so batches come out in order however producers finish. A producer's
    exception passed with `fail` is re-raised by `get` for that seq; the ring moves on and later
    seqs work. Every blocking call takes `timeout` (seconds; None = forever, 0 = do not block)
    and raises `RingTimeout` when it runs out.

Slot lifetime
    A slot's buffers are views of its memory, made fresh for each batch, and every array the caller
    derives from them (slices, `torch.from_numpy`, DLPack: each keeps its base) keeps that batch's
    views alive; the ring watches them with weak references and never writes memory a live one
    shows. A slot is reused only when nothing references its arrays any more; a slot the user still
    holds is replaced by a fresh one (counted in `stats()["replaced"]`), so a kept batch is never
    written over and nothing is copied when nothing is kept. In detail, when a producer acquires
    slot `i`:
      - nothing of the slot's last batch is referenced: the same memory is written again (same
        addresses every cycle, no allocation);
      - it is the slot the consumer released last: its batch may still be in the caller's loop
        variable (`for batch in loader` rebinds it only after the next `next()` returns), so the
        producer waits until those references go (a weakref callback wakes it: no replacement) or
        the consumer releases another batch or waits in `get` for this one (then it is kept:
        replaced). A plain loop therefore never replaces anything. A producer that asks for it
        (`acquire(seq, defer=True)`, the loader's readers) does not wait there when only fields
        outside `flat` are still named: it gets the slot at once, with those fields left out of
        `buffers`, reads into the rest (the staging area: encoded bytes) while the consumer is
        still waiting for the batch before, and calls `Slot.settle()` before writing them, which
        waits (or replaces) as above and then adds them to `buffers` (`publish` settles a slot
        that was not);
      - otherwise the arrays are kept: the slot gets other memory. Fields in `flat` (those written
        through `Slot.flat`/`Slot.host_flat` by offset; by default all) move as one block: a
        spare block not referenced any more (the `spares` made up front, or a block of the arena a
        kept batch has let go), else a fresh allocation of the same kind. Any other field still
        referenced moves alone, to memory of its own (that field, rounded up to 4 KiB and aligned):
        a kept label tensor keeps a few KiB, not the whole slot. Fields in `private` (a staging
        area the producer never hands on) are not watched: a decoder that keeps a reference to
        the input it read is not a kept batch.
    The memory a kept batch holds is freed when the caller drops it (a fresh allocation) or comes
    back to the ring as a spare (the arena's). A slot on fresh memory goes back to the arena's
    blocks as soon as one is free, so what the ring holds beyond its arena (`stats()
    ["fresh_nbytes"]`) is bounded by what the caller keeps. On the device the spare blocks sit in
    the arena, so registering the arena with KvikIO registers them; a fresh device block beyond
    them is not registered (KvikIO reads it through cuFile's bounce buffers). If a fresh allocation
    fails, that batch fails with the allocation's error (delivered by `get`) and `acquire` raises
    `RingClosed` to its producer. `Slot.copy()` gives owned copies.

Device fences
    On the GPU, "the consumer moved on" is not "the consumer's kernels are done": they are only
    queued. So `release(slot, fence=event)` keeps an event (anything with `synchronize()`, recorded
    by the caller on the consumer's stream), and the slot handed out by the next `acquire` of that
    slot carries it as `Slot.fence`; the producer calls `Slot.wait_fence()` before writing. A fence
    survives `reset()` (the last batch of a pass may still be read when the next pass starts).
    A batch kept past the consumer's next release may have work queued on it later (a metric over
    kept labels), so with `drop_fence` (a callable giving such an event) the ring asks for one when
    the caller lets go of such a field's last array (in the thread that let go), and the next batch
    written to that memory waits for it too (`Slot.fence` then stands for all of them). A batch let
    go before the consumer's next release (the loop variable) has only the release fence: work
    queued on it after asking for the next batch and before letting it go is not fenced.

Shutdown
    `close()` is idempotent and safe from any thread: it wakes every producer blocked in `acquire`
    and a consumer blocked in `get`, which raise `RingClosed`, as does any later `acquire`/`get`.
    `publish`, `fail` and `release` after close are silent no-ops, so `finally:` blocks in worker
    threads stay simple. The ring starts no threads; memory is freed when the ring is garbage
    collected (close does not free it, since the consumer may still hold views).

Thread-safety: any number of producer threads, one consumer thread. All state sits behind one
(re-entrant: a weakref callback may run in a thread that holds it) lock, with one
`threading.Condition` on it; nothing busy-waits.
"""

from __future__ import annotations

import functools
import math
import operator
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, TypedDict, cast

import numpy as np

from gdsload.errors import RingError, RingClosed, RingTimeout  # noqa: F401 (re-exported: defined in errors.py)
from gdsload.errors import require

ALIGN = 4096  # bytes; O_DIRECT and the GDS fast path want 4 KiB-aligned buffers

__all__ = [
    "ALIGN",
    "Ring",
    "RingClosed",
    "RingError",
    "RingStats",
    "RingTimeout",
    "Slot",
    "SlotSpec",
]


def _round_up(nbytes: int, align: int = ALIGN) -> int:
    return -(-nbytes // align) * align


@dataclass(frozen=True)
class SlotSpec:
    """The named buffers of one slot: `fields[name] = (shape, numpy dtype str)`.

    Example: `SlotSpec({"npy": ((256, 3, 224, 224), "uint8"), "bytes": ((64 << 20,), "uint8")})`.
    Shapes and dtypes are validated and normalised (tuples of ints, `np.dtype(...).str`); field
    order is the layout order inside a slot. A zero-size field is allowed (an empty view; it has
    no address of its own).
    """

    fields: Mapping[str, tuple[tuple[int, ...], str]]

    def __post_init__(self) -> None:
        if not isinstance(self.fields, Mapping) or not self.fields:
            raise RingError(
                f"SlotSpec needs a non-empty mapping name -> (shape, dtype), got {self.fields!r}"
            )
        norm: dict[str, tuple[tuple[int, ...], str]] = {}
        for name, value in self.fields.items():
            if not isinstance(name, str) or not name:
                raise RingError(f"SlotSpec field names must be non-empty strings, got {name!r}")
            try:
                shape_in, dtype_in = value
                shape = tuple(operator.index(d) for d in shape_in)
                dtype = np.dtype(dtype_in)
            except (TypeError, ValueError) as exc:
                raise RingError(
                    f"SlotSpec field {name!r}: expected (shape tuple of ints, numpy dtype str), got {value!r}"
                ) from exc
            if any(d < 0 for d in shape):
                raise RingError(f"SlotSpec field {name!r}: negative dimension in shape {shape}")
            if dtype.hasobject:
                raise RingError(f"SlotSpec field {name!r}: dtype {dtype} holds Python objects; use a numeric dtype")
            norm[name] = (shape, dtype.str)
        object.__setattr__(self, "fields", MappingProxyType(norm))

    def __hash__(self) -> int:
        return hash(tuple(self.fields.items()))

    def field_nbytes(self, name: str) -> int:
        """Payload bytes of one field (no padding)."""
        shape, dtype = self.fields[name]
        return math.prod(shape) * np.dtype(dtype).itemsize

    def layout(self) -> dict[str, tuple[int, int]]:
        """`name -> (offset, nbytes)` inside a slot; every offset is a multiple of `ALIGN`."""
        out, offset = {}, 0
        for name in self.fields:
            nbytes = self.field_nbytes(name)
            out[name] = (offset, nbytes)
            offset += _round_up(nbytes)
        return out

    @property
    def nbytes(self) -> int:
        """Bytes one slot occupies in the arena, padding included (a multiple of `ALIGN`)."""
        return sum(_round_up(self.field_nbytes(name)) for name in self.fields)


class Slot:
    """One batch in flight: `index` (which slot), `seq` (which batch), `buffers` (name -> array
    view of the slot's memory, NumPy or CuPy, made for this batch), `meta` (a fresh dict per batch
    for the producer to fill: keys, lengths, ...). Owned by one producer between `acquire` and
    `publish`/`fail`, then by the consumer between `get` and `release`; `release` empties
    `buffers`, `flat` and `host_flat` (arrays taken from them before stay valid: see "Slot
    lifetime")."""

    __slots__ = ("index", "seq", "buffers", "meta", "flat", "host_flat", "fence", "_settle")

    def __init__(self, index: int, seq: int, buffers: dict[str, Any], flat: Any = None):
        self.index = index
        self.seq = seq
        self.buffers = buffers
        self.meta: dict[str, Any] = {}
        # the whole slot as one uint8 array; field `name` starts at `spec.layout()[name][0]`,
        # so one read call can scatter into several fields of the slot
        self.flat = flat
        self.host_flat = None  # the host-memory fields' range (Ring(host_spec=...)), else None
        self.fence = None  # the release fence of the slot's previous batch (see "Device fences")
        self._settle: Callable[[Slot], None] | None = None  # `acquire(defer=True)` left fields out

    @property
    def unsettled(self) -> bool:
        """Fields were left out of `buffers` by `acquire(seq, defer=True)` (see "Slot lifetime")."""
        return self._settle is not None

    def settle(self, timeout: float | None = None) -> None:
        """Before writing a field left out by `acquire(seq, defer=True)`: wait until the slot's
        last batch's arrays of those fields are let go (or the consumer moved on: they get other
        memory), then add them to `buffers`. A no-op for a slot with every field (see "Slot
        lifetime"). Raises `RingClosed`, `RingTimeout`, or the allocation's error."""
        settle = self._settle
        if settle is not None:
            settle(self, timeout)

    def wait_fence(self) -> None:
        """Block until the consumer's queued work on the slot's previous batch is done."""
        fence, self.fence = self.fence, None
        if fence is not None:
            fence.synchronize()

    def copy(self) -> dict[str, Any]:
        """Owned copies of the buffers (same array kind, and for CuPy the same device: CuPy's
        `copy()` allocates on the *current* device)."""
        out = {}
        for name, arr in self.buffers.items():
            device = getattr(arr, "device", None)
            if hasattr(arr, "__cuda_array_interface__") and hasattr(device, "__enter__"):
                with device:
                    out[name] = arr.copy()
            else:
                out[name] = arr.copy()
        return out

    def _forget(self) -> None:
        self._settle = None
        self.buffers = {}
        self.flat = self.host_flat = None

    def __repr__(self) -> str:
        return f"Slot(index={self.index}, seq={self.seq}, fields={list(self.buffers)})"


class _HostLease:
    """One field of one batch in host memory (`np.asarray` of it is that field's bytes): every
    array handed out for the field has it as its base, so it lives as long as any of them."""

    __slots__ = ("__array_interface__", "memory", "__weakref__")


class _DeviceLease:
    """`_HostLease` for device memory: CuPy's array of it keeps it as the owner of its memory
    (`UnownedMemory`), and so do its views and their DLPack capsules."""

    __slots__ = ("__cuda_array_interface__", "memory", "__weakref__")


class _Block:
    """Memory of one slot: all the fields of one arena (`home`: a range of an arena, never freed
    alone), or one field on its own (a fresh allocation). `leases[name]` watches the arrays of the
    last batch whose field `name` lived here."""

    __slots__ = ("raw", "home", "address", "leases", "fences", "released", "__weakref__")

    def __init__(self, raw: Any, home: bool):
        self.raw = raw
        self.home = home
        self.address = _address(raw) if raw.nbytes else 0
        self.leases: dict[str, Any] = {}
        self.fences: dict[str, Any] = {}  # name -> the drop fence of its last batch (see "Device fences")
        self.released: dict[str, int] = {}  # name -> the release that let its last batch go (1, 2, ...)

    def held(self, names: Any = None) -> bool:
        """Whether an array of field `names` (None: any field) handed out from here is still alive."""
        return any(ref() is not None for name, ref in self.leases.items() if names is None or name in names)


def _address(arr: Any) -> int:
    return arr.data.ptr if hasattr(arr, "__cuda_array_interface__") else arr.ctypes.data


class _Fences:
    """Several fences as one (`Slot.fence`): the slot's release fence and its memory's drop fences."""

    __slots__ = ("fences",)

    def __init__(self, fences: list[Any]):
        self.fences = fences

    def synchronize(self) -> None:
        for fence in self.fences:
            fence.synchronize()


def _lease_dropped(ring_ref: Any, block_ref: Any, name: str, _ref: Any) -> None:
    """Weakref callback: the last array of a batch's field is gone. Records the drop fence (see
    "Device fences") and wakes a producer waiting for the slot the consumer released last (see
    "Slot lifetime"); runs in whatever thread let go."""
    ring = ring_ref()
    if ring is None:
        return
    block = block_ref() if block_ref is not None else None
    # only a batch kept past the consumer's next release: one dropped before its own release is
    # covered by the release fence, and one dropped in between is the caller's loop variable
    if block is not None and ring._drop_fence is not None and ring._releases > block.released.get(name, ring._releases):
        try:
            fence = ring._drop_fence()
        except Exception:  # interpreter shutdown, a driver error: the release fence still holds
            fence = None
        if fence is not None:
            block.fences[name] = fence
    if not ring._linger_wait:  # read without the lock: see Ring._pick
        return
    try:
        with ring._lock:
            ring._cv.notify_all()
    except Exception:  # interpreter shutdown
        pass


class RingStats(TypedDict):
    slots: int
    occupancy: int  # published (or failed), not yet taken by get(), now
    mean_occupancy: float  # occupancy sampled when get() is called, averaged over gets
    in_flight: int  # slots not FREE now (filling + ready + held)
    wait_s: float  # total seconds the consumer waited in get(): the data stall
    producer_wait_s: float  # total seconds producers waited in acquire(): backpressure
    gets: int  # batches delivered by get() (failed ones included)
    failed: int  # batches delivered as a producer's exception
    replaced: int  # acquires that gave a slot other memory because its last batch is still referenced
    fresh_nbytes: int  # memory the slots use now beyond the arenas (while the caller keeps batches)
    spares: int  # spare blocks made up front in the arena
    device: str
    pinned: bool
    nbytes_per_slot: int
    nbytes_total: int
    closed: bool


_FREE, _FILLING, _READY, _HELD = "free", "filling", "ready", "held"


class Ring:
    """`num_slots` preallocated batch slots; N producer threads fill them, one consumer reads them
    in seq order. See the module docstring for layout, invariant, backpressure, slot lifetime and
    shutdown."""

    def __init__(self, spec: SlotSpec, num_slots: int, *, device: str = "cpu", pin: bool = False,
                 host_spec: SlotSpec | None = None, flat: Any = None, private: Any = (), spares: int = 0,
                 drop_fence: Callable[[], Any] | None = None):
        """`host_spec`: fields that must stay in host memory (pinned when `pin`) even when the
        ring is on the device, such as encoded bytes that DALI parses on the host. They live in a
        second arena with the same layout rules; `Slot.host_flat` is their slot range.

        `flat`: the fields a producer writes through `Slot.flat`/`Slot.host_flat` (by offset)
        rather than through `Slot.buffers`; None (default): all of them. A kept field outside
        `flat` can move to memory of its own; the `flat` ones of an arena move together (see
        "Slot lifetime"). `private`: fields the producer uses for itself and never hands on (a
        staging area): their views are not watched, so a reference a decoder keeps to its input
        does not count as a kept batch. `spares`: blocks of one slot of the first arena made up
        front for slots whose batch is kept (in `arena`, so registering the arena registers them).
        `drop_fence`: a device ring's fence maker, called when the caller lets go of a batch (see
        "Device fences")."""
        if not isinstance(spec, SlotSpec):
            raise RingError(f"spec must be a SlotSpec, got {type(spec).__name__}")
        if host_spec is not None and set(host_spec.fields) & set(spec.fields):
            raise RingError(f"fields {sorted(set(host_spec.fields) & set(spec.fields))} are in both specs")
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise RingError(f"num_slots must be an int >= 1, got {num_slots!r}")
        if isinstance(spares, bool) or not isinstance(spares, int) or spares < 0:
            raise RingError(f"spares must be an int >= 0, got {spares!r}")
        self.spec = spec
        self.num_slots = num_slots
        self.spares = spares
        self.nbytes_per_slot = spec.nbytes
        self.pin_error: str | None = None  # why pin=True fell back to pageable memory
        self.device, self.pinned, arena = self._allocate(device, pin, (num_slots + spares) * self.nbytes_per_slot)
        self.nbytes_total = (num_slots + spares) * self.nbytes_per_slot
        self._arena = arena  # keeps the backing allocation alive
        self.arenas = [arena]  # one per allocation: this one, then one per `grow()`
        self._pin = pin
        self._cupy = None
        if self.device != "cpu":
            self._cupy = require("cupy", extra="cuda12", purpose="a ring in device memory (device='cuda')")
        self.host_spec = host_spec
        self.host_nbytes_per_slot = host_spec.nbytes if host_spec else 0
        self._host_arena = None
        if host_spec is not None:
            _, self.host_pinned, self._host_arena = self._allocate(
                "cpu", pin, num_slots * self.host_nbytes_per_slot)
            self.nbytes_total += num_slots * self.host_nbytes_per_slot

        # where each field lives: name -> (arena kind, offset in its slot, shape, dtype, nbytes)
        self._field_at: dict[str, tuple[str, int, tuple[int, ...], str, int]] = {}
        for kind, sp in (("main", spec), ("host", host_spec)):
            if sp is not None:
                layout = sp.layout()
                for name, (shape, dtype) in sp.fields.items():
                    self._field_at[name] = (kind, layout[name][0], shape, dtype, layout[name][1])
        flat = set(self._field_at) if flat is None else set(flat)
        self._private = frozenset(private)
        for what, names in (("flat", flat), ("private", self._private)):
            if names - set(self._field_at):
                raise RingError(f"{what} names fields the ring does not have: {sorted(names - set(self._field_at))}")
        watched = [n for n in self._field_at if n not in self._private]
        self._fixed = {kind: frozenset(n for n in watched if n in flat and self._field_at[n][0] == kind)
                       for kind in ("main", "host")}
        self._loose = tuple(n for n in watched if n not in flat)

        self._blocks: list[dict[str, _Block]] = []  # per slot: its memory now, per arena kind
        self._own: list[dict[str, _Block]] = []  # per slot: fields moved out of their block
        self._spare: dict[str, list[_Block]] = {"main": [], "host": []}  # arena blocks in no slot
        self._add_slots(arena, self._host_arena, num_slots)
        nb = self.nbytes_per_slot
        self._spare["main"] = [_Block(arena[(num_slots + k) * nb : (num_slots + k + 1) * nb], home=True)
                               for k in range(spares)]

        self._lock = threading.RLock()  # re-entrant: `_lease_dropped` may run in a thread holding it
        self._cv = threading.Condition(self._lock)  # one for all waiters: few threads, notify_all
        self._state = [_FREE] * num_slots
        self._seq = [-1] * num_slots  # the seq each slot carries now (-1: free)
        self._where: dict[int, int] = {}  # seq -> slot, for the seqs acquired and not recycled
        self._released = 0  # every seq below this one is recycled (released, or failed and got)
        self._recycled: set[int] = set()  # seqs recycled above `_released`
        self._slot: list[Slot | None] = [None] * num_slots
        self._error: list[BaseException | None] = [None] * num_slots
        self._fence: list[Any] = [None] * num_slots  # release fences (see "Device fences")
        self._next_get = 0
        self._closed = False
        self._wait_s = 0.0
        self._producer_wait_s = 0.0
        self._gets = 0
        self._failed = 0
        self._occupancy_sum = 0
        self._replaced = 0
        self._releases = 0  # releases so far (see "Device fences")
        self._base = 0  # batch seq goes to slot (seq + _base) % num_slots (see "Invariant")
        self._linger: int | None = None  # the slot the consumer released last (see "Slot lifetime")
        self._linger_wait: set[int] = set()  # seqs whose producer waits for that slot's arrays to go
        self._unsettled: set[int] = set()  # slots handed out by `acquire(defer=True)` without their loose fields
        self._getting: int | None = None  # the seq the consumer waits for in get()
        self._drop_fence = drop_fence
        self._ref = weakref.ref(self)
        self._dropped = functools.partial(_lease_dropped, self._ref, None, "")

    # -- allocation ----------------------------------------------------------------------------

    def _add_slots(self, arena: Any, host_arena: Any, n: int) -> None:
        nb, h = self.nbytes_per_slot, self.host_nbytes_per_slot
        for k in range(n):
            blocks = {"main": _Block(arena[k * nb : (k + 1) * nb], home=True)}
            if host_arena is not None:
                blocks["host"] = _Block(host_arena[k * h : (k + 1) * h], home=True)
            self._blocks.append(blocks)
            self._own.append({})

    def grow(self, extra: int) -> None:
        """Add `extra` slots, in a new allocation of the same kind (see "Growth"); safe while
        producers and the consumer run. The new arena is `arenas[-1]`."""
        if isinstance(extra, bool) or not isinstance(extra, int) or extra < 1:
            raise RingError(f"grow() needs an int >= 1 of slots, got {extra!r}")
        _, _, arena = self._allocate(self.device, self._pin, extra * self.nbytes_per_slot)
        host = None
        if self.host_spec is not None:
            _, _, host = self._allocate("cpu", self._pin, extra * self.host_nbytes_per_slot)
        with self._lock:
            self._add_slots(arena, host, extra)
            self.arenas.append(arena)
            self._state += [_FREE] * extra
            self._seq += [-1] * extra
            self._slot += [None] * extra
            self._error += [None] * extra
            self._fence += [None] * extra
            self.num_slots += extra
            self.nbytes_total += extra * (self.nbytes_per_slot + self.host_nbytes_per_slot)
            self._cv.notify_all()

    def _kind_nbytes(self, kind: str) -> int:
        return self.nbytes_per_slot if kind == "main" else self.host_nbytes_per_slot

    def _kind_device(self, kind: str) -> str:
        return self.device if kind == "main" else "cpu"

    def _fresh(self, kind: str, nbytes: int) -> _Block:
        """A fresh allocation for a slot whose memory the caller keeps (see "Slot lifetime")."""
        return _Block(self._allocate(self._kind_device(kind), self._pin, nbytes)[2], home=False)

    def _take_spare(self, kind: str) -> _Block | None:
        """An arena block in no slot whose `flat` fields nobody references any more."""
        spare = self._spare[kind]
        for j, block in enumerate(spare):
            if not block.held(self._fixed[kind]):
                return spare.pop(j)
        return None

    def _refresh(self, i: int, loose: bool = True) -> bool:
        """Give slot `i` memory nothing references (see "Slot lifetime"); whether any moved
        because its last batch is kept. `loose=False`: the `flat` blocks only (the others at
        `settle`). Lock held."""
        replaced = False
        blocks = self._blocks[i]
        for kind, block in blocks.items():
            fixed = self._fixed[kind]
            if fixed and block.held(fixed):
                blocks[kind] = self._take_spare(kind) or self._fresh(kind, self._kind_nbytes(kind))
                if block.home:  # back in use once the caller lets it go; a fresh one is the caller's now
                    self._spare[kind].append(block)
                replaced = True
            elif not block.home and not block.held():  # back to an arena block when one is free
                home = self._take_spare(kind)
                if home is not None:
                    blocks[kind] = home  # the fresh one is freed
        return self._refresh_loose(i) or replaced if loose else replaced

    def _refresh_loose(self, i: int) -> bool:
        """`_refresh` of the fields outside `flat`, each moving alone. Lock held."""
        replaced = False
        blocks = self._blocks[i]
        own = self._own[i]
        for name in self._loose:
            kind, _, _, _, nbytes = self._field_at[name]
            in_block = blocks[kind].held((name,))
            current = own.get(name)
            if current is None:
                if in_block:
                    own[name] = self._fresh(kind, _round_up(nbytes))
                    replaced = True
            elif not in_block:
                del own[name]  # its place in the block is free again
            elif current.held((name,)):
                own[name] = self._fresh(kind, _round_up(nbytes))
                replaced = True
        return replaced

    def _hand_out(self, i: int, fences: list[Any], names: Any = None, skip: Any = ()) -> dict[str, Any]:
        """Slot `i`'s buffers for one batch: fresh views, each field's watched by a weakref. The
        drop fences of the memory handed out are added to `fences`. `names`: only these fields
        (None: all); `skip`: not these."""
        blocks, own = self._blocks[i], self._own[i]
        out = {}
        for name, (kind, offset, shape, dtype, nbytes) in self._field_at.items():
            if (names is not None and name not in names) or name in skip:
                continue
            block = own.get(name)
            if block is None:
                block = blocks[kind]
            else:
                offset = 0
            if not nbytes or name in self._private:  # an empty view, or one the caller never sees
                out[name] = block.raw[offset : offset + nbytes].view(dtype).reshape(shape)
                continue
            fence = block.fences.pop(name, None)
            if fence is not None:
                fences.append(fence)
            block.released.pop(name, None)
            address = block.address + offset
            if kind == "main" and self._cupy is not None:
                lease: Any = _DeviceLease()
                lease.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                                  "version": 3, "strides": None, "stream": None}
                arr = self._cupy.asarray(lease)
            else:
                lease = _HostLease()
                lease.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                             "version": 3}
                arr = np.asarray(lease)
            lease.memory = block.raw
            dropped = self._dropped if self._drop_fence is None else functools.partial(
                _lease_dropped, self._ref, weakref.ref(block), name)
            block.leases[name] = weakref.ref(lease, dropped)
            out[name] = arr.view(dtype).reshape(shape)
        return out

    def _allocate(self, device: str, pin: bool, total: int) -> tuple[str, bool, Any]:
        if device == "cpu":
            if pin:
                try:
                    cupy = require("cupy", extra="cuda12", purpose="pinned host memory for the ring")
                    mem = cupy.cuda.alloc_pinned_memory(total + ALIGN)
                    raw = np.frombuffer(mem, dtype=np.uint8, count=total + ALIGN)
                    return "cpu", True, self._aligned(raw, raw.ctypes.data, total)
                except Exception as exc:  # no CuPy, no driver, out of pinned memory: stay correct
                    self.pin_error = f"{type(exc).__name__}: {exc}"
            raw = np.empty(total + ALIGN, dtype=np.uint8)
            return "cpu", False, self._aligned(raw, raw.ctypes.data, total)
        if device == "cuda" or device.startswith("cuda:"):
            if device != "cuda":
                try:
                    ordinal = int(device[5:])
                except ValueError:
                    ordinal = -1
                if ordinal < 0:
                    raise RingError(f"device {device!r} is not valid; use 'cpu', 'cuda' or 'cuda:N'")
            cupy = require("cupy", extra="cuda12", purpose="a ring in device memory (device='cuda')")
            if device == "cuda":  # the calling thread's current device, as torch's "cuda" means
                ordinal = int(cupy.cuda.runtime.getDevice())
            with cupy.cuda.Device(ordinal):
                raw = cupy.empty(total + ALIGN, dtype=cupy.uint8)
            return f"cuda:{ordinal}", False, self._aligned(raw, raw.data.ptr, total)
        raise RingError(f"device {device!r} is not valid; use 'cpu', 'cuda' or 'cuda:N'")

    @staticmethod
    def _aligned(raw: Any, address: int, total: int) -> Any:
        offset = (-address) % ALIGN
        return raw[offset : offset + total]

    # -- waiting -------------------------------------------------------------------------------

    def _wait(
        self, ready: Callable[[], bool], timeout: float | None, what: str, account: str
    ) -> None:
        """Wait (lock held) until `ready()`, adding the seconds waited to the counter `account`.
        Closed beats ready: after `close()` nothing is handed out."""
        if timeout is not None and timeout < 0:
            raise RingError(f"timeout must be None or >= 0 seconds, got {timeout!r}")
        if self._closed:
            raise RingClosed(f"ring closed while {what}")
        if ready():
            return
        start = time.perf_counter()
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise RingTimeout(f"timed out after {timeout} s {what}")
                self._cv.wait(remaining)
                if self._closed:
                    raise RingClosed(f"ring closed while {what}")
                if ready():
                    return
        finally:
            setattr(self, account, getattr(self, account) + time.perf_counter() - start)

    @staticmethod
    def _check_seq(seq: int) -> int:
        try:
            seq = operator.index(seq)
        except TypeError:
            raise RingError(f"seq must be an int >= 0, got {seq!r}") from None
        if seq < 0:
            raise RingError(f"seq must be an int >= 0, got {seq}")
        return seq

    def _held(self, slot: Slot, state: str, verb: str) -> int:
        i = getattr(slot, "index", None)
        if not isinstance(i, int) or not 0 <= i < self.num_slots or self._slot[i] is not slot:
            raise RingError(f"cannot {verb} {slot!r}: not a live slot of this ring (stale or foreign handle)")
        if self._state[i] != state:
            raise RingError(f"cannot {verb} {slot!r}: it is {self._state[i]}, expected {state}")
        return i

    # -- producer side -------------------------------------------------------------------------

    def acquire(self, seq: int, timeout: float | None = None, *, defer: bool = False) -> Slot:
        """Slot for batch `seq` (the one batch `seq - num_slots` used, unless the ring grew, see
        "Growth"); blocks until the consumer released batch `seq - num_slots`, and for the slot the
        consumer released last until its arrays are let go or the consumer moves on (see "Slot
        lifetime"). `defer`: when only fields outside `flat` hold it there, hand the slot out now
        without them (`Slot.settle()` adds them). Raises `RingClosed` (also when the ring failed
        this batch itself: no memory for a slot whose batch is kept), `RingTimeout`, or `RingError`
        if `seq` was already acquired."""
        seq = self._check_seq(seq)
        with self._lock:
            if (seq < self._released or seq in self._where or seq in self._recycled) and not self._closed:
                raise RingError(f"batch {seq} was already acquired; each seq is acquired once")
            picked: list[int] = []

            def ready() -> bool:
                i = self._pick(seq, defer)
                if i is not None:
                    picked.append(i)
                return i is not None

            try:
                self._wait(ready, timeout, f"acquiring batch {seq}", "_producer_wait_s")
            finally:
                self._linger_wait.discard(seq)
            i = picked[-1]
            self._seq[i] = seq
            self._where[seq] = i
            deferred = defer and self._lingering(i, seq)  # only loose fields still named (`_pick`)
            try:
                replaced = self._refresh(i, loose=not deferred)
            except Exception as exc:  # no memory for a kept batch's successor: that batch fails
                if hasattr(exc, "add_note"):
                    exc.add_note(f"the ring could not allocate memory for batch {seq}: the batches still "
                                 f"referenced keep theirs (drop them, or copy what you keep)")
                self._error[i] = exc
                self._state[i] = _READY
                self._cv.notify_all()
                raise RingClosed(f"batch {seq} failed in the ring: {type(exc).__name__}: {exc}") from exc
            self._replaced += replaced
            blocks = self._blocks[i]
            fences = [self._fence[i]] if self._fence[i] is not None else []
            self._fence[i] = None
            slot = Slot(i, seq, self._hand_out(i, fences, skip=self._loose if deferred else ()), blocks["main"].raw)
            if deferred:
                self._unsettled.add(i)
                slot._settle = self._settle
            slot.fence = fences[0] if len(fences) == 1 else _Fences(fences) if fences else None
            slot.host_flat = blocks["host"].raw if "host" in blocks else None
            self._state[i] = _FILLING
            self._slot[i] = slot
            return slot

    def _pick(self, seq: int, defer: bool = False) -> int | None:
        """The slot batch `seq` may take now, or None; with `defer`, also the slot the consumer
        released last when only its fields outside `flat` are still named. Lock held."""
        before = seq - self.num_slots
        if not ((before < 0 or self._recycled_seq(before)) and _FREE in self._state):
            return None
        i = (seq + self._base) % self.num_slots
        if self._state[i] != _FREE:  # only after a grow(): any free slot (one is, see "Growth")
            i = self._state.index(_FREE)
        if self._lingering(i, seq) and not (defer and self._loose and not self._kept(i, self._fixed)):
            # added before the producer waits; `_lease_dropped` reads it without the lock, which
            # is safe: a weakref is dead before its callback runs, so a drop it misses is seen here
            self._linger_wait.add(seq)
            return None
        return i

    def _kept(self, i: int, names: Any = None) -> bool:
        """Whether arrays of slot `i`'s last batch (of fields `names`; a dict by arena kind, or
        None: any) are still alive. Lock held."""
        if isinstance(names, dict):
            return any(b.held(names[kind]) for kind, b in self._blocks[i].items())
        return (any(b.held(names) for b in self._blocks[i].values())
                or any(b.held(names) for b in self._own[i].values()))

    def _lingering(self, i: int, seq: int) -> bool:
        """Slot `i` is the one the consumer released last, its batch still named, and the consumer
        is not waiting for `seq` (see "Slot lifetime"). Lock held."""
        return i == self._linger and self._getting != seq and self._kept(i)

    def _settle(self, slot: Slot, timeout: float | None = None) -> None:
        """`Slot.settle()`: wait as `acquire` would have for the fields it left out, then give them
        memory and views (see "Slot lifetime")."""
        fences: list[Any] = []
        with self._lock:
            i = self._held(slot, _FILLING, "settle")
            if i not in self._unsettled:
                slot._settle = None
                return
            seq = slot.seq
            loose = frozenset(self._loose)

            def ready() -> bool:
                if i == self._linger and self._getting != seq and self._kept(i, loose):
                    self._linger_wait.add(seq)  # woken by `_lease_dropped`, `get` or `release`
                    return False
                return True

            try:
                self._wait(ready, timeout, f"settling batch {seq}", "_producer_wait_s")
            finally:
                self._linger_wait.discard(seq)
            try:
                self._replaced += self._refresh_loose(i)
            except Exception as exc:
                if hasattr(exc, "add_note"):
                    exc.add_note(f"the ring could not allocate memory for batch {seq}: the batches still "
                                 f"referenced keep theirs (drop them, or copy what you keep)")
                raise
            self._unsettled.discard(i)
            slot._settle = None
            slot.buffers.update(self._hand_out(i, fences, names=loose))
        for fence in fences:  # the memory's drop fences (see "Device fences"), before it is written
            fence.synchronize()

    def _recycled_seq(self, seq: int) -> bool:
        return seq < self._released or seq in self._recycled

    def try_acquire(self, seq: int) -> Slot | None:
        """`acquire(seq, timeout=0)`, returning None instead of raising `RingTimeout`."""
        try:
            return self.acquire(seq, timeout=0)
        except RingTimeout:
            return None

    def publish(self, slot: Slot) -> None:
        """Hand a filled slot to the consumer (settled first: `Slot.settle`). A no-op after `close()`."""
        if getattr(slot, "_settle", None) is not None and not self._closed:
            try:
                slot.settle()
            except RingClosed:
                return
        with self._lock:
            if self._closed:
                return
            i = self._held(slot, _FILLING, "publish")
            self._state[i] = _READY
            self._cv.notify_all()

    def fail(self, slot: Slot, exc: BaseException) -> None:
        """Pass `exc` to the consumer in place of this batch; `get(slot.seq)` re-raises it."""
        if not isinstance(exc, BaseException):
            raise RingError(f"fail() needs an exception instance, got {exc!r}")
        with self._lock:
            if self._closed:
                return
            i = self._held(slot, _FILLING, "fail")
            self._error[i] = exc
            self._state[i] = _READY
            self._cv.notify_all()

    # -- consumer side -------------------------------------------------------------------------

    def get(self, seq: int, timeout: float | None = None) -> Slot:
        """Batch `seq`, in order (0, 1, 2, ...); blocks until published (time counts as `wait_s`).
        Re-raises the producer's exception if the batch failed (the slot is then recycled by the
        ring). Raises `RingClosed`, `RingTimeout`, or `RingError` for an out-of-order seq."""
        seq = self._check_seq(seq)
        with self._lock:
            if seq != self._next_get and not self._closed:
                raise RingError(
                    f"get({seq}) out of order: batches are delivered in seq order, next is {self._next_get}"
                )
            before = self._where.get(seq - self.num_slots)
            if (seq not in self._where and before is not None and self._state[before] == _HELD
                    and not self._closed):
                # Only this consumer can release it, so waiting would never end.
                raise RingError(
                    f"get({seq}) would wait forever: the consumer still holds batch {seq - self.num_slots} "
                    f"in slot {before}; release it first (at most num_slots={self.num_slots} batches can be held)"
                )
            occupancy = self._occupancy()  # how far ahead producers were when the consumer asked
            self._getting = seq  # a producer waiting for the last released slot need not wait for this one
            if seq in self._linger_wait:
                self._cv.notify_all()
            try:
                self._wait(
                    lambda: seq in self._where and self._state[self._where[seq]] == _READY,
                    timeout,
                    f"getting batch {seq}",
                    "_wait_s",
                )
            finally:
                self._getting = None
            i = self._where[seq]
            self._next_get += 1
            self._gets += 1
            self._occupancy_sum += occupancy
            error, self._error[i] = self._error[i], None
            if error is None:
                self._state[i] = _HELD
                return cast(Slot, self._slot[i])  # READY without an error implies a producer's handle
            self._failed += 1
            self._recycle(i)
        if hasattr(error, "add_note"):
            error.add_note(f"raised by the producer of batch {seq} (passed through the prefetch ring)")
        raise error

    def try_get(self, seq: int) -> Slot | None:
        """`get(seq, timeout=0)`, returning None instead of raising `RingTimeout`."""
        try:
            return self.get(seq, timeout=0)
        except RingTimeout:
            return None

    def release(self, slot: Slot, fence: Any = None) -> None:
        """The consumer is done with `slot`; it may be refilled with batch `seq + num_slots` once
        `fence` (see "Device fences"; None: nothing queued) has completed, and never while arrays
        of this batch are still referenced (see "Slot lifetime"). After `close()` only the fence is
        kept, for the next pass."""
        with self._lock:
            if fence is not None and self._slot[slot.index] is slot:
                self._fence[slot.index] = fence
            if self._closed:
                return
            i = self._held(slot, _HELD, "release")
            self._linger = i  # its batch may be the caller's loop variable until the next next()
            self._releases += 1
            if self._drop_fence is not None:
                for block in (*self._blocks[i].values(), *self._own[i].values()):
                    for name in block.leases:
                        block.released.setdefault(name, self._releases)
            self._recycle(i)

    def _recycle(self, i: int) -> None:
        seq = self._seq[i]
        self._state[i] = _FREE
        self._unsettled.discard(i)
        slot, self._slot[i] = self._slot[i], None
        if slot is not None:  # a stale handle (a producer's local) must not keep the batch's arrays
            slot._forget()
        self._seq[i] = -1
        del self._where[seq]
        self._recycled.add(seq)
        while self._released in self._recycled:
            self._recycled.remove(self._released)
            self._released += 1
        self._cv.notify_all()

    # -- lifecycle and stats -------------------------------------------------------------------

    def reset(self) -> None:
        """Start a new pass over the same memory: every slot free, seq numbering from 0, open.

        Only valid when no producer or consumer is using the ring (the loader calls it after
        joining the previous pass's threads). Counters in `stats()` keep accumulating. Batch 0
        goes to the slot after the one the consumer released last, whose batch may still be the
        caller's loop variable (see "Slot lifetime").
        """
        with self._lock:
            for slot in self._slot:
                if slot is not None:
                    slot._forget()
            self._state = [_FREE] * self.num_slots
            self._seq = [-1] * self.num_slots
            self._where = {}
            self._released = 0
            self._recycled = set()
            self._slot = [None] * self.num_slots
            self._error = [None] * self.num_slots
            self._next_get = 0
            self._closed = False
            self._linger_wait = set()
            self._unsettled = set()
            self._getting = None
            self._base = 0 if self._linger is None else (self._linger + 1) % self.num_slots

    def close(self) -> None:
        """Wake every waiter with `RingClosed`; idempotent, safe from any thread."""
        with self._lock:
            self._closed = True
            self._cv.notify_all()

    @property
    def arena(self) -> Any:
        """The first (device, or only) arena: the slots the ring was made with and its spares, one
        array (e.g. to register it with cuFile); `arenas` lists it and those `grow()` added."""
        return self._arena

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Ring:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _occupancy(self) -> int:
        return sum(state == _READY for state in self._state)

    def stats(self) -> RingStats:
        with self._lock:
            fresh = sum(b.raw.nbytes for blocks in self._blocks for b in blocks.values() if not b.home)
            fresh += sum(b.raw.nbytes for own in self._own for b in own.values())
            return RingStats(
                slots=self.num_slots,
                occupancy=self._occupancy(),
                mean_occupancy=self._occupancy_sum / self._gets if self._gets else 0.0,
                in_flight=sum(state != _FREE for state in self._state),
                wait_s=self._wait_s,
                producer_wait_s=self._producer_wait_s,
                gets=self._gets,
                failed=self._failed,
                replaced=self._replaced,
                fresh_nbytes=fresh,
                spares=self.spares,
                device=self.device,
                pinned=self.pinned,
                nbytes_per_slot=self.nbytes_per_slot,
                nbytes_total=self.nbytes_total,
                closed=self._closed,
            )

    def __repr__(self) -> str:
        return (
            f"Ring(slots={self.num_slots}, device={self.device!r}, pinned={self.pinned}, "
            f"nbytes_per_slot={self.nbytes_per_slot})"
        )
