"""A preprocessing pass's windows served from this server (`BatchRequest.windows`, issue 54).

A pass run with `gdsload.process(..., feed=ADDRESS)` decodes on the feed's servers: per input
shard one StreamBatches call whose request carries `windows` (a `PassWindows`) instead of an
epoch. `WindowSource` is that call's source for the one stream loop (`stream.serve`), so it takes
its turns with the other streams under the priority arbiter (`priority.Arbiter`: a pass sent at
priority 0 yields to training sent at 1 or more, and is told of its pauses when it understands
them) and holds a stream slot and a memory reservation (`WINDOW_BYTES`) of the server's budget.

The events are those of a pass run in the client's own process: the shard's samples in stored
order, per sample the selected fields present, per member its windows from
`gdsload.decode.passmedia` (the one decoding code of a pass, wherever it runs), then "done";
"nostream" for a member without the stream the mode needs, "error" (with the reason) for one
that does not decode or is over `max_seconds`; last, "end" (a stream that ends without it, e.g.
at a draining server's batch boundary, was cut short: the client asks again from there). Each
event is one batch of the stream (the proto's PassWindows gives its layout); the client turns
them back into the pass's windows.
Memory: one decoded window (and its serialized chunks) at a time, plus the decoder's buffers and
one read block (`passmedia.RangeFile`), whatever the member's length.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np

from gdsload.errors import BadRequest, DatasetChanged
from gdsload.service.protocol import wire
from gdsload.service.server import estimate
from gdsload.service.server.admission import Claim
from gdsload.v1 import feed_pb2 as pb

#: What a window stream reserves of the server's memory budget: the decoder's buffers and a few
#: windows (decoded, serialized, in flight), for 1080p frames in windows of 8 or 30 s of speech.
WINDOW_BYTES = 256 << 20
_CLAIM = Claim(name="a pass's window stream",
               over="a pass's window stream needs {n} bytes, more than the server's memory budget of {limit}",
               busy="a pass's window stream needs {n} bytes; {reserved} of the budget of {limit} are held by "
                    "{streams} streams: retry later")
#: Request fields a window request leaves unset (the epoch's; `PassWindows` replaces them).
_EPOCH_FIELDS = ("dataset", "mix", "media", "share", "transform", "block_stride", "block_batches", "bulk")


def check_windows(req: pb.BatchRequest) -> pb.PassWindows:
    """The request's `PassWindows`, checked (BadRequest naming the field)."""
    w = req.windows
    for name in _EPOCH_FIELDS:
        fd = pb.BatchRequest.DESCRIPTOR.fields_by_name[name]
        if fd.is_repeated:
            given = len(getattr(req, name)) > 0
        else:
            given = req.HasField(name) if fd.message_type is not None else bool(getattr(req, name))
        if given:
            raise BadRequest(f"BatchRequest.{name} is set with BatchRequest.windows; a window request names its "
                             f"dataset in PassWindows.dataset and leaves the epoch's fields unset")
    if not w.dataset:
        raise BadRequest("BatchRequest.windows.dataset is empty; ListDatasets gives the served names")
    if not w.fields:
        raise BadRequest("BatchRequest.windows.fields is empty: name the video or audio fields to decode")
    if w.mode == "frames":
        if not (w.fps > 0 and np.isfinite(w.fps)) or w.window < 1:
            raise BadRequest(f"BatchRequest.windows: frames need fps > 0 and window >= 1, got fps {w.fps} and "
                             f"window {w.window}")
    elif w.mode == "speech":
        if not (w.chunk_s > 0 and np.isfinite(w.chunk_s)):
            raise BadRequest(f"BatchRequest.windows: speech needs chunk_s > 0, got {w.chunk_s}")
    else:
        raise BadRequest(f"BatchRequest.windows.mode is {w.mode[:32]!r}: 'frames' or 'speech'")
    if w.start_field >= len(w.fields):
        raise BadRequest(f"BatchRequest.windows.start_field {w.start_field} is past its {len(w.fields)} fields")
    return w


def open_windows(req: pb.BatchRequest, *, loaders: Any) -> WindowSource:
    """The source of a window request: checked, its dataset opened from the catalog, a stream slot
    and `WINDOW_BYTES` reserved (released when it raises)."""
    spec = check_windows(req)
    ds = loaders.catalog.dataset(spec.dataset)
    if req.dataset_id and req.dataset_id != ds.dataset_id:
        raise DatasetChanged(f"dataset {spec.dataset!r} on this server has id {ds.dataset_id}, the pass planned "
                             f"with {req.dataset_id[:64]} (BatchRequest.dataset_id)")
    shards = ds.shards
    if spec.shard >= len(shards.shards):
        raise BadRequest(f"BatchRequest.windows.shard {spec.shard}: dataset {spec.dataset!r} has "
                         f"{len(shards.shards)} shards")
    kinds = shards.fields
    for f in spec.fields:
        if kinds.get(f) not in ("video", "audio"):
            raise BadRequest(f"BatchRequest.windows.fields: {f[:64]!r} is not a video or audio field of "
                             f"{spec.dataset!r} (fields: {sorted(kinds)})")
    reservation = loaders.budget.reserve(WINDOW_BYTES, _CLAIM)
    try:
        slot = loaders.budget.stream()
    except BaseException:
        reservation.release()
        raise
    return WindowSource(shards, spec, estimate.chunk_bytes(req, loaders.limits), [reservation, slot])


def member_windows(spec: pb.PassWindows, f: Any, skip: int, threads: int | None = None) -> Iterator[Any]:
    """One member's windows (`passmedia.frame_windows` or `speech_windows`), from window `skip`."""
    from gdsload.decode.passmedia import frame_windows, speech_windows

    if spec.mode == "frames":
        return frame_windows(f, spec.fps, spec.window, spec.size or None, skip, threads=threads)
    return speech_windows(f, spec.chunk_s, skip)


def events(shards: Any, spec: pb.PassWindows) -> Iterator[tuple[str, dict[str, Any], Any]]:
    """(key, event, window or None) of the shard from the spec's start (the module docstring)."""
    from gdsload.decode.passmedia import NoStream, RangeFile

    unit = spec.shard
    idx = shards.index(unit)
    start = (spec.start_sample, spec.start_field)
    for j in range(spec.start_sample, idx.num_samples):
        members = {e: (o, n) for e, o, n in idx.members(j)}
        for fi, name in enumerate(spec.fields):
            if name not in members or (j, fi) < start:
                continue
            key = idx.key(j)
            ev: dict[str, Any] = {"sample": j, "field": fi}
            seconds = float((idx.media_info(name, j) or {}).get("duration") or 0.0)
            if spec.max_seconds and seconds > spec.max_seconds:
                yield key, {**ev, "kind": "error", "reason": f"{seconds / 3600:.2f} hours long, over the limit of "
                            f"{spec.max_seconds / 3600} (process(max_hours=...)); not decoded"}, None
                continue
            off, size = members[name]
            f = RangeFile(lambda o, n: shards.read_extent(unit, o, n), off, size)
            gen = member_windows(spec, f, spec.start_window if (j, fi) == start else 0)
            try:
                for w in gen:
                    yield key, {**ev, "kind": "win", "window": w.index, "length": w.length}, w
                end = {**ev, "kind": "done"}
            except NoStream as exc:
                end = {**ev, "kind": "nostream", "reason": str(exc)}
            except ValueError as exc:
                end = {**ev, "kind": "error", "reason": str(exc)}
            finally:
                gen.close()
            yield key, end, None
    yield "", {"kind": "end"}, None  # the shard is done (a stream cut short lacks it)


class _Event:
    """One event serialized (`sources.Frames`' protocol; not `sources.Encoded`, which imports this
    module's caller)."""

    __slots__ = ("frames", "nbytes", "samples", "step")
    copy = False
    group = False

    def __init__(self, step: int, frames: Iterator[list[Any]], nbytes: int):
        self.step, self.frames, self.nbytes, self.samples = step, frames, nbytes, 1

    def pieces(self) -> Iterator[list[Any]]:
        return self.frames

    def messages(self) -> Iterator[bytes]:
        return (b"".join(pieces) for pieces in self.frames)


class WindowSource:
    """A window request's events as the stream's batches (`sources.BatchSource`'s protocol)."""

    payload = "windows"

    def __init__(self, shards: Any, spec: pb.PassWindows, chunk: int, held: list[Any]):
        self.spec, self.chunk, self.held = spec, chunk, held
        self.label = spec.dataset
        self.events = events(shards, spec)
        self.step = 0
        self.closed = False

    def next(self) -> _Event | None:
        got = next(self.events, None)
        if got is None:
            return None
        key, ev, w = got
        batch: dict[str, Any] = {"event": [json.dumps(ev).encode()]}
        if w is not None:
            batch["data"] = w.data[None]
            batch["t"] = np.asarray(w.t, np.float64).reshape(1, -1)
        batch[wire.KEY] = [key]
        step, self.step = self.step, self.step + 1
        frames = wire.encode_frames(batch, epoch=0, step=step, position=step + 1, max_chunk_bytes=self.chunk)
        return _Event(step, frames, wire.body_nbytes(batch))

    def close(self, outcome: str) -> None:
        if self.closed:
            return
        self.closed = True
        self.events.close()
        for r in self.held:
            r.release()

    def log_fields(self, end: bool) -> dict[str, Any]:
        s = self.spec
        return {} if end else {"windows": s.mode, "shard": s.shard, "start_sample": s.start_sample}
