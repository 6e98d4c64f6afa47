"""`gdsload.Dataset` and `gdsload.DataLoader`: plan -> I/O -> decode -> ring -> training loop.

Per batch, a producer thread (`num_workers` of them) takes the batch's sample ids from the plan,
plans the batch's reads with NumPy over the shard indexes (`gdsload.batchread`; no tar scan, no
Python object per member), and issues one coalesced read table per destination
(`gdsload.io.table`): `.npy` array data goes straight into the batch tensor in the ring slot (device
memory through KvikIO on a GPU host), encoded images and other small fields into the
slot's staging buffer (pinned host memory on a GPU host). Images are then decoded and transformed
by DALI into the slot's image tensor; labels are copied from the index's label column (parsed
from the `.cls` members for older indexes). What is checked on the way is `gdsload.loadcheck`.
The consumer gets views of the slot.

Slot lifetime: the tensors of batch k stay valid until the next `next()` on the iterator; after
that the slot is refilled. Pass `copy=True` to get tensors you may keep.

On a GPU (`device="cuda"` or `"cuda:N"`; which GPU: `gdsload.device`), every batch tensor lives in
the device ring: `.npy` rows (read by KvikIO straight into it, or by POSIX into pinned memory and
copied), decoded images (DALI "mixed" output copied device to device) and labels (parsed on the
host, copied without blocking). All copies run on the loader's private stream; a ready event
orders the consumer's stream after them, and a release fence recorded on the consumer's stream
when it moves on is waited for before the slot is written again (`gdsload.device`). Encoded bytes
and labels are read on the host by POSIX (one `preadv` per coalesced group), never through KvikIO
member by member.

Order and resumption come from `gdsload.plan`: the order of an epoch depends only on (dataset,
seed, epoch); `state_dict()` records the global position, and `load_state_dict()` resumes the
exact remaining order, also on another world size with the same global batch. After a full epoch
the loader moves to the next epoch by itself; `set_epoch(n)` sets it explicitly (as with
`DistributedSampler`).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from gdsload import fields as _fieldkinds
from gdsload.batchread import distinct
from gdsload.decode.raw import TensorField
from gdsload.distributed import dist_rank_world
from gdsload.errors import FormatError, GdsloadError
from gdsload.format.reader import ShardedDataset
from gdsload.format.tar import ALIGN
from gdsload.forksafe import ProcessLocal
from gdsload.loadcheck import VerifyMode, check_mode
from gdsload.mix import Mix
from gdsload.mapping import MapStage, host_copy
from gdsload.output import as_output, default_output, torch_or_none
from gdsload.plan import PlanCursor
from gdsload.sizes import SizeError, parse_size
from gdsload.turns import DecodeTurns

_META_FIELDS = ("__key__", "__source__")  # per-sample names in a batch, not read from shards


class Dataset(ProcessLocal):
    """A converted dataset, opened by path (or fsspec URL). Reads only the manifest until used.

    `verify`: what a loader checks while reading it, "fast" (default: shard sizes, CRC32 of the
    members staged in host memory), "full" (also `.npy` tensors) or None; see `gdsload.loadcheck`.

    A dataset at a URL (s3://, gs://, http(s)://) is read through a local shard cache
    (`gdsload.format.cache`): whole shards are fetched ahead of the plan and evicted by it.
    `cache_dir=None` uses `$XDG_CACHE_HOME/gdsload/shards` (else `~/.cache/gdsload/shards`);
    `cache_dir=False` reads byte ranges from the store instead. `cache_limit` (bytes, or a size
    such as "50GB", "200GiB") bounds the folder. A local dataset has no cache.

    Pickles to its path, fields, `verify` and cache settings; a copy in another process (or a
    forked child) opens the dataset again on first use and refuses it if its content changed in
    between.
    """

    _PROCESS_LOCAL = ("_shards",)

    def __init__(self, path: str, *, fields: Sequence[str] | None = None, verify: VerifyMode = "fast",
                 cache_dir: str | os.PathLike[str] | Literal[False] | None = None,
                 cache_limit: int | str = "50GB"):
        from gdsload.format.store import is_remote

        self.path = str(path)
        self.verify = check_mode(verify)
        self._start_process()
        self._shards = ShardedDataset(path)
        self._id = self._content_id(self._shards)
        self.cache_limit = _parse_limit(cache_limit)
        if cache_dir is False or not is_remote(self.path):
            self.cache_dir: str | None = None
        elif cache_dir is None:
            from gdsload.format.cache import default_cache_dir

            self.cache_dir = str(default_cache_dir())
        else:
            self.cache_dir = str(cache_dir)
        self.fields = list(fields) if fields else [f for f in self.shards.fields]
        unknown = [f for f in self.fields if f not in self.shards.fields and f != "__key__"]
        if unknown:
            raise GdsloadError(
                f"fields {unknown} are not in dataset {self.path} (it has {sorted(self.shards.fields)})"
            )

    def _init_process_local(self) -> None:
        self._shards = None

    @property
    def shards(self) -> ShardedDataset:
        """The open dataset of this process (its file descriptors and lock are per process)."""
        self._check_process()
        if self._shards is None:
            shards = ShardedDataset(self.path)
            if self._content_id(shards) != self._id:
                raise FormatError(
                    f"dataset {self.path} changed since this Dataset was opened (content id {self._id} "
                    f"then, {self._content_id(shards)} now): open it again"
                )
            self._shards = shards
        return self._shards

    @staticmethod
    def _content_id(shards: ShardedDataset) -> str:
        h = hashlib.sha256()
        for s in shards.shards:
            h.update(s["sha256"].encode())
        return h.hexdigest()[:16]

    def __len__(self) -> int:
        return len(self.shards)

    @property
    def dataset_id(self) -> str:
        """Identity for states: hash of the shards' content hashes, in order."""
        return self._id

    @property
    def shard_sizes(self) -> tuple[int, ...]:
        return tuple(s["samples"] for s in self.shards.shards)

    def __repr__(self) -> str:
        return f"gdsload.Dataset({self.path!r}, samples={len(self)}, fields={self.fields})"

    def _with_fields(self, fields: Sequence[str]) -> "Dataset":
        return Dataset(self.path, fields=fields, verify=self.verify, cache_dir=self.cache_dir or False,
                       cache_limit=self.cache_limit)


def _parse_limit(limit: int | str) -> int:
    """`cache_limit` in bytes: an int, or a size string as the CLI takes (`50GB`, `1.5GiB`)."""
    if isinstance(limit, bool) or not isinstance(limit, (int, str)):
        raise GdsloadError(f"cache_limit must be bytes (an int) or a size such as '50GB', got {limit!r}")
    try:
        n = parse_size(limit) if isinstance(limit, str) else limit
    except SizeError as exc:
        raise GdsloadError(f"cache_limit: {exc}") from None
    if n <= 0:
        raise GdsloadError(f"cache_limit must be positive, got {limit!r}")
    return n


def _check_mix_tensors(mix: Mix, fplans: list[_FieldPlan]) -> None:
    """A tensor field of a mix has one dtype and shape in every dataset (one batch tensor); the
    layout is probed on each dataset's first sample of the field, as for one dataset."""
    for fp in fplans:
        if fp.kind != "tensor":
            continue
        for name, d in zip(mix.names, mix.datasets):
            ds = d.shards
            s0, j0 = next((s, j) for s in range(len(ds.shards)) for j in range(ds.index(s).num_samples)
                          if any(e == fp.name for e, _, _ in ds.index(s).members(j)))
            o, n = next((o, n) for e, o, n in ds.index(s0).members(j0) if e == fp.name)
            t = TensorField.probe(fp.name, ds.read_extent(s0, o, min(n, 2 * ALIGN)))
            if (t.dtype, t.shape) != (fp.tensor.dtype, fp.tensor.shape):
                raise FormatError(
                    f"field {fp.name!r} is {t.dtype}{list(t.shape)} in dataset {name!r} of the mix and "
                    f"{fp.tensor.dtype}{list(fp.tensor.shape)} in {mix.names[0]!r}; a batch needs one "
                    f"shape per field (choose fields=[...] without it)"
                )


@dataclass
class _FieldPlan:
    name: str
    kind: str  # image | tensor | label | bytes
    tensor: TensorField | None = None
    max_nbytes: int = 0


def _kvikio_error() -> str | None:
    from gdsload.io import kvikio_import_error

    return kvikio_import_error()


class DataLoader(ProcessLocal, PlanCursor):
    """A drop-in for `torch.utils.data.DataLoader` over a gdsload dataset.

    Arguments follow PyTorch where they make sense: `batch_size`, `shuffle`, `drop_last`,
    `num_workers` (reader/decoder threads, not processes), `prefetch_factor` (batches filled ahead
    of the one being consumed: the ring has `prefetch_factor + 1` slots; unlike PyTorch it is not
    per worker, since workers are threads filling one shared ring; default 2, or 1 when images are
    decoded (below); `"auto"` for either: sized while it runs, within stated bounds, see
    `gdsload.autotune`), `pin_memory` (pinned staging on a
    GPU host; a no-op without one). Plus: `seed`, `device` ("cpu", "cuda"; default: cuda when a
    GPU is usable: a CUDA device, CuPy, and for torch output a CUDA build of torch; "cuda:N" picks
    GPU N, "cuda" LOCAL_RANK's, else the current device, see `gdsload.device`), `transform` (an `ImageTransform`, or None for the default training transform;
    `decode=False` returns encoded bytes), `fields` (which fields, in which order; the batch is then
    a tuple), `rank`/`world_size` (default: from `torch.distributed` when initialised),
    `shuffle_window` (shards open at once for the within-window shuffle), `on_error` ("raise" or
    "skip" corrupt samples), `copy` (return tensors you may keep), `io` (backend name or "auto"),
    `output` ("torch" when torch is installed, else "numpy"). User code (`gdsload.mapping`):
    `map(sample_dict) -> sample_dict` after decoding, `collate_fn(list_of_samples) -> batch` instead
    of the default stacking, and `worker_mode` ("thread", default; "process": `map` and `collate_fn`
    run in `num_workers` spawned processes and must be picklable). What each field kind becomes:
    `gdsload.fields`.

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
                      "_fields", "_stats", "_cuda_lost", "_planner", "_cache")

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
        from gdsload.mix import MixPlan
        from gdsload.plan import Plan

        if isinstance(dataset, Mix):  # a Mix reads like one Dataset (gdsload.mix)
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
        from gdsload import autotune

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
        from gdsload.device import parse_device

        self.output = default_output(output)
        self.device, self._device_index = parse_device(device or self._default_device(self.output))
        self.decode_threads = decode_threads or os.cpu_count() or 2
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
        self._fields: list[_FieldPlan] | None = None
        self._ring = None
        self._backend = None
        self._cache = None  # a ShardCache for a dataset at a URL with a cache folder
        self.device_ordinal: int | None = None  # the GPU, resolved once in `_setup`
        self._streams = None  # gdsload.device.CopyStreams, with a device ring
        self._host_backend = None  # POSIX for host-arena reads, beside a device backend
        self._stats: dict[str, Any] = {}
        # weak: an epoch its consumer dropped (a `break`, an exception) is collected, which
        # closes it and ends its threads (see `_Epoch._produce`)
        self._active_ref: Any = None
        self._decoder = None
        self._planner = None  # gdsload.batchread.BatchPlanner, made in `_setup`
        self._staging_pool = None  # gdsload.batchread.StagingPool, with `_own_staging`
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
        from gdsload.io import choose_backend, open_backend
        from gdsload.loadcheck import check_dataset
        from gdsload.memory import available_device_bytes, available_host_bytes, check_fits
        from gdsload.ring import Ring, SlotSpec

        ds = self.dataset.shards
        # what is verified (`gdsload.loadcheck`) is each dataset's own setting, also in a Mix
        parts = self.dataset.datasets if isinstance(self.dataset, Mix) else [self.dataset]
        notes = [check_dataset(d.shards, d.verify) for d in parts]
        self._verify_note = notes[0] if len(set(notes)) == 1 else "; ".join(
            f"{name}: {note}" for name, note in zip(self.dataset.names, notes))
        self._shard_verify = [d.verify for d in parts for _ in d.shards.shards]  # per global shard
        # rows per slot: a batch never holds more than one rank's samples of an epoch
        B = self._rows = max(1, min(self.batch_size, -(-self.plan.num_samples // self.plan.world_size)))
        # .npy headers are read (into staging) where the index does not vouch for C order
        # (the manifest says so for shards converted since it records it; older ones: the index)
        self._tensor_headers = any(
            mode == "full" or not (ds.shards[s].get("npy_c_order") or ds.index(s).npy_c_order)
            for s, mode in enumerate(self._shard_verify))
        fplans: list[_FieldPlan] = []
        for name in self.dataset.fields:
            kind = _fieldkinds.loader_kind(name, decode=self.decode)  # table: gdsload/fields.py
            if kind == "tensor" and _fieldkinds.is_ragged(ds, name):
                kind = "ragged"  # shapes vary: a list of tensors, parsed per sample
            fp = _FieldPlan(name, kind)
            for s in range(len(ds.shards)):
                known = ds.shards[s].get("max_nbytes")  # in the manifest: no index to load
                if known is not None:
                    fp.max_nbytes = max(fp.max_nbytes, known.get(name, 0))
                    continue
                idx = ds.index(s)
                if name in idx.extensions:
                    e = idx.extensions.index(name)
                    sizes = idx.member_size[idx.member_ext == e]
                    if len(sizes):
                        fp.max_nbytes = max(fp.max_nbytes, int(sizes.max()))
            if kind == "tensor":
                s0, j0 = next((s, j) for s in range(len(ds.shards)) for j in range(ds.index(s).num_samples)
                              if any(e == name for e, _, _ in ds.index(s).members(j)))
                o, n = next((o, n) for e, o, n in ds.index(s0).members(j0) if e == name)
                fp.tensor = TensorField.probe(name, ds.read_extent(s0, o, min(n, 2 * ALIGN)),
                                              where=f"{ds.shards[s0]['name']}:{ds.index(s0).key(j0)}")
            fplans.append(fp)
        if isinstance(self.dataset, Mix):
            _check_mix_tensors(self.dataset, fplans)
        self._fields = fplans
        from gdsload.batchread import BatchPlanner, StagingPool

        self._planner = None if self._tensor_headers else BatchPlanner(
            ds, [(fp.name, fp.kind, fp.tensor) for fp in fplans],
            crc_shards=[mode is not None for mode in self._shard_verify])

        # Batch tensors (decoded images, .npy rows, labels) go where the batch is consumed; encoded
        # bytes stay on the host, where DALI and the label parser read them. On a GPU, labels are
        # parsed into a host field "__h_<name>" and copied; so are .npy rows when the backend
        # cannot write device memory.
        spec: dict[str, tuple[tuple[int, ...], str]] = {}
        host: dict[str, tuple[tuple[int, ...], str]] = {}
        want_device = self.device == "cuda"
        cache_dir = getattr(self.dataset, "cache_dir", None)  # a Mix has none: it reads ranges
        where = cache_dir if cache_dir is not None else ds.root  # cached shards are local files
        io = self.io_name if self.io_name != "auto" else choose_backend(where, device=want_device)
        threads = max(2, self.num_workers)
        if want_device:
            from gdsload.device import resolve_ordinal

            self.device_ordinal = resolve_ordinal(self._device_index)
        kw = {"device_id": self.device_ordinal} if io == "kvikio" and want_device else {}
        self._backend = open_backend(io, threads=threads, **kw)
        if cache_dir is not None:
            from gdsload.format.cache import ShardCache

            ref = weakref.ref(self)

            def forget(path: str) -> None:  # backends close their fd: an evicted file frees its space
                loader = ref()
                for b in (loader._backend, loader._host_backend) if loader is not None else ():
                    if b is not None and hasattr(b, "forget"):
                        b.forget(path)

            self._cache = ShardCache(ds.root, ds.shards, cache_dir, self.dataset.cache_limit, on_release=forget)
            self._cache.check_limit(self.plan.window)
        direct = want_device and getattr(self._backend, "device_capable", False)
        # Nothing decoded, host memory: a planned batch's staged members (bytes, text, json,
        # label text) are read into a buffer of the batch's own, which its BytesColumns keep
        # (no copy out of the ring); see `_fill_planned`.
        self._own_staging = self._planner is not None and not want_device and not any(
            fp.kind == "image" for fp in fplans)
        self._staging_pool = StagingPool(keep=self.num_workers + 2) if self._own_staging else None
        staging = 0
        for fp in fplans:
            if fp.kind == "tensor":
                spec[fp.name] = ((B, *fp.tensor.shape), fp.tensor.dtype.str)
                if want_device and not direct:
                    host["__h_" + fp.name] = spec[fp.name]
            elif fp.kind == "image":
                spec[fp.name] = ((B, *self.transform.output_shape()), self.transform.dtype)
            elif fp.kind == "label":
                (spec if want_device else host)[fp.name] = ((B,), "int64")
                if want_device:
                    host["__h_" + fp.name] = ((B,), "int64")
            if fp.kind != "tensor":  # (untouched by planned batches with `_own_staging`)
                staging += B * (-(-fp.max_nbytes // 64) * 64)
            elif self._tensor_headers:
                staging += B * (-(-max(ALIGN, fp.tensor.header_nbytes) // 64) * 64)
        host["__staging__"] = ((max(staging, 64),), "uint8")
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
            from gdsload.device import CopyStreams

            self._ring = Ring(SlotSpec(fields=spec), slots, device=f"cuda:{self.device_ordinal}", pin=pin,
                              host_spec=SlotSpec(fields=host))
            self._streams = CopyStreams(self.device_ordinal, consumer=self.output)
            if direct:  # KvikIO writes the device arena; encoded bytes and labels go through POSIX
                self._host_backend = open_backend("posix", threads=threads)
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
    def _active(self) -> _Epoch | None:
        return self._active_ref() if self._active_ref is not None else None

    def __iter__(self) -> Iterator[Any]:
        self._enter_process()
        active = self._active
        if active is not None:
            active.close()
        if self._fields is None:
            self._setup()
        ep = _Epoch(self, self._epoch, self._position)
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
        out = dict(self._stats)
        if self._cache is not None:
            out["cache"] = self._cache.stats()
        return out

    def close(self) -> None:
        self._check_process()
        active = self._active
        if active is not None:
            active.close()
        if self._cache is not None:
            self._stats["cache"] = self._cache.stats()  # kept for stats() after close
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


class _Epoch:
    """One pass: producer threads fill ring slots in plan order; `__next__` hands out views."""

    def __init__(self, loader: DataLoader, epoch: int, position: int):
        self.loader = loader
        self.epoch = epoch
        self.pid = os.getpid()  # the producer threads and the ring state exist in this process only
        self._successor: Iterator[Any] | None = None
        self.G = loader.plan.global_batch
        self.batches = list(loader.plan.batches(epoch, position))
        self.ring = loader._ring
        self.ring.reset()
        if loader._cache is not None:  # the shards of every batch, so the cache can fetch ahead
            ends = np.cumsum(loader.dataset.shard_sizes)
            needs = [distinct(np.searchsorted(ends, b, side="right")) for b in self.batches]
            loader._cache.start_epoch(needs)
            # their indexes too (one request each at the URL), in order of first use
            loader.dataset.shards.load_indexes(s for b in needs for s in b)
        self.next_seq = 0
        self.handed = None
        self._consumer: int | None = None  # the consumer's thread (its current stream is the fence's)
        self._claim = 0
        self._claim_lock = threading.Lock()
        # Held by a reader for the Python-heavy parts of a batch (planning, per-sample values,
        # CRC32s member by member), never across its reads or decodes: readers that interleave those parts
        # convoy on the GIL (a thread back from a GIL-free `crc32` call waits up to the 5 ms
        # switch interval for one busy in Python), which measured at half the samples/s of one
        # reader on 2 cores; serialised, one reader's CPU part overlaps the others' reads.
        self._cpu = threading.Lock()
        self._closed = False
        self.n_images = sum(fp.kind == "image" for fp in loader._fields)  # decode turns per batch
        self.turns = DecodeTurns(self.n_images)
        if loader._tuner is not None:
            loader._tuner.restart()
        self.stage = loader._stage.start(loader.num_workers) if loader._stage is not None else None
        self._layout = {name: off for name, (off, _) in self.ring.spec.layout().items()}
        hs = self.ring.host_spec
        self._host_layout = {name: off for name, (off, _) in hs.layout().items()} if hs else None
        self.bytes_read = 0
        self.samples = 0
        self.skipped = 0
        self.t0 = time.perf_counter()
        self.wait0 = self.ring.stats()["wait_s"]
        self.threads = [
            threading.Thread(target=_Epoch._produce, args=(weakref.ref(self),),
                             name=f"gdsload-reader-{i}", daemon=True)
            for i in range(min(loader.num_workers, max(1, len(self.batches))))
        ]
        for t in self.threads:
            t.start()

    # producers --------------------------------------------------------------------------------
    @staticmethod
    def _produce(ref: weakref.ref) -> None:
        # The thread holds its epoch only while claiming and filling, never while blocked in
        # `acquire`: an epoch its consumer dropped is then collected, `__del__` closes the ring,
        # and the blocked `acquire` raises RingClosed.
        from gdsload.ring import RingClosed

        first = ref()
        ordinal = first.loader.device_ordinal if first is not None else None
        first = None
        if ordinal is not None:  # the current device is per thread; new threads start on GPU 0
            from gdsload.device import use_device

            use_device(ordinal)
        while True:
            self = ref()
            if self is None or self._closed:
                return
            ring = self.ring
            with self._claim_lock:
                seq = self._claim
                self._claim += 1
            if seq >= len(self.batches):
                return
            self = None
            try:
                slot = ring.acquire(seq)
            except RingClosed:
                return
            self = ref()
            if self is None:
                return
            decoded = False
            cache = self.loader._cache
            try:
                decoded = self._fill(slot, seq, self.batches[seq])
            except RingClosed:
                return
            except BaseException as exc:  # delivered to the consumer, in order
                self.ring.fail(slot, exc)
                continue
            finally:
                if cache is not None:
                    cache.release(seq)
                if self.n_images:  # turns not taken (a failure before or between decodes)
                    self.turns.skip_batch(seq)
            self.ring.publish(slot)

    def _decode(self, turn: int, encoded: list, names: list[str], dst):
        """Decode with the loader's one DALI pipeline, in turn order (`gdsload.turns`).

        One pipeline with all cores as DALI threads beats one per producer: the batch the
        consumer needs next gets every core (time to first batch), and memory is paid once.
        """
        with self.turns.take(turn):
            dec = self.loader._get_decoder()
            out, kept = dec.decode(encoded, names)
            if out is not None:  # inside the turn: the next run() reuses DALI's buffers
                streams = self.loader._streams
                dec.copy_into(out, dst, **({"stream": streams.stream_handle} if streams else {}))
            return kept

    def _fill(self, slot, seq: int, ids: np.ndarray) -> bool:
        """Read (and decode) batch `seq` into `slot`; returns whether it took its decode turn.

        Planned with array operations (`gdsload.batchread`); batches it does not plan (`.npy`
        headers to read) go member by member (`_fill_members`)."""
        planner = self.loader._planner
        with self._cpu:  # members packed in a batch-owned buffer: CRC-checked in one call
            reads = planner.plan(ids, packed=self.loader._own_staging) if planner is not None else None
        if reads is None:
            return self._fill_members(slot, seq, ids)
        return self._fill_planned(slot, seq, ids, reads)

    def _fill_planned(self, slot, seq: int, ids: np.ndarray, reads) -> bool:
        from gdsload.batchread import check_crcs
        from gdsload.io.table import ExtentTable, read_table
        from gdsload.loadcheck import label

        L = self.loader
        bufs = slot.buffers
        own = L._own_staging  # staged members into the batch's own buffer, not the ring's
        staging = L._staging_pool.take(int(reads.staged_pos[-1] + reads.staged_nbytes[-1]) if len(reads.staged_pos)
                                       else 0) if own else bufs["__staging__"]
        slot.wait_fence()  # the consumer's queued work on this slot's previous batch is done
        layout, hl = self._layout, self._host_layout
        to_host = hl is not None and L._host_backend is None
        paths = L._planner.paths
        local = None
        if L._cache is not None:  # whole shards in the local cache, pinned until the batch is read
            local = L._cache.acquire(seq, distinct(reads.shard))
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
            jobs = [(L._backend, ExtentTable.concat(paths, rows), slot.flat),
                    (L._backend, ExtentTable.concat(paths, [staged]), staging)]
        elif hl is None:
            jobs = [(L._backend, ExtentTable.concat(paths, rows + [staged]), slot.flat)]
        elif to_host:
            jobs = [(L._backend, ExtentTable.concat(paths, rows + [staged]), slot.host_flat)]
        else:  # KvikIO into the device arena, encoded bytes and labels via POSIX into pinned memory
            jobs = [(L._backend, ExtentTable.concat(paths, rows), slot.flat),
                    (L._host_backend, ExtentTable.concat(paths, [staged]), slot.host_flat)]
        nbytes = sum(f.result() for f in [read_table(b, t, out) for b, t, out in jobs if len(t)])
        if local is not None:  # read: unpin now, not after the decode turn (as `_fill_members`)
            L._cache.release(seq)
        streams = L._streams
        names = reads.names
        meta: dict[str, Any] = {"keys": reads.keys, "n": n, "bytes": nbytes, "extra": {}}
        if isinstance(L.dataset, Mix):
            meta["sources"] = L.dataset.sources_of(ids)
        keep = None
        decoded = False
        kepts: dict[str, list[int]] = {}
        if own:  # packed members: a few crc32 calls, each giving the GIL up once
            check_crcs(reads, staging)
        with self._cpu:  # per-sample values (and CRC32s member by member); images decode after, in their turn
            if not own:
                check_crcs(reads, staging)
            self._host_values(reads, staging, meta, to_host, bufs)
        for fp in L._fields:
            if fp.kind == "image":
                pos, nb, _ = reads.staged[fp.name]
                encoded = [staging[a : a + k] for a, k in zip(pos.tolist(), nb.tolist())]
                turn = seq * self.n_images + len(kepts)
                kept = kepts[fp.name] = self._decode(turn, encoded, names, bufs[fp.name])
                decoded = True
                if len(kept) < n:
                    keep = kept if keep is None else [k for k in keep if k in set(kept)]
                meta["skipped"] = meta.get("skipped", 0) + n - len(kept)
        self._finish_fill(slot, meta, bufs, names, n, keep, kepts)
        return decoded

    def _host_values(self, reads, staging, meta: dict, to_host: bool, bufs) -> None:
        """The planned batch's labels, host copies of `.npy` rows to the device, and per-sample
        values of list fields (bytes, text, json, ragged)."""
        from gdsload.loadcheck import label

        L = self.loader
        streams = L._streams
        names = reads.names
        n = reads.n
        for fp in L._fields:
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
                meta["extra"][fp.name] = col if L._own_staging else col.copy()  # not a view of the ring
            elif fp.kind in _fieldkinds.LIST_KINDS:
                pos, nb, _ = reads.staged[fp.name]
                meta["extra"][fp.name] = [_fieldkinds.parse(fp.kind, staging[a : a + k], names[i])
                                          for i, (a, k) in enumerate(zip(pos.tolist(), nb.tolist()))]

    def _fill_members(self, slot, seq: int, ids: np.ndarray) -> bool:
        """`_fill` one member at a time: `.npy` headers read and checked per sample."""
        from gdsload.io import Extent
        from gdsload.loadcheck import BatchChecks, label

        L = self.loader
        ds = L.dataset.shards
        bufs = slot.buffers
        staging = bufs["__staging__"]
        slot.wait_fence()  # the consumer's queued work on this slot's previous batch is done
        keys, names = [], []
        direct: dict[str, tuple[list, list]] = {}
        staged: list[Extent] = []
        staged_off: list[int] = []
        spans: dict[str, list[tuple[int, int]]] = {fp.name: [] for fp in L._fields}
        labels: dict[str, list[Any]] = {fp.name: [] for fp in L._fields if fp.kind == "label"}
        checks = BatchChecks()
        crc_staged = any(fp.kind == "image" or fp.kind in _fieldkinds.LIST_KINDS for fp in L._fields)  # labels come from the index
        # a device ring with a host-only backend: .npy rows land in pinned "__h_" fields first
        to_host = self._host_layout is not None and L._host_backend is None
        cursor = 0
        local = None
        if L._cache is not None:  # whole shards in the local cache, pinned until the batch is read
            ends = np.cumsum(L.dataset.shard_sizes)
            local = L._cache.acquire(seq, distinct(np.searchsorted(ends, ids, side="right")))
        for i, gid in enumerate(ids.tolist()):
            s, j = ds.locate(gid)
            idx = ds.index(s)
            key = idx.key(j)
            keys.append(key)
            where = f"{ds.shards[s]['name']}:{key}"
            names.append(where)
            members = {e: (o, n) for e, o, n in idx.members(j)}
            mode = L._shard_verify[s]
            crcs = (dict(zip(members, idx.crcs(j)))
                    if mode is not None and idx.member_crc is not None and (crc_staged or mode == "full") else {})
            path = local[s] if local is not None else ds.shard_path(s)
            for fp in L._fields:
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
            reads = [L._backend.read(extents, slot.host_flat, outs)] if extents else []
        else:
            outs = [layout[name] + o for name, (_, os_) in direct.items() for o in os_]
            if hl is None:
                extents += staged
                outs += [layout["__staging__"] + o for o in staged_off]
                staged = []
            reads = [L._backend.read(extents, slot.flat, outs)] if extents else []
            if staged:  # device ring: encoded bytes and labels via POSIX into the pinned host arena
                base = hl["__staging__"]
                reads.append(L._host_backend.read(staged, slot.host_flat, [base + o for o in staged_off]))
        nbytes = sum(f.result() for f in reads)
        if local is not None:  # read: unpin now, not after the decode turn (which waits on
            L._cache.release(seq)  # earlier batches, which may be waiting for room in the cache)
        checks.run()
        streams = L._streams
        meta: dict[str, Any] = {"keys": keys, "n": len(ids), "bytes": nbytes, "extra": {}}
        if isinstance(L.dataset, Mix):
            meta["sources"] = L.dataset.sources_of(ids)
        keep = None
        decoded = False
        kepts: dict[str, list[int]] = {}
        for fp in L._fields:
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
                meta["extra"][fp.name] = _fieldkinds.BytesColumn(
                    staging, np.array([a for a, _ in sp], np.int64), np.array([n for _, n in sp], np.int64)).copy()
            elif fp.kind in _fieldkinds.LIST_KINDS:
                meta["extra"][fp.name] = [_fieldkinds.parse(fp.kind, staging[a : a + n], w) for (a, n), w in zip(sp, names)]
            elif fp.kind == "image":
                turn = seq * self.n_images + len(kepts)
                kept = kepts[fp.name] = self._decode(turn, [staging[a : a + n] for a, n in sp], names, bufs[fp.name])
                decoded = True
                if len(kept) < len(sp):
                    keep = kept if keep is None else [k for k in keep if k in set(kept)]
                meta["skipped"] = meta.get("skipped", 0) + len(sp) - len(kept)
        self._finish_fill(slot, meta, bufs, names, len(ids), keep, kepts)
        return decoded

    def _finish_fill(self, slot, meta: dict, bufs, names: list[str], n: int, keep: list[int] | None,
                     kepts: dict[str, list[int]]) -> None:
        """What both fill paths end with: rows of several image fields aligned to the samples all
        of them kept, the kept rows and the ready event in the slot's metadata, then `map` /
        `collate_fn` (gdsload.mapping) on host copies of the batch."""
        if keep is not None and len(kepts) > 1:  # several image fields: keep rows all of them kept
            for name, kf in kepts.items():
                rows = [kf.index(k) for k in keep]
                bufs[name][: len(rows)] = bufs[name][rows]
            meta["skipped"] = n - len(keep)
        if keep is not None:  # corrupt images skipped: compact the other fields to match
            meta["keep"] = keep
        streams = self.loader._streams
        if streams:
            meta["ready"] = streams.ready()
        slot.meta.update(meta)
        if self.stage is not None:
            if meta.get("ready") is not None:  # device ring: the private stream's copies first
                meta["ready"].synchronize()
            kept_names = names if keep is None else [names[k] for k in keep]
            slot.meta["mapped"] = self.stage.run(self._make_batch(slot, host=True), kept_names,
                                                 lambda a: self._convert(a, copy=False))

    # consumer ---------------------------------------------------------------------------------
    def __iter__(self) -> "_Epoch":
        return self

    def __next__(self) -> Any:
        if self.pid != os.getpid():
            return self._next_in_forked_child()
        if self._closed:  # finished, failed, closed, or replaced by a newer iter(): the ring
            raise StopIteration  # may carry another epoch now, never touch it again
        if self.handed is not None:
            self._release(self.handed)
            self.handed = None
        if self.next_seq >= len(self.batches):
            self._finish()
            raise StopIteration
        try:
            slot = self.ring.get(self.next_seq)
        except BaseException:
            self.close()
            raise
        self.next_seq += 1
        self.handed = slot
        self._consumer = threading.get_ident()
        streams = self.loader._streams
        if streams is not None:  # the consumer's stream waits for the batch's copies (GPU-side)
            streams.consumer_wait(slot.meta.get("ready"))
        tuner = self.loader._tuner
        if tuner is not None:
            rs = self.ring.stats()
            action = tuner.observe(time.perf_counter(), rs["wait_s"], rs["producer_wait_s"])
            if action is not None:
                self._tune(action)
        batch = self._make_batch(slot)
        self.loader._position += self.G
        self.samples += slot.meta["n"] - slot.meta.get("skipped", 0)
        self.skipped += slot.meta.get("skipped", 0)
        self.bytes_read += slot.meta["bytes"]
        self._update_stats()
        return batch

    def _tune(self, action: str) -> None:
        """Carry out a `gdsload.autotune` decision: one more ring slot, or one more reader."""
        from gdsload import autotune

        L, tuner = self.loader, self.loader._tuner
        if action == "worker":
            t = threading.Thread(target=_Epoch._produce, args=(weakref.ref(self),),
                                 name=f"gdsload-reader-{len(self.threads)}", daemon=True)
            self.threads.append(t)
            t.start()
            L.num_workers = tuner.workers = tuner.workers + 1
            return
        from gdsload.memory import available_device_bytes, available_host_bytes

        ring = self.ring
        ok = autotune.fits(ring.host_nbytes_per_slot + (0 if ring.host_spec else ring.nbytes_per_slot),
                           available_host_bytes())
        if ring.host_spec is not None:  # a device ring: its batch tensors are on the GPU
            import cupy

            with cupy.cuda.Device(L.device_ordinal):
                ok = ok and autotune.fits(ring.nbytes_per_slot, available_device_bytes())
        if not ok:  # memory does not allow it: stay at this depth
            tuner.auto_prefetch = False
            return
        ring.grow(1)
        register = getattr(L._backend, "register", None)
        if L._host_backend is not None and register is not None:  # KvikIO reads into the new arena
            register(ring.arenas[-1])
        L.prefetch_factor = tuner.prefetch = tuner.prefetch + 1

    def _next_in_forked_child(self) -> Any:
        """The parent's iterator, used in a forked child: its threads are not here and its ring
        must not be touched, so continue with a new iteration of the child's copy of the loader,
        which starts at the loader's position (the batch after the last one handed out)."""
        if self._successor is None:
            if self._closed:
                raise StopIteration
            self._closed = True
            self._successor = iter(self.loader)
        return next(self._successor)

    def __reduce__(self):
        raise TypeError("a gdsload.DataLoader iterator cannot be pickled: pickle the loader itself, whose copy "
                        "continues from the loader's state_dict()")

    def _release(self, slot, *, same_thread: bool = True) -> None:
        """Hand the slot back, with a fence on the consumer's stream when the ring is on the GPU."""
        streams = self.loader._streams
        fence = streams.release_fence(same_thread=same_thread) if streams is not None else None
        self.ring.release(slot, fence=fence)

    def _make_batch(self, slot, *, host: bool = False) -> Any:
        if "mapped" in slot.meta:
            return slot.meta["mapped"]
        L = self.loader
        n = slot.meta["n"]
        keep = slot.meta.get("keep")
        out: dict[str, Any] = {}
        for fp in L._fields:
            if fp.kind == "bytes":  # a BytesColumn owning its buffer (never a view of the ring)
                col = slot.meta["extra"][fp.name]
                col = col.take(keep) if keep is not None else col
                out[fp.name] = col.tolist() if host else col  # `map`/`collate_fn` get bytes per sample
                continue
            if fp.kind in _fieldkinds.LIST_KINDS:
                vals = slot.meta["extra"][fp.name]
                vals = [vals[k] for k in keep] if keep is not None else vals
                out[fp.name] = [self._convert(v, copy=False) for v in vals] if fp.kind == "ragged" and not host else vals
                continue
            arr = slot.buffers[fp.name]
            if keep is not None and fp.kind != "image":
                arr = arr[np.asarray(keep, dtype=np.intp)] if not hasattr(arr, "__cuda_array_interface__") else arr[keep]
                view = arr
            else:
                view = arr[: len(keep) if keep is not None else n]
            out[fp.name] = host_copy(view) if host else self._convert(view, copy=L.copy or keep is not None and fp.kind != "image")
        keys = slot.meta["keys"]
        out["__key__"] = [keys[k] for k in keep] if keep is not None else list(keys)
        if "sources" in slot.meta:
            sources = slot.meta["sources"]
            out["__source__"] = [sources[k] for k in keep] if keep is not None else sources
        if L.tuple_fields is not None and not host:
            return tuple(out[f] for f in L.tuple_fields)
        return out

    def _convert(self, arr, *, copy: bool):
        """A slot view as the output type, on the loader's device (zero copy where it is there)."""
        L = self.loader
        return as_output(arr, L.output, f"cuda:{L.device_ordinal}" if L.device == "cuda" else "cpu", copy=copy)

    def _update_stats(self) -> None:
        L = self.loader
        el = max(time.perf_counter() - self.t0, 1e-9)
        rs = self.ring.stats()
        wait = rs["wait_s"] - self.wait0
        L._stats = {
            "epoch": self.epoch,
            "batches": self.next_seq,
            "samples": self.samples,
            "elapsed_s": el,
            "samples_per_s": self.samples / el,
            "bytes_per_s": self.bytes_read / el,
            "wait_s": wait,
            "wait_fraction": wait / el,
            "ring_slots": rs["slots"],
            "ring_occupancy": rs.get("mean_occupancy", rs.get("occupancy")),
            "io_path": L._backend.name if L._backend else None,
            "host_io_path": L._host_backend.name if L._host_backend else None,
            "ring_device": self.ring.device,
            "kvikio_error": _kvikio_error() if L.device == "cuda" else None,
            "decode_device": ("mixed" if L.device == "cuda" else "cpu") if any(
                fp.kind == "image" for fp in L._fields) else None,
            "device": L.device,
            "skipped": self.skipped,
            "verify": L._verify_note,
            "prefetch_factor": L.prefetch_factor,  # now: "auto" may have grown it (gdsload.autotune)
            "num_workers": L.num_workers,
            "auto": ",".join(k for k, v in L._auto.items() if v) or None,
        }

    def _finish(self) -> None:
        self.close()
        L = self.loader
        L._epoch = self.epoch + 1
        L._position = 0

    def close(self) -> None:
        if self._closed:
            return
        if self.pid != os.getpid():  # the parent's iterator in a forked child: touch nothing
            self._closed = True
            return
        self._closed = True
        self.turns.close()
        if self.handed is not None:  # keep the fence: the next pass may refill this slot
            try:
                self._release(self.handed, same_thread=threading.get_ident() == self._consumer)
            except Exception:
                pass
            self.handed = None
        if self.stage is not None:  # worker processes end with their epoch
            self.stage.close()
        self.ring.close()
        for t in self.threads:
            if t is not threading.current_thread():  # `__del__` may run in a producer
                t.join()
        if self.loader._streams is not None and self.next_seq < len(self.batches):
            self.loader._streams.synchronize()  # stopped early: unconsumed batches' copies may be queued
        if self.loader._active is self:
            self.loader._active_ref = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
