"""What one loader holds in its process: I/O backends, the shard cache, the ring, GPU streams, the
staging pool, the image decoder, and the reader settings autotune may change.

`Resources.open(source, layout, ...)` builds them before the first batch, in this order: the GPU
(`device_ordinal`), the backend for the source's storage (`gdsload.io.choose_backend` on
`gdsload.dataset.source.storage_root`) and the parts' shard caches, then the ring sized for one
batch (`BatchLayout.slot_nbytes`), refused up front when it does not fit in free memory. With a
device ring and a backend that writes device memory (KvikIO), a POSIX backend reads the host arena
beside it, and KvikIO registers the device arena and orders its reads on the loader's stream.

`num_workers` and `prefetch` are the live reader settings: `"auto"` grows them here (`add_slot`,
`add_worker`), never on the `DataLoader` itself. The decoder (one DALI pipeline) is built on first
use and kept across epochs; a `decoder_factory` (`DataLoader(decoder_factory=)`, the feed server's
shared decode pool) builds it instead. `close()` releases everything; stats come from `io_paths()`.

A batch the caller keeps is never written over: the ring gives its slot other memory
(`gdsload.ring.ring`, "Slot lifetime"). It is told which fields the filler writes by offset
(`written_by_offset`) and which it never hands out (`private_fields`); a device ring whose `.npy`
rows KvikIO reads has one spare slot block in its arena, so registered with it.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any

from gdsload.loader.layout import BatchLayout


def written_by_offset(layout: BatchLayout, spec: dict[str, Any], host: dict[str, Any]) -> set[str]:
    """The slot fields `SlotFiller.fill` writes through `Slot.flat`/`Slot.host_flat` by offset (the
    ring's `flat`): the staging area, host copies ("__h_*") and `.npy` fields read straight into
    the slot. The others (labels, decoded images, video, audio, `.npy` rows copied to the device)
    go through `Slot.buffers`, so a kept one can move to memory of its own."""
    tensors = {fp.name for fp in layout.fields if fp.kind == "tensor"}
    return {n for n in (*spec, *host)
            if n == "__staging__" or n.startswith("__h_") or (n in tensors and "__h_" + n not in host)}


def private_fields(host: dict[str, Any]) -> set[str]:
    """Slot fields the loader never hands out (the ring's `private`): the staging area (bytes,
    text, JSON and ragged values are copied out of it; DALI keeps a reference to the encoded bytes
    it was fed for two runs) and the host copies of device fields."""
    return {n for n in host if n == "__staging__" or n.startswith("__h_")}


class Resources:
    def __init__(self) -> None:
        self.backend: Any = None
        self.host_backend: Any = None  # POSIX for host-arena reads, beside a device backend
        self.cache: Any = None  # gdsload.dataset.source.PartCaches, when a part is cached
        self.ring: Any = None
        self.streams: Any = None  # gdsload.host.gpu.CopyStreams, with a device ring
        self.staging_pool: Any = None  # gdsload.ring.staging.StagingPool, with `own_staging`
        self.device_ordinal: int | None = None
        self.num_workers = 1
        self.prefetch = 1
        self._decoder: Any = None
        self._decoder_args: dict[str, Any] = {}
        self.decoder_factory: Any = None  # f(**decoder args) -> image decoder; None: ImageDecoder
        self._media: dict[str, Any] = {}  # field -> its VideoDecoder / AudioDecoder
        self.first: Any = None  # the loader's `gdsload.loader.stats.FirstBatch`: the build's share of it
        self._building: threading.Thread | None = None  # `build_decoder_async`
        self._built: Any = None

    @classmethod
    def open(cls, source: Any, layout: BatchLayout, *, device: str, device_index: int | None, io: str,
             num_workers: int, prefetch: int, pin_memory: bool, decode_threads: int, seed: int,
             on_error: str, window: int, output: str, decoder_factory: Any = None) -> "Resources":
        from gdsload.dataset.source import PartCaches, storage_root
        from gdsload.io import choose_backend, open_backend

        r = cls()
        r.num_workers, r.prefetch = num_workers, prefetch
        r.decoder_factory = decoder_factory
        want_device = device == "cuda"
        if want_device:
            from gdsload.host.gpu import resolve_ordinal

            r.device_ordinal = resolve_ordinal(device_index)
        name = io if io != "auto" else choose_backend(storage_root(source), device=want_device)
        kw = {"device_id": r.device_ordinal} if name == "kvikio" and want_device else {}
        r.backend = open_backend(name, threads=max(2, num_workers), **kw)
        ref = weakref.ref(r)

        def forget(path: str) -> None:  # backends close their fd: an evicted file frees its space
            res = ref()
            for b in (res.backend, res.host_backend) if res is not None else ():
                if b is not None:
                    b.forget(path)

        caches = PartCaches(source, on_release=forget)
        if caches:
            r.cache = caches
            caches.check_limit(window)
        r._make_ring(layout, want_device, pin_memory, output)
        r._decoder_args = dict(transform=layout.transform, batch_size=layout.rows,
                               device="mixed" if want_device else "cpu", threads=decode_threads, seed=seed,
                               on_error=on_error, device_id=r.device_ordinal or 0)
        return r

    def _make_ring(self, layout: BatchLayout, want_device: bool, pin_memory: bool, output: str) -> None:
        from gdsload.host.memory import available_device_bytes, available_host_bytes, check_fits
        from gdsload.io import open_backend
        from gdsload.ring.ring import Ring, SlotSpec
        from gdsload.ring.staging import StagingPool

        direct = want_device and self.backend.device_capable
        self.staging_pool = StagingPool(keep=self.num_workers + 2) if layout.own_staging else None
        spec, host = layout.slot_fields(on_device=want_device, direct=direct)
        flat = written_by_offset(layout, spec, host)
        slots = self.prefetch + 1
        pin = pin_memory and want_device
        hint = f"lower batch_size ({layout.rows}) or prefetch_factor ({self.prefetch}: {slots} slots)"
        on_device = bool(want_device and spec)
        dev_nb, host_nb = layout.slot_nbytes(on_device=on_device, direct=direct)
        if on_device:
            import cupy

            # a kept batch's `.npy` rows (read by KvikIO straight into the slot) move to a spare
            # block registered with the arena (gdsload.ring.ring, "Slot lifetime")
            spares = 1 if flat & set(spec) else 0
            with cupy.cuda.Device(self.device_ordinal):  # the loader's GPU, not the current one
                device_free = available_device_bytes()
            check_fits("the prefetch ring's device arena", (slots + spares) * dev_nb, device_free, where="GPU",
                       hint=hint)
            check_fits("the prefetch ring's pinned arena", slots * host_nb, available_host_bytes(),
                       where="host", hint=hint)
            from gdsload.host.gpu import CopyStreams

            # two arenas: device (batch tensors) and pinned host (staging)
            ref = weakref.ref(self)

            def drop_fence() -> Any:  # a kept batch let go: the consumer's work on it so far (ring, "Device fences")
                streams = getattr(ref(), "streams", None)
                return streams.release_fence(same_thread=False) if streams is not None else None

            self.ring = Ring(SlotSpec(fields=spec), slots, device=f"cuda:{self.device_ordinal}", pin=pin,
                             host_spec=SlotSpec(fields=host), flat=flat, private=private_fields(host),
                             spares=spares, drop_fence=drop_fence)
            self.streams = CopyStreams(self.device_ordinal, consumer=output)
            if direct:  # KvikIO writes the device arena; encoded bytes and labels go through POSIX
                self.host_backend = open_backend("posix", threads=max(2, self.num_workers))
                self.backend.register(self.ring.arena)
                # reads on the private stream, not behind the training stream
                self.backend.order_on(self.streams.stream.ptr)
        else:  # one host arena (also a GPU loader with encoded bytes only): one read per batch
            check_fits("the prefetch ring", slots * host_nb, available_host_bytes(), where="host", hint=hint)
            self.ring = Ring(SlotSpec(fields={**spec, **host}), slots, device="cpu", pin=pin, flat=flat,
                             private=private_fields(host))

    # -- what the readers use ------------------------------------------------------------------------
    def media_decoder(self, fp: Any) -> Any:
        """The VideoDecoder / AudioDecoder of media field `fp` (a FieldPlan), built on first use
        (its DALI pipelines on its first batch); safe to call from several reader threads."""
        dec = self._media.get(fp.name)
        if dec is None:
            if fp.kind == "video":
                from gdsload.decode.video import VideoDecoder as cls
            else:
                from gdsload.decode.audio import AudioDecoder as cls
            a = self._decoder_args
            kw = {"device": a["device"], "device_id": a["device_id"]} if fp.kind == "video" else {}
            dec = self._media.setdefault(fp.name, cls(fp.media, batch_size=a["batch_size"], threads=a["threads"],
                                                       on_error=a["on_error"], **kw))
        return dec

    def media_stats(self) -> dict[str, Any]:
        """Per decoded video/audio field: which decoders ran, skipped samples and, for video,
        frames decoded and returned (decode amplification: their ratio), since the loader began."""
        out = {}
        for name, dec in self._media.items():
            d = {"skipped": dec.skipped}
            if hasattr(dec, "frames_decoded"):
                d.update(frames_decoded=dec.frames_decoded, frames_returned=dec.frames_returned,
                         decode_amplification=dec.frames_decoded / max(1, dec.frames_returned))
            out[name] = d
        return out

    def build_decoder_async(self) -> None:
        """Start building the loader's own image decoder and its DALI pipeline in a thread, so
        that the first batch's plan and reads overlap it (issue 55: the build ran in the first
        decode, after the reads). CPU decoding only (a "mixed" pipeline is built where it is
        first used, as before); not with a `decoder_factory`. `decoder` waits for it."""
        if (self._decoder is not None or self._building is not None or self.decoder_factory is not None
                or self._decoder_args.get("device") != "cpu"):
            return

        def build() -> None:
            try:
                from gdsload.decode.image import ImageDecoder

                dec = ImageDecoder(**self._decoder_args)
                t0 = time.perf_counter()
                dec.build()
                if self.first is not None:
                    self.first.pipeline_build_s = time.perf_counter() - t0
                self._built = dec
            except BaseException:  # noqa: BLE001 - built again where it is used, which raises in context
                self._built = None

        self._building = threading.Thread(target=build, name="gdsload-decoder-build", daemon=True)
        self._building.start()

    @property
    def decoder(self) -> Any:
        """The loader's image decoder (one DALI pipeline), built on first use, kept across epochs:
        `ImageDecoder(**args)`, or `decoder_factory(**args)` when the loader was given one (it
        returns an object with `ImageDecoder`'s `decode_into` and `device`). A build started by
        `build_decoder_async` is waited for (that wait is the first batch's `pipeline_build`)."""
        if self._decoder is None:
            first = self.first
            if self._building is not None:
                t0 = time.perf_counter()
                self._building.join()
                if first is not None:
                    first.add("pipeline_build", time.perf_counter() - t0)
                self._building, self._decoder, self._built = None, self._built, None
        if self._decoder is None:
            if self.decoder_factory is not None:
                self._decoder = self.decoder_factory(**self._decoder_args)
            else:
                from gdsload.decode.image import ImageDecoder

                dec = ImageDecoder(**self._decoder_args)
                t0 = time.perf_counter()
                dec.build()  # here, not in the first decode: the first batch's `pipeline_build`
                if first is not None:
                    first.add("pipeline_build", time.perf_counter() - t0)
                    first.pipeline_build_s = time.perf_counter() - t0
                self._decoder = dec
        return self._decoder

    @property
    def decode_device(self) -> str:
        return self._decoder_args.get("device", "cpu")

    # -- autotune ---------------------------------------------------------------------------------
    def add_worker(self) -> None:
        self.num_workers += 1

    def add_slot(self) -> bool:
        """One more ring slot if memory allows (`gdsload.loader.autotune.fits`); False: it does not."""
        from gdsload.host.memory import available_device_bytes, available_host_bytes
        from gdsload.loader import autotune

        ring = self.ring
        ok = autotune.fits(ring.host_nbytes_per_slot + (0 if ring.host_spec else ring.nbytes_per_slot),
                           available_host_bytes())
        if ring.host_spec is not None:  # a device ring: its batch tensors are on the GPU
            import cupy

            with cupy.cuda.Device(self.device_ordinal):
                ok = ok and autotune.fits(ring.nbytes_per_slot, available_device_bytes())
        if not ok:
            return False
        ring.grow(1)
        if self.host_backend is not None:  # KvikIO reads into the new device arena
            self.backend.register(ring.arenas[-1])
        self.prefetch += 1
        return True

    # -- stats and lifecycle ------------------------------------------------------------------------
    def io_paths(self) -> dict[str, Any]:
        """What the loader's `stats()` takes from here: the I/O paths, and the ring's slots given
        other memory because a batch the caller keeps was in them (`ring_replaced`; the memory
        they use beyond the arena now, `ring_fresh_nbytes`)."""
        rs = self.ring.stats() if self.ring is not None else {}
        return {"ring_replaced": rs.get("replaced"), "ring_fresh_nbytes": rs.get("fresh_nbytes"),
                "io_path": self.backend.name if self.backend else None,
                "host_io_path": self.host_backend.name if self.host_backend else None,
                # KvikIO: reads per "path/how", e.g. "kvikio-compat/sync-fallback" (gdsload.io.kvikio_backend)
                "io_read_modes": dict(getattr(self.backend, "read_modes", None) or {}) or None}

    def close(self) -> dict[str, Any] | None:
        """Release everything; returns the cache's last stats (None without a cache)."""
        if self._building is not None:  # a pipeline build not waited for yet (tens of ms)
            self._building.join()
            self._building = self._built = None
        cache_stats = None
        if self.cache is not None:
            cache_stats = self.cache.stats()
            self.cache.close()
            self.cache = None
        for backend in (self.backend, self.host_backend):
            if backend is not None:
                backend.close()
        self.backend = self.host_backend = None
        if self.streams is not None:  # copies still queued must not land in freed ring memory
            self.streams.synchronize()
        self.streams = None
        self.ring = None
        for dec in self._media.values():  # their PyAV thread pools
            dec.close()
        self._media = {}
        return cache_stats
