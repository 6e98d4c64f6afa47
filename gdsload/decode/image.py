"""Image decoding and training transforms with NVIDIA DALI, fed by `external_source`.

One `ImageDecoder` owns one DALI pipeline (built lazily on first use, so constructing a loader is
cheap); it is not thread-safe, so each producer thread keeps its own. Encoded bytes come in as
NumPy views of the ring's staging buffer (pinned host memory on a GPU host): nvJPEG and DALI parse
JPEG bitstreams on the host, so encoded images are never read straight into device memory.
`device="mixed"` decodes on the GPU (nvJPEG, the A100/H100 hardware decoder where present);
`device="cpu"` runs DALI's CPU decoders. The output of a batch is one uniform tensor
(N, C, H, W) or (N, H, W, C).

Corrupt input: DALI fails the whole batch and invalidates the pipeline. The decoder then rebuilds
it and decodes the batch's samples one at a time to find the bad ones; with `on_error="raise"`
(default) it raises `DecodeError` naming shard and key, with `on_error="skip"` it drops and
counts them, and the batch comes back smaller.

Processes: a DALI pipeline does not survive a fork. A forked child that destroys one it
inherited (dropping it, collecting it as garbage, or DALI's own shutdown at exit) waits on worker
threads that exist only in the parent and crashes. So in a forked child every pipeline this
module built is emptied (DALI then sees it as shut down) and its native part kept forever,
untouched; an `ImageDecoder` used in the child builds a pipeline of its own.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from gdsload.errors import GdsloadError, require

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


_BUILT: weakref.WeakSet = weakref.WeakSet()  # the DALI pipelines this process built


def _disown_inherited_pipelines() -> None:
    """In a forked child: never destroy the parent's pipelines (see the module docstring)."""
    for pipe in list(_BUILT):
        native = getattr(pipe, "_pipe", None)  # DALI's own handle; None reads as "shut down"
        if native is not None:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(native))  # never freed in this process
            pipe._pipe = None
    _BUILT.clear()


os.register_at_fork(after_in_child=_disown_inherited_pipelines)


class DecodeError(GdsloadError):
    """An image could not be decoded; the message names its shard and key."""


@dataclass(frozen=True)
class ImageTransform:
    """The standard training (or evaluation) transform, run inside DALI.

    train: random resized crop to `size` (area fraction `scale`, aspect `ratio`), horizontal flip
    with probability `flip`. eval (`train=False`): resize the shorter side to `resize`, center
    crop `size`. Then normalize with `mean`/`std` (in 0..1 units; None: no normalization), output
    `layout` and `dtype` ("float32", "float16" or "uint8"; uint8 skips normalization).
    `user_fn(images) -> images` adds DALI operations on the batch node before normalization.
    """

    size: int = 224
    train: bool = True
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    resize: int = 256
    flip: float = 0.5
    mean: tuple[float, float, float] | None = IMAGENET_MEAN
    std: tuple[float, float, float] | None = IMAGENET_STD
    layout: Literal["NCHW", "NHWC"] = "NCHW"
    dtype: Literal["float32", "float16", "uint8"] = "float32"
    user_fn: Callable[[Any], Any] | None = field(default=None, compare=False)

    def output_shape(self) -> tuple[int, int, int]:
        s = self.size
        return (3, s, s) if self.layout == "NCHW" else (s, s, 3)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled for spawned workers; a `user_fn` travels by reference, so it must be importable."""
        if self.user_fn is not None:
            try:
                pickle.dumps(self.user_fn)
            except Exception as exc:
                raise GdsloadError(
                    f"ImageTransform.user_fn {self.user_fn!r} cannot be pickled ({exc}), so this transform "
                    f"cannot go to a spawned or forkserver worker: define the function at module level"
                ) from exc
        return dict(self.__dict__)

    def to_spec(self) -> dict[str, Any]:
        """JSON form (for the gRPC feed); a user callable cannot travel and is left out."""
        return {k: getattr(self, k) for k in ("size", "train", "scale", "ratio", "resize", "flip",
                                              "mean", "std", "layout", "dtype")}


class ImageDecoder:
    """Decode + transform batches of encoded images with one DALI pipeline."""

    def __init__(self, transform: ImageTransform, *, batch_size: int, device: Literal["cpu", "mixed"] = "cpu",
                 device_id: int = 0,
                 threads: int = 2, seed: int = 0, on_error: Literal["raise", "skip"] = "raise"):
        if device not in ("cpu", "mixed"):
            raise ValueError(f"decode device must be 'cpu' or 'mixed', not {device!r}")
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', not {on_error!r}")
        self.transform = transform
        self.batch_size = batch_size
        self.device = device
        self.threads = threads
        self.seed = seed
        self.on_error = on_error
        self.device_id = device_id  # the GPU that "mixed" decodes on (the rank's own under torchrun)
        self.skipped = 0
        self._pipe = None
        self._pid = os.getpid()  # the process that built `_pipe`
        self._builds = 0

    def _build(self) -> None:
        require("nvidia.dali", extra="cpu", purpose="image decoding")
        from nvidia.dali import fn, pipeline_def, types

        t = self.transform
        dev = self.device

        @pipeline_def(batch_size=self.batch_size, num_threads=self.threads,
                      device_id=self.device_id if dev == "mixed" else None, seed=self.seed + 7919 * self._builds,
                      prefetch_queue_depth=1, exec_async=False, exec_pipelined=False)
        def pipe():
            enc = fn.external_source(name="encoded", dtype=types.UINT8, ndim=1)
            if t.train:
                img = fn.decoders.image_random_crop(enc, device=dev, output_type=types.RGB,
                                                    random_area=list(t.scale), random_aspect_ratio=list(t.ratio))
                img = fn.resize(img, size=(t.size, t.size))
            else:
                img = fn.decoders.image(enc, device=dev, output_type=types.RGB)
                img = fn.resize(img, resize_shorter=t.resize)
            if t.user_fn is not None:
                img = t.user_fn(img)
            mirror = fn.random.coin_flip(probability=t.flip) if t.train and t.flip > 0 else 0
            norm = t.mean is not None and t.dtype != "uint8"
            out_dtype = {"float32": types.FLOAT, "float16": types.FLOAT16, "uint8": types.UINT8}[t.dtype]
            return fn.crop_mirror_normalize(
                img, dtype=out_dtype, output_layout="CHW" if t.layout == "NCHW" else "HWC",
                crop=(t.size, t.size), mirror=mirror,
                mean=[255 * m for m in t.mean] if norm else [0.0],
                std=[255 * s for s in t.std] if norm and t.std else [1.0],
            )

        self._pipe = pipe()
        self._pipe.build()
        self._pid = os.getpid()
        _BUILT.add(self._pipe)
        self._builds += 1

    def _run(self, encoded: Sequence[np.ndarray]):
        if self._pipe is None or self._pid != os.getpid():
            self._build()
        self._pipe.feed_input("encoded", list(encoded))
        (out,) = self._pipe.run()
        return out

    def decode(self, encoded: Sequence[np.ndarray], names: Sequence[str]) -> tuple[Any, list[int]]:
        """Decode a batch; returns (DALI TensorList of the kept samples, indices kept).

        `names[i]` ("shard.tar:key") identifies sample i in error messages.
        """
        if not encoded:
            raise ValueError("decode() needs at least one sample")
        try:
            return self._run(encoded), list(range(len(encoded)))
        except RuntimeError:
            self._pipe = None  # DALI invalidates a pipeline after an operator error
        kept, bad = [], []
        for i, e in enumerate(encoded):
            try:
                self._run([e])
                kept.append(i)
            except RuntimeError as exc:
                self._pipe = None
                bad.append((i, exc))
        if bad and self.on_error == "raise":
            i, exc = bad[0]
            msg = str(exc).strip().splitlines()
            detail = next((line for line in msg if "rror" in line and "Critical" not in line), msg[0] if msg else "")
            raise DecodeError(
                f"cannot decode image {names[i]} ({len(bad)} bad in this batch): {detail.strip()[:200]}; "
                f"pass on_error='skip' to skip and count corrupt samples"
            ) from exc
        self.skipped += len(bad)
        if not kept:
            return None, []
        return self._run([encoded[i] for i in kept]), kept

    def copy_into(self, out, dst) -> None:
        """Copy a decoded batch into `dst[:len(out)]` (a ring slot: NumPy or CuPy).

        Must run before the pipeline's next `run()`, which reuses its output buffers. Host
        output is copied once, straight into the slot (`copy_to_external`); device output goes
        through `__cuda_array_interface__` into the CuPy slot.
        """
        n = len(out)
        if hasattr(dst, "__cuda_array_interface__"):
            import cupy

            dst[:n] = cupy.asarray(out.as_tensor())
            return
        target = dst[:n]
        shape = tuple(out.as_tensor().shape())
        if shape != target.shape or not target.flags.c_contiguous:
            raise ValueError(f"decoded batch has shape {shape}, the slot expects {target.shape}")
        out.copy_to_external(ctypes.c_void_p(target.ctypes.data))
