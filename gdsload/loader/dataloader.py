"""`gdsload.DataLoader`: plan -> I/O -> decode -> ring -> training loop.

Reading order (one batch, from `iter(loader)` to the training loop), all in `gdsload/loader/`:
1. `dataloader` (this module): the options (`gdsload.frontend.options.LoaderOptions`), the source
   (`gdsload.dataset.source`: a `Dataset` or a `Mix`, one interface), the plan and the cursor
   (`gdsload.frontend.cursor`); on first iteration it builds the stages below; `stats()`, `close()`.
2. `layout`: `BatchLayout`, what each field becomes and the ring slot one batch needs.
3. `resources`: `Resources`, the I/O backends, shard caches, ring, GPU streams, staging pool and
   the image decoder, sized from the layout; autotune (`autotune`) grows them.
4. `epoch`: `Epoch`, one pass: reader threads and the consumer's `next()`.
5. `fill`: `SlotFiller`, one batch into one slot: `gather` plans its reads with NumPy over the
   shard indexes, `gdsload.io.table` reads them, `gdsload.dataset.verify` checks them.
6. `decoding`: `OrderedDecoder`, the one DALI pipeline in batch order (`gdsload.decode.image`).
7. `assemble`: `BatchAssembler`, a slot as the batch handed out (`gdsload.frontend.output`).
8. `stats`: `Progress` and the per-stage times of `stats()["stages"]`.
No stage writes the loader's state: each is given its collaborators, and only the epoch moves the
cursor.

Per batch, a producer thread (`num_workers` of them) takes the batch's sample ids from the plan,
plans the batch's reads with NumPy over the shard indexes (`gdsload.loader.gather`; no tar scan, no
Python object per member), and issues one coalesced read table per destination
(`gdsload.io.table`): `.npy` array data goes straight into the batch tensor in the ring slot (device
memory through KvikIO on a GPU host), encoded images and other small fields into the
slot's staging buffer (pinned host memory on a GPU host). Images are then decoded and transformed
by DALI into the slot's image tensor; labels are copied from the index's label column (parsed
from the `.cls` members for older indexes). What is checked on the way is `gdsload.dataset.verify`.
The consumer gets views of the slot.

Slot lifetime: with `copy=False` (the default) a batch's tensors are views of a ring slot, and a
batch you still reference is never written over. When a slot's next batch is due while arrays of
its last one are alive (kept in a list, sliced, or tensors made from them with `torch.from_numpy`
or DLPack), the ring gives the slot fresh memory instead (`stats()["ring_replaced"]`); the kept
batch's memory is freed when you drop it. A kept label alone keeps its own field, not the slot. A
plain loop keeps nothing past the next `next()`, so nothing is replaced, allocated or copied.
`copy=True` hands out owned copies (`gdsload.ring.ring`, "Slot lifetime").

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
`DistributedSampler`). `load_state_dict()`, or a `set_epoch()` that changes the epoch, while a
pass is live stops that pass first (its readers end and its slots are freed before the call
returns; the next `iter()` starts from the new state): see `gdsload.frontend.cursor`.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal

from gdsload.dataset.dataset import Dataset
from gdsload.dataset.source import open_source
from gdsload.errors import ConfigError, GdsloadError
from gdsload.frontend import fields as _fieldkinds
from gdsload.frontend.cursor import Cursor, PlanCursor
from gdsload.frontend.options import LoaderOptions, check_torch_habits, check_workers
from gdsload.frontend.usercode import MapStage
from gdsload.host.dist import dist_rank_world
from gdsload.host.forksafe import ProcessLocal
from gdsload.loader.epoch import Epoch
from gdsload.loader.stats import FirstBatch
from gdsload.plan.plan import DEFAULT_ORDER, BlockSteps

if TYPE_CHECKING:  # imported where a Mix is opened (`open_source`): a Dataset's loader never imports it
    from gdsload.dataset.mix import Mix

__all__ = ["DataLoader", "Dataset"]


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
    `decode=False` returns encoded bytes; a `VideoTransform` or `AudioTransform`, or a dict field ->
    transform for samples of several kinds: `gdsload.decode.video`, `gdsload.decode.audio`; a
    video or audio field without one comes back as bytes), `fields` (which fields, in which order; the batch is then
    a tuple), `rank`/`world_size` (default: from `torch.distributed` when initialised),
    `shuffle_window` (shards open at once for the within-window shuffle), `order` (the order
    version, `gdsload.plan.plan`: 2 computes each batch's samples on demand, nothing per sample
    in memory; 1, built whole per epoch, is what states saved before versions resume; the default,
    `DEFAULT_ORDER`, is 2, a `RemoteLoader`'s too), `on_error` ("raise" or
    "skip" corrupt samples), `copy` (return tensors you may keep), `io` (backend name or "auto"),
    `output` ("torch" when torch is installed, else "numpy"), `decode_threads` (DALI's worker
    threads; default: one more than the cores, see `__init__`). User code (`gdsload.frontend.usercode`):
    `map(sample_dict) -> sample_dict` after decoding, `collate_fn(list_of_samples) -> batch` instead
    of the default stacking, and `worker_mode` ("thread", default; "process": `map` and `collate_fn`
    run in `num_workers` spawned processes and must be picklable), `timeout` (as in torch: seconds
    to wait for a batch from a process worker, 0 = forever; past it `WorkerTimeout` names the
    worker and the epoch ends; no effect with thread workers), `decoder_factory` (None: the loader
    builds its own `ImageDecoder`; else a callable taking `ImageDecoder`'s keyword arguments and
    returning an object with its `decode_into(encoded, names, dst, *, stream=None) -> kept rows`
    and `device`, called once, on the first image batch: the feed server hands its shared decode
    pool in this way, `gdsload.service.server.pool`; a loader holding one pickles only if it
    does). What each field kind becomes: `gdsload.frontend.fields`.

    torch's other `DataLoader` arguments (`gdsload.frontend.options.check_torch_habits`):
    `num_workers=0` starts no reader thread: each batch is read in the loop's thread when `next()`
    asks for it, nothing ahead (`prefetch_factor` is then refused; process-mode `map` runs in that
    thread too, as torch's 0 runs in the main process). `persistent_workers` is accepted and
    changes nothing: reader threads start with each pass (microseconds), and with
    `worker_mode="process"` the worker processes start with each pass too (0.29 s to the first
    batch of each pass with 2 workers whose map's module imports NumPy and gdsload, 2 cores;
    a whole epoch is one pass). `generator` (a `torch.Generator`) is the seed's source when `seed`
    is not given: the seed is `generator.initial_seed()`, read once, the generator not advanced
    (both given: refused; neither: seed 0). `worker_init_fn(worker_id)` runs in each worker
    process before its first batch (`worker_mode="process"` only: reader threads have no process
    to set up). `sampler` and `batch_sampler` are refused with a `ConfigError` naming the
    gdsload way (`shuffle`/`seed`, `rank`/`world_size`, `gdsload.Mix`), and `loader.sampler` is
    an `AttributeError` saying so. Rank and world size left to `torch.distributed` when no group
    exists yet are taken from the group at the first `len()`, `iter()` or state call that finds
    one (`_bind_ranks`). Class names: `loader.dataset.classes` (`gdsload.Dataset.classes`).

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

    _PROCESS_LOCAL = ("_layout", "_resources", "_progress", "_stats", "_cuda_lost", "_first")

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
        seed: int | None = None,
        device: str | None = None,
        decode: bool = True,
        transform: Any = None,
        fields: Sequence[str] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        shuffle_window: int = 4,
        order: int = DEFAULT_ORDER,
        on_error: Literal["raise", "skip"] = "raise",
        copy: bool = False,
        io: str = "auto",
        output: Literal["torch", "numpy", None] = None,
        decode_threads: int | None = None,
        map: Any = None,
        collate_fn: Any = None,
        worker_mode: Literal["thread", "process"] = "thread",
        timeout: float = 0,
        decoder_factory: Any = None,
        persistent_workers: bool = False,
        generator: Any = None,
        worker_init_fn: Any = None,
        sampler: Any = None,
        batch_sampler: Any = None,
    ):
        t_start = time.perf_counter()  # the first batch's clock (`stats()["first_batch"]`)
        # torch's DataLoader arguments: what has a meaning here, and a ConfigError naming the gdsload
        # way for the rest (`gdsload.frontend.options.check_torch_habits`)
        seed = check_torch_habits(seed=seed, generator=generator, sampler=sampler, batch_sampler=batch_sampler,
                                  worker_init_fn=worker_init_fn, worker_mode=worker_mode,
                                  persistent_workers=persistent_workers)
        self.persistent_workers = persistent_workers  # accepted; see the class docstring
        self.options = opts = LoaderOptions.create(
            remote=False, batch_size=batch_size, shuffle=shuffle, drop_last=drop_last, seed=seed, rank=rank,
            world_size=world_size, shuffle_window=shuffle_window, decode=decode, transform=transform,
            fields=fields, on_error=on_error, output=output, device=device, copy=copy)
        t = time.perf_counter()
        self.dataset = open_source(dataset)
        if opts.read_fields is not None:
            self.dataset = self.dataset.select(opts.read_fields)
        t_open = time.perf_counter() - t
        self._stage = MapStage.create(  # map / collate_fn / worker_mode (None: none given)
            map, collate_fn, worker_mode)
        self.worker_mode = worker_mode
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
            raise GdsloadError(f"timeout must be a number of seconds >= 0 (0: wait forever), got {timeout!r}")
        self.timeout = float(timeout)  # for a batch from a process worker (gdsload.frontend.workers)
        if self._stage is not None:
            self._stage.timeout = self.timeout
            self._stage.worker_init_fn = worker_init_fn  # process workers (check_torch_habits)
        if type(num_workers) is int and num_workers == 0:  # reads in the loop's thread (`Epoch`): none ahead
            if prefetch_factor is not None:
                raise ConfigError(f"prefetch_factor needs reader threads (num_workers >= 1): with num_workers=0 "
                                  f"each batch is read in the loop's thread when next() asks for it, none ahead; "
                                  f"got prefetch_factor={prefetch_factor!r}")
            prefetch_factor = 1
        self._auto = {"prefetch": prefetch_factor == "auto", "workers": num_workers == "auto"}
        if any(self._auto.values()):  # imported only for "auto" (not on every loader's first-batch path)
            from gdsload.loader import autotune
        if self._auto["workers"]:  # reads block in the kernel: threads beyond the cores help
            num_workers = autotune.START_WORKERS
        if self._auto["prefetch"]:
            prefetch_factor = autotune.START_PREFETCH
        elif prefetch_factor is None:  # one batch ahead of the one in use when DALI decodes (above)
            prefetch_factor = 1 if decode and any(
                _fieldkinds.loader_kind(f, decode=True) == "image" for f in self.dataset.fields) else 2
        check_workers(num_workers, prefetch_factor)
        self._tuner = autotune.Tuner(self._auto["prefetch"], self._auto["workers"], prefetch_factor,
                                     num_workers, autotune.max_workers()) if any(self._auto.values()) else None
        self._num_workers = num_workers  # as configured; `Resources` holds the live values
        self._prefetch_factor = prefetch_factor
        self.pin_memory = pin_memory
        self.io_name = io
        # one DALI thread more than the cores: the synchronous runs leave cores idle at their
        # barriers and while a run's output is copied into the slot, and a spare thread fills
        # them (tier T, 2 cores, batch 64, photos: 2,211-2,275 img/s against 1,743-1,919 with 2
        # threads, 3 interleaved rounds; DALI's own pipeline measured the same with 2 or 3)
        self.decode_threads = decode_threads or (os.cpu_count() or 1) + 1
        self.decoder_factory = decoder_factory
        t = time.perf_counter()
        self.plan = self.dataset.make_plan(**opts.plan_args(), order=order)
        t_plan = time.perf_counter() - t
        self._order = order
        # rank and world size left to torch.distributed, which has no group yet: taken from the group
        # if one exists by the first len(), iter() or state call (`_bind_ranks`)
        self._ranks_pending = rank is None and world_size is None and dist_rank_world() is None
        self.cursor = Cursor()
        self._ctor_first = (t_start, t_open, t_plan)  # taken by `_init_process_local`
        self._start_process()

    # the options, as attributes (read-only views of `self.options`)
    batch_size = property(lambda self: self.options.batch_size)
    decode = property(lambda self: self.options.decode)
    transform = property(lambda self: self.options.transform)
    on_error = property(lambda self: self.options.on_error)
    copy = property(lambda self: self.options.copy)
    output = property(lambda self: self.options.output)
    device = property(lambda self: self.options.device)
    tuple_fields = property(lambda self: self.options.tuple_fields)

    @property
    def num_workers(self) -> int:
        """Reader threads now (`"auto"` may have added some)."""
        return self._resources.num_workers if self._resources is not None else self._num_workers

    @property
    def prefetch_factor(self) -> int:
        """Batches filled ahead now (`"auto"` may have grown the ring)."""
        return self._resources.prefetch if self._resources is not None else self._prefetch_factor

    @property
    def device_ordinal(self) -> int | None:
        """The GPU, resolved on first iteration (None on the CPU)."""
        return self._resources.device_ordinal if self._resources is not None else None

    def _init_process_local(self) -> None:
        self._layout = None  # BatchLayout, decided on first iteration
        self._resources = None  # Resources: backends, cache, ring, streams, decoder (per process)
        self._progress = None  # the Progress of the pass that handed out the last batch
        self._stats: dict[str, Any] = {}  # stats() after close
        self._cuda_lost = False  # forked from a parent in which this loader used CUDA
        # the first batch's stages (`stats()["first_batch"]`): from the constructor, or in a copy
        # made in another process (pickled, forked), from when it was made
        ctor = self.__dict__.pop("_ctor_first", None)
        self._first = FirstBatch(ctor[0] if ctor else time.perf_counter())
        if ctor:
            self._first.add("open", ctor[1])
            self._first.add("plan", ctor[2])

    def _enter_process(self) -> None:
        """Start afresh in a forked child; CUDA state does not survive a fork, so a loader that
        had CUDA memory or a GPU decoder in the parent is refused there with a clear error."""
        inherited = self._check_process()
        if inherited is not None and inherited["_resources"] is not None:
            res = inherited["_resources"]
            ring, decoder = res.ring, res._decoder
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
    # len(), set_epoch(), epoch, state_dict(), load_state_dict(): PlanCursor, over `self.cursor`
    def __len__(self) -> int:
        self._bind_ranks()
        return super().__len__()

    def state_dict(self) -> dict[str, Any]:
        self._bind_ranks()
        return super().state_dict()

    def load_state_dict(self, state: Any) -> None:
        self._bind_ranks()
        super().load_state_dict(state)

    def skip(self, n: int) -> None:
        """Skip the next `n` global steps of this epoch without reading or decoding them
        (`PlanCursor.skip`); during a pass the loop goes on with the batch after them (the pass
        restarts behind the same iterator: `gdsload.loader.epoch.Epoch.skip_to`)."""
        self._bind_ranks()
        super().skip(n)

    @property
    def sampler(self) -> Any:
        """None to give: a torch habit, answered (an AttributeError, so `getattr(loader, "sampler",
        None)` is None) with where gdsload's order comes from, and what a trainer that skips batches
        through the sampler on resume should do instead."""
        raise AttributeError(
            "gdsload.DataLoader has no sampler: the order is shuffle=/seed= and ranks take their slices by "
            "rank=/world_size=; it resumes by load_state_dict(), so nothing is skipped through a sampler "
            "(transformers.Trainer: override get_resumed_dataloader to return the loader, see "
            "gdsload.integrations.hf; accelerate: do not call skip_first_batches)")

    def _bind_ranks(self) -> None:
        """Rank and world size from a `torch.distributed` group initialised after this loader was
        built with neither given (a script that builds its loader before Lightning's DDP or the HF
        Trainer set the group up): the plan is made again for this rank, at the first `len()`,
        `iter()` or state call that finds the group. A loader that has read batches as rank 0 of 1
        by then is refused (`ConfigError`): its position belongs to another world size."""
        if not self.__dict__.get("_ranks_pending"):
            return
        dist = dist_rank_world()
        if dist is None:
            return
        self._ranks_pending = False
        opts = self.options
        if dist == (opts.rank, opts.world_size):
            return
        if self._resources is not None or self.cursor.position != 0:
            raise ConfigError(
                f"this loader was built before torch.distributed was initialised and read batches as rank 0 of "
                f"1; the process group now has {dist[1]} ranks: build the loader after init_process_group "
                f"(Lightning: in train_dataloader(); accelerate: after Accelerator()), or pass rank= and world_size=")
        self.options = dataclasses.replace(opts, rank=dist[0], world_size=dist[1])
        self.plan = self.dataset.make_plan(**self.options.plan_args(), order=self._order)
        self._layout = None

    # -- set-up, lazily on first iteration -----------------------------------------------------
    def batch_layout(self) -> Any:
        """The `gdsload.loader.layout.BatchLayout` of this loader's batches, decided once, before
        anything is allocated (the feed server sizes a stream's memory reservation from its
        `slot_nbytes` before the loader's first batch)."""
        self._bind_ranks()
        if self._layout is None:
            from gdsload.loader.layout import BatchLayout

            opts, plan = self.options, self.plan
            self._layout = BatchLayout.build(
                self.dataset, batch_size=opts.batch_size, samples_per_rank=-(-plan.num_samples // plan.world_size),
                decode=opts.decode, transform=opts.transform, on_device=opts.device == "cuda",
                media=opts.media_for)
        return self._layout

    def _setup(self) -> None:
        """On first iteration: the batch layout, then the resources sized for it; the image
        decoder's pipeline starts building in a thread (`Resources.build_decoder_async`)."""
        from gdsload.loader.resources import Resources

        opts, plan = self.options, self.plan
        t = time.perf_counter()
        layout = self.batch_layout()
        self._first.add("index", time.perf_counter() - t)
        self._resources = Resources.open(
            self.dataset, layout, device=opts.device, device_index=opts.device_index, io=self.io_name,
            num_workers=self._num_workers, prefetch=self._prefetch_factor, pin_memory=self.pin_memory,
            decode_threads=self.decode_threads, seed=plan.seed, on_error=opts.on_error, window=plan.window,
            output=opts.output, decoder_factory=self.decoder_factory)
        self._resources.first = self._first
        if layout.n_images:
            self._resources.build_decoder_async()

    # -- iteration -------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        return self.iter_batches()

    def iter_batches(self, max_batches: int | None = None, *, steps: Sequence[int] | None = None) -> Iterator[Any]:
        """`iter(loader)`, stopping after `max_batches` batches (None: the epoch's end). The
        readers read nothing past them (a server's stream of one striped block), and stopping
        there does not end the epoch: the cursor stays where the last batch left it.

        `steps`: instead, these steps of the cursor's epoch (batch indices, increasing), read
        ahead across gaps as if consecutive (a server's blocks of a stripe, `gdsload.service`);
        the cursor moves to the position after each batch handed out."""
        if max_batches is not None and max_batches < 1:
            raise ConfigError(f"max_batches must be >= 1 or None, got {max_batches!r}")
        if steps is not None:
            if not isinstance(steps, BlockSteps):  # (increasing by construction and never listed: a server's)
                steps = [int(s) for s in steps]
            n = len(self.plan)
            if (not steps or steps[0] < 0 or steps[-1] >= n
                    or (isinstance(steps, list) and any(b <= a for a, b in zip(steps, steps[1:])))):
                raise ConfigError(f"steps must be increasing batch indices in 0..{n - 1}, got "
                                  f"{len(steps)} from {steps[:1]} to {steps[-1:]}")
        self._enter_process()
        self._bind_ranks()
        active = self.cursor.live()
        if active is not None:
            active.close()
        self._first.iter_started()
        if self._resources is None:
            self._setup()
        from gdsload.loader.assemble import BatchAssembler

        res, opts = self._resources, self.options
        device = f"cuda:{res.device_ordinal}" if opts.device == "cuda" else "cpu"
        assembler = BatchAssembler(self._layout.fields, output=opts.output, device=device, copy=opts.copy,
                                   tuple_fields=opts.tuple_fields, resources=res)
        ep = Epoch(plan=self.plan, cursor=self.cursor, resources=res, layout=self._layout, source=self.dataset,
                   assembler=assembler, stage=self._stage, tuner=self._tuner, restart=self.__iter__,
                   max_batches=max_batches, steps=steps, first=self._first)
        self._progress = ep.progress
        return ep

    def stats(self) -> dict[str, Any]:
        """samples/s, bytes/s, data stall (seconds and fraction), ring occupancy, I/O and decode,
        per-stage times ("stages"); "cache" with a shard cache (read here, not per batch: its lock
        is the readers')."""
        out = self._stats_now() if self._resources is not None else dict(self._stats)
        if self._resources is not None and self._resources.cache is not None:
            out["cache"] = self._resources.cache.stats()
        return out

    def _stats_now(self) -> dict[str, Any]:
        """`stats()` from the counters of the pass that handed out the last batch (`Progress`)."""
        p = self._progress
        if p is None:
            return {}
        res, layout, opts = self._resources, self._layout, self.options
        el = max(p.t_last - p.t0, 1e-9)
        rs = res.ring.stats()
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
            **res.io_paths(),
            "ring_device": res.ring.device,
            "kvikio_error": _kvikio_error() if opts.device == "cuda" else None,
            "decode_device": res.decode_device if layout.n_images else None,
            "device": opts.device,
            "skipped": p.skipped,
            "verify": layout.verify_note,
            "prefetch_factor": res.prefetch,  # now: "auto" may have grown it (gdsload.loader.autotune)
            "num_workers": res.num_workers,
            "auto": ",".join(k for k, v in self._auto.items() if v) or None,
            "stages": p.stages.report(p.batches) if p.stages is not None else None,
            "first_batch": self._first.report(),
            "media": res.media_stats() or None,
        }

    def close(self) -> None:
        self._check_process()
        active = self.cursor.live()
        if active is not None:
            active.close()
        if self._resources is not None:  # what stats() reports after close
            self._stats = self._stats_now()
            cache_stats = self._resources.close()
            if cache_stats is not None:
                self._stats["cache"] = cache_stats
        self._resources = None
        self._layout = None

    def __del__(self, _finalizing=sys.is_finalizing) -> None:
        # `sys.is_finalizing` is bound at definition: at exit this module's globals may already be
        # None when a module-level loader is collected (seen: `'NoneType' object has no attribute
        # 'is_finalizing'` printed at exit)
        if _finalizing():  # at exit daemon threads are frozen, maybe holding the locks close()
            return  # takes (seen: a read-ahead thread's cache lock, a process hung); the OS frees fds and flocks
        try:
            self.close()
        except Exception:
            pass


def _kvikio_error() -> str | None:
    from gdsload.io import kvikio_import_error

    return kvikio_import_error()
