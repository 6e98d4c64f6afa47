"""`gdsload.DataLoader`: plan -> I/O -> decode -> ring -> training loop.

Read in this order: this module (options, set-up on first iteration, `iter()`, `stats()`,
`close()`); `gdsload.loader.layout` (what each field becomes, the slot one batch needs);
`gdsload.loader.epoch` (one pass: producer threads and the consumer's `next()`); `gdsload.loader.fill`
(filling one slot). `gdsload.Dataset` is in `gdsload.dataset.dataset`.

Per batch, a producer thread (`num_workers` of them) takes the batch's sample ids from the plan,
plans the batch's reads with NumPy over the shard indexes (`gdsload.loader.gather`; no tar scan, no
Python object per member), and issues one coalesced read table per destination
(`gdsload.io.table`): `.npy` array data goes straight into the batch tensor in the ring slot (device
memory through KvikIO on a GPU host), encoded images and other small fields into the
slot's staging buffer (pinned host memory on a GPU host). Images are then decoded and transformed
by DALI into the slot's image tensor; labels are copied from the index's label column (parsed
from the `.cls` members for older indexes). What is checked on the way is `gdsload.dataset.verify`.
The consumer gets views of the slot.

Slot lifetime: the tensors of batch k stay valid until the next `next()` on the iterator; after
that the slot is refilled. Pass `copy=True` to get tensors you may keep.

On a GPU (`device="cuda"` or `"cuda:N"`; which GPU: `gdsload.host.gpu`), every batch tensor lives in
the device ring: `.npy` rows (read by KvikIO straight into it, or by POSIX into pinned memory and
copied), decoded images (DALI "mixed" output copied device to device) and labels (parsed on the
host, copied without blocking). All copies run on the loader's private stream; a ready event
orders the consumer's stream after them, and a release fence recorded on the consumer's stream
when it moves on is waited for before the slot is written again (`gdsload.host.gpu`). Encoded bytes
and labels are read on the host by POSIX (one `preadv` per coalesced group), never through KvikIO
member by member.

Order and resumption come from `gdsload.plan.plan`: the order of an epoch depends only on (dataset,
seed, epoch); `state_dict()` records the global position, and `load_state_dict()` resumes the
exact remaining order, also on another world size with the same global batch. After a full epoch
the loader moves to the next epoch by itself; `set_epoch(n)` sets it explicitly (as with
`DistributedSampler`).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, Literal

from gdsload.frontend import fields as _fieldkinds
from gdsload.dataset.dataset import Dataset
from gdsload.host.dist import dist_rank_world
from gdsload.loader.epoch import Epoch
from gdsload.errors import GdsloadError
from gdsload.host.forksafe import ProcessLocal
from gdsload.loader.layout import FieldPlan, plan_fields, slot_fields, tensor_headers_needed
from gdsload.frontend.usercode import MapStage
from gdsload.dataset.mix import Mix
from gdsload.frontend.output import default_output, torch_or_none
from gdsload.plan.plan import PlanCursor

__all__ = ["DataLoader", "Dataset"]

_META_FIELDS = ("__key__", "__source__")  # per-sample names in a batch, not read from shards


class DataLoader(ProcessLocal, PlanCursor):
    """A drop-in for `torch.utils.data.DataLoader` over a gdsload dataset.

    Arguments follow PyTorch where they make sense: `batch_size`, `shuffle`, `drop_last`,
    `num_workers` (reader/decoder threads, not processes), `prefetch_factor` (batches filled ahead
    of the one being consumed: the ring has `prefetch_factor + 1` slots; unlike PyTorch it is not
    per worker, since workers are threads filling one shared ring; default 2, or 1 when images are
    decoded (below); `"auto"` for either: sized while it runs, within stated bounds, see
    `gdsload.loader.autotune`), `pin_memory` (pinned staging on a
    GPU host; a no-op without one). Plus: `seed`, `device` ("cpu", "cuda"; default: cuda when a
    GPU is usable: a CUDA device, CuPy, and for torch output a CUDA build of torch; "cuda:N" picks
    GPU N, "cuda" LOCAL_RANK's, else the current device, see `gdsload.host.gpu`), `transform` (an `ImageTransform`, or None for the default training transform;
    `decode=False` returns encoded bytes), `fields` (which fields, in which order; the batch is then
    a tuple), `rank`/`world_size` (default: from `torch.distributed` when initialised),
    `shuffle_window` (shards open at once for the within-window shuffle), `on_error` ("raise" or
    "skip" corrupt samples), `copy` (return tensors you may keep), `io` (backend name or "auto"),
    `output` ("torch" when torch is installed, else "numpy"), `decode_threads` (DALI's worker
    threads; default: one more than the cores, see `__init__`). User code (`gdsload.frontend.usercode`):
    `map(sample_dict) -> sample_dict` after decoding, `collate_fn(list_of_samples) -> batch` instead
    of the default stacking, and `worker_mode` ("thread", default; "process": `map` and `collate_fn`
    run in `num_workers` spawned processes and must be picklable). What each field kind becomes:
    `gdsload.frontend.fields`.

    Why one batch ahead when images are decoded: every batch is decoded by the loader's one DALI
    pipeline, which has all the cores, so a second batch ahead adds no decoding, only a slot of
    decoded float32 rows (154 MB at batch 256, 224x224). Measured on 2 cores, tier T: 1 gave the
    same or more images/s than 2 (5 interleaved pairs of fresh processes, batch 64 and 256) and
    159-175 MB less peak RSS at batch 256 (849 against 1008 MB, photos; 1030 against 1205 MB,
    ImageNet-like).

    Processes: a loader pickles to its configuration and cursor (`state_dict()`), never to its
    threads, ring, files or DALI pipeline; a copy (a spawned worker's) or a forked child builds
    those afresh on first iteration and continues where the loader stood.
    """

    _PROCESS_LOCAL = ("_ring", "_backend", "_host_backend", "_streams", "device_ordinal", "_decoder", "_active_ref",
                      "_staging_pool",
                      "_fields", "_stats", "_progress", "_cuda_lost", "_planner", "_cache")

    def __init__(
        self,
        dataset: Dataset | Mix | str,
        batch_size: int = 1,
        shuffle: bool = False,
        drop_last: bool = False,
        num_workers: int | Literal["auto"] = 2,
        prefetch_factor: int | Literal["auto"] | None = None,
        pin_memory: bool = True,
        *,
        seed: int = 0,
        device: str | None = None,
        decode: bool = True,
        transform: Any = None,
        fields: Sequence[str] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        shuffle_window: int = 4,
        on_error: Literal["raise", "skip"] = "raise",
        copy: bool = False,
        io: str = "auto",
        output: Literal["torch", "numpy", None] = None,
        decode_threads: int | None = None,
        map: Any = None,
        collate_fn: Any = None,
        worker_mode: Literal["thread", "process"] = "thread",
    ):
        from gdsload.plan.mix import MixPlan
        from gdsload.plan.plan import Plan

        if isinstance(dataset, Mix):  # a Mix reads like one Dataset (gdsload.plan.mix)
            self.dataset = dataset.open(Dataset)
            if fields is not None:
                self.dataset = self.dataset.with_fields([f for f in fields if f not in _META_FIELDS])
        else:
            self.dataset = dataset if isinstance(dataset, Dataset) else Dataset(dataset)
            if fields is not None:
                self.dataset = self.dataset._with_fields([f for f in fields if f != "__key__"])
        self.tuple_fields = list(fields) if fields is not None else None
        self._stage = MapStage.create(  # map / collate_fn / worker_mode (None: none given)
            map, collate_fn, worker_mode)
        self.worker_mode = worker_mode
        from gdsload.loader import autotune

        self._auto = {"prefetch": prefetch_factor == "auto", "workers": num_workers == "auto"}
        if self._auto["workers"]:  # reads block in the kernel: threads beyond the cores help
            num_workers = autotune.START_WORKERS
        if self._auto["prefetch"]:
            prefetch_factor = autotune.START_PREFETCH
        elif prefetch_factor is None:  # one batch ahead of the one in use when DALI decodes (above)
            prefetch_factor = 1 if decode and any(
                _fieldkinds.loader_kind(f, decode=True) == "image" for f in self.dataset.fields) else 2
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise GdsloadError(f"num_workers must be >= 1 (reader threads) or 'auto', got {num_workers!r}")
        if isinstance(prefetch_factor, bool) or not isinstance(prefetch_factor, int) or prefetch_factor < 1:
            raise GdsloadError(f"prefetch_factor must be >= 1 or 'auto', got {prefetch_factor!r}")
        self._tuner = autotune.Tuner(self._auto["prefetch"], self._auto["workers"], prefetch_factor,
                                     num_workers, autotune.max_workers()) if any(self._auto.values()) else None
        dist = dist_rank_world()
        if rank is None:
            rank = dist[0] if dist else 0
        if world_size is None:
            world_size = dist[1] if dist else 1
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        self.pin_memory = pin_memory
        self.decode = decode
        self.on_error = on_error
        self.copy = copy
        self.io_name = io
        from gdsload.host.gpu import parse_device

        self.output = default_output(output)
        self.device, self._device_index = parse_device(device or self._default_device(self.output))
        # one DALI thread more than the cores: the synchronous runs leave cores idle at their
        # barriers and while a run's output is copied into the slot, and a spare thread fills
        # them (tier T, 2 cores, batch 64, photos: 2,211-2,275 img/s against 1,743-1,919 with 2
        # threads, 3 interleaved rounds; DALI's own pipeline measured the same with 2 or 3)
        self.decode_threads = decode_threads or (os.cpu_count() or 1) + 1
        if transform is None and decode:
            from gdsload.decode.image import ImageTransform

            transform = ImageTransform()
        self.transform = transform
        mixed = {"mix": self.dataset.spec} if isinstance(self.dataset, Mix) else {}
        self.plan = (MixPlan if mixed else Plan)(
            dataset_id=self.dataset.dataset_id, shard_sizes=self.dataset.shard_sizes,
            batch_size=batch_size, world_size=world_size, rank=rank, seed=seed, shuffle=shuffle,
            window=shuffle_window, drop_last=drop_last, **mixed,
        )
        self._epoch = 0
        self._position = 0
        self._start_process()

    def _init_process_local(self) -> None:
        self._fields: list[FieldPlan] | None = None
        self._ring = None
        self._backend = None
        self._cache = None  # a ShardCache for a dataset at a URL with a cache folder
        self.device_ordinal: int | None = None  # the GPU, resolved once in `_setup`
        self._streams = None  # gdsload.host.gpu.CopyStreams, with a device ring
        self._host_backend = None  # POSIX for host-arena reads, beside a device backend
        self._stats: dict[str, Any] = {}  # stats() after close
        self._progress = None  # gdsload.loader.epoch.Progress of the pass that handed out the last batch
        # weak: an epoch its consumer dropped (a `break`, an exception) is collected, which
        # closes it and ends its threads (see `Epoch._produce`)
        self._active_ref: Any = None
        self._decoder = None
        self._planner = None  # gdsload.loader.gather.BatchPlanner, made in `_setup`
        self._staging_pool = None  # gdsload.loader.gather.StagingPool, with `_own_staging`
        self._cuda_lost = False  # forked from a parent in which this loader used CUDA

    def _enter_process(self) -> None:
        """Start afresh in a forked child; CUDA state does not survive a fork, so a loader that
        had CUDA memory or a GPU decoder in the parent is refused there with a clear error."""
        inherited = self._check_process()
        if inherited is not None:
            ring, decoder = inherited["_ring"], inherited["_decoder"]
            self._cuda_lost = (ring is not None and (ring.device != "cpu" or ring.pinned
                                                     or getattr(ring, "host_pinned", False))) or (
                decoder is not None and decoder.device == "mixed")
        if self._cuda_lost:
            raise GdsloadError(
                "this loader was forked after it used CUDA in the parent, and CUDA does not survive a fork: "
                "start the workers with the 'spawn' or 'forkserver' start method (e.g. "
                "torch.utils.data.DataLoader(..., multiprocessing_context='spawn')), or build the loader in "
                "the child"
            )

    # -- torch-like surface --------------------------------------------------------------------
    # len(), set_epoch(), epoch, state_dict(), load_state_dict(): from PlanCursor

    # -- set-up, lazily on first iteration -----------------------------------------------------
    @staticmethod
    def _default_device(output: str | None) -> str:
        """"cuda" when a device exists *and* the loader can use it; else "cpu", with a warning
        when a device exists (a CPU-only torch build, or no CuPy, on a GPU host)."""
        from gdsload.io import cuda_device_count

        if cuda_device_count() < 1:
            return "cpu"
        why = None
        try:
            import cupy  # noqa: F401
        except Exception as exc:
            why = f"CuPy does not import ({type(exc).__name__}: {exc})"
        torch = torch_or_none() if output == "torch" else None
        if why is None and torch is not None and not torch.cuda.is_available():
            why = f"torch {torch.__version__} has no CUDA (torch.cuda.is_available() is False)"
        if why is None:
            return "cuda"
        import warnings

        warnings.warn(f"a CUDA device is present but {why}; gdsload uses device='cpu' (pass "
                      f"device='cuda' to insist)", RuntimeWarning, stacklevel=3)
        return "cpu"

    def _setup(self) -> None:
        """On first iteration: what to read and check (`_plan_reads`), the I/O backends and shard
        cache (`_open_io`), then the ring sized for one batch (`_make_ring`)."""
        self._plan_reads()
        want_device = self.device == "cuda"
        if want_device:
            from gdsload.host.gpu import resolve_ordinal

            self.device_ordinal = resolve_ordinal(self._device_index)
        self._open_io(want_device)
        self._make_ring(want_device)

    def _plan_reads(self) -> None:
        from gdsload.loader.gather import BatchPlanner
        from gdsload.dataset.verify import check_dataset

        ds = self.dataset.shards
        # what is verified (`gdsload.dataset.verify`) is each dataset's own setting, also in a Mix
        parts = self.dataset.datasets if isinstance(self.dataset, Mix) else [self.dataset]
        notes = [check_dataset(d.shards, d.verify) for d in parts]
        self._verify_note = notes[0] if len(set(notes)) == 1 else "; ".join(
            f"{name}: {note}" for name, note in zip(self.dataset.names, notes))
        self._shard_verify = [d.verify for d in parts for _ in d.shards.shards]  # per global shard
        # rows per slot: a batch never holds more than one rank's samples of an epoch
        self._rows = max(1, min(self.batch_size, -(-self.plan.num_samples // self.plan.world_size)))
        self._tensor_headers = tensor_headers_needed(ds, self._shard_verify)
        self._fields = fplans = plan_fields(self.dataset, decode=self.decode)
        self._planner = None if self._tensor_headers else BatchPlanner(
            ds, [(fp.name, fp.kind, fp.tensor) for fp in fplans],
            crc_shards=[mode is not None for mode in self._shard_verify])

    def _open_io(self, want_device: bool) -> None:
        from gdsload.io import choose_backend, open_backend

        ds = self.dataset.shards
        cache_dir = getattr(self.dataset, "cache_dir", None)  # a Mix has none: it reads ranges
        where = cache_dir if cache_dir is not None else ds.root  # cached shards are local files
        io = self.io_name if self.io_name != "auto" else choose_backend(where, device=want_device)
        kw = {"device_id": self.device_ordinal} if io == "kvikio" and want_device else {}
        self._backend = open_backend(io, threads=max(2, self.num_workers), **kw)
        if cache_dir is not None:
            from gdsload.io.cache import ShardCache

            ref = weakref.ref(self)

            def forget(path: str) -> None:  # backends close their fd: an evicted file frees its space
                loader = ref()
                for b in (loader._backend, loader._host_backend) if loader is not None else ():
                    if b is not None and hasattr(b, "forget"):
                        b.forget(path)

            self._cache = ShardCache(ds.root, ds.shards, cache_dir, self.dataset.cache_limit, on_release=forget)
            self._cache.check_limit(self.plan.window)

    def _make_ring(self, want_device: bool) -> None:
        from gdsload.loader.gather import StagingPool
        from gdsload.io import open_backend
        from gdsload.host.memory import available_device_bytes, available_host_bytes, check_fits
        from gdsload.ring.ring import Ring, SlotSpec

        direct = want_device and getattr(self._backend, "device_capable", False)
        # Nothing decoded, host memory: a planned batch's staged members (bytes, text, json,
        # label text) are read into a buffer of the batch's own, which its BytesColumns keep
        # (no copy out of the ring); see `SlotFill._fill_planned`.
        self._own_staging = self._planner is not None and not want_device and not any(
            fp.kind == "image" for fp in self._fields)
        self._staging_pool = StagingPool(keep=self.num_workers + 2) if self._own_staging else None
        spec, host = slot_fields(self._fields, self._rows, self.transform, on_device=want_device,
                                 direct=direct, tensor_headers=self._tensor_headers)
        slots = self.prefetch_factor + 1
        pin = self.pin_memory and want_device
        hint = (f"lower batch_size ({self.batch_size}) or prefetch_factor ({self.prefetch_factor}: "
                f"{slots} slots)")
        on_device = bool(want_device and spec)
        if on_device:
            import cupy

            with cupy.cuda.Device(self.device_ordinal):  # the loader's GPU, not the current one
                device_free = available_device_bytes()
            check_fits("the prefetch ring's device arena", slots * SlotSpec(fields=spec).nbytes,
                       device_free, where="GPU", hint=hint)
            check_fits("the prefetch ring's pinned arena", slots * SlotSpec(fields=host).nbytes,
                       available_host_bytes(), where="host", hint=hint)
        else:
            check_fits("the prefetch ring", slots * SlotSpec(fields={**spec, **host}).nbytes,
                       available_host_bytes(), where="host", hint=hint)
        if on_device:  # two arenas: device (batch tensors) and pinned host (staging)
            from gdsload.host.gpu import CopyStreams

            self._ring = Ring(SlotSpec(fields=spec), slots, device=f"cuda:{self.device_ordinal}", pin=pin,
                              host_spec=SlotSpec(fields=host))
            self._streams = CopyStreams(self.device_ordinal, consumer=self.output)
            if direct:  # KvikIO writes the device arena; encoded bytes and labels go through POSIX
                self._host_backend = open_backend("posix", threads=max(2, self.num_workers))
                register = getattr(self._backend, "register", None)
                if register is not None:
                    register(self._ring.arena)
                order_on = getattr(self._backend, "order_on", None)
                if order_on is not None:  # reads on the private stream, not behind the training stream
                    order_on(self._streams.stream.ptr)
        else:  # one host arena (also a GPU loader with encoded bytes only): one read per batch
            self._ring = Ring(SlotSpec(fields={**spec, **host}), slots, device="cpu", pin=pin)

    # -- iteration -------------------------------------------------------------------------------
    @property
    def _active(self) -> Epoch | None:
        return self._active_ref() if self._active_ref is not None else None

    def __iter__(self) -> Iterator[Any]:
        self._enter_process()
        active = self._active
        if active is not None:
            active.close()
        if self._fields is None:
            self._setup()
        ep = Epoch(self, self._epoch, self._position)
        self._active_ref = weakref.ref(ep)
        return ep

    def _get_decoder(self):
        """The loader's image decoder (one DALI pipeline), built on first use, kept across epochs."""
        if self._decoder is None:
            from gdsload.decode.image import ImageDecoder

            self._decoder = ImageDecoder(self.transform, batch_size=self._rows,
                                         device="mixed" if self.device == "cuda" else "cpu",
                                         threads=self.decode_threads, seed=self.plan.seed,
                                         on_error=self.on_error, device_id=self.device_ordinal or 0)
        return self._decoder

    def stats(self) -> dict[str, Any]:
        """samples/s, bytes/s, data stall (seconds and fraction), ring occupancy, I/O and decode;
        "cache" with a shard cache (read here, not per batch: its lock is the readers')."""
        out = self._stats_now() if self._ring is not None else dict(self._stats)
        if self._cache is not None:
            out["cache"] = self._cache.stats()
        return out

    def _stats_now(self) -> dict[str, Any]:
        """`stats()` from the counters of the pass that handed out the last batch (`Progress`)."""
        p = self._progress
        if p is None:
            return {}
        el = max(p.t_last - p.t0, 1e-9)
        rs = self._ring.stats()
        wait = rs["wait_s"] - p.wait0
        return {
            "epoch": p.epoch,
            "batches": p.batches,
            "samples": p.samples,
            "elapsed_s": el,
            "samples_per_s": p.samples / el,
            "bytes_per_s": p.bytes_read / el,
            "wait_s": wait,
            "wait_fraction": wait / el,
            "ring_slots": rs["slots"],
            "ring_occupancy": rs.get("mean_occupancy", rs.get("occupancy")),
            "io_path": self._backend.name if self._backend else None,
            "host_io_path": self._host_backend.name if self._host_backend else None,
            "ring_device": self._ring.device,
            "kvikio_error": _kvikio_error() if self.device == "cuda" else None,
            "decode_device": ("mixed" if self.device == "cuda" else "cpu") if any(
                fp.kind == "image" for fp in self._fields) else None,
            "device": self.device,
            "skipped": p.skipped,
            "verify": self._verify_note,
            "prefetch_factor": self.prefetch_factor,  # now: "auto" may have grown it (gdsload.loader.autotune)
            "num_workers": self.num_workers,
            "auto": ",".join(k for k, v in self._auto.items() if v) or None,
        }

    def close(self) -> None:
        self._check_process()
        active = self._active
        if active is not None:
            active.close()
        if self._ring is not None:  # what stats() reports after close
            self._stats = self._stats_now()
        if self._cache is not None:
            self._stats["cache"] = self._cache.stats()
            self._cache.close()
            self._cache = None
        for backend in (self._backend, self._host_backend):
            if backend is not None:
                backend.close()
        self._backend = self._host_backend = None
        if self._streams is not None:  # copies still queued must not land in freed ring memory
            self._streams.synchronize()
        self._streams = None
        self._ring = None
        self._fields = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _kvikio_error() -> str | None:
    from gdsload.io import kvikio_import_error

    return kvikio_import_error()
