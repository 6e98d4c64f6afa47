"""The video and audio step of a GPU check: NVDEC clips against PyAV by PSNR, clips/s per codec,
DALI audio decoding and log-mel shapes.

    python bench/media_gpu_check.py make DIR                  # here (needs PyAV): clips + references
    python bench/media_gpu_check.py check DIR --device mixed --out OUT   # on the GPU host (no PyAV)
    python bench/media_gpu_check.py check DIR --device cpu    # the same check on a CPU host (tests)

`make` writes small clips (H.264, HEVC and VP9, `W`x`H` = 192x160, 24 frames, GOP 8, a moving
pattern) and a FLAC and a WAV recording to DIR, with what PyAV decodes from them (`ref.npz`: only
the frames the check compares, and the recordings resampled to 16 kHz), so the GPU host needs no
PyAV. 192x160: NVDEC refuses coded sizes under its per-codec minimum (`cuvidGetDecoderCaps`
`nMinWidth`/`nMinHeight`; DALI's "Video is too small in at least one dimension"): 144x144 for
HEVC, 128x128 for VP9 and AV1, 48x16 for H.264 on Turing to Hopper (NVDEC application note,
audit 4 R2), so every side is >= `MIN_SIDE` = 144 and a multiple of 16.

`check` decodes, with `gdsload.decode.video.VideoDecoder(device=...)` and the clip positions a
`VideoTransform(frames=6, stride=3, clips=2, size=None, dtype="uint8")` draws, the two rows of
every clip and compares each returned frame with PyAV's frame of the same index: PSNR >= 30 dB per
frame passes (YUV->RGB conversions differ by rounding, not by frame). Then `--runs` more decodes of
the same batch, timed: clips/s. Then the same clips once more through the crop path (`CROP`: the
centre 160x160 square at 1:1, so nothing is resampled, ImageNet-normalised, "NCTHW"), untimed:
the output un-normalised against PyAV's square, PSNR >= 30 dB per frame, is part of PASS.

With `--device mixed` the output is device memory written on a private stream, as in the loader
(`VideoDecoder`'s one mixed pipeline: NVDEC, then crop, normalisation and layout on the GPU,
`copy_to_external`; audit 4 R11), read back once for the comparison; the clips/s are of that
path. A host without CuPy or a CUDA device decodes with `device="cpu"` and says so. With
`--device mixed` each clip is routed as the decoder routes it (`gdsload.host.gpu.nvdec_route` over
this GPU's NVDEC capabilities): NVDEC when it takes the codec, bit depth and size, else the CPU
path. The row says where it ran (`on`: "gpu" only when
every sample went to NVDEC, from the decoder's own `routes` counters) and where the probe said it
would run (`expect`); the verdict FAILs a row whose two differ, so a CPU fallback is never reported
as a GPU figure. A CPU fallback that cannot decode on the GPU host (H.264/HEVC need PyAV, which
is not carried) is an INFO row that says so. With `--device cpu` (a CPU host) DALI's CPU build
takes VP9 only; the rest go to PyAV there and are SKIP rows here. Audio: `AudioDecoder` (DALI's
CPU decoder: rows labelled "cpu" even on a GPU host) against PyAV's resampled waveforms
(correlation >= 0.99) and log-mel finite with the expected shape. `pass_nvdec`: a preprocessing
pass's NVDEC frames (`gdsload.preprocess.gpu.NvdecFrames`, what `gdsload.process(frames=...)` runs
on a GPU host) over the H.264 clip at its own 24 fps in windows of `PASS_WINDOW`, every frame
against PyAV's by PSNR (>= 30 dB), then whole passes timed for `PASS_SECONDS`: frames/s; the clip's
demuxed timestamps come from `make` (`pass.json`: no PyAV on the GPU host); INFO where the probe
routes H.264 to the CPU, SKIP with `--device cpu`.

Each row is printed as one JSON line (`{"step", "status", "figure", "on", "expect"}`) as soon as
its step ends, and with `--out` added at once to OUT/gpu-check.json (bench/gpu_table.py), so a
check cut short by its timeout keeps the rows it finished. Exit 1 on any FAIL, 3 when the check
itself crashed (gpu_check.sh's "media" row).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from pathlib import Path

import numpy as np

CODECS = {"h264": ("libx264", "mp4", {"preset": "ultrafast"}),
          "hevc": ("libx265", "mp4", {"preset": "ultrafast", "x265-params": "log-level=error"}),
          "vp9": ("libvpx-vp9", "webm", {"deadline": "realtime", "cpu-used": "8", "lag-in-frames": "0"})}
W, H, N = 192, 160, 24
MIN_SIDE = 144  # NVDEC's largest per-codec minimum on Turing..Hopper (HEVC 144x144)
ROWS = 2  # decoded samples per codec (the same clip twice, two draws)
TRANSFORM = dict(frames=6, stride=3, clips=2, sampling="random", size=None, dtype="uint8", layout="NTHWC")
# the same clips cropped and normalised: the centre H x H square at 1:1 (no resampling), "NCTHW"
CROP = dict(TRANSFORM, size=H, train=False, resize=H, dtype="float32", layout="NCTHW")
SEED, SALT = 1, 0x7669
STEPS = [f"video_{c}" for c in CODECS] + ["pass_nvdec", "audio_flac", "audio_wav"]
PASS_SECONDS = 4.0  # pass_nvdec: timed passes over the H.264 clip for about this long (frames/s)
PASS_WINDOW = 8  # frames per window of the pass (every frame picked: the clip's own 24 fps)


def _pattern(i: int) -> np.ndarray:
    """Frame i: 32x32 blocks of mid colours drawn from seed i (every frame unlike its neighbours, and
    flat blocks aligned to the codecs' blocks decode to flat blocks, so `ref.npz` compresses)."""
    grid = np.random.default_rng(1000 + i).integers(48, 208, (H // 32, W // 32, 3), dtype=np.uint8)
    return np.kron(grid, np.ones((32, 32, 1), np.uint8))


def _draws() -> np.ndarray:
    from gdsload.decode import media

    return media.draws(SEED, 0, np.arange(ROWS), SALT, k=6)


def compared_frames(n_frames: int = N) -> np.ndarray:
    """The source frame indices the check compares (both rows, both clips): sorted, unique."""
    from gdsload.decode import media

    u = _draws()
    t = TRANSFORM
    idx = [media.clip_indices(n_frames, t["frames"], t["stride"], t["clips"], t["sampling"], float(u[i, 0]))
           for i in range(ROWS)]
    allidx = np.concatenate([i.reshape(-1) for i in idx])
    return np.unique(allidx[allidx >= 0])


def make(d: Path) -> None:
    import io

    import av

    from gdsload.bench import mediagen as mg
    from gdsload.decode.media import rgb24_scaler

    d.mkdir(parents=True, exist_ok=True)
    keep = compared_frames()
    ref = {}
    for name, (enc, container, opts) in CODECS.items():
        buf = io.BytesIO()
        with av.open(buf, "w", format=container) as c:
            s = c.add_stream(enc, rate=24)
            s.width, s.height, s.pix_fmt = W, H, "yuv420p"
            s.codec_context.gop_size = 8
            s.options = dict(opts)
            for i in range(N):
                for p in s.encode(av.VideoFrame.from_ndarray(_pattern(i), format="rgb24")):
                    c.mux(p)
            for p in s.encode():
                c.mux(p)
        (d / f"{name}.{container}").write_bytes(buf.getvalue())
        with av.open(io.BytesIO(buf.getvalue())) as c:
            rgb24 = rgb24_scaler()
            frames = np.stack([rgb24(f) for f in c.decode(c.streams.video[0])])
        assert len(frames) == N, (name, len(frames))
        ref[name] = frames[keep]  # only what the check compares (audit 4 R2: keep .media small)
        ref[f"{name}_frames"] = keep
    for name, data in (("flac", mg.encode_audio("flac", seconds=1.5, sample_rate=22050, freq=330)),
                       ("wav", mg.encode_audio("wav", seconds=0.7, sample_rate=8000, freq=500))):
        (d / f"tone.{name}").write_bytes(data)
        with av.open(io.BytesIO(data)) as c:
            rs = av.AudioResampler(format="flt", layout="mono", rate=16000)
            parts = [g.to_ndarray().reshape(-1) for f in c.decode(c.streams.audio[0]) for g in rs.resample(f)]
            parts += [g.to_ndarray().reshape(-1) for g in rs.resample(None)]
        ref[f"audio_{name}"] = np.concatenate(parts)
    np.savez_compressed(d / "ref.npz", **ref)
    from gdsload.preprocess.gpu import demux  # the pass's timestamps (PyAV demuxes; not on the GPU host)

    info = demux((d / "h264.mp4").read_bytes())
    info["times"], info["ends"] = ([[x.numerator, x.denominator] for x in info[k]] for k in ("times", "ends"))
    (d / "pass.json").write_text(json.dumps(info))
    meta = {name: {"frames": N, "codec": name, "width": W, "height": H, "fps": 24.0, "keyint": 8, "bits": 8}
            for name in CODECS}
    (d / "meta.json").write_text(json.dumps(meta))


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return 99.0 if mse == 0 else 10 * np.log10(255.0**2 / mse)


class _Rows:
    """Rows as they end: a JSON line on stdout, and OUT/gpu-check.json when `out` is given."""

    def __init__(self, out: Path | None):
        self.rows: list[dict] = []
        self.report = None
        if out is not None:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from gpu_table import Report

            self.report = Report(out, echo=False)
        self.t = time.perf_counter()

    def add(self, step: str, status: str, figure: str, on: str, expect: str, **detail) -> None:
        seconds = time.perf_counter() - self.t
        row = {"step": step, "status": status, "figure": figure, "on": on, "expect": expect}
        self.rows.append(row)
        print(json.dumps(row), flush=True)
        if self.report is not None:
            self.report.add(step, status, figure, None, seconds, on=on, expect=expect, **detail)
        self.t = time.perf_counter()


def _route(device: str, codec: str, meta: dict) -> tuple[str, str]:
    """(where the probe says this clip decodes: "gpu" | "cpu", why) for `device`."""
    if device != "mixed":
        return "cpu", "device='cpu'"
    from gdsload.host import gpu

    why = gpu.nvdec_route(gpu.nvdec_caps(0), codec, int(meta.get("bits", 8)), int(meta["width"]),
                          int(meta["height"]))
    return ("cpu", why) if why else ("gpu", "NVDEC takes it")


def _video(rows: _Rows, d: Path, name: str, device: str, ref, meta: dict, runs: int) -> None:
    from gdsload.decode import media
    from gdsload.decode.video import VideoDecoder, VideoTransform
    from gdsload.errors import MissingDependencyError

    t = VideoTransform(**TRANSFORM)
    path = next(d.glob(f"{name}.*"))
    on_dali = media.NVDEC_VIDEO if device == "mixed" else media.DALI_CPU_VIDEO
    if name not in on_dali:
        rows.add(f"video_{name}", "SKIP", f"{device} decoding does not take {name}", "cpu", "cpu")
        return
    expect, why = _route(device, name, meta)
    enc = np.frombuffer(path.read_bytes(), np.uint8)
    u = _draws()
    out = np.zeros((ROWS, *t.output_shape((H, W))), np.uint8)
    idx = np.zeros((ROWS, *t.frames_shape()), np.int64)
    dst, kw, stream, dec_device = out, {}, None, device
    if device == "mixed":  # as the loader: into device memory on a private stream (audit 4 R11)
        try:
            import cupy

            cupy.cuda.runtime.getDeviceCount()  # raises without a CUDA device
            stream = cupy.cuda.Stream(non_blocking=True)
            dst = cupy.zeros(out.shape, out.dtype)
            kw = {"host": np.zeros_like(out), "stream": ctypes.c_void_p(stream.ptr)}
        except Exception as exc:  # noqa: BLE001 (no CuPy or no device: nothing runs on a GPU here)
            dec_device, why = "cpu", f"{why}; no CUDA device for the output ({type(exc).__name__})"
    dec = VideoDecoder(t, batch_size=ROWS, threads=2, device=dec_device)
    args = ([enc] * ROWS, [f"{name}:{i}" for i in range(ROWS)], [meta] * ROWS, u, dst, idx)
    try:
        kept = dec.decode_into(*args, **kw)
    except MissingDependencyError as exc:  # the CPU fallback needs PyAV, which the GPU host lacks
        routes = dict(dec.routes)
        on = "gpu" if routes.get("nvdec") and len(routes) == 1 else "cpu"
        rows.add(f"video_{name}", "INFO" if expect == "cpu" else "FAIL",
                 f"routed to the CPU ({why}); not decoded here: {exc}"[:300], on, expect, routes=routes)
        return
    if stream is not None:
        out[...] = dst.get(stream=stream)
    routes = dict(dec.routes)
    on = "gpu" if routes.get("nvdec") == ROWS and len(routes) == 1 else "cpu"
    stored = ref[f"{name}_frames"]
    psnrs, missing = [], []
    for i in kept:
        for c in range(t.clips):
            for k in range(t.frames):
                j = int(idx[i, c, k])
                if j < 0:
                    continue
                pos = int(np.searchsorted(stored, j))
                if pos >= len(stored) or stored[pos] != j:
                    missing.append(j)
                    continue
                psnrs.append(_psnr(out[i, c, k], ref[name][pos]))
    crop_psnrs = _cropped(dec_device, dst is not out, enc, meta, name, u, idx, stored, ref[name])
    t0 = time.perf_counter()
    for _ in range(runs):
        dec.decode_into(*args, **kw)
    if stream is not None:
        stream.synchronize()
    rate = runs * ROWS * t.clips / max(time.perf_counter() - t0, 1e-9)
    ok = (len(kept) == ROWS and bool(psnrs) and not missing and min(psnrs) >= 30.0 and bool(crop_psnrs)
          and min(crop_psnrs) >= 30.0)
    label = "nvdec" if on == "gpu" else "cpu" if device == "cpu" else f"cpu fallback ({why})"
    figure = (f"{label}: {rate:.1f} clips/s; {len(psnrs)} frames, PSNR min "
              f"{min(psnrs) if psnrs else float('nan'):.1f} dB, median "
              f"{float(np.median(psnrs)) if psnrs else float('nan'):.1f}; cropped and normalised: PSNR min "
              f"{min(crop_psnrs) if crop_psnrs else float('nan'):.1f} dB")
    rows.add(f"video_{name}", "PASS" if ok else "FAIL", figure, on, expect, clips_per_s=rate, routes=routes,
             frames=idx[0].tolist(), not_in_reference=missing[:10], psnr_min=min(psnrs) if psnrs else None,
             crop_psnr_min=min(crop_psnrs) if crop_psnrs else None)
    dec.close()


def _pass_nvdec(rows: _Rows, d: Path, device: str, ref, meta: dict) -> None:
    """A pass's NVDEC frames (`gdsload.preprocess.gpu.NvdecFrames`, what `gdsload.process(frames=...)`
    runs on a GPU host) over the H.264 clip at its own 24 fps in windows of `PASS_WINDOW`: every
    frame picked once, checked against PyAV's by PSNR, then passes timed for `PASS_SECONDS`:
    frames/s. The demuxed timestamps come from `make` (pass.json: no PyAV on the GPU host)."""
    from fractions import Fraction

    expect, why = _route(device, "h264", meta)
    if expect != "gpu":
        rows.add("pass_nvdec", "INFO" if device == "mixed" else "SKIP",
                 f"a pass decodes on the CPU here ({why}): no NVDEC figure", "cpu", "cpu")
        return
    from gdsload.preprocess.gpu import NvdecFrames

    info = json.loads((d / "pass.json").read_text())
    info["times"], info["ends"] = ([Fraction(*x) for x in info[k]] for k in ("times", "ends"))
    enc = np.frombuffer((d / "h264.mp4").read_bytes(), np.uint8)
    nv = NvdecFrames(0)

    def one_pass(keep: bool) -> tuple[int, list]:
        n, got = 0, []
        for w in nv._nvdec(enc, info, 24.0, PASS_WINDOW, None, 0):
            n += int((w.t >= 0).sum())
            if keep:
                got.append(w.data.get())
        return n, got

    n, got = one_pass(True)
    frames = np.concatenate(got)[:n]
    stored = ref["h264_frames"]
    psnrs = [_psnr(frames[j], ref["h264"][pos]) for pos, j in enumerate(stored) if j < n]
    t0, total, passes = time.perf_counter(), 0, 0
    while time.perf_counter() - t0 < PASS_SECONDS:
        total += one_pass(False)[0]
        passes += 1
    rate = total / max(time.perf_counter() - t0, 1e-9)
    ok = n == N and len(psnrs) == len(stored) and min(psnrs) >= 30.0
    rows.add("pass_nvdec", "PASS" if ok else "FAIL",
             f"nvdec: {rate:.0f} frames/s for a pass ({W}x{H} H.264, {N} frames a pass in windows of "
             f"{PASS_WINDOW}, {passes} passes); {n} frames, PSNR min {min(psnrs) if psnrs else float('nan'):.1f} dB",
             "gpu", expect, frames_per_s=rate, frames=n, psnr_min=min(psnrs) if psnrs else None)


def _cropped(device: str, on_device: bool, enc: np.ndarray, meta: dict, name: str, u: np.ndarray,
             idx: np.ndarray, stored: np.ndarray, ref: np.ndarray) -> list[float]:
    """The same clips through the crop path (`CROP`: the centre H x H square at 1:1, so no
    resampling to compare, then ImageNet normalisation, "NCTHW" with 2 clips: on a GPU the mixed
    pipeline's resize, sequence_rearrange, crop_mirror_normalize, reshape and transpose), decoded
    once (not timed); PSNR per frame of the output un-normalised against PyAV's centre square."""
    from gdsload.decode.video import VideoDecoder, VideoTransform

    t = VideoTransform(**CROP)
    out = np.zeros((ROWS, *t.output_shape()), np.float32)
    frames = np.zeros((ROWS, *t.frames_shape()), np.int64)
    dec = VideoDecoder(t, batch_size=ROWS, threads=2, device=device)
    args = ([enc] * ROWS, [f"{name}:{i}" for i in range(ROWS)], [meta] * ROWS, u)
    if on_device:
        import cupy

        stream = cupy.cuda.Stream(non_blocking=True)
        dst = cupy.zeros(out.shape, out.dtype)
        kept = dec.decode_into(*args, dst, frames, host=np.zeros_like(out), stream=ctypes.c_void_p(stream.ptr))
        out[...] = dst.get(stream=stream)
    else:
        kept = dec.decode_into(*args, out, frames)
    dec.close()
    if kept != list(range(ROWS)) or not np.array_equal(frames, idx):
        return []
    mean = np.array(t.mean, np.float32)[:, None, None] * 255
    std = np.array(t.std, np.float32)[:, None, None] * 255
    x0 = (W - H) // 2
    psnrs = []
    for i in range(ROWS):
        for c in range(t.clips):
            for k in range(t.frames):
                j = int(frames[i, c, k])
                pos = int(np.searchsorted(stored, j))
                if j < 0 or pos >= len(stored) or stored[pos] != j:
                    continue
                back = np.clip(out[i, c, :, k] * std + mean, 0, 255).transpose(1, 2, 0)
                psnrs.append(_psnr(back, ref[pos][:, x0 : x0 + H]))
    return psnrs


def _audio(rows: _Rows, d: Path, name: str, ref) -> None:
    from gdsload.decode.audio import AudioDecoder, AudioTransform

    wave_t = AudioTransform(sample_rate=16000, seconds=2.0, crop="start")
    enc = np.frombuffer((d / f"tone.{name}").read_bytes(), np.uint8)
    out, n = np.zeros((1, wave_t.samples), np.float32), np.zeros(1, np.int64)
    AudioDecoder(wave_t, batch_size=1).decode_into([enc], [name], [None], np.zeros((1, 6)), out, n)
    r = ref[f"audio_{name}"]
    m = min(int(n[0]), len(r))
    corr = float(np.corrcoef(out[0, 200 : m - 200], r[200 : m - 200])[0, 1])
    feat_t = AudioTransform(sample_rate=16000, seconds=2.0, crop="start", features="logmel", n_mels=64)
    f = np.zeros((1, *feat_t.output_shape()), np.float32)
    AudioDecoder(feat_t, batch_size=1).decode_into([enc], [name], [None], np.zeros((1, 6)), f, n)
    ok = corr >= 0.99 and abs(int(n[0]) - (1 + m // 160)) <= 2 and np.isfinite(f).all()
    rows.add(f"audio_{name}", "PASS" if ok else "FAIL",
             f"cpu (DALI's CPU audio decoder): {m} samples, correlation with PyAV {corr:.4f}, log-mel {f.shape[1:]}",
             "cpu", "cpu")


def check(d: Path, device: str, out: Path | None = None, runs: int = 8) -> list[dict]:
    ref = np.load(d / "ref.npz")
    meta = json.loads((d / "meta.json").read_text())
    rows = _Rows(out)
    for name in CODECS:
        try:
            _video(rows, d, name, device, ref, meta[name], runs)
        except Exception as exc:  # noqa: BLE001 (a step's failure is its row)
            rows.add(f"video_{name}", "FAIL", f"{type(exc).__name__}: {exc}"[:400], "", "")
    try:
        _pass_nvdec(rows, d, device, ref, meta["h264"])
    except Exception as exc:  # noqa: BLE001
        rows.add("pass_nvdec", "FAIL", f"{type(exc).__name__}: {exc}"[:400], "", "gpu")
    for name in ("flac", "wav"):
        try:
            _audio(rows, d, name, ref)
        except Exception as exc:  # noqa: BLE001
            rows.add(f"audio_{name}", "FAIL", f"{type(exc).__name__}: {exc}"[:400], "cpu", "cpu")
    return rows.rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["make", "check"])
    p.add_argument("dir", type=Path)
    p.add_argument("--device", choices=["mixed", "cpu"], default="mixed")
    p.add_argument("--out", type=Path, default=None, help="add each row to OUT/gpu-check.json as it ends")
    p.add_argument("--runs", type=int, default=8, help="timed decodes per codec after the checked one (clips/s)")
    a = p.parse_args(argv)
    if a.what == "make":
        make(a.dir)
        print(f"made {sorted(x.name for x in a.dir.iterdir())}, {sum(x.stat().st_size for x in a.dir.iterdir())} bytes")
        return 0
    try:
        rows = check(a.dir, a.device, a.out, a.runs)
    except Exception:  # before or between rows (an unreadable ref.npz): not a FAIL row, a crash
        import traceback

        traceback.print_exc()
        return 3
    return 1 if any(r["status"] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
