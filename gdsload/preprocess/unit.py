"""One unit of a pass: an input shard's windows through `fn` into its own output shards.

Order: the shard's samples in stored order, per sample its selected fields (in `fields=` order,
else the dataset's), per field its windows: (key, field, window) order. A reader thread decodes
(`gdsload.preprocess.media`) into a queue (the decode buffer, `AHEAD_BYTES` of windows); the
calling thread makes batches of up to `batch_size` windows (cut early where the window's shape
changes, and at the shard's end), calls `fn`, and writes its outputs. Memory: a batch (each
window copied into it as it arrives, then dropped: no window is held twice), the windows the
reader is ahead by (at most `AHEAD_BYTES`, at least one), the decoder's buffers and one read
block; never a whole member.

Outputs: `fn` returns N items, each a dict, a list of dicts or None. An output's key is its
`"__key__"` or `{key}/{field}/{window:06d}` (`/{j}` added for the j-th of a list). Output shards
are this unit's alone, `part-{unit:06d}-{n:06d}`, cut between windows (a window's outputs stay
in one shard) when the next window's outputs would take the shard past `shard_size`; so the
bytes depend on the unit alone, never on how many units run at once or where.

Crash safety: a finished output shard is published (fsynced, renamed) and then recorded in
`STATE_DIR/done/` with the position of the first window after it and the counts and rejects up
to there; a finished unit leaves `STATE_DIR/units/{unit:06d}.json`. A unit restarted after a
crash keeps the recorded shards, decodes from the member it stopped in (windows before its
position decoded but not passed to `fn`) and writes the rest again, identically for a
deterministic `fn`: `fn` runs again on the windows of at most the shard being written and the
batch that straddled its start. `GDSLOAD_PROCESS_KILL=POINT:N` (tests) SIGKILLs the process at
the N-th passage of POINT: `decode` (a window decoded), `fn` (fn returned, outputs not written),
`write` (an output added to an unfinished shard), `publish` (a shard published, not recorded),
`manifest` (every unit done, no manifest: `gdsload.preprocess.run`).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gdsload.convert.engine import STATE_DIR
from gdsload.convert.shards import ShardFile
from gdsload.convert.writer import _check_names, encode_sample, sample_nbytes
from gdsload.errors import DecodeError, GdsloadError, InputError
from gdsload.format import manifest as mf
from gdsload.decode.passmedia import NoStream, RangeFile, Window, frame_windows, speech_windows
from gdsload.preprocess.options import PassOptions, callable_of

KILL_ENV = "GDSLOAD_PROCESS_KILL"
_hits: dict[str, int] = {}


def kill_point(point: str) -> None:
    """Test hook (module docstring): SIGKILL this process at the N-th passage of `point`."""
    spec = os.environ.get(KILL_ENV)
    if not spec:
        return
    want, _, n = spec.partition(":")
    if want != point:
        return
    _hits[point] = _hits.get(point, 0) + 1
    if _hits[point] == int(n or 1):
        os.kill(os.getpid(), signal.SIGKILL)


class FnError(GdsloadError):
    """`fn` raised, or returned something that is not one item per window."""


def part_name(unit: int, n: int) -> str:
    return f"part-{unit:06d}-{n:06d}"


def done_name(unit: int, n: int) -> str:
    return f"{STATE_DIR}/done/{part_name(unit, n)}.json"


def unit_name(unit: int) -> str:
    return f"{STATE_DIR}/units/{unit:06d}.json"


def new_counts() -> dict[str, float]:
    return {"windows": 0, "outputs": 0, "batches": 0, "members": 0, "no_stream": 0, "media_s": 0.0}


@dataclass
class Stages:
    """Seconds per stage in this run (stages overlap: reading and decoding run beside `fn`)."""

    read: float = 0.0
    decode: float = 0.0
    fn: float = 0.0
    write: float = 0.0

    def add(self, other: dict[str, float]) -> None:
        for k, v in other.items():
            setattr(self, k, getattr(self, k) + v)


@dataclass
class _Item:
    """A (sample, field) of the unit: `pos` = (sample, field number)."""

    pos: tuple[int, int]
    key: str
    field: str
    offset: int
    size: int
    seconds: float  # from the index (0 where unknown)


@dataclass
class _Event:
    item: _Item
    kind: str  # "win", "done", "nostream", "error"
    win: Window | None = None
    reason: str = ""

    @property
    def nbytes(self) -> int:
        return self.win.nbytes if self.win is not None else 0


AHEAD_BYTES = 8 << 20  # decoded windows the reader may hold beyond the batch (at least one window)


@dataclass
class _Out:
    """The unit's output being written: the open shard, its counters since the last record."""

    n: int = 0
    shard: ShardFile | None = None
    nbytes: int = 0
    counts: dict[str, float] = field(default_factory=new_counts)
    rejects: list[dict[str, Any]] = field(default_factory=list)


def unit_items(ds: Any, unit: int, fields: list[str]) -> list[_Item]:
    idx = ds.index(unit)
    items = []
    for j in range(idx.num_samples):
        members = {e: (o, n) for e, o, n in idx.members(j)}
        key = None
        for fi, f in enumerate(fields):
            if f not in members:
                continue
            key = key or idx.key(j)
            meta = idx.media_info(f, j) or {}
            items.append(_Item((j, fi), key, f, *members[f], float(meta.get("duration") or 0.0)))
    return items


def _windows(opts: PassOptions, f: RangeFile, skip: int, threads: int | None, nvdec: Any = None):
    if opts.mode == "frames" and nvdec is not None:  # NVDEC (`gdsload.preprocess.gpu.NvdecFrames`)
        return nvdec.windows(f, opts.fps, opts.window, opts.size, skip, threads=threads)
    if opts.mode == "frames":
        return frame_windows(f, opts.fps, opts.window, opts.size, skip, threads=threads)
    return speech_windows(f, opts.chunk_s, skip)


def _too_long(it: _Item, opts: PassOptions) -> str:
    return (f"{it.seconds / 3600:.2f} hours long, over the limit of {opts.max_hours} (process(max_hours=...)); "
            f"not decoded")


class Remote:
    """A pass decoded on a feed server (`process(feed=...)`): the feed (`service.client.passfeed.
    WindowFeed`, duck-typed here: this layer does not import the feed), the source's name there and
    id, and the window spec (`PassWindows`' fields) of the pass's options."""

    def __init__(self, feed: Any, name: str, dataset_id: str, opts: PassOptions, fields: list[str]):
        self.feed, self.name, self.dataset_id = feed, name, dataset_id
        self.spec: dict[str, Any] = {"mode": opts.mode, "fields": list(fields),
                                     "max_seconds": opts.max_hours * 3600}
        if opts.mode == "frames":
            self.spec.update(fps=opts.fps, window=opts.window, size=opts.size or 0)
        else:
            self.spec.update(chunk_s=opts.chunk_s)

    def events(self, unit: int, start: tuple[int, int, int]) -> Any:
        return self.feed.events(self.name, self.dataset_id, unit, self.spec, start)

    def close(self) -> None:
        """Close the feed's connection in this process (before forking workers: each opens its own)."""
        close = getattr(self.feed, "close", None)
        if close is not None:
            close()


class _Reader:
    """The reader thread: items decoded in order (here, or on a feed server: `remote`) into a
    bounded queue of events."""

    def __init__(self, ds: Any, unit: int, items: list[_Item], opts: PassOptions, start: tuple[int, int, int],
                 threads: int | None = None, remote: Remote | None = None, nvdec: Any = None):
        self.remote, self.nvdec = remote, nvdec
        self.q: queue.Queue = queue.Queue(maxsize=max(2, opts.batch_size))
        self.stop = threading.Event()
        self._ahead = 0  # bytes of windows queued (`AHEAD_BYTES`)
        self._cv = threading.Condition()
        self.read_s = self.decode_s = 0.0
        self._args = (ds, unit, items, opts, start, threads)
        self.thread = threading.Thread(target=self._run, name="gdsload-process-read", daemon=True)
        self.thread.start()

    def _put(self, ev: Any) -> bool:
        nb = ev.nbytes if isinstance(ev, _Event) else 0
        with self._cv:
            while self._ahead and self._ahead + nb > AHEAD_BYTES and not self.stop.is_set():
                self._cv.wait(0.1)
            self._ahead += nb
        while not self.stop.is_set():
            try:
                self.q.put(ev, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run_remote(self) -> None:
        """The events of the feed server's window stream (`Remote`): the same as `_run`'s."""
        ds, unit, items, opts, start, threads = self._args
        by_pos = {it.pos: it for it in items}
        gen = self.remote.events(unit, start)  # type: ignore[union-attr]
        try:
            t0 = time.perf_counter()
            for key, ev, data, t in gen:
                it = by_pos[(ev["sample"], ev["field"])]
                self.decode_s += time.perf_counter() - t0
                if ev["kind"] == "win":
                    w = Window(ev["window"], data, t if opts.mode == "frames" else float(t[0]), ev.get("length", 0))
                    kill_point("decode")
                    if not self._put(_Event(it, "win", w)):
                        return
                else:
                    reason = ev.get("reason", "")
                    if ev["kind"] == "error" and it.seconds > opts.max_hours * 3600:
                        reason = _too_long(it, opts)  # (worded here, as a pass decoded here words it)
                    if not self._put(_Event(it, ev["kind"], reason=reason)):
                        return
                t0 = time.perf_counter()
        finally:
            gen.close()
        self._put(None)

    def _run(self) -> None:
        ds, unit, items, opts, start, threads = self._args
        if self.remote is not None:
            try:
                self._run_remote()
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                self._put(exc)
            return
        try:
            for it in items:
                if it.pos < start[:2]:
                    continue
                skip = start[2] if it.pos == start[:2] else 0
                if it.seconds > opts.max_hours * 3600:
                    ev = _Event(it, "error", reason=_too_long(it, opts))
                    if not self._put(ev):
                        return
                    continue
                f = RangeFile(lambda o, n: ds.read_extent(unit, o, n), it.offset, it.size)
                gen = _windows(opts, f, skip, threads, self.nvdec)
                t0 = time.perf_counter()
                ev = None
                while True:
                    try:
                        w = next(gen)
                    except StopIteration:
                        ev = _Event(it, "done")
                        break
                    except NoStream as exc:
                        ev = _Event(it, "nostream", reason=str(exc))
                        break
                    except ValueError as exc:
                        ev = _Event(it, "error", reason=str(exc))
                        break
                    self.decode_s += time.perf_counter() - t0
                    kill_point("decode")
                    if not self._put(_Event(it, "win", w)):
                        gen.close()
                        return
                    t0 = time.perf_counter()
                self.decode_s += time.perf_counter() - t0
                self.read_s += f.read_s
                if not self._put(ev):
                    return
            self._put(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            self._put(exc)

    def taken(self, ev: Any) -> None:
        """The consumer took `ev` off the queue: its bytes no longer count as ahead."""
        if isinstance(ev, _Event) and ev.win is not None:
            with self._cv:
                self._ahead -= ev.nbytes
                self._cv.notify()

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def decode_threads(side_by_side: int) -> int:
    """Decoder threads for each of `side_by_side` units running at once on this machine: its
    usable cores shared out, at least 1. One thread per decoder where units fill the cores: frame
    threads cost CPU time (8 % more per frame on 360p H.264, measured) that a core busy with
    another unit does not give back."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, side_by_side))


def _positions(rec: dict[str, Any]) -> tuple[int, int, int]:
    return tuple(rec["next"])  # type: ignore[return-value]


def run_unit(ds: Any, dst_store: Any, unit: int, opts: PassOptions, fields: list[str], fn: Any,
             progress: Callable[[float], None] | None = None, threads: int | None = None,
             remote: Remote | None = None, nvdec: Any = None) -> dict[str, Any]:
    """Run unit `unit` (input shard `unit` of `ds`) into `dst_store`; returns its unit record
    (also written to `STATE_DIR/units/`) plus `"stages"`: this run's seconds per stage.
    `threads`: video decoder threads (`gdsload.preprocess.media.frame_windows`; None: FFmpeg's
    choice); where units run side by side, each gets its share of the cores (`decode_threads`).
    They change the time a unit takes, never its bytes; nor does `remote` (the windows decoded on
    a feed server, `Remote`). `nvdec`: frames decoded on a GPU (`gdsload.preprocess.gpu.NvdecFrames`;
    other bytes, docs/preprocessing.md), batched on the device, `fn` gets them as a torch tensor."""
    store = dst_store
    prior = []
    start = (0, 0, 0)
    n = 0
    while store.exists(done_name(unit, n)):  # shards an interrupted run finished
        rec = json.loads(store.read(done_name(unit, n)))
        if store.size(rec["entry"]["name"]) != rec["entry"]["bytes"]:
            break
        prior.append(rec)
        start = _positions(rec)
        n += 1
    items = unit_items(ds, unit, fields)
    out = _Out(n=n)
    stages = Stages()
    first_key = next((r["first_key"] for r in prior if r.get("first_key")), None)
    want_fields: dict[str, str] = next((r["fields"] for r in prior if r["fields"]), {})
    call = callable_of(fn)
    reader = _Reader(ds, unit, items, opts, start, threads, remote, nvdec)
    batch: list[_Event] = []  # windows and the events between them, in order
    nwin = 0
    shape = None
    data: np.ndarray | None = None  # the batch's frames or audio, filled as windows arrive

    def flush() -> None:
        nonlocal batch, nwin, shape, data
        if batch:
            _run_batch(batch, nwin, data)
        batch, nwin, shape, data = [], 0, None, None

    def _run_batch(events: list[_Event], count: int, data: np.ndarray | None) -> None:
        nonlocal first_key, want_fields
        wins = [e for e in events if e.kind == "win"]
        results: list[Any] = []
        if wins:
            b = _batch_dict(wins, opts, data[: len(wins)])
            t0 = time.perf_counter()
            try:
                results = call(b)
            except Exception as exc:
                raise FnError(f"fn {_span(wins)} raised {type(exc).__name__}: {exc}") from exc
            finally:
                stages.fn += time.perf_counter() - t0
            if not isinstance(results, (list, tuple)) or len(results) != len(wins):
                got = f"{len(results)} items" if isinstance(results, (list, tuple)) else type(results).__name__
                raise FnError(f"fn {_span(wins)} returned {got}; it must return a list of {len(wins)} "
                              f"items (one per window: a dict, a list of dicts, or None)")
            kill_point("fn")
            out.counts["batches"] += 1
        t0 = time.perf_counter()
        k = 0
        for e in events:
            if e.kind != "win":
                _note(e)
                continue
            w = e.win
            samples = _outputs(e, results[k], wins)
            k += 1
            encoded = []
            for s in samples:
                key, payloads = encode_sample(s)
                if not want_fields:
                    _check_names(key, payloads, f"output {key!r} of ({e.item.key}, {e.item.field}, {w.index})")
                    want_fields = {f: mf.field_kind(f) for f in payloads}
                    first_key = key
                elif payloads.keys() != want_fields.keys():
                    raise InputError(
                        f"output {key!r} has fields {sorted(payloads)}, the pass's are {sorted(want_fields)} "
                        f"(those of its first output, {first_key!r}); every output has exactly those")
                encoded.append((key, payloads))
            size = sum(sample_nbytes(p) for _, p in encoded)
            if out.shard is not None and out.shard.num_samples and out.nbytes + size > opts.shard_size:
                _finish((e.item.pos[0], e.item.pos[1], w.index))
            for key, payloads in encoded:
                if out.shard is None:
                    out.shard = ShardFile(store, part_name(unit, out.n))
                    out.nbytes = 0
                out.shard.add(key, payloads)
                out.nbytes += sample_nbytes(payloads)
                kill_point("write")
            out.counts["windows"] += 1
            out.counts["outputs"] += len(encoded)
        stages.write += time.perf_counter() - t0

    def _note(e: _Event) -> None:
        c = out.counts
        if e.kind == "done":
            c["members"] += 1
            c["media_s"] += e.item.seconds
            if progress is not None:
                progress(e.item.seconds)
        elif e.kind == "nostream":
            c["no_stream"] += 1
            c["media_s"] += e.item.seconds
        elif e.kind == "error":
            if opts.on_error == "raise":
                raise DecodeError(f"cannot decode {ds.shards[unit]['name']}:{e.item.key} field {e.item.field!r}: "
                                  f"{e.reason}", remedy="pass on_error='skip' to skip and list such members "
                                  "in DST/rejected.jsonl")
            out.rejects.append({"shard": ds.shards[unit]["name"], "key": e.item.key, "field": e.item.field,
                                "reason": e.reason})

    def _finish(nxt: tuple[int, int, int]) -> None:
        cur, out.shard = out.shard, None
        if cur is None:
            return
        entry = cur.finish()
        cur.publish()
        kill_point("publish")
        rec = {"unit": unit, "entry": entry, "fields": want_fields,
               "first_key": first_key, "next": list(nxt), "counts": out.counts, "rejects": out.rejects}
        store.write(done_name(unit, out.n), json.dumps(rec).encode())
        prior.append(rec)
        out.n += 1
        out.counts, out.rejects = new_counts(), []

    try:
        while True:
            ev = reader.q.get()
            reader.taken(ev)
            if isinstance(ev, BaseException):
                raise ev
            if ev is None:
                break
            if ev.kind == "win":
                if nwin and (nwin >= opts.batch_size or ev.win.shape != shape):
                    flush()
                if data is None:  # pages are touched as windows land: a short batch costs its windows
                    data = (np.empty((opts.batch_size, *ev.win.shape), ev.win.data.dtype) if nvdec is None
                            else _gpu().batch_buffer(ev.win.data, opts.batch_size))
                data[nwin] = ev.win.data
                ev.win.data = None  # the batch holds it now: one copy of each window in memory
                shape = ev.win.shape
                nwin += 1
            batch.append(ev)
        flush()
        if out.shard is not None:
            _finish((items[-1].pos[0] + 1, 0, 0))  # past every item
    except BaseException:
        if out.shard is not None:
            out.shard.abort()
        raise
    finally:
        reader.close()
    stages.read, stages.decode = reader.read_s, max(0.0, reader.decode_s - reader.read_s)
    totals = new_counts()
    rejects: list[dict[str, Any]] = []
    for r in prior + [{"counts": out.counts, "rejects": out.rejects}]:
        for k, v in r["counts"].items():
            totals[k] += v
        rejects += r["rejects"]
    record = {"unit": unit, "shards": [r["entry"] for r in prior], "fields": want_fields, "first_key": first_key,
              "counts": totals, "rejects": rejects}
    store.write(unit_name(unit), json.dumps(record).encode())
    routes = dict(nvdec.routes) if nvdec is not None else {}
    return {**record, "stages": stages.__dict__.copy(), "resumed_shards": n, "routes": routes}


def _gpu() -> Any:
    from gdsload.preprocess import gpu

    return gpu


def _span(wins: list[_Event]) -> str:
    a, b = wins[0], wins[-1]
    return (f"on the batch from ({a.item.key!r}, {a.item.field!r}, window {a.win.index}) to "
            f"({b.item.key!r}, {b.item.field!r}, window {b.win.index})")


def _batch_dict(wins: list[_Event], opts: PassOptions, data: np.ndarray) -> dict[str, Any]:
    """The batch `fn` gets; `data` holds the windows' frames or audio, in order (filled as they
    arrived, so no window is held twice)."""
    b: dict[str, Any] = {"__key__": [e.item.key for e in wins], "field": [e.item.field for e in wins],
                         "window": np.array([e.win.index for e in wins], np.int64)}
    if opts.mode == "frames":
        b["frames"] = _gpu().as_torch(data) if hasattr(data, "__cuda_array_interface__") else data
        b["t"] = np.stack([e.win.t for e in wins])
    else:
        b["audio"] = data
        b["length"] = np.array([e.win.length for e in wins], np.int64)
        b["t"] = np.array([e.win.t for e in wins], np.float64)
    return b


def _outputs(e: _Event, item: Any, wins: list[_Event]) -> list[dict[str, Any]]:
    """The output samples of one window's item, keyed by the default rule where they have no key."""
    base = f"{e.item.key}/{e.item.field}/{e.win.index:06d}"
    if item is None:
        return []
    if isinstance(item, dict):
        return [item if "__key__" in item else {"__key__": base, **item}]
    if isinstance(item, (list, tuple)) and all(isinstance(x, dict) for x in item):
        return [x if "__key__" in x else {"__key__": f"{base}/{j}", **x} for j, x in enumerate(item)]
    raise FnError(f"fn {_span(wins)}: the item for ({e.item.key!r}, {e.item.field!r}, window {e.win.index}) is "
                  f"{type(item).__name__}; an item is a dict, a list of dicts, or None")
