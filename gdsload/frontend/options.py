"""`LoaderOptions`: the options `DataLoader`, `RemoteLoader` and the feed server share, validated once.

Both loaders take the same batch, order and output options (`batch_size` ... `copy` below) and
build one `LoaderOptions` from them; the feed server maps a `BatchRequest` to the same object
(`gdsload.service.protocol.request`). An invalid option is a `ConfigError` (a `GdsloadError` and a
`ValueError`) naming the option, whichever loader was given it. Order options (`batch_size`,
`seed`, `shuffle_window`, ranks) are checked again by the plan, with `PlanError`, a `ValueError` too.

One difference is on purpose, and only here: the default **device**.
- `DataLoader` (`remote=False`): "cuda" when this host can put batches on a GPU (a CUDA device,
  CuPy, and for torch output a CUDA build of torch), else "cpu" (with a warning when a GPU is
  present but unusable). Takes "cpu", "cuda" or "cuda:N" (a torch.device too).
- `RemoteLoader` (`remote=True`): batches arrive in host memory and are copied to the GPU by torch,
  so "cuda" needs torch output and the default is "cuda" exactly when torch output has a CUDA
  torch. Takes "cpu" or "cuda".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gdsload.errors import ConfigError, GdsloadError

ON_ERROR = ("raise", "skip")
OUTPUTS = ("torch", "numpy")
META_FIELDS = ("__key__", "__source__")  # per-sample names in a batch, not read from shards


@dataclass(frozen=True)
class LoaderOptions:
    batch_size: int
    shuffle: bool
    drop_last: bool
    seed: int
    rank: int
    world_size: int
    shuffle_window: int
    decode: bool
    transform: Any  # an ImageTransform (decode=True), else None
    fields: tuple[str, ...] | None  # as asked (then batches are tuples), meta fields included
    on_error: str
    output: str  # "torch" | "numpy"
    device: str  # "cpu" | "cuda"
    device_index: int | None  # "cuda:N": N
    copy: bool
    # video/audio transforms: ((field or None, transform), ...); None applies to every field of
    # the transform's kind. A media field without one comes back as bytes.
    media: tuple = ()
    # the share group of a RemoteLoader (BatchRequest.share: see `check_share`); None: no sharing.
    # A local DataLoader has nobody to share with and is never given one.
    share: str | None = None

    @classmethod
    def create(
        cls,
        *,
        remote: bool,
        batch_size: int = 1,
        shuffle: bool = False,
        drop_last: bool = False,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        shuffle_window: int = 4,
        decode: bool = True,
        transform: Any = None,
        fields: Sequence[str] | None = None,
        on_error: str = "raise",
        output: str | None = None,
        device: Any = None,
        copy: bool = False,
        share: str | None = None,
    ) -> LoaderOptions:
        for name, value in (("shuffle", shuffle), ("drop_last", drop_last), ("decode", decode), ("copy", copy)):
            if not isinstance(value, bool):
                raise ConfigError(f"{name} must be True or False, got {value!r}")
        for name, value, least in (("batch_size", batch_size, 1), ("seed", seed, 0),
                                   ("shuffle_window", shuffle_window, 1)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{name} must be an int >= {least}, got {value!r}")
            if value < least:
                raise ConfigError(f"{name} must be >= {least}, got {value!r}")
        share = check_share(share)
        if on_error not in ON_ERROR:
            raise ConfigError(f"on_error must be 'raise' or 'skip', not {on_error!r}")
        if output is not None and output not in OUTPUTS:
            raise ConfigError(f"output must be 'torch', 'numpy' or None (torch where it imports), not {output!r}")
        if fields is not None:
            if isinstance(fields, (str, bytes)) or not all(isinstance(f, str) and f for f in fields):
                raise ConfigError(f"fields must be a list of field names such as ['jpg', 'cls'], got {fields!r}")
            fields = tuple(fields)
        transform, media = split_transforms(transform) if decode else (None, ())
        if decode and transform is None:
            from gdsload.decode.image import ImageTransform

            transform = ImageTransform()
        elif not decode:
            transform = None
        from gdsload.frontend.output import default_output
        from gdsload.host.dist import dist_rank_world

        output = default_output(output)
        dist = dist_rank_world()
        if rank is None:
            rank = dist[0] if dist else 0
        if world_size is None:
            world_size = dist[1] if dist else 1
        kind, index = (_remote_device if remote else _local_device)(device, output)
        return cls(batch_size=batch_size, shuffle=shuffle, drop_last=drop_last, seed=seed, rank=rank,
                   world_size=world_size, shuffle_window=shuffle_window, decode=decode, transform=transform,
                   fields=fields, on_error=on_error, output=output, device=kind, device_index=index, copy=copy,
                   media=media, share=share)

    def media_for(self, name: str, kind: str) -> Any:
        """The VideoTransform/AudioTransform for field `name` of `kind`, or None (bytes)."""
        for f, t in self.media:
            if f == name:
                return t
        return next((t for f, t in self.media if f is None and t.kind == kind), None)

    @property
    def read_fields(self) -> list[str] | None:
        """The fields read from shards (the asked ones without "__key__"/"__source__"), or None: all."""
        if self.fields is None:
            return None
        asked = set(self.fields)
        # "<video>.frames" / "<audio>.length" come with their field's transform, not from shards
        aux = {f for f in asked if f.rpartition(".")[2] in ("frames", "length") and f.rpartition(".")[0] in asked
               and self.media_for(f.rpartition(".")[0], "video" if f.endswith(".frames") else "audio") is not None}
        return [f for f in self.fields if f not in META_FIELDS and f not in aux]

    @property
    def tuple_fields(self) -> list[str] | None:
        return list(self.fields) if self.fields is not None else None

    def plan_args(self) -> dict[str, Any]:
        """The keyword arguments of `Plan`/`MixPlan` these options fix."""
        return dict(batch_size=self.batch_size, world_size=self.world_size, rank=self.rank, seed=self.seed,
                    shuffle=self.shuffle, window=self.shuffle_window, drop_last=self.drop_last)


#: Longest share name, in characters (BatchRequest.share).
MAX_SHARE_CHARS = 128


def check_share(share: Any) -> str | None:
    """A share name as given to `RemoteLoader(share=...)`: None (no sharing) or a string of 1 to
    `MAX_SHARE_CHARS` characters without control characters (it travels in every request and is
    echoed in server logs)."""
    if share is None:
        return None
    if not isinstance(share, str) or not share:
        raise ConfigError(f"share must be a non-empty name such as 'sweep-17' (or None), got {share!r}")
    if len(share) > MAX_SHARE_CHARS:
        raise ConfigError(f"share must be at most {MAX_SHARE_CHARS} characters, got {len(share)}")
    if any(not c.isprintable() for c in share):
        raise ConfigError(f"share must not contain control characters, got {share!r}")
    return share


def check_workers(num_workers: Any, prefetch_factor: Any) -> None:
    """`DataLoader`'s reader settings: `num_workers` an int >= 0 (0: no reader threads, each batch
    is read in the loop's thread when `next()` asks for it, as torch's `num_workers=0` reads in
    the main process), `prefetch_factor` an int >= 1 ("auto" for either is resolved by the caller
    first)."""
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise ConfigError(f"num_workers must be >= 0 (reader threads; 0: read in the loop's thread) or 'auto', "
                          f"got {num_workers!r}")
    if isinstance(prefetch_factor, bool) or not isinstance(prefetch_factor, int) or prefetch_factor < 1:
        raise ConfigError(f"prefetch_factor must be >= 1 or 'auto', got {prefetch_factor!r}")


#: torch DataLoader arguments with no meaning here, and the gdsload way instead (`check_torch_habits`).
GDSLOAD_WAY = {
    "sampler": "the order is shuffle= and seed= (a pure function of dataset, seed and epoch, resumable "
               "with state_dict()), ranks take their slices by rank=/world_size= (default: torch.distributed's), "
               "and gdsload.Mix([...], weights=...) weights datasets",
    "batch_sampler": "batches are batch_size= and drop_last= over the order of shuffle= and seed=; ranks by "
                     "rank=/world_size=; gdsload.Mix([...], mix_by='batch') gives each batch one dataset",
}


def check_torch_habits(*, seed: Any, generator: Any = None, sampler: Any = None, batch_sampler: Any = None,
                       worker_init_fn: Any = None, worker_mode: str = "thread", persistent_workers: Any = False) -> int:
    """The torch DataLoader arguments people bring, checked; returns the seed to use.

    - `sampler`, `batch_sampler`: refused (`ConfigError` naming the gdsload way, `GDSLOAD_WAY`).
    - `generator`: a `torch.Generator` (anything with `initial_seed()`) as the seed's source when
      `seed` is not given: the seed is `generator.initial_seed()`, the number `manual_seed(n)`
      set, read once (the generator is not advanced, so the same seeding gives the same order on
      every run, and a resumed run finds the state's seed again). Both given: refused.
      Neither: seed 0.
    - `worker_init_fn(worker_id)`: called in each worker process before its first batch
      (`worker_mode="process"`); thread workers have no process to set up: refused.
    - `persistent_workers`: True or False (validated; its effect is the loader's to say).
    """
    for name in ("sampler", "batch_sampler"):
        if locals()[name] is not None:
            raise ConfigError(f"{name} is not a gdsload.DataLoader option: {GDSLOAD_WAY[name]}")
    if not isinstance(persistent_workers, bool):
        raise ConfigError(f"persistent_workers must be True or False, got {persistent_workers!r}")
    if worker_init_fn is not None:
        if not callable(worker_init_fn):
            raise ConfigError(f"worker_init_fn must be a callable taking the worker id, got {worker_init_fn!r}")
        if worker_mode != "process":
            raise ConfigError("worker_init_fn runs in worker processes (worker_mode='process', with map= or "
                              "collate_fn=); reader threads have no process of their own: set things up once "
                              "before the loop instead")
        import pickle

        try:
            pickle.dumps(worker_init_fn)
        except Exception as exc:
            raise ConfigError(f"worker_init_fn runs in spawned processes, so it must be picklable (a module-level "
                              f"function, not a lambda or closure): {exc}") from exc
    if generator is not None:
        if seed is not None:
            raise ConfigError(f"give seed= or generator= (whose initial_seed() is then the seed), not both: "
                              f"seed={seed!r}")
        initial = getattr(generator, "initial_seed", None)
        if not callable(initial):
            raise ConfigError(f"generator must be a torch.Generator (its initial_seed() is the seed), "
                              f"got {type(generator).__name__}")
        return int(initial())
    return 0 if seed is None else seed


def _local_device(device: Any, output: str) -> tuple[str, int | None]:
    if isinstance(device, str) and device == "cpu":  # without importing gdsload.host.gpu (first batch)
        return "cpu", None
    from gdsload.host.gpu import parse_device

    try:
        return parse_device(device if device is not None else default_local_device(output))
    except ConfigError:
        raise
    except GdsloadError as exc:
        raise ConfigError(str(exc)) from None


def _remote_device(device: Any, output: str) -> tuple[str, int | None]:
    if device is None:
        from gdsload.frontend.output import torch_or_none

        torch = torch_or_none() if output == "torch" else None
        device = "cuda" if torch is not None and torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda") or (device == "cuda" and output != "torch"):
        raise ConfigError(f"device must be 'cpu', or 'cuda' with torch output, not {device!r}")
    return device, None


def default_local_device(output: str | None) -> str:
    """"cuda" when a device exists *and* the loader can use it; else "cpu", with a warning when a
    device exists (a CPU-only torch build, or no CuPy, on a GPU host)."""
    from gdsload.host.driver import cuda_device_count

    if cuda_device_count() < 1:
        return "cpu"
    why = None
    try:
        import cupy  # noqa: F401
    except Exception as exc:
        why = f"CuPy does not import ({type(exc).__name__}: {exc})"
    if why is None and output == "torch":
        from gdsload.frontend.output import torch_or_none

        torch = torch_or_none()
        if torch is not None and not torch.cuda.is_available():
            why = f"torch {torch.__version__} has no CUDA (torch.cuda.is_available() is False)"
    if why is None:
        return "cuda"
    import warnings

    warnings.warn(f"a CUDA device is present but {why}; gdsload uses device='cpu' (pass "
                  f"device='cuda' to insist)", RuntimeWarning, stacklevel=4)
    return "cpu"


def split_transforms(transform: Any) -> tuple[Any, tuple]:
    """`transform=` as (the image transform or None, the media transforms): one transform, or a
    dict field -> transform (`{"jpg": ImageTransform(), "mp4": VideoTransform()}`)."""
    def media_kind(t: Any) -> str | None:
        return getattr(type(t), "kind", None) if type(t).__name__ in ("VideoTransform", "AudioTransform") else None

    def check_image(t: Any, where: str) -> Any:
        if not callable(getattr(t, "output_shape", None)) or media_kind(t):
            raise ConfigError(f"{where} must be a gdsload.ImageTransform, VideoTransform or AudioTransform, "
                              f"got {t!r}")
        return t

    if transform is None:
        return None, ()
    if media_kind(transform):
        return None, ((None, transform),)
    if not isinstance(transform, dict):
        return check_image(transform, "transform"), ()
    image, media = None, []
    for name, t in transform.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"transform={{...}} keys must be field names, got {name!r}")
        if media_kind(t):
            media.append((name, t))
            continue
        check_image(t, f"transform[{name!r}]")
        if image is not None and t != image:
            raise ConfigError(f"transform[{name!r}] differs from another image field's: a loader's image "
                              f"fields share one ImageTransform")
        image = t
    return image, tuple(media)
