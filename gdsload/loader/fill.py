"""Filling one ring slot with one batch: `SlotFiller.fill(slot, seq, ids)`, run by a reader thread.

`fill` plans the batch's reads with NumPy (`gdsload.loader.gather`) and, when it can, goes through
`_fill_planned`: one coalesced read table per destination arena, CRC32s checked per contiguous
run, labels from the index, bytes fields as one `BytesColumn`, images decoded by the loader's one
DALI pipeline in plan order (`gdsload.loader.decoding`). Batches it cannot plan (`.npy` headers to
read) go member by member through `_fill_members`. Both end in `_finish_fill`, which records what
the consumer needs in a `BatchInfo` (`gdsload.loader.assemble`) and runs the user's
`map`/`collate_fn`.

A filler is given everything it uses: the loader's `Resources` (backends, cache, ring, streams,
staging pool), the `BatchLayout`, the source (a mix's "__source__"), the pass's `OrderedDecoder`,
`BatchAssembler`, user-code run and `StageTimes`. It writes nothing but the slot.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import numpy as np

from gdsload.dataset.verify import BatchChecks, check_crcs, label
from gdsload.errors import FormatError
from gdsload.format.tar import ALIGN
from gdsload.io.base import Extent
from gdsload.io.table import ExtentTable, read_table
from gdsload.frontend import fields as _fieldkinds
from gdsload.loader.assemble import BatchInfo
from gdsload.loader.gather import distinct


class SlotFiller:
    """Fills ring slots for one pass (see the module docstring)."""

    def __init__(self, resources: Any, layout: Any, source: Any, decoder: Any, assembler: Any, stage: Any,
                 times: Any):
        self.res = resources
        self.layout = layout
        self.source = source
        self.decoder = decoder  # gdsload.loader.decoding.OrderedDecoder
        self.assembler = assembler  # gdsload.loader.assemble.BatchAssembler
        self.stage = stage  # the pass's map/collate_fn run, or None
        self.times = times  # gdsload.loader.stats.StageTimes
        self.n_images = layout.n_images
        self.draw_key = (0, 0)  # (seed, epoch): media draws per sample (`gdsload.decode.media.draws`)
        ring = resources.ring
        self._layout = {name: off for name, (off, _) in ring.spec.layout().items()}
        hs = ring.host_spec
        self._host_layout = {name: off for name, (off, _) in hs.layout().items()} if hs else None
        # Held by a reader for the Python-heavy parts of a batch (planning, per-sample values,
        # CRC32s member by member), never across its reads or decodes: readers that interleave
        # those parts convoy on the GIL (a thread back from a GIL-free `crc32` call waits up to the
        # 5 ms switch interval for one busy in Python), which measured at half the samples/s of
        # one reader on 2 cores; serialised, one reader's CPU part overlaps the others' reads.
        self._cpu = threading.Lock()

    def _decode(self, turn: int, encoded: list, names: list[str], dst):
        return self.decoder.decode(turn, encoded, names, dst)

    def fill(self, slot, seq: int, ids: np.ndarray) -> None:
        """Read (and decode) batch `seq` into `slot`.

        Planned with array operations (`gdsload.loader.gather`); batches it does not plan (`.npy`
        headers to read) go member by member (`_fill_members`)."""
        planner = self.layout.planner
        with self._cpu:  # members packed in a batch-owned buffer: CRC-checked in one call
            reads = planner.plan(ids, packed=self.layout.own_staging) if planner is not None else None
        if reads is None:
            return self._fill_members(slot, seq, ids)
        return self._fill_planned(slot, seq, ids, reads)

    def _fill_planned(self, slot, seq: int, ids: np.ndarray, reads) -> None:

        R = self.res
        bufs = slot.buffers
        own = self.layout.own_staging  # staged members into the batch's own buffer, not the ring's
        staging = R.staging_pool.take(int(reads.staged_pos[-1] + reads.staged_nbytes[-1]) if len(reads.staged_pos)
                                       else 0) if own else bufs["__staging__"]
        slot.wait_fence()  # the consumer's queued work on this slot's previous batch is done
        layout, hl = self._layout, self._host_layout
        to_host = hl is not None and R.host_backend is None
        paths = self.layout.planner.paths
        local = None
        if R.cache is not None:  # whole shards in the local cache, pinned until the batch is read
            local = R.cache.acquire(seq, distinct(reads.shard))
            paths = list(paths)
            for s, path in local.items():
                paths[s] = path
            paths = tuple(paths)
        n = reads.n
        rows = []  # .npy rows: (file, offset, nbytes, out offset) into their batch tensor
        for name, (off, nb) in reads.tensors.items():
            base = hl["__h_" + name] if to_host else layout[name]
            rows.append((reads.shard, off, nb, base + np.arange(n, dtype=np.int64) * nb))
        staged = (reads.staged_file, reads.staged_offset, reads.staged_nbytes,
                  reads.staged_pos + (0 if own else (hl if hl is not None else layout)["__staging__"]))
        # one table per destination arena: a host ring reads the whole batch in one call
        if own:
            jobs = [(R.backend, ExtentTable.concat(paths, rows), slot.flat),
                    (R.backend, ExtentTable.concat(paths, [staged]), staging)]
        elif hl is None:
            jobs = [(R.backend, ExtentTable.concat(paths, rows + [staged]), slot.flat)]
        elif to_host:
            jobs = [(R.backend, ExtentTable.concat(paths, rows + [staged]), slot.host_flat)]
        else:  # KvikIO into the device arena, encoded bytes and labels via POSIX into pinned memory
            jobs = [(R.backend, ExtentTable.concat(paths, rows), slot.flat),
                    (R.host_backend, ExtentTable.concat(paths, [staged]), slot.host_flat)]
        t0 = time.perf_counter()
        nbytes = sum(f.result() for f in [read_table(b, t, out) for b, t, out in jobs if len(t)])
        self.times.add("read", time.perf_counter() - t0)
        if local is not None:  # read: unpin now, not after the decode turn (as `_fill_members`)
            R.cache.release(seq)
        names = reads.names
        info = BatchInfo(keys=reads.keys, n=n, nbytes=nbytes, sources=self.source.sources_of(ids))
        keep = None
        kepts: dict[str, list[int]] = {}
        if own:  # packed members: a few crc32 calls, each giving the GIL up once
            t0 = time.perf_counter()
            check_crcs(reads, staging)
            self.times.add("check", time.perf_counter() - t0)
        with self._cpu:  # per-sample values (and CRC32s member by member); images decode after, in their turn
            if not own:
                t0 = time.perf_counter()
                check_crcs(reads, staging)
                self.times.add("check", time.perf_counter() - t0)
            self._host_values(reads, staging, info, to_host, bufs)
        for fp in self.layout.fields:
            if fp.kind == "image":
                pos, nb, _ = reads.staged[fp.name]
                encoded = [staging[a : a + k] for a, k in zip(pos.tolist(), nb.tolist())]
                turn = seq * self.n_images + len(kepts)
                kept = kepts[fp.name] = self._decode(turn, encoded, names, bufs[fp.name])
                if len(kept) < n:
                    keep = kept if keep is None else _both(keep, kept)
                info.skipped += n - len(kept)
        for fp in self.layout.media_fields:
            pos, nb, _ = reads.staged[fp.name]
            kept = self._media(fp, [staging[a : a + k] for a, k in zip(pos.tolist(), nb.tolist())], names, ids, bufs)
            if len(kept) < n:
                info.skipped += n - len(kept) if keep is None else len(set(keep) - set(kept))
                keep = kept if keep is None else _both(keep, kept)
        self._finish_fill(slot, info, bufs, names, n, keep, kepts)

    def _host_values(self, reads, staging, info: BatchInfo, to_host: bool, bufs) -> None:
        """The planned batch's labels, host copies of `.npy` rows to the device, and per-sample
        values of list fields (bytes, text, json, ragged)."""
        streams = self.res.streams
        names = reads.names
        n = reads.n
        for fp in self.layout.fields:
            if fp.kind == "label":
                dst = bufs["__h_" + fp.name] if streams else bufs[fp.name]
                col = reads.labels.get(fp.name)
                if col is not None:
                    dst[:n] = col
                if fp.name in reads.staged:  # indexes without a label column: parse the text
                    pos, nb, smp = reads.staged[fp.name]
                    for a, k, i in zip(pos.tolist(), nb.tolist(), smp.tolist()):
                        dst[i] = label(staging, a, k, names[i], fp.name)
                if streams:  # non-blocking, on the private stream, after the fence above
                    streams.to_device(bufs[fp.name][:n], dst[:n])
            elif fp.kind == "tensor" and to_host:
                streams.to_device(bufs[fp.name][:n], bufs["__h_" + fp.name][:n])
            elif fp.kind == "bytes":  # one object for the batch; bytes made when asked (fields.py)
                pos, nb, _ = reads.staged[fp.name]
                col = _fieldkinds.BytesColumn(staging, pos, nb)
                info.extra[fp.name] = col if self.layout.own_staging else col.copy()  # not a view of the ring
            elif fp.kind in _fieldkinds.LIST_KINDS:
                pos, nb, _ = reads.staged[fp.name]
                info.extra[fp.name] = [_fieldkinds.parse(fp.kind, staging[a : a + k], names[i])
                                          for i, (a, k) in enumerate(zip(pos.tolist(), nb.tolist()))]

    def _fill_members(self, slot, seq: int, ids: np.ndarray) -> None:
        """`_fill` one member at a time: `.npy` headers read and checked per sample."""

        R = self.res
        fields = self.layout.fields
        ds = self.source.shards
        bufs = slot.buffers
        staging = bufs["__staging__"]
        slot.wait_fence()  # the consumer's queued work on this slot's previous batch is done
        keys, names = [], []
        direct: dict[str, tuple[list, list]] = {}
        staged: list[Extent] = []
        staged_off: list[int] = []
        spans: dict[str, list[tuple[int, int]]] = {fp.name: [] for fp in fields}
        labels: dict[str, list[Any]] = {fp.name: [] for fp in fields if fp.kind == "label"}
        checks = BatchChecks()
        crc_staged = any(fp.kind == "image" or fp.kind in _fieldkinds.LIST_KINDS for fp in fields)  # labels come from the index
        # a device ring with a host-only backend: .npy rows land in pinned "__h_" fields first
        to_host = self._host_layout is not None and R.host_backend is None
        cursor = 0
        local = None
        if R.cache is not None:  # whole shards in the local cache, pinned until the batch is read
            ends = np.cumsum(self.source.shard_sizes)
            local = R.cache.acquire(seq, distinct(np.searchsorted(ends, ids, side="right")))
        for i, gid in enumerate(ids.tolist()):
            s, j = ds.locate(gid)
            idx = ds.index(s)
            key = idx.key(j)
            keys.append(key)
            where = f"{ds.shards[s]['name']}:{key}"
            names.append(where)
            members = {e: (o, n) for e, o, n in idx.members(j)}
            mode = self.layout.shard_verify[s]
            crcs = (dict(zip(members, idx.crcs(j)))
                    if mode is not None and idx.member_crc is not None and (crc_staged or mode == "full") else {})
            path = local[s] if local is not None and s in local else ds.shard_path(s)
            for fp in fields:
                m = members.get(fp.name)
                if m is None:
                    raise FormatError(f"sample {key!r} in {ds.shards[s]['name']} has no field {fp.name!r}")
                o, n = m
                if fp.kind == "label" and fp.name in idx.labels:
                    labels[fp.name].append(int(idx.labels[fp.name][j]))  # validated at conversion
                elif fp.kind == "tensor":
                    head = None if n >= ALIGN else ds.read_extent(s, o, n)
                    off, nb = fp.tensor.data_extent(where, o, n, head)
                    ex, outs = direct.setdefault(fp.name, ([], []))
                    ex.append(Extent(path, off, nb))
                    outs.append(i * nb)
                    if head is None and (mode == "full" or not idx.npy_c_order):
                        head = (staging, cursor, off - o)  # read its header too, to check it
                        staged.append(Extent(path, o, off - o))
                        staged_off.append(cursor)
                        checks.header(fp.tensor, where, *head)
                        cursor += -(-(off - o) // 64) * 64
                    if mode == "full" and fp.name in crcs:  # a small payload's head is all of it
                        rows = () if isinstance(head, bytes) else (
                            (slot.host_flat, self._host_layout["__h_" + fp.name] + i * nb, nb) if to_host
                            else (slot.flat, self._layout[fp.name] + i * nb, nb),)
                        checks.crc(where, fp.name, crcs[fp.name], head, *rows)
                else:
                    staged.append(Extent(path, o, n))
                    staged_off.append(cursor)
                    (labels if fp.kind == "label" else spans)[fp.name].append((cursor, n))
                    if fp.name in crcs:
                        checks.crc(where, fp.name, crcs[fp.name], (staging, cursor, n))
                    cursor += -(-n // 64) * 64
        # One read for the whole batch: offsets are relative to the slot, so adjacent members of
        # a sample (an .npy row and its .cls) coalesce into one preadv that scatters into both.
        layout = self._layout
        hl = self._host_layout
        extents = [e for ex, _ in direct.values() for e in ex]
        if to_host:  # .npy rows into pinned host fields, copied to the device below
            outs = [hl["__h_" + name] + o for name, (_, os_) in direct.items() for o in os_]
            extents += staged
            outs += [hl["__staging__"] + o for o in staged_off]
            reads = [R.backend.read(extents, slot.host_flat, outs)] if extents else []
        else:
            outs = [layout[name] + o for name, (_, os_) in direct.items() for o in os_]
            if hl is None:
                extents += staged
                outs += [layout["__staging__"] + o for o in staged_off]
                staged = []
            reads = [R.backend.read(extents, slot.flat, outs)] if extents else []
            if staged:  # device ring: encoded bytes and labels via POSIX into the pinned host arena
                base = hl["__staging__"]
                reads.append(R.host_backend.read(staged, slot.host_flat, [base + o for o in staged_off]))
        t0 = time.perf_counter()
        nbytes = sum(f.result() for f in reads)
        t1 = time.perf_counter()
        self.times.add("read", t1 - t0)
        if local is not None:  # read: unpin now, not after the decode turn (which waits on
            R.cache.release(seq)  # earlier batches, which may be waiting for room in the cache)
        streams = R.streams
        with streams.producing() if streams else contextlib.nullcontext():  # CRCs of device rows:
            checks.run()  # their device-to-host copy on the private stream, not behind training (C5)
        self.times.add("check", time.perf_counter() - t1)
        info = BatchInfo(keys=keys, n=len(ids), nbytes=nbytes, sources=self.source.sources_of(ids))
        keep = None
        kepts: dict[str, list[int]] = {}
        for fp in fields:
            sp = spans[fp.name]
            if fp.kind == "label":
                vals = labels[fp.name]  # per sample: the index's value, or where its text was staged
                dst = bufs["__h_" + fp.name] if streams else bufs[fp.name]
                dst[: len(vals)] = [v if isinstance(v, int) else label(staging, *v, names[k], fp.name)
                                    for k, v in enumerate(vals)]
                if streams:  # non-blocking, on the private stream, after the fence above
                    streams.to_device(bufs[fp.name][: len(vals)], dst[: len(vals)])
            elif fp.kind == "tensor" and to_host:
                streams.to_device(bufs[fp.name][: len(ids)], bufs["__h_" + fp.name][: len(ids)])
            elif fp.kind == "bytes":  # copied out of the ring's staging area
                info.extra[fp.name] = _fieldkinds.BytesColumn(
                    staging, np.array([a for a, _ in sp], np.int64), np.array([n for _, n in sp], np.int64)).copy()
            elif fp.kind in _fieldkinds.LIST_KINDS:
                info.extra[fp.name] = [_fieldkinds.parse(fp.kind, staging[a : a + n], w) for (a, n), w in zip(sp, names)]
            elif fp.kind == "image":
                turn = seq * self.n_images + len(kepts)
                kept = kepts[fp.name] = self._decode(turn, [staging[a : a + n] for a, n in sp], names, bufs[fp.name])
                if len(kept) < len(sp):
                    keep = kept if keep is None else _both(keep, kept)
                info.skipped += len(sp) - len(kept)
        for fp in self.layout.media_fields:
            kept = self._media(fp, [staging[a : a + n] for a, n in spans[fp.name]], names, ids, bufs)
            if len(kept) < len(ids):
                info.skipped += len(ids) - len(kept) if keep is None else len(set(keep) - set(kept))
                keep = kept if keep is None else _both(keep, kept)
        self._finish_fill(slot, info, bufs, names, len(ids), keep, kepts)

    def _media(self, fp: Any, encoded: list, names: list[str], ids: np.ndarray, bufs: Any) -> list[int]:
        """Decode a video or audio field into its rows (not compacted: skipped rows are left out
        by the batch's `keep`), the index's probed metadata per sample, draws from the plan."""
        from gdsload.decode import audio, video
        from gdsload.decode.media import draws

        ds = self.source.shards
        metas = []
        for gid in ids.tolist():
            s, j = ds.locate(gid)
            metas.append(ds.index(s).media_info(fp.name, j))
        salt = video.SALT if fp.kind == "video" else audio.SALT
        u = draws(*self.draw_key, ids, salt + 0x10000 * zlib_crc(fp.name), k=6)
        streams = self.res.streams
        dst = bufs["__h_" + fp.name] if streams else bufs[fp.name]
        aux = bufs["__h_" + fp.aux] if streams else bufs[fp.aux]
        t0 = time.perf_counter()
        kept = self.res.media_decoder(fp).decode_into(encoded, names, metas, u, dst, aux)
        self.times.add("decode", time.perf_counter() - t0)
        if streams:
            streams.to_device(bufs[fp.name][: len(ids)], dst[: len(ids)])
            streams.to_device(bufs[fp.aux][: len(ids)], aux[: len(ids)])
        return kept

    def _finish_fill(self, slot, info: BatchInfo, bufs, names: list[str], n: int, keep: list[int] | None,
                     kepts: dict[str, list[int]]) -> None:
        """What both fill paths end with: rows of several image fields aligned to the samples all
        of them kept, the kept rows and the ready event in the batch's `BatchInfo`, then `map` /
        `collate_fn` (gdsload.frontend.usercode) on host copies of the batch."""
        streams = self.res.streams
        # a device ring: the producer's own GPU work (row compaction, map's copies) goes on the
        # private stream, before the ready event (gdsload.host.gpu, audit 3 C3/C4)
        with streams.producing() if streams else contextlib.nullcontext():
            if keep is not None and (len(kepts) > 1 or any(kf != keep for kf in kepts.values())):
                # several image fields (or media skipped too): keep rows all of them kept
                for name, kf in kepts.items():
                    rows = [kf.index(k) for k in keep]
                    bufs[name][: len(rows)] = bufs[name][rows]
                info.skipped = n - len(keep)
            if keep is not None:  # corrupt images skipped: compact the other fields to match
                info.keep = keep
            slot.meta["batch"] = info
            if self.stage is not None:  # host copies: `.get()` on the private stream, after its copies
                kept_names = names if keep is None else [names[k] for k in keep]
                t0 = time.perf_counter()
                info.mapped = self.stage.run(self.assembler.make(slot, host=True), kept_names,
                                             lambda a: self.assembler.convert(a, copy=False))
                self.times.add("map", time.perf_counter() - t0)
            if streams:
                info.ready = streams.ready()


def zlib_crc(name: str) -> int:
    """A stable small number per field name (draws of two media fields differ)."""
    import zlib

    return zlib.crc32(name.encode()) & 0xFFFF


def _both(keep: list[int], kept: list[int]) -> list[int]:
    """The rows in `keep` that `kept` has too (several image fields, each skipping its corrupt ones)."""
    also = set(kept)
    return [k for k in keep if k in also]
