"""Video clips: `VideoTransform` and the `VideoDecoder` a loader runs per batch.

Per sample: the clip's source frame indices (`gdsload.decode.media.clip_indices`, positions drawn
from the seeded plan), refused before any decoding when the video's frame count or frame size is
over the transform's limits (`max_frames`, `max_pixels`: from the index, probed at conversion).
Decoding on a CPU host (`device="cpu"`): DALI's `fn.decoders.video(device="cpu")` for VP8, VP9
and MJPEG, which its CPU build decodes, with the frame list as a per-sample argument; PyAV (the
`media` extra) for H.264, HEVC and the rest, decoding from the keyframe before the clip (a
constant-frame-rate stream; others from the stream's start) to the last frame wanted (decode
amplification: frames decoded / frames returned, in `stats`). Frames are counted in
presentation order, as both decoders return them; indices are positions, not timestamps, so a
variable-frame-rate video is sampled by frame count, not by time. 10-bit video comes out as
8-bit RGB; full-range (JPEG) video is converted with its range; rotation metadata is ignored.

Then one crop window per clip, the same for all its frames (train: random resized crop with
`ImageTransform`'s scale and ratio, and a flip; eval: the short side resized, centre crop),
resized to `size` and normalised in one DALI pipeline on the frames as a sequence ("FHWC").
`dtype="uint8"` with `size=None` returns the decoded frames untouched (every video of the
dataset must then have one frame size). Padding frames (index -1) are zeros in the output.

GPU hosts (`device="mixed"`, audit 4 R11): NVDEC's frames never visit the host. The videos this
GPU's NVDEC takes (H.264, HEVC, VP8, VP9, AV1, MPEG-4 by codec, bit depth and size from the index,
against `gdsload.host.gpu.nvdec_caps`, probed once per process) go through ONE mixed DALI pipeline,
one video per sample, all on the GPU after the demux:
`fn.decoders.video(device="mixed", frames=...)` (NVDEC decodes the sorted, unique frames the clips
need: the CPU path's list, each frame once in stream order however the clips overlap) ->
`fn.resize` with the row's relative crop window as `roi_start`/`roi_end` ->
`fn.sequence_rearrange` (the clips' frames back to back, repeats allowed) ->
`fn.crop_mirror_normalize` (dtype, mean/std, flip, "CFHW" or "FHWC") -> with several clips a
`fn.reshape` to (clips, T, H, W, C), and for "NCTHW" a `fn.transpose` to (clips, C, T, H, W).
The crop window needs only the frame size and the draws (`crop_roi`), and the index holds width
and height, so nothing is decoded to choose it. The output goes into the caller's device memory
(the ring's device slot) with `copy_to_external` on the loader's private stream (a
`ctypes.c_void_p`, as images do, `gdsload.decode.image`): one copy for a batch whose NVDEC rows
are consecutive, one per row otherwise, complete when it returns (DALI reuses its output
buffers on the next run). A padding position (index -1) takes the clip's last real frame and is
zeroed afterwards in the slot by `cudaMemsetAsync` on the same stream, so padding is zeros as on
the CPU path (a memset rather than a mask multiply in the graph: only padded rows pay, and DALI's
CPU arithmetic, on which the tests run this graph, has no float16). What NVDEC does not take, by
the probe or by refusing it at decode time (a chroma the index does not record), is decoded by
PyAV, cropped by the CPU pipeline into host memory (the ring's pinned "__h_" field, `host=`) and
copied to its rows on the same stream: the only host-to-device copy, for those rows only.
`routes` counts samples per decoder ("nvdec", "dali-cpu", "pyav"). Shapes, dtypes and layouts
are the CPU path's; values may differ from it by the GPU kernels' rounding (not yet compared on
a GPU: bench/gpu_check.sh's video step checks NVDEC's frames against PyAV's). A host `dst` is
refused with `device="mixed"`: that would be the round trip.

NVDEC's host thread pool is built with `affine=False`. DALI's default (`affine=True`) has each of
its threads call `nvml::SetCPUAffinity`, restricting it to the CPUs NVML reports as close to the
GPU; a loader shares the host's cores with its reader threads, PyAV's pool and the training
process, and a container's cgroup/cpuset decides which cores it may use, so the OS scheduler
places these threads instead (they demux and feed NVDEC; the decoding itself is on the GPU).

Threads: the decoder may be called from several reader threads; its DALI pipelines each run
under a lock, PyAV decodes outside it. Corrupt media follow `on_error` naming shard and key.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from gdsload.decode.media import (
    DALI_CPU_VIDEO,
    NVDEC_VIDEO,
    clip_indices,
    crop_roi,
    probe,
    rgb24_scaler,
)
from gdsload.errors import DecodeError, require

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
MAX_FRAMES = 100_000  # default source-length limit: ~55 min at 30 fps
MAX_PIXELS = 3840 * 2160  # default frame-size limit: 4K UHD
SALT = 0x7669  # draws(...) salt of video clips


@dataclass(frozen=True)
class VideoTransform:
    """Clips of `frames` decoded frames `stride` apart, `clips` per video (see the module
    docstring for sampling, crops and limits). Batch shape (N, C, T, H, W) for `layout="NCTHW"`
    ((N, T, H, W, C) for "NTHWC"), with a clips axis after N when `clips > 1`; the source frame
    indices go under `"<field>.frames"` ((N, T) or (N, clips, T), -1 for padding)."""

    frames: int = 16
    stride: int = 2
    clips: int = 1
    sampling: Literal["random", "uniform", "center"] = "random"
    size: int | None = 224
    train: bool = True
    dtype: Literal["float32", "float16", "uint8"] = "float32"
    layout: Literal["NCTHW", "NTHWC"] = "NCTHW"
    max_pixels: int | None = MAX_PIXELS
    max_frames: int | None = MAX_FRAMES
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    resize: int = 256
    flip: float = 0.5
    mean: tuple[float, float, float] | None = IMAGENET_MEAN
    std: tuple[float, float, float] | None = IMAGENET_STD

    kind = "video"

    def __post_init__(self) -> None:
        for name in ("frames", "stride", "clips"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"VideoTransform({name}={v!r}): a positive integer is needed")
        if self.sampling not in ("random", "uniform", "center"):
            raise ValueError(f"VideoTransform(sampling={self.sampling!r}): 'random', 'uniform' or 'center'")
        if self.layout not in ("NCTHW", "NTHWC"):
            raise ValueError(f"VideoTransform(layout={self.layout!r}): 'NCTHW' or 'NTHWC'")
        if self.dtype not in ("float32", "float16", "uint8"):
            raise ValueError(f"VideoTransform(dtype={self.dtype!r}): 'float32', 'float16' or 'uint8'")
        if self.size is None and self.dtype != "uint8":
            raise ValueError("VideoTransform(size=None) returns frames untouched: it needs dtype='uint8'")
        for name in ("max_pixels", "max_frames"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"VideoTransform({name}={v!r}): a positive integer or None")

    def output_shape(self, hw: tuple[int, int] | None = None) -> tuple[int, ...]:
        """One sample's shape; `hw`: the dataset's frame size, needed when `size` is None."""
        h, w = (self.size, self.size) if self.size is not None else hw
        per = (3, self.frames, h, w) if self.layout == "NCTHW" else (self.frames, h, w, 3)
        return per if self.clips == 1 else (self.clips, *per)

    def frames_shape(self) -> tuple[int, ...]:
        return (self.frames,) if self.clips == 1 else (self.clips, self.frames)

    def to_spec(self) -> dict[str, Any]:
        """JSON form (for the gRPC feed)."""
        return {"kind": "video", **{k: getattr(self, k) for k in self.__dataclass_fields__}}


class VideoDecoder:
    """Decodes a loader's batch of one video field (`decode_into`); see the module docstring."""

    def __init__(self, transform: VideoTransform, *, batch_size: int, threads: int = 2,
                 on_error: Literal["raise", "skip"] = "raise", device: Literal["cpu", "mixed"] = "cpu",
                 device_id: int = 0):
        if device not in ("cpu", "mixed"):
            raise ValueError(f"VideoDecoder(device={device!r}): 'cpu' or 'mixed'")
        self.t = transform
        # "mixed": NVDEC rows decoded, cropped and normalised by one mixed DALI pipeline straight
        # into device memory (module docstring); the rest on the CPU. Not yet run on a GPU here:
        # bench/gpu_check.sh's video step is what checks it (docs/training/media.md, "Video").
        self.device = device
        self.device_id = device_id
        self.batch_size = batch_size
        self.threads = threads
        self.on_error = on_error
        self.skipped = 0
        self.frames_decoded = 0  # decode amplification: frames_decoded / frames_returned
        self.frames_returned = 0
        self.routes: dict[str, int] = {}  # samples per decoder: "nvdec", "dali-cpu", "pyav"
        self._dec = self._xf = None  # the CPU pipelines: decoder ("cpu" only) and crop
        self._cpu_pid: int | None = None  # the process that built them (None: build again)
        self._gpu = None  # the mixed pipeline (NVDEC -> resize -> crop_mirror_normalize)
        self._gpu_key: tuple | None = None  # (process, slot row shape) it was built for
        self._lock = threading.Lock()
        self._pool = None  # PyAV decodes, `threads` at a time

    # -- CPU pipelines (built on first use, one lock each run) -------------------------------
    def _pipes(self) -> None:
        if self._cpu_pid == os.getpid():
            return
        require("nvidia.dali", extra="cpu" if self.device == "cpu" else "cuda12", purpose="video decoding")
        from nvidia.dali import fn, pipeline_def, types

        from gdsload.decode.image import _BUILT

        t = self.t

        @pipeline_def(batch_size=self.batch_size, num_threads=self.threads, device_id=None,
                      prefetch_queue_depth=1, exec_async=False, exec_pipelined=False)
        def dec():
            enc = fn.external_source(name="enc", dtype=types.UINT8, ndim=1)
            idx = fn.external_source(name="idx", dtype=types.INT32, ndim=1)
            return fn.decoders.video(enc, device="cpu", frames=idx)

        @pipeline_def(batch_size=self.batch_size * t.clips, num_threads=self.threads, device_id=None,
                      prefetch_queue_depth=1, exec_async=False, exec_pipelined=False)
        def xf():
            x = fn.external_source(name="x", dtype=types.UINT8, ndim=4, layout="FHWC")
            r0 = fn.external_source(name="r0", dtype=types.FLOAT, ndim=1)
            r1 = fn.external_source(name="r1", dtype=types.FLOAT, ndim=1)
            m = fn.external_source(name="m", dtype=types.INT32, ndim=0)
            y = fn.resize(x, size=[t.size, t.size], roi_start=r0, roi_end=r1, roi_relative=True)
            norm = t.mean is not None and t.dtype != "uint8"
            out = {"float32": types.FLOAT, "float16": types.FLOAT16, "uint8": types.UINT8}[t.dtype]
            return fn.crop_mirror_normalize(
                y, dtype=out, output_layout="CFHW" if t.layout == "NCTHW" else "FHWC", mirror=m,
                mean=[255 * v for v in t.mean] if norm else [0.0],
                std=[255 * v for v in t.std] if norm and t.std else [1.0])

        # "mixed" decodes on NVDEC (the mixed pipeline) or with PyAV: no CPU DALI decoder then
        self._dec = dec() if self.device == "cpu" else None
        self._xf = xf() if t.size is not None else None
        for p in (self._dec, self._xf):
            if p is not None:
                p.build()
                _BUILT.add(p)
        self._cpu_pid = os.getpid()

    def _dali_decode(self, items: list[tuple[int, np.ndarray, np.ndarray]]) -> dict[int, Any]:
        """{row: (k, H, W, 3) uint8 or the exception} for rows DALI's CPU decoder takes."""
        out: dict[int, Any] = {}
        if not items:
            return out
        with self._lock:
            self._pipes()
            try:
                self._dec.feed_input("enc", [e for _, e, _ in items])
                self._dec.feed_input("idx", [w.astype(np.int32) for _, _, w in items])
                (res,) = self._dec.run()
                for k, (i, _, _) in enumerate(items):
                    out[i] = np.array(res[k])
                return out
            except RuntimeError:
                self._cpu_pid = None  # DALI invalidates a pipeline after an operator error
            for i, e, w in items:  # one by one, to name the bad ones
                try:
                    self._pipes()
                    self._dec.feed_input("enc", [e])
                    self._dec.feed_input("idx", [w.astype(np.int32)])
                    (res,) = self._dec.run()
                    out[i] = np.array(res[0])
                except RuntimeError as exc:
                    from gdsload.decode.image import dali_reason

                    self._cpu_pid = None
                    out[i] = ValueError(dali_reason(exc))
        return out

    # -- the mixed pipeline (GPU hosts; module docstring) -----------------------------------------
    def _gpu_graph(self, row_shape: tuple[int, ...], device_id: int | None) -> Any:
        """The mixed pipeline for slot rows of `row_shape`, built: NVDEC (the sorted unique frames)
        -> resize (roi) -> sequence_rearrange (the clips' frames back to back) ->
        crop_mirror_normalize (-> reshape [+ transpose] for several clips); one video per sample."""
        from nvidia.dali import fn, pipeline_def, types

        t = self.t
        ncthw = t.layout == "NCTHW"

        @pipeline_def(batch_size=self.batch_size, num_threads=self.threads, device_id=device_id,
                      prefetch_queue_depth=1, exec_async=False, exec_pipelined=False)
        def gpu():
            enc = fn.external_source(name="enc", dtype=types.UINT8, ndim=1)
            idx = fn.external_source(name="idx", dtype=types.INT32, ndim=1)
            order = fn.external_source(name="order", dtype=types.INT32, ndim=1)
            # affine=False: the OS places NVDEC's host threads (module docstring)
            x = fn.decoders.video(enc, device="mixed", frames=idx, affine=False)  # (k, H, W, 3) "FHWC"
            one = t.clips == 1
            if t.size is not None:
                r0 = fn.external_source(name="r0", dtype=types.FLOAT, ndim=1)
                r1 = fn.external_source(name="r1", dtype=types.FLOAT, ndim=1)
                m = fn.external_source(name="m", dtype=types.INT32, ndim=0)
                x = fn.resize(x, size=[t.size, t.size], roi_start=r0, roi_end=r1, roi_relative=True)
            x = fn.sequence_rearrange(x, new_order=order)  # the clips back to back: (clips*T, h, w, 3)
            if t.size is not None:
                norm = t.mean is not None and t.dtype != "uint8"
                out = {"float32": types.FLOAT, "float16": types.FLOAT16, "uint8": types.UINT8}[t.dtype]
                x = fn.crop_mirror_normalize(
                    x, dtype=out, output_layout="CFHW" if ncthw and one else "FHWC", mirror=m,
                    mean=[255 * v for v in t.mean] if norm else [0.0],
                    std=[255 * v for v in t.std] if norm and t.std else [1.0])
            elif ncthw and one:
                x = fn.transpose(x, perm=[3, 0, 1, 2])  # FHWC -> CFHW
            if not one:  # (clips*T, H, W, C) -> (clips, T, H, W, C) (no copy) [-> (clips, C, T, H, W)]
                h, w = row_shape[-2:] if ncthw else row_shape[-3:-1]
                x = fn.reshape(x, shape=[t.clips, t.frames, h, w, 3])
                if ncthw:
                    x = fn.transpose(x, perm=[0, 4, 1, 2, 3])
            return x

        p = gpu()
        p.build()
        return p

    def _build_gpu(self, row_shape: tuple[int, ...]) -> Any:
        """The mixed pipeline on this decoder's GPU (tests/gpu_fakes.py runs `_gpu_graph` on the CPU)."""
        require("nvidia.dali", extra="cuda12", purpose="video decoding on the GPU")
        return self._gpu_graph(row_shape, self.device_id)

    def _gpu_items(self, rows: list[int], encoded: Sequence[np.ndarray], plans: dict, u: np.ndarray) -> list[dict]:
        """Per NVDEC row, the mixed pipeline's inputs: the encoded video, the frames to decode (the
        CPU path's: sorted, unique), where each clip position takes its frame from (a padding
        position the clip's last real frame, zeroed later), and the crop window from the
        index's frame size and the draws."""
        t = self.t
        items = []
        for i in rows:
            idx, wanted, meta = plans[i]
            frames = idx.copy()
            for c in range(t.clips):
                valid = frames[c] >= 0
                frames[c][~valid] = frames[c][valid][-1]
            item = {"enc": encoded[i], "idx": wanted.astype(np.int32),
                    "order": np.searchsorted(wanted, frames.reshape(-1)).astype(np.int32)}
            if t.size is not None:
                a, b = crop_roi(int(meta["height"]), int(meta["width"]), t.train, t.scale, t.ratio, t.size, t.resize,
                                u[i, 1:5])
                item.update(r0=np.array(a, np.float32), r1=np.array(b, np.float32),
                            m=np.array(int(t.train and u[i, 5] < t.flip), np.int32))
            items.append(item)
        return items

    def _gpu_decode(self, rows: list[int], encoded: Sequence[np.ndarray], plans: dict, u: np.ndarray, dst: Any,
                    stream: ctypes.c_void_p | None) -> dict[int, Exception | None]:
        """Rows `rows` through the mixed pipeline into `dst`'s rows: {row: None (written) or the
        exception}. A failed batch is retried sample by sample (DALI invalidates a pipeline after
        an operator error), to name the bad ones and keep the rest."""
        out: dict[int, Exception | None] = {}
        if not rows:
            return out
        items = self._gpu_items(rows, encoded, plans, u)
        with self._lock:
            try:
                self._gpu_run(items, rows, dst, stream)
                out = dict.fromkeys(rows)
            except RuntimeError:
                self._gpu = None
                from gdsload.decode.image import dali_reason

                for i, item in zip(rows, items):
                    try:
                        self._gpu_run([item], [i], dst, stream)
                        out[i] = None
                    except RuntimeError as exc:
                        self._gpu = None
                        out[i] = ValueError(dali_reason(exc))
        self._zero_padding([i for i in rows if out[i] is None], plans, dst, stream)
        return out

    def _gpu_run(self, items: list[dict], rows: list[int], dst: Any, stream: ctypes.c_void_p | None) -> None:
        """One run of the mixed pipeline, its output copied into `dst`'s `rows` on `stream`
        (`copy_to_external`, complete when this returns: the next run reuses DALI's buffers)."""
        row_shape = tuple(dst.shape[1:])
        key = (os.getpid(), row_shape)
        if self._gpu is None or self._gpu_key != key:
            from gdsload.decode.image import _BUILT

            self._gpu = self._build_gpu(row_shape)
            self._gpu_key = key
            _BUILT.add(self._gpu)
        for name in items[0]:
            self._gpu.feed_input(name, [it[name] for it in items])
        (res,) = self._gpu.run()
        shapes = [tuple(s) for s in res.shape()]
        if len(shapes) != len(rows) or any(s != row_shape for s in shapes):
            raise ValueError(f"the mixed video pipeline made samples of shape {sorted(set(shapes))}, the slot's rows "
                             f"are {row_shape}")
        base = dst.__cuda_array_interface__["data"][0]
        row_nb = int(np.prod(row_shape)) * dst.dtype.itemsize
        if rows == list(range(rows[0], rows[0] + len(rows))):  # consecutive rows: one copy
            res.copy_to_external(ctypes.c_void_p(base + rows[0] * row_nb), cuda_stream=stream, non_blocking=False)
        else:
            for k, i in enumerate(rows):
                res[k].copy_to_external(ctypes.c_void_p(base + i * row_nb), cuda_stream=stream, non_blocking=False)

    def _zero_padding(self, rows: list[int], plans: dict, dst: Any, stream: ctypes.c_void_p | None) -> None:
        """Zero the padding frames (index -1: a video shorter than the clip) of NVDEC rows in
        `dst`, on `stream` after their copy: `cudaMemsetAsync` per padded run."""
        t = self.t
        spans = []  # (byte offset, bytes)
        item = dst.dtype.itemsize
        row_nb = int(np.prod(dst.shape[1:])) * item
        for i in rows:
            idx = plans[i][0]
            for c in range(t.clips):
                n = int((idx[c] >= 0).sum())  # padding is each clip's tail (clip_indices)
                if n == t.frames:
                    continue
                if t.layout == "NCTHW":  # (clips, C, T, H, W): per channel, frames n.. of clip c
                    plane = int(np.prod(dst.shape[-2:])) * item
                    for ch in range(3):
                        spans.append((i * row_nb + ((c * 3 + ch) * t.frames + n) * plane, (t.frames - n) * plane))
                else:  # (clips, T, H, W, C): frames n.. of clip c
                    frame = int(np.prod(dst.shape[-3:])) * item
                    spans.append((i * row_nb + (c * t.frames + n) * frame, (t.frames - n) * frame))
        if not spans:
            return
        import cupy

        base = dst.__cuda_array_interface__["data"][0]
        handle = stream.value if stream is not None else 0
        with cupy.cuda.Device(self.device_id):
            for off, nb in spans:
                cupy.cuda.runtime.memsetAsync(base + off, 0, nb, handle or 0)

    def _to_device(self, host: np.ndarray, dst: Any, rows: list[int], stream: ctypes.c_void_p | None,
                   wait: bool) -> None:
        """Copy `host`'s `rows` (the CPU path's, in mixed mode) into `dst`'s, on `stream`; runs of
        consecutive rows in one copy each. `wait`: synchronise the stream (a scratch `host`)."""
        import cupy

        rt = cupy.cuda.runtime
        row_nb = int(np.prod(dst.shape[1:])) * dst.dtype.itemsize
        base, src = dst.__cuda_array_interface__["data"][0], host.ctypes.data
        handle = (stream.value if stream is not None else 0) or 0
        runs: list[list[int]] = []
        for i in rows:
            if runs and runs[-1][1] == i:
                runs[-1][1] = i + 1
            else:
                runs.append([i, i + 1])
        with cupy.cuda.Device(self.device_id):
            for a, b in runs:
                rt.memcpyAsync(base + a * row_nb, src + a * row_nb, (b - a) * row_nb, rt.memcpyHostToDevice, handle)
            if wait:
                cupy.cuda.ExternalStream(handle, self.device_id).synchronize()

    def _nvdec_takes(self, meta: dict) -> bool:
        """"mixed": whether this GPU's NVDEC decodes the video (codec, bit depth, size from the
        index, against `gdsload.host.gpu.nvdec_caps`, probed once per process); what it does not
        take goes to the CPU path instead of failing as corrupt (audit 4 R3: Hopper has no AV1
        and no 10-bit H.264, HEVC needs >= 144x144, VP9 >= 128x128)."""
        if self.device != "mixed":
            return True
        from gdsload.host import gpu

        return gpu.nvdec_route(gpu.nvdec_caps(self.device_id), meta["codec"], int(meta.get("bits") or 8),
                               int(meta["width"]), int(meta["height"])) is None

    def _route(self, where: str, n: int) -> None:
        if n:
            with self._lock:
                self.routes[where] = self.routes.get(where, 0) + n

    @staticmethod
    def _pyav_decode(data: np.ndarray, wanted: np.ndarray, meta: dict | None = None) -> tuple[np.ndarray, int]:
        """Frames `wanted` (sorted, unique) decoded with PyAV; (frames, frames decoded).

        When the clip starts past the first keyframe interval (`meta["keyint"]`) and the stream
        has a constant frame rate, it seeks to the keyframe before the first wanted frame and
        numbers frames by their timestamps (`(pts - start) * fps * time_base`); a timestamp that
        is not on the frame grid, or a seek that lands past the frame, falls back to decoding
        from the start, counting frames (what variable-frame-rate video gets)."""
        import io

        av = require("av", extra="media", purpose="video decoding on the CPU path (PyAV)")
        buf = data.tobytes()
        first, last = int(wanted[0]), int(wanted[-1])
        want = set(wanted.tolist())
        meta = meta or {}
        fps, keyint = float(meta.get("fps") or 0), int(meta.get("keyint") or 0)
        rgb24 = rgb24_scaler()
        if fps > 0 and 0 < keyint <= first:
            try:
                got = VideoDecoder._pyav_seek(av, buf, first, last, want, fps, rgb24)
            except av.FFmpegError:
                got = None
            if got is not None:
                return got
        out = []
        n = 0
        try:
            with av.open(io.BytesIO(buf), "r") as c:
                s = c.streams.video[0]
                for f in c.decode(s):
                    if n in want:
                        out.append(rgb24(f))
                    n += 1
                    if n > last:
                        break
        except av.FFmpegError as exc:
            raise ValueError(f"corrupt video after {n} frames: {exc}") from None
        if len(out) != len(wanted):
            raise ValueError(f"video has {n} decodable frames, frame {last} was wanted")
        return np.stack(out), n

    @staticmethod
    def _pyav_seek(av: Any, buf: bytes, first: int, last: int, want: set, fps: float,
                   rgb24: Callable[..., np.ndarray]) -> tuple[np.ndarray, int] | None:
        """`_pyav_decode` from the keyframe before frame `first`; None when the timestamps do not
        number the frames (then the caller decodes from the start)."""
        import io

        with av.open(io.BytesIO(buf), "r") as c:
            s = c.streams.video[0]
            if not s.time_base or s.start_time is None:
                return None
            step = 1.0 / (fps * float(s.time_base))  # pts per frame
            c.seek(int(s.start_time + first * step), stream=s, backward=True, any_frame=False)
            got: dict[int, np.ndarray] = {}
            n = 0
            for f in c.decode(s):
                if f.pts is None:
                    return None
                k = (f.pts - s.start_time) / step
                if abs(k - round(k)) > 0.25:
                    return None  # not on a constant-rate grid
                k = round(k)
                if n == 0 and k > first:
                    return None  # landed past the frame
                n += 1
                if k in want:
                    got[k] = rgb24(f)
                if k >= last:
                    break
        if len(got) != len(want):
            return None
        return np.stack([got[k] for k in sorted(got)]), n

    def close(self) -> None:
        """Stop the PyAV thread pool (the DALI pipelines go with the decoder)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def decode_into(self, encoded: Sequence[np.ndarray], names: Sequence[str], metas: Sequence[dict | None],
                    u: np.ndarray, dst: Any, frames_dst: np.ndarray, *, host: np.ndarray | None = None,
                    stream: Any = None) -> list[int]:
        """Decode row i's clip(s) into `dst[i]`, their indices into `frames_dst[i]` (host memory);
        `metas[i]`: the index's metadata (None: probed now), `u[i]`: its 6 draws. Returns the rows
        kept.

        `device="mixed"`: `dst` is device memory (CuPy, C-contiguous: the ring's device slot
        field); NVDEC rows are written there by the mixed pipeline with `copy_to_external` on
        `stream` (a `ctypes.c_void_p` or an int handle: the loader's private stream; None: the
        legacy default stream); CPU-path rows are made in `host` (a host array shaped like `dst`,
        pinned in a loader; None: a scratch array, then the stream is synchronised) and copied to
        their rows on `stream` (module docstring)."""
        t = self.t
        mixed = self.device == "mixed"
        if mixed:
            cai = getattr(dst, "__cuda_array_interface__", None)
            if cai is None:
                raise ValueError("VideoDecoder(device='mixed') writes device memory: dst is a host array (a "
                                 "GPU -> host round trip); pass the device slot (CuPy) and `host=` for the CPU path")
            if cai.get("strides") is not None:
                raise ValueError(f"VideoDecoder(device='mixed'): dst must be C-contiguous, not strides "
                                 f"{cai['strides']}")
            if np.dtype(dst.dtype) != np.dtype(t.dtype):  # DALI copies its own bytes to the pointer
                raise ValueError(f"VideoDecoder(device='mixed'): dst is {np.dtype(dst.dtype)}, the transform "
                                 f"makes {t.dtype}")
            if host is not None and (tuple(host.shape) != tuple(dst.shape) or not host.flags.c_contiguous
                                     or np.dtype(host.dtype) != np.dtype(dst.dtype)):
                raise ValueError(f"host= must be a C-contiguous {np.dtype(dst.dtype)} array of dst's shape "
                                 f"{tuple(dst.shape)}, not {host.dtype} {tuple(host.shape)}")
            if isinstance(stream, int) and not isinstance(stream, bool):
                stream = ctypes.c_void_p(stream)
            if stream is not None and not isinstance(stream, ctypes.c_void_p):
                raise TypeError(f"stream must be a ctypes.c_void_p, an int handle or None, not {type(stream).__name__} "
                                f"(DALI's copy_to_external reads any other object as the legacy stream)")
        bad: list[tuple[int, str]] = []
        plans: dict[int, tuple[np.ndarray, np.ndarray, dict]] = {}
        for i, (e, meta) in enumerate(zip(encoded, metas)):
            try:
                meta = meta or probe(e, "video")
            except ValueError as exc:
                bad.append((i, str(exc)))
                continue
            if t.max_frames is not None and meta["frames"] > t.max_frames:
                bad.append((i, (f"{meta['frames']} frames, over the limit of {t.max_frames} "
                                f"(VideoTransform(max_frames=...)); not decoded")))
                continue
            if t.max_pixels is not None and meta["width"] * meta["height"] > t.max_pixels:
                bad.append((i, (f"{meta['width']} x {meta['height']} pixels, over the limit of {t.max_pixels} "
                                f"(VideoTransform(max_pixels=...)); not decoded")))
                continue
            idx = clip_indices(meta["frames"], t.frames, t.stride, t.clips, t.sampling, float(u[i, 0]))
            wanted = np.unique(idx[idx >= 0])
            plans[i] = (idx, wanted, meta)
        on_gpu: dict[int, Exception | None] = {}  # mixed: NVDEC rows, None once in dst
        got: dict[int, Any] = {}  # rows decoded on the host: (k, H, W, 3) frames or the exception
        if mixed:
            nv = [i for i, (_, w, m) in plans.items() if m["codec"] in NVDEC_VIDEO and self._nvdec_takes(m)]
            on_gpu = self._gpu_decode(nv, encoded, plans, u, dst, stream)
            from gdsload.host.gpu import nvdec_refused

            for i in [i for i, r in on_gpu.items() if isinstance(r, Exception) and nvdec_refused(str(r))]:
                del on_gpu[i]  # NVDEC refused it after all (a chroma the index does not record): CPU path
            self._route("nvdec", sum(r is None for r in on_gpu.values()))
            for i, r in on_gpu.items():
                if r is None:
                    self.frames_decoded += int(plans[i][1][-1]) + 1
        else:
            dali = [(i, encoded[i], w) for i, (_, w, m) in plans.items() if m["codec"] in DALI_CPU_VIDEO]
            got = self._dali_decode(dali)
            self._route("dali-cpu", sum(not isinstance(r, Exception) for r in got.values()))
            for i, r in got.items():
                if not isinstance(r, Exception):
                    m = plans[i][2]
                    self.frames_decoded += int(plans[i][1][-1]) + 1 if m["codec"] != "mjpeg" else len(plans[i][1])
        rest = [i for i in plans if i not in got and i not in on_gpu]
        self._route("pyav", len(rest))
        if rest:  # PyAV (H.264, HEVC, ...): `threads` videos at a time, the GIL released in FFmpeg
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor

                self._pool = ThreadPoolExecutor(max(1, self.threads), thread_name_prefix="gdsload-video")

            def one(i: int) -> Any:
                try:
                    return self._pyav_decode(encoded[i], plans[i][1], plans[i][2])
                except ValueError as exc:
                    return exc

            for i, r in zip(rest, self._pool.map(one, rest)):
                if isinstance(r, Exception):
                    got[i] = r
                else:
                    got[i], n = r
                    self.frames_decoded += n
        for i in list(plans):
            r = on_gpu[i] if i in on_gpu else got[i]
            if isinstance(r, Exception):
                bad.append((i, str(r)))
                del plans[i]
        if bad and self.on_error == "raise":
            i, why = min(bad)
            raise DecodeError(f"cannot decode video {names[i]} ({len(bad)} bad in this batch): {why}",
                              remedy="pass on_error='skip' to skip and count such samples")
        self.skipped += len(bad)
        kept = sorted(plans)
        for i in kept:
            idx = plans[i][0]
            frames_dst[i] = idx.reshape(frames_dst[i].shape)
            self.frames_returned += int((idx >= 0).sum())
        cpu_rows = [i for i in kept if i not in on_gpu]
        if not mixed:
            self._host_rows(cpu_rows, plans, got, u, dst)
        elif cpu_rows:  # the CPU path's rows, made on the host, one copy to the device each run of rows
            scratch = host is None
            out = np.zeros(dst.shape, np.dtype(dst.dtype)) if scratch else host
            self._host_rows(cpu_rows, plans, got, u, out)
            self._to_device(out, dst, cpu_rows, stream, wait=scratch)
        return kept

    def _host_rows(self, rows: list[int], plans: dict, got: dict, u: np.ndarray, dst: np.ndarray) -> None:
        """The CPU path's crop pipeline: rows `rows` (their frames decoded on the host, in `got`)
        cropped, resized and normalised into host array `dst` (untouched frames for size=None)."""
        t = self.t
        clips: list[tuple[int, int, np.ndarray, int]] = []  # (row, clip, frames (T', H, W, 3), T')
        for i in rows:
            idx, wanted, _ = plans[i]
            arr = got[i]
            for c in range(t.clips):
                valid = idx[c][idx[c] >= 0]
                clips.append((i, c, arr[np.searchsorted(wanted, valid)], len(valid)))
        out_rows = dst if t.clips > 1 else dst[:, None]
        for i in rows:
            out_rows[i] = 0  # padding frames are zeros
        if t.size is None:  # untouched frames
            for i, c, fr, n in clips:
                o = out_rows[i, c]
                if t.layout == "NCTHW":
                    o[:, :n] = fr.transpose(3, 0, 1, 2)
                else:
                    o[:n] = fr
            return
        if not clips:
            return
        r0, r1, mirror = [], [], []
        for i, c, fr, _ in clips:
            h, w = fr.shape[1:3]
            a, b = crop_roi(h, w, t.train, t.scale, t.ratio, t.size, t.resize, u[i, 1:5])
            r0.append(np.array(a, np.float32))
            r1.append(np.array(b, np.float32))
            mirror.append(np.array(int(t.train and u[i, 5] < t.flip), np.int32))
        with self._lock:
            self._pipes()
            step = self.batch_size * t.clips
            for a in range(0, len(clips), step):
                part = slice(a, a + step)
                self._xf.feed_input("x", [fr for _, _, fr, _ in clips[part]], layout="FHWC")
                self._xf.feed_input("r0", r0[part])
                self._xf.feed_input("r1", r1[part])
                self._xf.feed_input("m", mirror[part])
                (res,) = self._xf.run()
                for k, (i, c, _, n) in enumerate(clips[part]):
                    o = out_rows[i, c]
                    if t.layout == "NCTHW":
                        o[:, :n] = np.array(res[k])
                    else:
                        o[:n] = np.array(res[k])
