"""The loader's GPU: which device a rank uses, and the stream/event protocol around ring slots.

Which device (resolved once, in the thread that sets the loader up; `resolve_ordinal`):
  1. `device="cuda:N"` (or a `torch.device("cuda", N)`) names it;
  2. else `LOCAL_RANK` (what torchrun exports; it sets no device) when it names a visible device;
  3. else the calling thread's current device (torch's when torch has CUDA, else CuPy's).
The CUDA current device belongs to each host thread ("cudaSetDevice: sets device as the current
device for the calling host thread", CUDA runtime API) and a new thread starts on device 0, so
every thread of ours that touches CUDA (producers, DALI, KvikIO's issuing threads) calls
`use_device(ordinal)` first; torch's own pin-memory thread does the same
(torch/utils/data/_utils/pin_memory.py). Without it, rank k's DALI pipeline and copies ran on GPU 0.

Streams and events (`CopyStreams`, one per loader), for a slot in device memory:
  - every copy into a device slot (DALI's decoded output, host-to-device copies of labels and of
    tensors read on the host) runs on one private non-blocking stream, never on the legacy default
    stream, so it neither queues behind nor implicitly synchronises with the training kernels;
  - after a batch's copies a *ready* event is recorded on that stream; when the batch is handed out
    the consumer's current stream waits on it (GPU-side; the host does not block);
  - when the consumer moves on (the slot is released) a *release fence* is recorded on the
    consumer's current stream; the producer that refills the slot synchronises on it (host-side)
    before writing anything, because KvikIO/cuFile writes are not stream-ordered. Without it a
    consumer on a side stream (torch.cuda.Stream, CUDA graphs) could read the next batch's data.
The consumer's current stream is torch's (`torch.cuda.current_stream(device)`) for torch output,
CuPy's for CuPy output. Work a producer enqueues itself (the compaction of rows when images were
skipped, a `map`/`collate_fn` batch's device-to-host and host-to-device copies, a
`verify="full"` CRC's device-to-host copy) runs under `CopyStreams.producing()`, on the private
stream before the ready event, never on the legacy stream (audit 3 C3-C5).
Limit: the ready wait and the release fence go on the stream that is current when `next()` is
called. `for b in loader: with torch.cuda.stream(s): ...` makes `s` current only after `next()`,
so `s` gets neither: enter the stream around the whole loop (`with torch.cuda.stream(s): for b in
loader: ...`), or call `s.wait_stream(torch.cuda.current_stream())` at the top of each step.

CuPy is imported on first use; `import gdsload.host.gpu` needs the standard library only.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
import warnings
from typing import Any

from gdsload.errors import GdsloadError, require


def parse_device(device: Any) -> tuple[str, int | None]:
    """("cpu" | "cuda", explicit ordinal or None) from "cpu", "cuda", "cuda:N" or a torch.device."""
    kind = getattr(device, "type", None)
    if kind is not None and not isinstance(device, str):  # torch.device
        if kind == "cpu":
            return "cpu", None
        if kind == "cuda":
            return "cuda", getattr(device, "index", None)
        raise GdsloadError(f"device {device!r} is not valid; use 'cpu', 'cuda' or 'cuda:N'")
    if device == "cpu" or device == "cuda":
        return device, None
    if isinstance(device, str) and device.startswith("cuda:"):
        try:
            ordinal = int(device[5:])
        except ValueError:
            ordinal = -1
        if ordinal >= 0:
            return "cuda", ordinal
    raise GdsloadError(f"device {device!r} is not valid; use 'cpu', 'cuda' or 'cuda:N'")


def _cupy() -> Any:
    return require("cupy", extra="cuda12", purpose="device='cuda'")


def _torch_cuda() -> Any:
    """torch, when it is imported and has a usable CUDA build; else None (never imports torch)."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available():
            return torch
    except Exception:
        pass
    return None


def current_device() -> int:
    """The calling thread's current CUDA device (torch's view when torch has CUDA, else CuPy's)."""
    torch = _torch_cuda()
    if torch is not None:
        return int(torch.cuda.current_device())
    return int(_cupy().cuda.runtime.getDevice())


def resolve_ordinal(explicit: int | None) -> int:
    """The rank's GPU: `explicit`, else LOCAL_RANK, else the current device (module docstring)."""
    count = int(_cupy().cuda.runtime.getDeviceCount())
    if explicit is not None:
        if explicit >= count:
            raise GdsloadError(f"device='cuda:{explicit}', but this process sees {count} CUDA device(s) "
                               f"(ordinals 0..{count - 1}; CUDA_VISIBLE_DEVICES renumbers them)")
        return explicit
    local = os.environ.get("LOCAL_RANK")
    if local is not None:
        try:
            rank = int(local)
        except ValueError:
            raise GdsloadError(f"LOCAL_RANK={local!r} is not an integer") from None
        if 0 <= rank < count:
            current = current_device()
            if current not in (0, rank):  # the script chose a device, and not LOCAL_RANK's
                warnings.warn(f"LOCAL_RANK={rank} but the current CUDA device is {current}; gdsload "
                              f"uses cuda:{rank} (pass device='cuda:{current}' to override)",
                              RuntimeWarning, stacklevel=3)
            return rank
        warnings.warn(f"LOCAL_RANK={rank} names no visible CUDA device ({count} visible, e.g. one "
                      f"per rank through CUDA_VISIBLE_DEVICES); using the current device",
                      RuntimeWarning, stacklevel=3)
    return current_device()


def use_device(ordinal: int) -> None:
    """Make `ordinal` the calling thread's current device for CuPy (the CUDA runtime) and torch."""
    _cupy().cuda.Device(ordinal).use()
    torch = _torch_cuda()
    if torch is not None:
        torch.cuda.set_device(ordinal)


class CopyStreams:
    """One loader's private copy stream and its ready/release events (module docstring).

    `consumer` is "torch" when batches are handed out as torch tensors (then torch's current
    stream is the consumer's), anything else for CuPy. Thread-safety: copies may be enqueued from
    any producer thread; the event calls are cheap and lock-free in CUDA.
    """

    def __init__(self, ordinal: int, *, consumer: str) -> None:
        self.cupy = _cupy()
        self.ordinal = ordinal
        self.consumer = consumer
        with self.cupy.cuda.Device(ordinal):
            self.stream = self.cupy.cuda.Stream(non_blocking=True)
        self._last_consumer: Any = None
        self._lock = threading.Lock()

    @property
    def stream_handle(self) -> ctypes.c_void_p:
        """The private stream as the `ctypes.c_void_p` DALI's `copy_to_external` takes."""
        return ctypes.c_void_p(self.stream.ptr)

    def to_device(self, dst: Any, src: Any) -> None:
        """Enqueue a host-to-device copy of `src` (NumPy, pinned for real asynchrony) into `dst`
        (CuPy, same byte size, both C-contiguous) on the private stream; returns at once."""
        nbytes = src.nbytes
        if nbytes != dst.nbytes:
            raise GdsloadError(f"host-to-device copy of {nbytes} bytes into {dst.nbytes} bytes")
        if nbytes:
            rt = self.cupy.cuda.runtime
            rt.memcpyAsync(dst.data.ptr, src.ctypes.data, nbytes, rt.memcpyHostToDevice, self.stream.ptr)

    def ready(self) -> Any:
        """An event recorded on the private stream after the copies enqueued so far."""
        with self.cupy.cuda.Device(self.ordinal):
            event = self.cupy.cuda.Event(disable_timing=True)
            event.record(self.stream)
        return event

    @contextlib.contextmanager
    def producing(self):
        """The private stream as the calling thread's current stream for CuPy and (torch output)
        torch, on the loader's device: what a producer enqueues inside runs there, before the batch's
        ready event (module docstring)."""
        torch = _torch_cuda() if self.consumer == "torch" else None
        with self.cupy.cuda.Device(self.ordinal), self.stream:
            if torch is None:
                yield
            else:
                with torch.cuda.stream(torch.cuda.ExternalStream(self.stream.ptr, device=f"cuda:{self.ordinal}")):
                    yield

    def record_consumer(self, batch: Any) -> None:
        """`record_stream` every torch CUDA tensor of a mapped batch on the consumer's current stream:
        they were allocated on the private stream (`producing()`), and torch's caching allocator
        must not hand their memory to the next batch while the consumer's kernels still read it."""
        torch = _torch_cuda() if self.consumer == "torch" else None
        if torch is None:
            return
        stream = torch.cuda.current_stream(self.ordinal)
        todo = [batch]
        while todo:
            x = todo.pop()
            if isinstance(x, dict):
                todo += x.values()
            elif isinstance(x, (list, tuple)):
                todo += [v for v in x if isinstance(v, (dict, list, tuple, torch.Tensor))]
            elif isinstance(x, torch.Tensor) and x.is_cuda:
                x.record_stream(stream)

    def consumer_stream(self) -> Any:
        """The calling thread's current stream on the loader's device, as a CuPy stream."""
        cuda = self.cupy.cuda
        torch = _torch_cuda() if self.consumer == "torch" else None
        with cuda.Device(self.ordinal):
            if torch is not None:
                stream = cuda.ExternalStream(torch.cuda.current_stream(self.ordinal).cuda_stream, self.ordinal)
            else:
                stream = cuda.get_current_stream()
        with self._lock:
            self._last_consumer = stream
        return stream

    @contextlib.contextmanager
    def consuming(self):
        """The loader's device and the consumer's stream on it current in the calling thread (for
        CuPy), around work done for the consumer: the gather of kept rows. `consumer_stream()`
        enters the device only to find the stream, so a gather under it alone ran on the thread's
        current device (GPU 0 under torchrun without `set_device`: a peer-access error or a
        tensor on the wrong GPU) and that device's stream (audit 4 R9)."""
        with self.cupy.cuda.Device(self.ordinal), self.consumer_stream():
            yield

    def consumer_wait(self, event: Any) -> None:
        """Make the consumer's current stream wait for `event` (a batch's ready event)."""
        if event is not None:
            self.consumer_stream().wait_event(event)

    def synchronize(self) -> None:
        """Wait for every copy enqueued so far and for the work queued so far on the consumer's
        stream (the one seen last), before the ring's memory may be freed: the last batch's
        release fence is kept for a next pass that a close never takes, and a consumer on a side
        stream may still have kernels reading it (audit 4 R12). A consumer stream that no longer
        exists (a CuPy stream the user dropped) is replaced by a whole-device synchronize."""
        self.stream.synchronize()
        last = self._last_consumer
        if last is None:
            return
        with self.cupy.cuda.Device(self.ordinal):
            try:
                event = self.cupy.cuda.Event(disable_timing=True)
                event.record(last)
                event.synchronize()
            except Exception:  # an invalid stream handle: wait for the whole device instead
                self.cupy.cuda.Device(self.ordinal).synchronize()

    def release_fence(self, *, same_thread: bool = True) -> Any:
        """An event recorded on the consumer's current stream: when it completes, the work the
        consumer queued on the released batch is done. `same_thread=False` (a close from another
        thread, e.g. the garbage collector) reuses the consumer stream seen last."""
        stream = self.consumer_stream() if same_thread else self._last_consumer
        if stream is None:
            return None
        with self.cupy.cuda.Device(self.ordinal):
            event = self.cupy.cuda.Event(disable_timing=True)
            event.record(stream)
        return event


def _cu_mem_get_address_range(ptr: int) -> tuple[int, int]:
    """The driver's `cuMemGetAddressRange` (the calling thread needs the device's context current)."""
    cuda = ctypes.CDLL("libcuda.so.1")
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    rc = cuda.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    if rc:
        raise RuntimeError(f"cuMemGetAddressRange returned CUDA error {rc}")
    return int(base.value), int(size.value)


def allocation_range(ptr: int) -> tuple[int, int]:
    """(base, nbytes) of the device allocation (one cudaMalloc) holding `ptr`: what KvikIO's
    `memory_register` registers with cuFile (cpp/src/buffer.cpp `get_alloc_info`: "the entire
    underlying allocation"), and so the base cuFile wants registered reads addressed from. A ring
    arena is a slice of a CuPy pool chunk, itself possibly a split of a larger allocation."""
    return _cu_mem_get_address_range(ptr)


# -- NVDEC capabilities (audit 4 R2/R3) ------------------------------------------------------------
#: cudaVideoCodec values (nvcuvid's cuviddec.h) of the codecs gdsload sends to NVDEC
NVDEC_CODEC_IDS = {"mpeg4": 2, "h264": 4, "hevc": 8, "vp8": 9, "vp9": 10, "av1": 11}
#: (codec, bits) pairs the probe asks about, 4:2:0 chroma (what `gdsload.decode.media.probe` admits)
NVDEC_PROBED = (("mpeg4", 8), ("h264", 8), ("h264", 10), ("hevc", 8), ("hevc", 10), ("vp8", 8),
                ("vp9", 8), ("vp9", 10), ("av1", 8), ("av1", 10))
_CHROMA_420 = 1  # cudaVideoChromaFormat_420
#: DALI's refusals after its own `cuvidGetDecoderCaps` (dali/operators/video/frames_decoder_gpu.cc,
#: NVDECCache::GetDecoder): what NVDEC cannot take, not a corrupt sample
NVDEC_REFUSALS = ("Codec configuration not supported on this GPU", "Video is too small in at least one dimension",
                  "Video is too large in at least one dimension", "Video is too large (too many macroblocks)")


class _DecodeCaps(ctypes.Structure):
    """CUVIDDECODECAPS (cuviddec.h, as DALI's dynlink_nvcuvid bundles it)."""

    _fields_ = [("eCodecType", ctypes.c_int), ("eChromaFormat", ctypes.c_int), ("nBitDepthMinus8", ctypes.c_uint),
                ("reserved1", ctypes.c_uint * 3), ("bIsSupported", ctypes.c_ubyte), ("nNumNVDECs", ctypes.c_ubyte),
                ("nOutputFormatMask", ctypes.c_ushort), ("nMaxWidth", ctypes.c_uint), ("nMaxHeight", ctypes.c_uint),
                ("nMaxMBCount", ctypes.c_uint), ("nMinWidth", ctypes.c_ushort), ("nMinHeight", ctypes.c_ushort),
                ("bIsHistogramSupported", ctypes.c_ubyte), ("nCounterBitDepth", ctypes.c_ubyte),
                ("nMaxHistogramBins", ctypes.c_ushort), ("reserved3", ctypes.c_uint * 10)]


def _nvdec_query(device_id: int) -> dict[str, Any]:
    """Ask the driver's NVDEC library (`libnvcuvid.so.1`, user-space driver code that no wheel
    carries and a container may lack) what device `device_id` decodes, through
    `cuvidGetDecoderCaps` with that device's primary context current (the call needs one); raises
    OSError/RuntimeError when the libraries or the driver say no."""
    cuda = ctypes.CDLL("libcuda.so.1")
    lib = None
    for name in ("libnvcuvid.so.1", "libnvcuvid.so"):  # DALI's dynlink tries both
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError as exc:
            err = exc
    if lib is None:
        raise OSError(f"libnvcuvid (NVDEC) does not load: {err}")

    def ok(rc: int, what: str) -> None:
        if rc:
            raise RuntimeError(f"{what} returned CUDA error {rc}")

    ok(cuda.cuInit(0), "cuInit")
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    ok(cuda.cuDeviceGet(ctypes.byref(dev), int(device_id)), "cuDeviceGet")
    ok(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    out: dict[str, Any] = {}
    try:
        ok(cuda.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")
        try:
            for codec, bits in NVDEC_PROBED:
                c = _DecodeCaps(eCodecType=NVDEC_CODEC_IDS[codec], eChromaFormat=_CHROMA_420,
                                nBitDepthMinus8=bits - 8)
                rc = lib.cuvidGetDecoderCaps(ctypes.byref(c))
                out[nvdec_key(codec, bits)] = {
                    "supported": rc == 0 and bool(c.bIsSupported), "rc": int(rc), "nvdecs": int(c.nNumNVDECs),
                    "min": [int(c.nMinWidth), int(c.nMinHeight)], "max": [int(c.nMaxWidth), int(c.nMaxHeight)],
                    "max_mb": int(c.nMaxMBCount)}
        finally:
            cuda.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
    finally:
        cuda.cuDevicePrimaryCtxRelease_v2(dev)
    return out


def nvdec_key(codec: str, bits: int) -> str:
    """"h264", "hevc-10", ...: the key of `nvdec_caps()["codecs"]`."""
    return codec if bits <= 8 else f"{codec}-{bits}"


_nvdec_cache: dict[int, dict[str, Any]] = {}
_nvdec_lock = threading.Lock()


def nvdec_caps(device_id: int = 0) -> dict[str, Any]:
    """What device `device_id`'s NVDEC decodes, asked once per process: `{"available": bool,
    "error": str | None, "codecs": {nvdec_key: {"supported", "min": [w, h], "max": [w, h],
    "max_mb", "nvdecs", "rc"}}}`. Never raises: no driver, no `libnvcuvid` (a container without
    the "video" driver capability) or a failing call gives `available=False` and the reason.
    Hopper (H100/H200) decodes neither AV1 nor 10-bit H.264 and needs HEVC >= 144x144 and VP9/AV1
    >= 128x128 (NVDEC application note); this is where a loader learns it before sending a sample."""
    with _nvdec_lock:
        caps = _nvdec_cache.get(device_id)
        if caps is None:
            try:
                caps = {"available": True, "error": None, "codecs": _nvdec_query(device_id)}
            except Exception as exc:  # OSError: no libcuda/libnvcuvid; RuntimeError: a driver error
                caps = {"available": False, "error": f"{type(exc).__name__}: {exc}", "codecs": {}}
            _nvdec_cache[device_id] = caps
        return caps


def nvdec_route(caps: dict[str, Any], codec: str, bits: int, width: int, height: int) -> str | None:
    """None when NVDEC (per `caps`, from `nvdec_caps`) decodes a 4:2:0 `codec` video of `bits` and
    `width` x `height`; else why not, which sends the sample to the CPU path instead."""
    if not caps.get("available"):
        return f"no NVDEC here ({caps.get('error')})"
    key = nvdec_key(codec, bits)
    c = caps.get("codecs", {}).get(key)
    if c is None:
        return f"NVDEC is not used for {key}"
    if not c["supported"]:
        return f"this GPU's NVDEC does not decode {key}"
    (w0, h0), (w1, h1) = c["min"], c["max"]
    if not (w0 <= width <= w1 and h0 <= height <= h1):
        return f"{width}x{height} is outside NVDEC's {w0}x{h0}..{w1}x{h1} for {key}"
    if c.get("max_mb") and width * height // 256 > c["max_mb"]:
        return f"{width}x{height} is over NVDEC's {c['max_mb']} macroblocks for {key}"
    return None


def nvdec_refused(message: str) -> bool:
    """Whether a DALI "mixed" video error is NVDEC refusing the stream (`NVDEC_REFUSALS`), which
    means "decode it elsewhere", not "corrupt"."""
    return any(r in message for r in NVDEC_REFUSALS)


def nvdec_summary(caps: dict[str, Any]) -> str:
    """One line: each probed codec's size range, or "no" (the GPU check's `nvdec` row)."""
    if not caps.get("available"):
        return f"no NVDEC: {caps.get('error')}"
    parts = []
    for key, c in caps["codecs"].items():
        parts.append(f"{key} {c['min'][0]}x{c['min'][1]}+" if c["supported"] else f"{key} no")
    return ", ".join(parts)
