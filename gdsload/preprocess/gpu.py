"""A pass's frames decoded with NVDEC (issue 54 item 4): `gdsload.process(..., frames=..., device=)`.

Where: `pass_device` picks the pass's GPU. `device="auto"` (the default) takes the current CUDA
device when one is there and DALI, CuPy and torch import, the pass runs in this process
(`engine="local"`, no `workers`, no `feed`); otherwise frames are PyAV's on the CPU, as before.
`device="cpu"` keeps the CPU; `device="cuda"`/`"cuda:N"` asks for NVDEC and is refused where it
cannot be had. Each member is then routed as the loader's video path routes a sample: its codec,
bit depth and size against `gdsload.host.gpu.nvdec_caps` (the driver's NVDEC probe, once per
process); a member NVDEC does not take (AV1 on Hopper, HEVC under 144x144, ...) or that DALI
refuses with one of `NVDEC_REFUSALS` is decoded by the CPU path instead and counted
(`NvdecFrames.routes`). Either way `fn` gets `frames` as a torch uint8 tensor (N, window, H, W, 3)
on the pass's GPU (`t`, `window` and the keys stay NumPy/lists).

How: the member's packets are demuxed (no decoding) for their presentation timestamps, which
give each sample its frame by the CPU path's rule (`gdsload.decode.passmedia`: sample k at k/fps
shows the last frame at or before it; before the first frame, the first; samples run to the end
of the last frame), as frame indices in presentation order. One mixed DALI pipeline
(`fn.decoders.video(device="mixed", frames=...)` -> `fn.resize` to the short side `size`) decodes
the picks of up to `CHUNK_FRAMES` frames a run into device memory, copied out with
`copy_to_external`; padding frames are zeroed on the device. DALI's video decoder takes a whole
encoded stream, so this path holds the member's encoded bytes (the CPU path streams them by
range); decoded memory is still bounded by a chunk and the batch.

NVDEC frames differ from the CPU path's in their last bits (NVDEC's YUV->RGB conversion and
DALI's resize are not FFmpeg's swscale): a pass decoded on a GPU writes other bytes than one on
the CPU, so the resume record says `"decode": "nvdec"` and a resume across the two is refused.
"""

from __future__ import annotations

import ctypes
import io
from collections.abc import Iterator
from fractions import Fraction
from typing import Any

import numpy as np

from gdsload.decode.passmedia import NoStream, RangeFile, Window, frame_windows, out_size
from gdsload.errors import InputError, require

CHUNK_FRAMES = 128  # frames decoded per pipeline run (device memory: CHUNK_FRAMES frames of the output size)
_PIX_BITS = {"yuv420p": 8, "yuvj420p": 8, "nv12": 8, "yuv420p10le": 10, "p010le": 10}


def _gpu_stack_imports() -> bool:
    try:
        import cupy  # noqa: F401
        import nvidia.dali  # noqa: F401
        import torch
    except Exception:  # noqa: BLE001 - any failure to import means no NVDEC path here
        return False
    return bool(torch.cuda.is_available())


def pass_device(device: Any, *, engine: str, workers: int | None, feed: Any, mode: str) -> int | None:
    """The CUDA ordinal a pass decodes its frames on, or None for the CPU (module docstring)."""
    if device is None or device == "auto":
        if mode != "frames" or engine != "local" or workers or feed is not None:
            return None
        from gdsload.host import driver

        if driver.cuda_device_count() < 1 or not _gpu_stack_imports():
            return None
        from gdsload.host import gpu

        return gpu.resolve_ordinal(None)
    if device == "cpu":
        return None
    if not isinstance(device, str) or not (device == "cuda" or device.startswith("cuda:")):
        raise InputError(f"process(device={device!r}): 'auto', 'cpu', 'cuda' or 'cuda:N'")
    where = ("frames=(fps, window) (speech decodes on the CPU)" if mode != "frames" else
             "engine='local'" if engine != "local" else "no workers=" if workers else
             "no feed= (a feed decodes on its server)" if feed is not None else "")
    if where:
        raise InputError(f"process(device={device!r}): NVDEC decoding needs {where}")
    if not _gpu_stack_imports():
        raise InputError(f"process(device={device!r}): no usable CUDA device with DALI, CuPy and torch here "
                         f"(install gdsload[cuda12] on a GPU host, or pass device='cpu')")
    from gdsload.host import gpu

    _, ordinal = gpu.parse_device(device)
    return gpu.resolve_ordinal(ordinal)


def sample_picks(times: list[Fraction], ends: list[Fraction], fps: float) -> np.ndarray:
    """The frame (presentation-order index into `times`, sorted) of each sample: sample k, at k/fps
    (`times` counted from the container's start), shows the last frame at or before it (the first
    before the first); samples run while k/fps is before the latest end of a frame."""
    step = Fraction(fps).limit_denominator(1 << 20)
    end = max(Fraction(0), max(ends))
    n = -((-end * step).numerator // (end * step).denominator)  # ceil(end * fps): k/fps < end
    first = np.array([max(0, -((-(t * step)).numerator // (t * step).denominator)) for t in times], np.int64)
    return np.maximum(np.searchsorted(first, np.arange(n), side="right") - 1, 0)


def demux(data: bytes) -> dict[str, Any]:
    """The video stream's codec, size, bits and each frame's time and end (seconds from the
    container's start, presentation order), from its packets alone (nothing decoded)."""
    import av

    try:
        with av.open(io.BytesIO(data), "r") as c:
            if not c.streams.video:
                raise NoStream("no video stream")
            s = c.streams.video[0]
            starts = [Fraction(x.start_time) * x.time_base for x in list(c.streams.video) + list(c.streams.audio)
                      if x.start_time is not None and x.time_base]
            origin, tb = (min(starts) if starts else Fraction(0)), Fraction(s.time_base)
            rate = s.average_rate or s.guessed_rate
            dflt = Fraction(1) / Fraction(rate) if rate else Fraction(0)
            cc = s.codec_context
            info = {"codec": cc.name, "width": int(cc.width), "height": int(cc.height),
                    "bits": _PIX_BITS.get(cc.pix_fmt or "", 10 if "10" in (cc.pix_fmt or "") else 8)}
            frames = []
            for p in c.demux(s):
                if p.size == 0:
                    continue
                if p.pts is None:
                    return {**info, "times": None}
                frames.append((Fraction(p.pts) * tb - origin, Fraction(p.duration) * tb if p.duration else dflt))
    except av.FFmpegError as exc:
        raise ValueError(f"unreadable media: {exc}") from None
    frames.sort()
    return {**info, "times": [t for t, _ in frames], "ends": [t + d for t, d in frames]}


class NvdecFrames:
    """The NVDEC frame windows of a pass on CUDA device `device_id` (module docstring)."""

    def __init__(self, device_id: int):
        self.device_id = device_id
        self.routes: dict[str, int] = {}  # members per decoder: "nvdec", "cpu" (and why, in `reasons`)
        self.reasons: list[str] = []
        self._pipes: dict[bool, Any] = {}

    def _graph(self, device_id: int | None, resize: bool) -> Any:
        """The mixed pipeline: NVDEC (the picked frames, in sample order) [-> resize to [h, w]]."""
        from nvidia.dali import fn, pipeline_def, types

        @pipeline_def(batch_size=1, num_threads=2, device_id=device_id, prefetch_queue_depth=1,
                      exec_async=False, exec_pipelined=False)
        def frames():
            enc = fn.external_source(name="enc", dtype=types.UINT8, ndim=1)
            idx = fn.external_source(name="idx", dtype=types.INT32, ndim=1)
            x = fn.decoders.video(enc, device="mixed", frames=idx, affine=False)  # (k, H, W, 3)
            if resize:
                hw = fn.external_source(name="hw", dtype=types.FLOAT, ndim=1)
                x = fn.resize(x, size=hw, interp_type=types.INTERP_LINEAR, antialias=False)
            return x

        p = frames()
        p.build()
        return p

    def _build(self, resize: bool) -> Any:
        """The pipeline on this pass's GPU (the tests run `_graph` on DALI's CPU backend)."""
        require("nvidia.dali", extra="cuda12", purpose="NVDEC decoding of a pass's frames")
        return self._graph(self.device_id, resize)

    def _run(self, data: np.ndarray, picks: np.ndarray, hw: tuple[int, int] | None, out: Any, stream: Any) -> None:
        """One run of the pipeline: frames `picks` of `data` [resized to `hw`] into `out` (device
        memory) on `stream` (DALI's copy waits for it: its next run reuses the output buffer)."""
        resize = hw is not None
        if resize not in self._pipes:
            self._pipes[resize] = self._build(resize)
        p = self._pipes[resize]
        p.feed_input("enc", [data])
        p.feed_input("idx", [picks.astype(np.int32)])
        if resize:
            p.feed_input("hw", [np.array(hw, np.float32)])
        (res,) = p.run()
        shape = tuple(res.shape()[0])
        if shape != tuple(out.shape):
            raise ValueError(f"NVDEC gave frames of shape {shape}, expected {tuple(out.shape)}")
        res.copy_to_external(ctypes.c_void_p(out.__cuda_array_interface__["data"][0]),
                             cuda_stream=ctypes.c_void_p(stream.ptr), non_blocking=False)

    def windows(self, f: RangeFile, fps: float, window: int, size: int | None, skip: int = 0,
                threads: int | None = None) -> Iterator[Window]:
        """The member's frame windows (as `passmedia.frame_windows`), on the device."""
        import cupy

        from gdsload.host import gpu

        data = f.read()
        info = demux(data)
        why = (gpu.nvdec_route(gpu.nvdec_caps(self.device_id), info["codec"], info["bits"], info["width"],
                               info["height"]) if info["codec"] in gpu.NVDEC_CODEC_IDS else
               f"NVDEC is not used for {info['codec']}")
        if why is None and not info["times"]:
            why = "packets without timestamps" if info["times"] is None else "no video frame"
        if why is None:
            sent = 0
            try:
                for w in self._nvdec(np.frombuffer(data, np.uint8), info, fps, window, size, skip):
                    yield w
                    sent += 1
                self.routes["nvdec"] = self.routes.get("nvdec", 0) + 1
                return
            except RuntimeError as exc:  # DALI refusing the stream (before any window went out)
                if sent or not gpu.nvdec_refused(str(exc)):
                    raise ValueError(f"NVDEC: {exc}") from None
                why = str(exc).splitlines()[0]
        self.routes["cpu"] = self.routes.get("cpu", 0) + 1
        self.reasons.append(why)
        f.seek(0)
        with cupy.cuda.Device(self.device_id):
            for w in frame_windows(f, fps, window, size, skip, threads=threads):
                yield Window(w.index, cupy.asarray(w.data), w.t)

    def _nvdec(self, data: np.ndarray, info: dict[str, Any], fps: float, window: int, size: int | None,
               skip: int) -> Iterator[Window]:
        import cupy

        picks = sample_picks(info["times"], info["ends"], fps)
        step = Fraction(fps).limit_denominator(1 << 20)
        ow, oh = out_size(info["width"], info["height"], size)
        hw = (oh, ow) if size is not None else None
        nwin = -(-len(picks) // window)
        per = max(1, CHUNK_FRAMES // window)
        for w0 in range(skip, nwin, per):
            w1 = min(nwin, w0 + per)
            chunk = picks[w0 * window: w1 * window]
            with cupy.cuda.Device(self.device_id):
                stream = cupy.cuda.get_current_stream()
                buf = cupy.empty(((w1 - w0) * window, oh, ow, 3), np.uint8)
                self._run(data, chunk, hw, buf[: len(chunk)], stream)
                if len(chunk) < len(buf):
                    buf[len(chunk):] = 0
                stream.synchronize()  # the chunk is whole before its windows go to another thread
            for w in range(w0, w1):
                m = min(window, len(picks) - w * window)
                t = np.full(window, -1.0)
                t[:m] = [float(Fraction(k) / step) for k in range(w * window, w * window + m)]
                yield Window(w, buf[(w - w0) * window: (w - w0 + 1) * window], t)


def batch_buffer(like: Any, n: int) -> Any:
    """A device batch of `n` windows shaped and typed as `like` (a CuPy window) on its device."""
    import cupy

    with cupy.cuda.Device(like.device.id):
        return cupy.empty((n, *like.shape), like.dtype)


def as_torch(frames: Any) -> Any:
    """A device batch as the torch tensor `fn` gets: zero copy, with the array's device current and
    torch's current stream as CuPy's, so CuPy's `__dlpack__` has nothing to wait for (the loader's
    `frontend.output` hand-over, which this layer does not import)."""
    import cupy
    import torch

    dev = frames.device.id
    with cupy.cuda.Device(dev), cupy.cuda.ExternalStream(torch.cuda.current_stream(dev).cuda_stream, dev):
        return torch.from_dlpack(frames)
