"""Filling one ring slot with one batch: `SlotFiller.fill(slot, seq, ids)`, run by a reader thread.

`fill` plans the batch's reads with NumPy (`gdsload.loader.gather`): one coalesced read table per
destination arena, then every check in one call (`gdsload.dataset.verify.check_crcs`: CRC32s of
the staged members per contiguous run, `.npy` headers where they are read, and under
`verify="full"` each `.npy` member's CRC32 over its header and its row), labels from the index,
bytes fields as one `BytesColumn`, images decoded by the loader's one DALI pipeline in plan
order (`gdsload.loader.decoding`), video and audio by their transforms. `_finish_fill` records
what the consumer needs in a `BatchInfo` (`gdsload.loader.assemble`) and runs the user's
`map`/`collate_fn`. There is one path for every batch: `verify="full"`, indexes from before C
order was recorded and `.npy` payloads under 4 KiB are planned too (their headers staged, or
read while planning).

A filler is given everything it uses: the loader's `Resources` (backends, cache, ring, streams,
staging pool), the `BatchLayout`, the source (a mix's "__source__"), the pass's `OrderedDecoder`,
`BatchAssembler`, user-code run and `StageTimes`. It writes nothing but the slot. A field it
writes by offset into `Slot.flat`/`Slot.host_flat` must be named in
`gdsload.loader.resources.written_by_offset`: the ring moves a kept field outside that set to memory
of its own, which only `Slot.buffers` reaches (`gdsload.ring.ring`, "Slot lifetime").
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import numpy as np

from gdsload.dataset.verify import check_crcs, label
from gdsload.io.table import ExtentTable, read_table
from gdsload.frontend import fields as _fieldkinds
from gdsload.loader.assemble import BatchInfo
from gdsload.loader.decoding import SettledField
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
        self.first: Any = None  # the loader's `FirstBatch` (`stats()["first_batch"]`)
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
        """Read (and decode) batch `seq` into `slot`, planned with array operations
        (`gdsload.loader.gather`); its Python-heavy planning under the readers' CPU lock. The
        loader's first batch records its index, read and decode stages in `self.first`."""
        first = self.first if self.first is not None and self.first.mine(seq) else None
        t0 = time.perf_counter()
        reads = self.layout.planner.plan(ids, packed=self.layout.own_staging, lock=self._cpu)
        if first is not None:
            first.add("index", time.perf_counter() - t0)
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
        if first is not None:
            first.add("first_read", time.perf_counter() - t0)
        if local is not None:  # read: unpin now, not after the decode turn (which waits on
            R.cache.release(seq)  # earlier batches, which may be waiting for room in the cache)
        names = reads.names
        info = BatchInfo(keys=reads.keys, n=n, nbytes=nbytes, sources=self.source.sources_of(ids))
        keep = None
        kepts: dict[str, list[int]] = {}
        # verify="full": where each .npy field's rows are, for their CRC32s
        tensor_rows = {name: (slot.host_flat, hl["__h_" + name]) if to_host else (slot.flat, layout[name])
                       for name in reads.tensors} if reads.tensor_checks else None
        if own:  # packed members: a few crc32 calls, each giving the GIL up once
            self._check(reads, staging, tensor_rows)
        else:
            with self._cpu:  # CRC32s member by member
                self._check(reads, staging, tensor_rows)
        # The fields written through `bufs` (images, labels, media) may still be the consumer's loop
        # variable: the slot was handed out before it let go (`Ring.acquire(defer=True)`), so this
        # batch was planned, read and checked while the batch before it decoded. The loader's own
        # decoder settles the slot after its DALI run, before its first copy into the slot
        # (`decoding.SettledField`); labels and media come after the decode.
        lazy = slot.unsettled and self.res.decoder_factory is None
        if not lazy:
            slot.settle()
        for fp in self.layout.fields:
            if fp.kind == "image":
                pos, nb, _ = reads.staged[fp.name]
                encoded = [staging[a : a + k] for a, k in zip(pos.tolist(), nb.tolist())]
                turn = seq * self.n_images + len(kepts)
                dst = SettledField(slot, fp.name) if lazy else bufs[fp.name]
                t0, build0 = time.perf_counter(), first.stages["pipeline_build"] if first is not None else 0.0
                kept = kepts[fp.name] = self._decode(turn, encoded, names, dst)
                if first is not None:  # the decode without the wait for the pipeline's build
                    first.add("first_decode", time.perf_counter() - t0 - (first.stages["pipeline_build"] - build0))
                if len(kept) < n:
                    keep = kept if keep is None else _both(keep, kept)
                info.skipped += n - len(kept)
        slot.settle()  # (every image skipped: nothing was copied)
        with self._cpu:  # per-sample values
            self._host_values(reads, staging, info, to_host, bufs)
        for fp in self.layout.media_fields:
            pos, nb, _ = reads.staged[fp.name]
            kept = self._media(fp, [staging[a : a + k] for a, k in zip(pos.tolist(), nb.tolist())], names, ids, bufs)
            if len(kept) < n:
                info.skipped += n - len(kept) if keep is None else len(set(keep) - set(kept))
                keep = kept if keep is None else _both(keep, kept)
        self._finish_fill(slot, info, bufs, names, n, keep, kepts)

    def _check(self, reads, staging, rows) -> None:
        """`check_crcs`, timed as "check". Under `verify="full"` on a device ring, the rows' copies
        to the host for their CRC32s run on the private stream, not behind training (C5)."""
        t0 = time.perf_counter()
        streams = self.res.streams
        rows_crc = rows is not None and any(tc.crcs for tc in reads.tensor_checks)
        with streams.producing() if streams and rows_crc else contextlib.nullcontext():
            check_crcs(reads, staging, rows)
        self.times.add("check", time.perf_counter() - t0)

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
        dec = self.res.media_decoder(fp)
        dst = bufs["__h_" + fp.name] if streams else bufs[fp.name]
        aux = bufs["__h_" + fp.aux] if streams else bufs[fp.aux]
        t0 = time.perf_counter()
        if streams and getattr(dec, "device", "cpu") == "mixed":
            # NVDEC video: one mixed pipeline writes the device slot on the private stream; only
            # rows that take the CPU path go through the host field (gdsload.decode.video, R11)
            kept = dec.decode_into(encoded, names, metas, u, bufs[fp.name], aux, host=dst,
                                   stream=streams.stream_handle)
            self.times.add("decode", time.perf_counter() - t0)
            streams.to_device(bufs[fp.aux][: len(ids)], aux[: len(ids)])
            return kept
        kept = dec.decode_into(encoded, names, metas, u, dst, aux)
        self.times.add("decode", time.perf_counter() - t0)
        if streams:
            streams.to_device(bufs[fp.name][: len(ids)], dst[: len(ids)])
            streams.to_device(bufs[fp.aux][: len(ids)], aux[: len(ids)])
        return kept

    def _finish_fill(self, slot, info: BatchInfo, bufs, names: list[str], n: int, keep: list[int] | None,
                     kepts: dict[str, list[int]]) -> None:
        """What a fill ends with: rows of several image fields aligned to the samples all
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
