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

Oversized input: before anything is decoded, every image's width and height are read from its
header (`imagesize`, microseconds per image); one over `ImageTransform.max_pixels` (default
8192 x 8192, about 200 MB decoded as RGB) is handled by the same `on_error` policy, so a
16000 x 16000 JPEG never makes DALI allocate gigabytes. Images whose header cannot be read are
left to DALI (it refuses them as corrupt, or decodes them).

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

from gdsload.errors import DecodeError  # noqa: F401 (re-exported: defined in errors.py)
from gdsload.decode.imagesize import image_size
from gdsload.errors import GdsloadError, require

MAX_PIXELS = 8192 * 8192  # default input limit per image: about 200 MB once decoded to RGB
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


def dali_reason(exc: BaseException, limit: int = 1000) -> str:
    """DALI's error as one line: the operator and what it encountered, without the pipeline
    traceback and the "no longer valid" trailer (the first line alone, "Error in CPU operator
    `...`,", stops mid-sentence). Cut at a word, with "...", past `limit` characters."""
    import re

    text = str(exc)
    op = re.search(r"operator `([^`]+)`", text)
    _, found, tail = text.partition("encountered:")
    lines = [line.strip() for line in (tail if found else text).splitlines()]
    what = " ".join(line for line in lines
                    if line and "no longer valid" not in line and not line.startswith("Critical error"))
    what = what or text.strip() or type(exc).__name__
    if op and found:
        what = f"{op.group(1)} failed: {what}"
    if len(what) > limit:
        what = what[:limit].rsplit(" ", 1)[0] + " ..."
    return what


@dataclass(frozen=True)
class ImageTransform:
    """The standard training (or evaluation) transform, run inside DALI.

    train: random resized crop to `size` (area fraction `scale`, aspect `ratio`), horizontal flip
    with probability `flip`. eval (`train=False`): resize the shorter side to `resize`, center
    crop `size`. Then normalize with `mean`/`std` (in 0..1 units; None: no normalization), output
    `layout` and `dtype` ("float32", "float16" or "uint8"; uint8 skips normalization).
    `user_fn(images) -> images` adds DALI operations on the batch node before normalization.
    `max_pixels`: the largest input image (width x height) decoded; larger ones are refused before
    decoding, by the `on_error` policy (None: no limit). A server keeps its own limit: it is not
    part of the feed's transform spec.
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
    max_pixels: int | None = MAX_PIXELS

    def __post_init__(self) -> None:
        if self.max_pixels is not None and (not isinstance(self.max_pixels, int) or self.max_pixels < 1):
            raise ValueError(f"max_pixels must be a positive number of pixels or None, not {self.max_pixels!r}")

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


RUN_SIZE = 64  # images per DALI run: a loader's batch is decoded in runs of at most this many


class ImageDecoder:
    """Decode + transform batches of encoded images with one DALI pipeline.

    `decode_into` decodes a loader's batch in runs of at most `RUN_SIZE` images, each copied into
    its rows of the slot. DALI keeps buffers sized for its largest run (decoded crops, resized
    images, the float32 output), so runs of 64 rather than one run of the whole batch held 289 MB
    less at batch 256 on the ImageNet-like set, at the same speed (769 vs 1,058 MB peak RSS,
    853-1,055 vs 916-1,109 img/s; a standalone pipeline, 2 threads, 2 rounds; 128: 845 MB).
    """

    def __init__(self, transform: ImageTransform, *, batch_size: int, device: Literal["cpu", "mixed"] = "cpu",
                 device_id: int = 0,
                 threads: int = 2, seed: int = 0, on_error: Literal["raise", "skip"] = "raise"):
        if device not in ("cpu", "mixed"):
            raise ValueError(f"decode device must be 'cpu' or 'mixed', not {device!r}")
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', not {on_error!r}")
        self.transform = transform
        self.batch_size = batch_size
        self.run_size = min(batch_size, RUN_SIZE)  # the pipeline's batch size
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
        require("nvidia.dali", extra="cpu" if self.device == "cpu" else "cuda12", purpose="image decoding")
        from nvidia.dali import fn, pipeline_def, types

        t = self.transform
        dev = self.device

        # Not DALI's async/pipelined executor: tried (exec_async, exec_pipelined, the dynamic
        # executor, the slot copy moved out of the decode turn) on 2 CPU cores it gave 196-211 vs
        # 214-270 img/s and 614-639 vs 522 MB peak RSS (tier T, batch 64, 3 interleaved rounds):
        # decoding already has every core, and reads of later batches overlap it in other threads.
        # Again on 2026-12-03 (standalone, photos, batch 256): one synchronous run of 256 gave
        # 2106-2146 img/s and 726 MB; async, 2 deep, in runs of 64 or 128 gave 1624-2001 img/s.
        # And fed a run ahead by a decode thread, each output copied while DALI ran the next (the
        # pipelined executor, 2 output buffers): in the loader 0.85-0.93x DALI's own pipeline
        # against 0.84-0.98x for this one (medians of 5 rounds; photos at batch 64, ImageNet-like
        # at 64 and 256), 34-37 MB more: with 2 ring slots there is rarely a batch to feed ahead.
        @pipeline_def(batch_size=self.run_size, num_threads=self.threads,
                      device_id=self.device_id if dev == "mixed" else None, seed=self.seed + 7919 * self._builds,
                      prefetch_queue_depth=1, exec_async=False, exec_pipelined=False)
        def pipe():
            # no_copy: DALI reads the encoded bytes where they are (the slot's staging), not a copy
            # of them; they stay untouched until the batch is consumed, long after the one run
            # (prefetch_queue_depth=1) that reads them. feed_input: 7-8 instead of 11-12 µs per
            # image (photos ~35 KB, batch 64, 3 rounds), a small part of the ~1,300 µs decoding.
            enc = fn.external_source(name="encoded", dtype=types.UINT8, ndim=1, no_copy=True)
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

    def build(self) -> None:
        """Build the DALI pipeline now rather than at the first decode (the loader builds it in a
        thread while its first batch is planned and read); a no-op once built in this process."""
        if self._pipe is None or self._pid != os.getpid():
            self._build()

    def _run(self, encoded: Sequence[np.ndarray]):
        if self._pipe is None or self._pid != os.getpid():
            self._build()
        self._pipe.feed_input("encoded", list(encoded))
        (out,) = self._pipe.run()
        return out

    def decode_into(self, encoded: Sequence[np.ndarray], names: Sequence[str], dst: Any, *,
                    stream: Any = None) -> list[int]:
        """Decode a batch into `dst` (a ring slot's image tensor), `run_size` images per DALI run;
        returns the indices kept, whose images are `dst[:len(kept)]` in order."""
        kept_all: list[int] = []
        for a in range(0, len(encoded), self.run_size):
            out, kept = self.decode(encoded[a : a + self.run_size], names[a : a + self.run_size])
            if out is not None:
                self.copy_into(out, dst[len(kept_all):], stream=stream)
            kept_all += [a + k for k in kept]
        return kept_all

    def decode(self, encoded: Sequence[np.ndarray], names: Sequence[str]) -> tuple[Any, list[int]]:
        """Decode up to `run_size` images; returns (DALI TensorList of the kept samples, indices
        kept). Its buffers are reused by the next run: copy out first (`copy_into`).

        `names[i]` ("shard.tar:key") identifies sample i in error messages.
        """
        if not encoded:
            raise ValueError("decode() needs at least one sample")
        limit = self.transform.max_pixels
        if limit is None:
            return self._decode(encoded, names)
        over = []
        for i, e in enumerate(encoded):
            size = image_size(e)
            if size is not None and size[0] * size[1] > limit:
                over.append((i, size))
        if not over:
            return self._decode(encoded, names)
        if self.on_error == "raise":
            i, (w, h) = over[0]
            raise DecodeError(
                f"image {names[i]} is {w} x {h} pixels, over the limit of {limit} "
                f"(ImageTransform(max_pixels=...)); not decoded ({len(over)} such in this batch); "
                f"pass on_error='skip' to skip and count such samples"
            )
        self.skipped += len(over)
        refused = {i for i, _ in over}
        rest = [i for i in range(len(encoded)) if i not in refused]
        if not rest:
            return None, []
        out, kept = self._decode([encoded[i] for i in rest], [names[i] for i in rest])
        return out, [rest[k] for k in kept]

    def _decode(self, encoded: Sequence[np.ndarray], names: Sequence[str]) -> tuple[Any, list[int]]:
        """`decode` without the pixel limit: DALI first, one by one to find corrupt samples."""
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
            raise DecodeError(
                f"cannot decode image {names[i]} ({len(bad)} bad in this batch): {dali_reason(exc)}",
                remedy="pass on_error='skip' to skip and count corrupt samples",
            ) from exc
        self.skipped += len(bad)
        if not kept:
            return None, []
        return self._run([encoded[i] for i in kept]), kept

    def copy_into(self, out, dst, *, stream: Any = None) -> None:
        """Copy a decoded batch into `dst[:len(out)]` (a ring slot: NumPy for "cpu", CuPy for
        "mixed"), completed when this returns.

        It must be complete before the pipeline's next `run()`, which reuses its output buffers:
        DALI 2.4 with `exec_async=False, prefetch_queue_depth=1` calls `release_outputs()` at the
        start of the next run (pipeline.py `_run_once`) and reruns on its own non-blocking streams,
        and a TensorGPU's `__cuda_array_interface__` is version 2 (no stream key), so nothing would
        order a CuPy copy on the legacy stream against it. Hence device output goes through
        `TensorListGPU.copy_to_external(ptr, cuda_stream=stream, non_blocking=False)`: ordered
        after DALI's work on its buffer, on `stream` (the loader's private copy stream, a
        `ctypes.c_void_p`; None is the default stream), and waited for. Host output is copied
        once, straight into the slot. A host slot never receives device output (that was a
        GPU -> host -> GPU round trip; "mixed" decodes into a device slot).
        """
        n = len(out)
        target = dst[:n]
        on_device = hasattr(dst, "__cuda_array_interface__")
        if on_device != (self.device == "mixed"):
            raise ValueError(f"a {'device' if on_device else 'host'} slot cannot take the output of "
                             f"{self.device!r} decoding")
        shapes = out.shape()  # per sample; as_tensor() would refuse a non-contiguous TensorList
        shape = (len(out), *shapes[0]) if shapes and all(tuple(x) == tuple(shapes[0]) for x in shapes) else None
        if on_device:
            cai = target.__cuda_array_interface__
            contiguous = cai.get("strides") is None
            address = cai["data"][0]
        else:
            contiguous = target.flags.c_contiguous
            address = target.ctypes.data
        if shape != target.shape or not contiguous:
            raise ValueError(f"decoded batch has shape {shape}, the slot expects {target.shape}")
        if on_device:
            out.copy_to_external(ctypes.c_void_p(address), cuda_stream=stream, non_blocking=False)
        else:
            out.copy_to_external(ctypes.c_void_p(address))
