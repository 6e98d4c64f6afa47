"""`gdsload.Dataset` and `gdsload.DataLoader`: plan -> I/O -> decode -> ring -> training loop.

Per batch, a producer thread (`num_workers` of them) takes the batch's sample ids from the plan,
looks up every member in the shard indexes (no tar scan), and issues one coalesced read per
destination: `.npy` array data goes straight into the batch tensor in the ring slot (device
memory through KvikIO on a GPU host), encoded images, labels and other small fields into the
slot's staging buffer (pinned host memory on a GPU host). Images are then decoded and transformed
by DALI into the slot's image tensor; labels are parsed into an int64 tensor. The consumer gets
views of the slot.

Slot lifetime: the tensors of batch k stay valid until the next `next()` on the iterator; after
that the slot is refilled. Pass `copy=True` to get tensors you may keep.

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

from gdsload.decode.raw import TensorField
from gdsload.errors import FormatError, GdsloadError
from gdsload.format.reader import ShardedDataset
from gdsload.format.tar import ALIGN
from gdsload.plan import PlanCursor

_LABEL_FIELDS = ("cls",)


class Dataset:
    """A converted dataset, opened by path (or fsspec URL). Reads only the manifest until used.

    A dataset at a URL (s3://, gs://, http(s)://) is read through a local shard cache
    (`gdsload.format.cache`): whole shards are fetched ahead of the plan and evicted by it.
    `cache_dir=None` uses `$XDG_CACHE_HOME/gdsload/shards` (else `~/.cache/gdsload/shards`);
    `cache_dir=False` reads byte ranges from the store instead. `cache_limit` (bytes, or a size
    such as "50GB", "200GiB") bounds the folder. A local dataset has no cache.
    """

    def __init__(self, path: str, *, fields: Sequence[str] | None = None,
                 cache_dir: str | os.PathLike[str] | Literal[False] | None = None,
                 cache_limit: int | str = "50GB"):
        from gdsload.format.store import is_remote

        self.path = str(path)
        self.shards = ShardedDataset(path)
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

    def __len__(self) -> int:
        return len(self.shards)

    @property
    def dataset_id(self) -> str:
        """Identity for states: hash of the shards' content hashes, in order."""
        h = hashlib.sha256()
        for s in self.shards.shards:
            h.update(s["sha256"].encode())
        return h.hexdigest()[:16]

    @property
    def shard_sizes(self) -> tuple[int, ...]:
        return tuple(s["samples"] for s in self.shards.shards)

    def __repr__(self) -> str:
        return f"gdsload.Dataset({self.path!r}, samples={len(self)}, fields={self.fields})"

    def _with_fields(self, fields: Sequence[str]) -> "Dataset":
        return Dataset(self.path, fields=fields, cache_dir=self.cache_dir or False, cache_limit=self.cache_limit)


def _parse_limit(limit: int | str) -> int:
    """`cache_limit` in bytes: an int, or a size string as the CLI takes (`50GB`, `1.5GiB`)."""
    import argparse

    from gdsload.cli import parse_size  # a pure function; cli imports nothing heavy at the top

    if isinstance(limit, bool) or not isinstance(limit, (int, str)):
        raise GdsloadError(f"cache_limit must be bytes (an int) or a size such as '50GB', got {limit!r}")
    try:
        n = parse_size(limit) if isinstance(limit, str) else limit
    except argparse.ArgumentTypeError as exc:
        raise GdsloadError(f"cache_limit: {exc}") from None
    if n <= 0:
        raise GdsloadError(f"cache_limit must be positive, got {limit!r}")
    return n


@dataclass
class _FieldPlan:
    name: str
    kind: str  # image | tensor | label | bytes
    tensor: TensorField | None = None
    max_nbytes: int = 0


def _torch():
    try:
        import torch

        return torch
    except ImportError:
        return None


def _current_cuda_device() -> int:
    """The CUDA device this process uses (torch's current device, as set per rank under torchrun;
    else LOCAL_RANK; else 0)."""
    torch = _torch()
    if torch is not None and torch.cuda.is_available():
        return torch.cuda.current_device()
    return int(os.environ.get("LOCAL_RANK", 0))


def _dist_rank_world() -> tuple[int, int] | None:
    torch = _torch()
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return None


class DataLoader(PlanCursor):
    """A drop-in for `torch.utils.data.DataLoader` over a gdsload dataset.

    Arguments follow PyTorch where they make sense: `batch_size`, `shuffle`, `drop_last`,
    `num_workers` (reader/decoder threads, not processes), `prefetch_factor` (batches filled ahead
    of the one being consumed: the ring has `prefetch_factor + 1` slots; unlike PyTorch it is not
    per worker, since workers are threads filling one shared ring), `pin_memory` (pinned staging on a
    GPU host; a no-op without one). Plus: `seed`, `device` ("cpu", "cuda"; default: cuda when a
    GPU is usable), `transform` (an `ImageTransform`, or None for the default training transform;
    `decode=False` returns encoded bytes), `fields` (which fields, in which order; the batch is then
    a tuple), `rank`/`world_size` (default: from `torch.distributed` when initialised),
    `shuffle_window` (shards open at once for the within-window shuffle), `on_error` ("raise" or
    "skip" corrupt samples), `copy` (return tensors you may keep), `io` (backend name or "auto"),
    `output` ("torch" when torch is installed, else "numpy").
    """

    def __init__(
        self,
        dataset: Dataset | str,
        batch_size: int = 1,
        shuffle: bool = False,
        drop_last: bool = False,
        num_workers: int = 2,
        prefetch_factor: int = 2,
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
    ):
        from gdsload.plan import Plan

        self.dataset = dataset if isinstance(dataset, Dataset) else Dataset(dataset)
        if fields is not None:
            self.dataset = self.dataset._with_fields([f for f in fields if f != "__key__"])
        self.tuple_fields = list(fields) if fields is not None else None
        if num_workers < 1:
            raise GdsloadError(f"num_workers must be >= 1 (reader threads), got {num_workers}")
        if prefetch_factor < 1:
            raise GdsloadError(f"prefetch_factor must be >= 1, got {prefetch_factor}")
        dist = _dist_rank_world()
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
        self.device = device or self._default_device()
        if self.device not in ("cpu", "cuda"):
            raise GdsloadError(f"device must be 'cpu' or 'cuda', not {self.device!r}")
        self.output = output or ("torch" if _torch() is not None else "numpy")
        self.decode_threads = decode_threads or os.cpu_count() or 2
        if transform is None and decode:
            from gdsload.decode.image import ImageTransform

            transform = ImageTransform()
        self.transform = transform
        self.plan = Plan(
            dataset_id=self.dataset.dataset_id, shard_sizes=self.dataset.shard_sizes,
            batch_size=batch_size, world_size=world_size, rank=rank, seed=seed, shuffle=shuffle,
            window=shuffle_window, drop_last=drop_last,
        )
        self._epoch = 0
        self._position = 0
        self._fields: list[_FieldPlan] | None = None
        self._ring = None
        self._backend = None
        self._cache = None  # a ShardCache for a dataset at a URL with a cache folder
        self._stats: dict[str, Any] = {}
        # weak: an epoch its consumer dropped (a `break`, an exception) is collected, which
        # closes it and ends its threads (see `_Epoch._produce`)
        self._active_ref: Any = None
        self._decoder = None

    # -- torch-like surface --------------------------------------------------------------------
    # len(), set_epoch(), epoch, state_dict(), load_state_dict(): from PlanCursor

    # -- set-up, lazily on first iteration -----------------------------------------------------
    @staticmethod
    def _default_device() -> str:
        from gdsload.io import cuda_device_count

        return "cuda" if cuda_device_count() > 0 else "cpu"

    def _setup(self) -> None:
        from gdsload.format.manifest import field_kind
        from gdsload.io import choose_backend, open_backend
        from gdsload.ring import Ring, SlotSpec

        ds = self.dataset.shards
        B = self.batch_size
        fplans: list[_FieldPlan] = []
        for name in self.dataset.fields:
            kind = field_kind(name)
            if kind == "image" and not self.decode:
                kind = "bytes"
            if kind not in ("image", "tensor", "label"):
                kind = "label" if name in _LABEL_FIELDS else "bytes"
            fp = _FieldPlan(name, kind)
            for s in range(len(ds.shards)):
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
                fp.tensor = TensorField.probe(name, ds.read_extent(s0, o, min(n, 2 * ALIGN)))
            fplans.append(fp)
        images = [fp.name for fp in fplans if fp.kind == "image"]
        if len(images) > 1:
            raise GdsloadError(
                f"dataset fields {images} are all images; a loader decodes one image field, choose "
                f"it with fields=[...] (or decode=False for encoded bytes)"
            )
        self._fields = fplans

        # Batch tensors (decoded images, .npy rows) go where the batch is consumed; encoded bytes
        # and labels stay on the host, where DALI and the label parser read them.
        spec: dict[str, tuple[tuple[int, ...], str]] = {}
        host: dict[str, tuple[tuple[int, ...], str]] = {}
        staging = 0
        for fp in fplans:
            if fp.kind == "tensor":
                spec[fp.name] = ((B, *fp.tensor.shape), fp.tensor.dtype.str)
            elif fp.kind == "image":
                spec[fp.name] = ((B, *self.transform.output_shape()), self.transform.dtype)
            elif fp.kind == "label":
                host[fp.name] = ((B,), "int64")
            if fp.kind != "tensor":
                staging += B * (-(-fp.max_nbytes // 64) * 64)
        host["__staging__"] = ((max(staging, 64),), "uint8")
        want_device = self.device == "cuda"
        cached = self.dataset.cache_dir is not None
        where = self.dataset.cache_dir if cached else ds.root  # cached shards are local files
        io = self.io_name if self.io_name != "auto" else choose_backend(where, device=want_device)
        self._backend = open_backend(io, threads=max(2, self.num_workers))
        if cached:
            from gdsload.format.cache import ShardCache

            self._cache = ShardCache(ds.root, ds.shards, self.dataset.cache_dir, self.dataset.cache_limit,
                                     on_release=getattr(self._backend, "forget", None))
            self._cache.check_limit(self.plan.window)
        on_device = want_device and getattr(self._backend, "device_capable", False)
        slots = self.prefetch_factor + 1
        pin = self.pin_memory and want_device
        if on_device:  # two arenas: device (GDS target) and pinned host
            self._ring = Ring(SlotSpec(fields=spec), slots, device=f"cuda:{_current_cuda_device()}", pin=pin,
                              host_spec=SlotSpec(fields=host))
        else:  # one host arena: one read per batch scatters into every field
            self._ring = Ring(SlotSpec(fields={**spec, **host}), slots, device="cpu", pin=pin)

    # -- iteration -------------------------------------------------------------------------------
    @property
    def _active(self) -> _Epoch | None:
        return self._active_ref() if self._active_ref is not None else None

    def __iter__(self) -> Iterator[Any]:
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

            self._decoder = ImageDecoder(self.transform, batch_size=self.batch_size,
                                         device="mixed" if self.device == "cuda" else "cpu",
                                         threads=self.decode_threads, seed=self.plan.seed,
                                         on_error=self.on_error, device_id=_current_cuda_device())
        return self._decoder

    def stats(self) -> dict[str, Any]:
        """samples/s, bytes/s, data stall (seconds and fraction), ring occupancy, I/O and decode."""
        return dict(self._stats)

    def close(self) -> None:
        active = self._active
        if active is not None:
            active.close()
        if self._cache is not None:
            self._cache.close()
            self._cache = None
        if self._backend is not None:
            self._backend.close()
            self._backend = None
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
        self.G = loader.plan.global_batch
        self.batches = list(loader.plan.batches(epoch, position))
        self.ring = loader._ring
        self.ring.reset()
        if loader._cache is not None:  # the shards of every batch, so the cache can fetch ahead
            ends = np.cumsum(loader.dataset.shard_sizes)
            loader._cache.start_epoch([np.unique(np.searchsorted(ends, b, side="right")) for b in self.batches])
        self.next_seq = 0
        self.handed = None
        self._claim = 0
        self._claim_lock = threading.Lock()
        self._closed = False
        self._turn = threading.Condition()
        self._decode_turn = 0
        self.has_images = any(fp.kind == "image" for fp in loader._fields)
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
                if self.has_images and not decoded:
                    self._skip_turn(seq)
            self.ring.publish(slot)

    def _decode(self, seq: int, encoded: list, names: list[str], dst):
        """Decode with the loader's one DALI pipeline, batches strictly in seq order.

        One pipeline with all cores as DALI threads beats one per producer: the batch the
        consumer needs next gets every core (time to first batch), and memory is paid once.
        """
        with self._turn:
            while self._decode_turn != seq and not self._closed:
                self._turn.wait()
            if self._closed:
                from gdsload.ring import RingClosed

                raise RingClosed("loader closed")
            try:
                dec = self.loader._get_decoder()
                out, kept = dec.decode(encoded, names)
                if out is not None:  # inside the turn: the next run() reuses DALI's buffers
                    dec.copy_into(out, dst)
                return kept
            finally:
                self._decode_turn += 1
                self._turn.notify_all()

    def _skip_turn(self, seq: int) -> None:
        """A batch that failed before decoding gives up its turn, so later batches proceed."""
        with self._turn:
            while self._decode_turn < seq and not self._closed:
                self._turn.wait()
            if self._decode_turn == seq:
                self._decode_turn += 1
                self._turn.notify_all()

    def _fill(self, slot, seq: int, ids: np.ndarray) -> bool:
        """Read (and decode) batch `seq` into `slot`; returns whether it took its decode turn."""
        from gdsload.io import Extent

        L = self.loader
        ds = L.dataset.shards
        bufs = slot.buffers
        staging = bufs["__staging__"]
        keys, names = [], []
        direct: dict[str, tuple[list, list]] = {}
        staged: list[Extent] = []
        staged_off: list[int] = []
        spans: dict[str, list[tuple[int, int]]] = {fp.name: [] for fp in L._fields}
        cursor = 0
        local = None
        if L._cache is not None:  # whole shards in the local cache, pinned until the batch is read
            ends = np.cumsum(L.dataset.shard_sizes)
            local = L._cache.acquire(seq, np.unique(np.searchsorted(ends, ids, side="right")).tolist())
        for i, gid in enumerate(ids.tolist()):
            s, j = ds.locate(gid)
            idx = ds.index(s)
            key = idx.key(j)
            keys.append(key)
            names.append(f"{ds.shards[s]['name']}:{key}")
            members = {e: (o, n) for e, o, n in idx.members(j)}
            path = local[s] if local is not None else ds.shard_path(s)
            for fp in L._fields:
                m = members.get(fp.name)
                if m is None:
                    raise FormatError(f"sample {key!r} in {ds.shards[s]['name']} has no field {fp.name!r}")
                o, n = m
                if fp.kind == "tensor":
                    head = None if n >= ALIGN else ds.read_extent(s, o, n)
                    off, nb = fp.tensor.data_extent(key, o, n, head)
                    ex, outs = direct.setdefault(fp.name, ([], []))
                    ex.append(Extent(path, off, nb))
                    outs.append(i * nb)
                else:
                    staged.append(Extent(path, o, n))
                    staged_off.append(cursor)
                    spans[fp.name].append((cursor, n))
                    cursor += -(-n // 64) * 64
        # One read for the whole batch: offsets are relative to the slot, so adjacent members of
        # a sample (an .npy row and its .cls) coalesce into one preadv that scatters into both.
        layout = self._layout
        extents = [e for ex, _ in direct.values() for e in ex]
        outs = [layout[name] + o for name, (_, os_) in direct.items() for o in os_]
        if self._host_layout is None:
            extents += staged
            outs += [layout["__staging__"] + o for o in staged_off]
            staged = []
        reads = [L._backend.read(extents, slot.flat, outs)] if extents else []
        if staged:  # device ring: encoded bytes and labels go to the pinned host arena
            base = self._host_layout["__staging__"]
            reads.append(L._backend.read(staged, slot.host_flat, [base + o for o in staged_off]))
        nbytes = sum(f.result() for f in reads)
        meta: dict[str, Any] = {"keys": keys, "n": len(ids), "bytes": nbytes, "extra": {}}
        keep = None
        decoded = False
        for fp in L._fields:
            sp = spans[fp.name]
            if fp.kind == "label":
                bufs[fp.name][: len(sp)] = [int(bytes(staging[a : a + n]).decode().strip() or -1) for a, n in sp]
            elif fp.kind == "bytes":
                meta["extra"][fp.name] = [bytes(staging[a : a + n]) for a, n in sp]
            elif fp.kind == "image":
                kept = self._decode(seq, [staging[a : a + n] for a, n in sp], names, bufs[fp.name])
                decoded = True
                if len(kept) < len(sp):
                    keep = kept if keep is None else [k for k in keep if k in set(kept)]
                meta["skipped"] = meta.get("skipped", 0) + len(sp) - len(kept)
        if keep is not None:  # corrupt images skipped: compact the other fields to match
            meta["keep"] = keep
        slot.meta.update(meta)
        return decoded

    # consumer ---------------------------------------------------------------------------------
    def __iter__(self) -> "_Epoch":
        return self

    def __next__(self) -> Any:
        if self._closed:  # finished, failed, closed, or replaced by a newer iter(): the ring
            raise StopIteration  # may carry another epoch now, never touch it again
        if self.handed is not None:
            self.ring.release(self.handed)
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
        batch = self._make_batch(slot)
        self.loader._position += self.G
        self.samples += slot.meta["n"] - slot.meta.get("skipped", 0)
        self.skipped += slot.meta.get("skipped", 0)
        self.bytes_read += slot.meta["bytes"]
        self._update_stats()
        return batch

    def _make_batch(self, slot) -> Any:
        L = self.loader
        n = slot.meta["n"]
        keep = slot.meta.get("keep")
        out: dict[str, Any] = {}
        for fp in L._fields:
            if fp.kind == "bytes":
                vals = slot.meta["extra"][fp.name]
                out[fp.name] = [vals[k] for k in keep] if keep is not None else vals
                continue
            arr = slot.buffers[fp.name]
            if keep is not None and fp.kind != "image":
                arr = arr[np.asarray(keep, dtype=np.intp)] if not hasattr(arr, "__cuda_array_interface__") else arr[keep]
                view = arr
            else:
                view = arr[: len(keep) if keep is not None else n]
            out[fp.name] = self._convert(view, copy=L.copy or keep is not None and fp.kind != "image")
        keys = slot.meta["keys"]
        out["__key__"] = [keys[k] for k in keep] if keep is not None else list(keys)
        if L.tuple_fields is not None:
            return tuple(out[f] for f in L.tuple_fields)
        return out

    def _convert(self, arr, *, copy: bool):
        """A slot view as the output type, on the loader's device (zero copy where it is there)."""
        L = self.loader
        on_device = hasattr(arr, "__cuda_array_interface__")
        if L.output == "torch":
            torch = _torch()
            t = torch.from_dlpack(arr) if on_device else torch.from_numpy(arr)
            if L.device == "cuda" and not on_device:
                return t.to("cuda")  # labels, or a host ring without KvikIO: a copy (blocking)
            return t.clone() if copy else t
        if L.device == "cuda" and not on_device:
            import cupy

            return cupy.asarray(arr)
        return arr.copy() if copy else arr

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
            "decode_device": ("mixed" if L.device == "cuda" else "cpu") if any(
                fp.kind == "image" for fp in L._fields) else None,
            "device": L.device,
            "skipped": self.skipped,
        }
        if L._cache is not None:
            L._stats["cache"] = L._cache.stats()

    def _finish(self) -> None:
        self.close()
        L = self.loader
        L._epoch = self.epoch + 1
        L._position = 0

    def close(self) -> None:
        if self._closed:
            return
        with self._turn:
            self._closed = True
            self._turn.notify_all()
        if self.handed is not None:
            self.handed = None
        self.ring.close()
        for t in self.threads:
            if t is not threading.current_thread():  # `__del__` may run in a producer
                t.join()
        if self.loader._active is self:
            self.loader._active_ref = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
