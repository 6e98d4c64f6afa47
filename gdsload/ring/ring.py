"""The prefetch ring: N batch slots, allocated once, filled ahead by producers, consumed in order.

This is the only place in gdsload that allocates batch memory; I/O backends and decoders write
into the buffers of a slot they were handed and never allocate their own.

Memory layout
    One arena per ring, allocated eagerly in `Ring.__init__` (never lazily, never again):
    `num_slots * nbytes_per_slot` bytes, its start aligned to `ALIGN` (4096 bytes, the O_DIRECT and
    GDS rule). Slot `i` is the byte range `[i * nbytes_per_slot, (i + 1) * nbytes_per_slot)`.
    Inside a slot the fields of the `SlotSpec` follow in mapping order, each at an offset that is
    a multiple of 4096 and padded up to the next one, so every field buffer starts 4 KiB-aligned
    and `nbytes_per_slot = sum(round_up(field nbytes, 4096))`. The arena lives in:
      - device="cpu": pageable NumPy memory (over-allocated by 4096 bytes and offset);
      - device="cpu", pin=True: page-locked host memory from CuPy (`cupy.cuda.alloc_pinned_memory`),
        viewed as NumPy; without CuPy or a CUDA driver the ring falls back to pageable memory and
        reports `pinned=False`;
      - device="cuda:N": CuPy device memory on GPU N; "cuda" means the calling thread's current
        device (CUDA's current device is per host thread), not GPU 0. `pin` is ignored there.
    Contents are uninitialised. CuPy is imported on first use only.

Invariant
    Slot `i` carries batches `i, i + N, i + 2N, ...` (round-robin, N = num_slots). A slot is
    FREE (waiting for its next seq) -> FILLING (held by exactly one producer, between `acquire`
    and `publish`/`fail`) -> READY (published, untouched) -> HELD (read by the one consumer,
    between `get` and `release`) -> FREE for seq + N. So a slot is written only by the producer
    holding it and read only by the consumer between `get` and `release`; at most N batches are in
    flight, and a producer is never more than N batches ahead of the consumer. Memory is allocated
    once; the same arrays (same ids and addresses) are handed out on every cycle. Producers must
    not touch a slot after `publish`; the ring cannot enforce that.

Growth
    `grow(k)` adds k slots in a new allocation (the one exception to "allocated once", for
    `prefetch_factor="auto"`): producers may then run k batches further ahead. Batch seq goes to
    slot `seq % N` when that slot is free, else to a free one (a producer also waits for a free
    slot). Without a `grow()` the slot is always `seq % N`, which batch `seq - N` has left.

Backpressure policy
    Producers block in `acquire(seq)` until slot `seq % N` has been released for batch `seq - N`;
    nothing is dropped and no memory is added. The consumer blocks in `get(seq)` until batch `seq`
    is published; that time is the data stall (`stats()["wait_s"]`). `get` must be called in plan
    order (0, 1, 2, ...), so batches come out in order however producers finish. A producer's
    exception passed with `fail` is re-raised by `get` for that seq; the ring moves on and later
    seqs work. Every blocking call takes `timeout` (seconds; None = forever, 0 = do not block)
    and raises `RingTimeout` when it runs out.

Slot lifetime
    A slot's buffers are views into ring memory. The loader releases batch k when the consumer asks
    for batch k+1, so a batch's memory is reused after the next `next()` unless the caller copied
    it (`Slot.copy()`).

Device fences
    On the GPU, "the consumer moved on" is not "the consumer's kernels are done": they are only
    queued. So `release(slot, fence=event)` keeps an event (anything with `synchronize()`, recorded
    by the caller on the consumer's stream), and the slot handed out by the next `acquire` of that
    slot carries it as `Slot.fence`; the producer calls `Slot.wait_fence()` before writing. A fence
    survives `reset()` (the last batch of a pass may still be read when the next pass starts).

Shutdown
    `close()` is idempotent and safe from any thread: it wakes every producer blocked in `acquire`
    and a consumer blocked in `get`, which raise `RingClosed`, as does any later `acquire`/`get`.
    `publish`, `fail` and `release` after close are silent no-ops, so `finally:` blocks in worker
    threads stay simple. The ring starts no threads; memory is freed when the ring is garbage
    collected (close does not free it, since the consumer may still hold views).

Thread-safety: any number of producer threads, one consumer thread. All state sits behind one lock,
with one `threading.Condition` per slot on that lock; nothing busy-waits.
"""

from __future__ import annotations

import math
import operator
import threading
import time
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
    view into ring memory, NumPy or CuPy), `meta` (a fresh dict per batch for the producer to fill:
    keys, lengths, ...). Owned by one producer between `acquire` and `publish`/`fail`, then by the
    consumer between `get` and `release`; the views are invalid after `release`."""

    __slots__ = ("index", "seq", "buffers", "meta", "flat", "host_flat", "fence")

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

    def wait_fence(self) -> None:
        """Block until the consumer's queued work on the slot's previous batch is done."""
        fence, self.fence = self.fence, None
        if fence is not None:
            fence.synchronize()

    def copy(self) -> dict[str, Any]:
        """Owned copies of the buffers (same array kind, and for CuPy the same device: CuPy's
        `copy()` allocates on the *current* device), to keep a batch past its `release`."""
        out = {}
        for name, arr in self.buffers.items():
            device = getattr(arr, "device", None)
            if hasattr(arr, "__cuda_array_interface__") and hasattr(device, "__enter__"):
                with device:
                    out[name] = arr.copy()
            else:
                out[name] = arr.copy()
        return out

    def __repr__(self) -> str:
        return f"Slot(index={self.index}, seq={self.seq}, fields={list(self.buffers)})"


class RingStats(TypedDict):
    slots: int
    occupancy: int  # published (or failed), not yet taken by get(), now
    mean_occupancy: float  # occupancy sampled when get() is called, averaged over gets
    in_flight: int  # slots not FREE now (filling + ready + held)
    wait_s: float  # total seconds the consumer waited in get(): the data stall
    producer_wait_s: float  # total seconds producers waited in acquire(): backpressure
    gets: int  # batches delivered by get() (failed ones included)
    failed: int  # batches delivered as a producer's exception
    device: str
    pinned: bool
    nbytes_per_slot: int
    nbytes_total: int
    closed: bool


_FREE, _FILLING, _READY, _HELD = "free", "filling", "ready", "held"


class Ring:
    """`num_slots` preallocated batch slots; N producer threads fill them, one consumer reads them
    in seq order. See the module docstring for layout, invariant, backpressure and shutdown."""

    def __init__(self, spec: SlotSpec, num_slots: int, *, device: str = "cpu", pin: bool = False,
                 host_spec: SlotSpec | None = None):
        """`host_spec`: fields that must stay in host memory (pinned when `pin`) even when the
        ring is on the device, such as encoded bytes that DALI parses on the host. They live in a
        second arena with the same layout rules; `Slot.host_flat` is their slot range."""
        if not isinstance(spec, SlotSpec):
            raise RingError(f"spec must be a SlotSpec, got {type(spec).__name__}")
        if host_spec is not None and set(host_spec.fields) & set(spec.fields):
            raise RingError(f"fields {sorted(set(host_spec.fields) & set(spec.fields))} are in both specs")
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise RingError(f"num_slots must be an int >= 1, got {num_slots!r}")
        self.spec = spec
        self.num_slots = num_slots
        self.nbytes_per_slot = spec.nbytes
        self.nbytes_total = num_slots * self.nbytes_per_slot
        self.pin_error: str | None = None  # why pin=True fell back to pageable memory
        self.device, self.pinned, arena = self._allocate(device, pin, self.nbytes_total)
        self._arena = arena  # keeps the backing allocation alive
        self.arenas = [arena]  # one per allocation: this one, then one per `grow()`
        self._pin = pin
        self.host_spec = host_spec
        self.host_nbytes_per_slot = host_spec.nbytes if host_spec else 0
        self._host_arena = None
        if host_spec is not None:
            _, self.host_pinned, self._host_arena = self._allocate(
                "cpu", pin, num_slots * self.host_nbytes_per_slot)
            self.nbytes_total += num_slots * self.host_nbytes_per_slot
        self._arrays: list[dict[str, Any]] = []
        self._flat: list[Any] = []
        self._host_flat: list[Any] = []
        self._add_slots(arena, self._host_arena, num_slots)

        self._lock = threading.Lock()
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

    # -- allocation ----------------------------------------------------------------------------

    def _add_slots(self, arena: Any, host_arena: Any, n: int) -> None:
        h = self.host_nbytes_per_slot
        for k in range(n):
            views = self._views(self.spec, arena, k * self.nbytes_per_slot)
            self._flat.append(arena[k * self.nbytes_per_slot : (k + 1) * self.nbytes_per_slot])
            self._host_flat.append(host_arena[k * h : (k + 1) * h] if host_arena is not None else None)
            if host_arena is not None:
                views.update(self._views(self.host_spec, host_arena, k * h))
            self._arrays.append(views)

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

    @staticmethod
    def _views(spec: SlotSpec, arena: Any, base: int) -> dict[str, Any]:
        layout = spec.layout()
        views = {}
        for name, (shape, dtype) in spec.fields.items():
            off, nbytes = layout[name]
            views[name] = arena[base + off : base + off + nbytes].view(dtype).reshape(shape)
        return views

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

    def acquire(self, seq: int, timeout: float | None = None) -> Slot:
        """Slot for batch `seq` (slot `seq % num_slots` unless the ring grew, see "Growth");
        blocks until the consumer released batch `seq - num_slots`. Raises `RingClosed`,
        `RingTimeout`, or `RingError` if `seq` was already acquired."""
        seq = self._check_seq(seq)
        with self._lock:
            if (seq < self._released or seq in self._where or seq in self._recycled) and not self._closed:
                raise RingError(f"batch {seq} was already acquired; each seq is acquired once")
            self._wait(
                lambda: self._admitted(seq),
                timeout,
                f"acquiring batch {seq}",
                "_producer_wait_s",
            )
            i = seq % self.num_slots
            if self._state[i] != _FREE:  # only after a grow(): any free slot (one is, see "Growth")
                i = self._state.index(_FREE)
            slot = Slot(i, seq, dict(self._arrays[i]), self._flat[i])
            slot.fence, self._fence[i] = self._fence[i], None
            slot.host_flat = self._host_flat[i]
            self._seq[i] = seq
            self._where[seq] = i
            self._state[i] = _FILLING
            self._slot[i] = slot
            return slot

    def _recycled_seq(self, seq: int) -> bool:
        return seq < self._released or seq in self._recycled

    def _admitted(self, seq: int) -> bool:
        before = seq - self.num_slots
        return (before < 0 or self._recycled_seq(before)) and _FREE in self._state

    def try_acquire(self, seq: int) -> Slot | None:
        """`acquire(seq, timeout=0)`, returning None instead of raising `RingTimeout`."""
        try:
            return self.acquire(seq, timeout=0)
        except RingTimeout:
            return None

    def publish(self, slot: Slot) -> None:
        """Hand a filled slot to the consumer. A no-op after `close()`."""
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
            self._wait(
                lambda: seq in self._where and self._state[self._where[seq]] == _READY,
                timeout,
                f"getting batch {seq}",
                "_wait_s",
            )
            i = self._where[seq]
            self._next_get += 1
            self._gets += 1
            self._occupancy_sum += occupancy
            error, self._error[i] = self._error[i], None
            if error is None:
                self._state[i] = _HELD
                return cast(Slot, self._slot[i])  # READY implies a producer's handle
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
        `fence` (see "Device fences"; None: nothing queued) has completed. After `close()` only
        the fence is kept, for the next pass."""
        with self._lock:
            if fence is not None and self._slot[slot.index] is slot:
                self._fence[slot.index] = fence
            if self._closed:
                return
            self._recycle(self._held(slot, _HELD, "release"))

    def _recycle(self, i: int) -> None:
        seq = self._seq[i]
        self._state[i] = _FREE
        self._slot[i] = None
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
        joining the previous pass's threads). Counters in `stats()` keep accumulating.
        """
        with self._lock:
            self._state = [_FREE] * self.num_slots
            self._seq = [-1] * self.num_slots
            self._where = {}
            self._released = 0
            self._recycled = set()
            self._slot = [None] * self.num_slots
            self._error = [None] * self.num_slots
            self._next_get = 0
            self._closed = False

    def close(self) -> None:
        """Wake every waiter with `RingClosed`; idempotent, safe from any thread."""
        with self._lock:
            self._closed = True
            self._cv.notify_all()

    @property
    def arena(self) -> Any:
        """The first (device, or only) arena: the slots the ring was made with, one array (e.g. to
        register it with cuFile); `arenas` lists it and those `grow()` added."""
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
            return RingStats(
                slots=self.num_slots,
                occupancy=self._occupancy(),
                mean_occupancy=self._occupancy_sum / self._gets if self._gets else 0.0,
                in_flight=sum(state != _FREE for state in self._state),
                wait_s=self._wait_s,
                producer_wait_s=self._producer_wait_s,
                gets=self._gets,
                failed=self._failed,
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
