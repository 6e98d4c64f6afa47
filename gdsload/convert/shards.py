"""Shard writer: samples in, an aligned tar plus its two indexes out.

The root is a local folder or an fsspec URL (`gdsload.io.store`). A shard is hashed while it
is written (SHA-256, no second read) and published as `NAME.tar` only after both index files are
in place: locally it is written as `.NAME.tar.tmp-PID`, fsynced and renamed; at a URL its upload
completes then. `abort()` (or an exception inside `with`) drops it, so a shard under its final
name is always complete.

Per member it also stores, in the index, the payload's CRC32 (`gdsload.format.crc`: zlib's polynomial) for the
loader's load-time checks, and per label field the parsed label values as an int64 column; labels
that are not integers and `.npy` payloads that do not parse are refused (`FormatError`) before
anything of the sample is written. Video and audio members are stored unchanged and probed
(`gdsload.decode.media.probe`: codec, size, fps, frames, ...; sample rate, channels, length), the
metadata kept in the index's media columns; media that do not probe are refused. Fortran-ordered arrays are stored in C order (`npy.normalize`)
and counted per field in the shard entry (`fortran_to_c`) and the manifest (`created`).

Threads: the bytes go to the file and into the SHA-256 on two background threads (`_Pipe`), in
order, so that copying into the page cache (~0.9 GB/s a core here) and hashing (~1.8 GB/s) overlap
each other and the caller's next sample instead of adding up on one core (both release the GIL).
At most `PIPE_BYTES` are in flight; a `bytearray` payload (or a view of one) is copied before it
is queued, so the caller may reuse it at once; other buffers (Arrow's, NumPy's) are held, not
copied, and must not change until the shard is closed. A write error
(named by the store) is raised by the next `add`, or by `close`.

Memory: one sample's payloads plus `PIPE_BYTES` in flight. Not thread-safe: one writer per thread
or process.
"""

from __future__ import annotations

import hashlib
import queue
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gdsload.errors import FormatError
from gdsload.format import manifest as mf
from gdsload.format import npy
from gdsload.format.crc import crc32
from gdsload.format.index import ShardIndex, check_key
from gdsload.format.labels import parse_label
from gdsload.io.store import Store, open_store, save_manifest
from gdsload.format.tar import end_of_archive, write_member


PIPE_BYTES = 64 << 20  # bytes queued for the write and hash threads at most
_GATHER = 1 << 20  # bytes of pieces per queue item


class _Pipe:
    """Feeds the same bytes, in order, to `write` on one thread and `update` on another.

    `put` blocks while more than `limit` bytes wait for either thread; the first exception of
    either thread is raised by the next `put` or by `finish` (the remaining items are dropped).
    Writes are queued in groups of about `_GATHER` bytes (a list of the caller's pieces, not
    copied: joining them cost two extra copies of every payload under 256 KiB, i.e. of nearly
    every JPEG); a `bytearray` (or a view of one) is copied, since its owner may reuse it.
    """

    def __init__(self, write, update, limit: int = PIPE_BYTES):
        self._cv = threading.Condition()
        self._pending = [0, 0]  # bytes queued for the writer, the hasher
        self._limit = limit
        self._error: BaseException | None = None
        self._parts: list = []  # pieces gathered for the next queue item
        self._parts_n = 0
        self._queues = (queue.SimpleQueue(), queue.SimpleQueue())
        self._threads = [threading.Thread(target=self._run, args=(i, fn), daemon=True,
                                          name=f"gdsload-shard-{what}")
                         for i, (fn, what) in enumerate(((write, "write"), (update, "hash")))]
        for t in self._threads:
            t.start()

    def _run(self, i: int, fn) -> None:
        q = self._queues[i]
        while True:
            item = q.get()
            if item is None:
                return
            parts, n = item
            if self._error is None:
                try:
                    for data in parts:
                        fn(data)
                except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                    with self._cv:
                        self._error = self._error or exc
            with self._cv:
                self._pending[i] -= n
                self._cv.notify_all()

    def put(self, data: bytes | memoryview) -> None:
        n = memoryview(data).nbytes
        if isinstance(data, bytearray) or (isinstance(data, memoryview) and isinstance(data.obj, bytearray)):
            data = bytes(data)  # the caller may reuse its bytearray once `put` returns
        self._parts.append(data)
        self._parts_n += n
        if self._parts_n >= _GATHER:
            self._flush()

    def _flush(self) -> None:
        if self._parts:
            parts, n = self._parts, self._parts_n
            self._parts, self._parts_n = [], 0
            self._queue(parts, n)

    def _queue(self, data, n: int) -> None:
        with self._cv:
            while self._error is None and max(self._pending) > self._limit:
                self._cv.wait()
            if self._error is not None:
                raise self._error
            self._pending[0] += n
            self._pending[1] += n
        for q in self._queues:
            q.put((data, n))

    def finish(self) -> None:
        """Wait until every byte is written and hashed; raise the first error."""
        try:
            if self._error is None:
                self._flush()
        finally:
            self.stop()
        if self._error is not None:
            raise self._error

    def stop(self) -> None:
        """End both threads after what is queued (idempotent)."""
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join()


_KINDS: dict[str, str] = {}  # field names already checked -> their kind (`manifest.field_kind`)


def shard_name(prefix: str, i: int) -> str:
    return f"{prefix}-{i:06d}"


class ShardFile:
    """Write one shard `root/NAME.tar` with `NAME.idx` and `NAME.dali.idx` (the unit every dataset
    writer is built from; the public whole-dataset writer is `gdsload.ShardWriter`)."""

    def __init__(self, root: str | Path | Store, name: str):
        self.store = open_store(root)
        self.name = name
        self._f = self.store.create(f"{name}.tar")
        self._hash = hashlib.sha256()
        self._offset = 0
        self._samples: list[tuple[str, list[tuple[str, int, int]]]] = []
        self._crc: list[int] = []  # per member, in tar order
        self._sizes: dict[str, list[int]] = {}  # field -> [smallest, largest] payload
        self._labels: list[dict[str, int]] = []  # per sample: label field -> value
        self._media: list[dict[str, dict]] = []  # per sample: video/audio field -> probed metadata
        self.fortran_to_c: dict[str, int] = {}  # .npy field -> payloads rewritten in C order
        self._keys: set[str] = set()
        self._indexes: tuple[bytes, bytes] | None = None  # built by `finish`, written by `publish`
        self._sink = _Tee(self)
        self._pipe = _Pipe(self._f.write, self._hash.update)

    def __enter__(self) -> "ShardFile":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    @property
    def nbytes(self) -> int:
        return self._offset

    @property
    def num_samples(self) -> int:
        return len(self._samples)

    def _write(self, data: bytes | memoryview) -> None:
        self._pipe.put(data)
        self._offset += memoryview(data).nbytes

    def add(self, key: str, fields: Mapping[str, bytes | memoryview]) -> None:
        """Append one sample; its members are written adjacent, in the order of `fields`."""
        check_key(key)
        if key in self._keys:
            raise FormatError(f"duplicate sample key {key!r} in shard {self.name}")
        if not fields:
            raise FormatError(f"sample {key!r} has no fields")
        prepared = []
        labels: dict[str, int] = {}
        media: dict[str, dict] = {}
        fortran: list[str] = []
        for ext, payload in fields.items():
            kind = _KINDS.get(ext)
            if kind is None:  # a field name not seen before in this process: check it once
                if not ext or "/" in ext or any(c.isspace() or not c.isprintable() for c in ext):
                    raise FormatError(f"sample {key!r}: invalid field name {ext!r} (no '/', whitespace "
                                      f"or control characters)")
                kind = _KINDS[ext] = mf.field_kind(ext)
            try:
                if kind == "label":
                    labels[ext] = parse_label(payload)
                elif kind in ("video", "audio"):  # stored unchanged; what the loader plans from
                    from gdsload.decode.media import probe

                    try:
                        media[ext] = probe(payload, kind)
                    except ValueError as exc:
                        raise FormatError(str(exc)) from None
                payload, was_fortran = npy.normalize(payload) if kind == "tensor" else (payload, False)
            except FormatError as exc:
                raise FormatError(f"sample {key!r}: field {ext!r}: {exc}") from None
            if was_fortran:
                fortran.append(ext)
            prepared.append((ext, payload))
        members = []
        sizes = self._sizes
        for ext, payload in prepared:
            hdr_start = self._offset
            data_off, _ = write_member(self._sink, hdr_start, f"{key}.{ext}", payload)
            n = len(payload)
            members.append((ext, data_off, n))
            self._crc.append(crc32(payload))
            lo_hi = sizes.get(ext)
            if lo_hi is None:
                sizes[ext] = [n, n]
            elif n < lo_hi[0]:
                lo_hi[0] = n
            elif n > lo_hi[1]:
                lo_hi[1] = n
        self._keys.add(key)
        self._samples.append((key, members))
        self._labels.append(labels)
        self._media.append(media)
        for ext in fortran:
            self.fortran_to_c[ext] = self.fortran_to_c.get(ext, 0) + 1

    def close(self) -> mf.ShardEntry:
        """Finish the archive, write both indexes, and rename the shard into place."""
        entry = self.finish()
        self.publish()
        return entry

    def finish(self, index_extra: Mapping[str, Any] | None = None) -> mf.ShardEntry:
        """End the archive: every byte written and hashed, the indexes built; returns the
        manifest entry. The shard is not in place until `publish()` (or dropped by `abort()`).
        `index_extra`: more arrays for the index (`ShardIndex.to_bytes`: a token shard's documents)."""
        self._write(end_of_archive())
        self._pipe.finish()
        index = ShardIndex.build(self._samples, crc=self._crc, labels=self._labels, npy_c_order=True,
                                 media=self._media)
        self._indexes = (index.to_bytes(index_extra), index.to_dali().encode())
        entry: mf.ShardEntry = {
            "name": f"{self.name}.tar",
            "index": f"{self.name}.idx",
            "dali_index": f"{self.name}.dali.idx",
            "samples": len(self._samples),
            "bytes": self._offset,
            "sha256": self._hash.hexdigest(),
        }
        if self.fortran_to_c:
            entry["fortran_to_c"] = dict(sorted(self.fortran_to_c.items()))
        # what a loader sizes its buffers from without loading every index (`ShardEntry`)
        sizes = self._sizes
        entry["max_nbytes"] = {ext: hi for ext, (_, hi) in sorted(sizes.items())}
        entry["min_nbytes"] = {ext: lo for ext, (lo, _) in sorted(sizes.items())}
        entry["member_crc"] = entry["npy_c_order"] = True
        return entry

    def publish(self) -> None:
        """After `finish()`: write both indexes and put the tar in place (durably: each file is
        fsynced before its rename, the tar last). May run on another thread than `finish()`."""
        assert self._indexes is not None, "publish() before finish()"
        idx, dali = self._indexes
        self.store.write(f"{self.name}.idx", idx)
        self.store.write(f"{self.name}.dali.idx", dali)
        self._f.commit()

    def abort(self) -> None:
        self._pipe.stop()
        self._f.abort()


class _Tee:
    """File-like `write` that goes through the shard writer's hashing and offset accounting."""

    def __init__(self, w: ShardFile):
        self._w = w

    def write(self, data: bytes | memoryview) -> int:
        self._w._write(data)
        return len(data)


def make_manifest(
    shards: list[mf.ShardEntry],
    fields: Mapping[str, str],
    *,
    classes: list[str] | None = None,
    created: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    from gdsload._version import __version__

    fortran: dict[str, int] = {}
    for s in shards:
        for ext, n in s.get("fortran_to_c", {}).items():
            fortran[ext] = fortran.get(ext, 0) + n
    notes = {"fortran_to_c": dict(sorted(fortran.items()))} if fortran else {}
    return {
        "format": "gdsload",
        "version": mf.FORMAT_VERSION,
        "num_samples": sum(s["samples"] for s in shards),
        "num_bytes": sum(s["bytes"] for s in shards),
        "shards": list(shards),
        "fields": dict(sorted(fields.items())),
        "classes": classes,
        "created": {
            "by": f"gdsload {__version__}",
            "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            **(created or {}),
            **notes,  # .npy payloads stored in C order, per field
        },
    }


class DatasetWriter:
    """Stream samples into shards rolled at `shard_size` bytes; `close()` writes the manifest.

    A minimal single-process writer kept for tests and internal tools; the public writer, with
    resume, appends and worker processes, is `gdsload.ShardWriter` (`gdsload.convert.writer`).
    """

    def __init__(self, root: str | Path, *, shard_size: int = 1 << 30, prefix: str = "shard",
                 classes: list[str] | None = None):
        self.root = open_store(root)  # a local folder or an fsspec URL
        self.root.make_dirs()
        if self.root.exists(mf.MANIFEST):
            from gdsload.errors import DestinationError

            raise DestinationError(f"{self.root.root} already holds a dataset ({mf.MANIFEST} exists)")
        self.shard_size = shard_size
        self.prefix = prefix
        self.classes = classes
        self.shards: list[mf.ShardEntry] = []
        self.fields: dict[str, str] = {}
        self._cur: ShardFile | None = None
        self._keys: set[str] = set()

    def write(self, key: str, fields: Mapping[str, bytes | memoryview]) -> None:
        if self._cur is not None and self._cur.nbytes >= self.shard_size:
            self.shards.append(self._cur.close())
            self._cur = None
        if key in self._keys:
            raise FormatError(f"duplicate sample key {key!r}: keys must be unique across the dataset")
        if self._cur is None:
            self._cur = ShardFile(self.root, shard_name(self.prefix, len(self.shards)))
        self._cur.add(key, fields)
        self._keys.add(key)
        for ext in fields:
            self.fields.setdefault(ext, mf.field_kind(ext))

    def close(self) -> dict[str, Any]:
        if self._cur is not None:
            self.shards.append(self._cur.close())
            self._cur = None
        m = make_manifest(self.shards, self.fields, classes=self.classes, created={"source_format": "api"})
        save_manifest(self.root, m)
        return m

    def __enter__(self) -> "DatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        elif self._cur is not None:
            self._cur.abort()
