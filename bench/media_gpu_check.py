"""The video and audio step of a GPU check: NVDEC clips against PyAV by PSNR, DALI audio decoding and log-mel shapes.

    python bench/media_gpu_check.py make DIR                  # here (needs PyAV): clips + references
    python bench/media_gpu_check.py check DIR --device mixed  # on the GPU host (DALI only, no PyAV)
    python bench/media_gpu_check.py check DIR --device cpu    # the same check on a CPU host (tests)

`make` writes small clips (H.264, HEVC and VP9, 160x96, 24 frames, GOP 8, a moving pattern) and a
FLAC and a WAV recording to DIR, with what PyAV decodes from them (`ref.npz`: every frame as RGB,
and the recordings resampled to 16 kHz), about 2 MB in all, so the GPU host needs no PyAV.
`check` decodes, with `gdsload.decode.video.VideoDecoder(device=...)` and the clip positions a
`VideoTransform(frames=6, stride=3, clips=2, size=None, dtype="uint8")` draws, every clip whose
codec the device decodes ("mixed": NVDEC takes all three; "cpu": DALI's CPU build takes VP9 only,
the rest go to PyAV and are skipped here) and compares each returned frame with PyAV's frame of
the same index: PSNR >= 30 dB per frame passes (YUV->RGB conversions differ by rounding, not by
frame). Audio: `AudioDecoder` waveforms against PyAV's resampled ones (correlation >= 0.99) and
log-mel finite with the expected shape. Prints one JSON line per step (`{"step", "status",
"figure"}`) and exits 1 on any FAIL.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

CODECS = {"h264": ("libx264", "mp4", {"preset": "ultrafast"}), "hevc": ("libx265", "mp4", {"preset": "ultrafast"}),
          "vp9": ("libvpx-vp9", "webm", {"deadline": "realtime", "cpu-used": "8", "lag-in-frames": "0"})}
W, H, N = 160, 96, 24


def _pattern(i: int) -> np.ndarray:
    y, x = np.mgrid[0:H, 0:W]
    return np.stack([(x * 2 + 6 * i) % 256, (y * 3 + 4 * i) % 256, (x + y + 9 * i) % 256], -1).astype(np.uint8)


def make(d: Path) -> None:
    import io

    import av

    from gdsload.bench import mediagen as mg

    d.mkdir(parents=True, exist_ok=True)
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
            ref[name] = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(c.streams.video[0])])
    for name, data in (("flac", mg.encode_audio("flac", seconds=1.5, sample_rate=22050, freq=330)),
                       ("wav", mg.encode_audio("wav", seconds=0.7, sample_rate=8000, freq=500))):
        (d / f"tone.{name}").write_bytes(data)
        with av.open(io.BytesIO(data)) as c:
            rs = av.AudioResampler(format="flt", layout="mono", rate=16000)
            parts = [g.to_ndarray().reshape(-1) for f in c.decode(c.streams.audio[0]) for g in rs.resample(f)]
            parts += [g.to_ndarray().reshape(-1) for g in rs.resample(None)]
        ref[f"audio_{name}"] = np.concatenate(parts)
    np.savez_compressed(d / "ref.npz", **ref)
    meta = {name: {"frames": N, "codec": name, "width": W, "height": H, "fps": 24.0, "keyint": 8}
            for name in CODECS}
    (d / "meta.json").write_text(json.dumps(meta))


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return 99.0 if mse == 0 else 10 * np.log10(255.0**2 / mse)


def check(d: Path, device: str) -> list[dict]:
    from gdsload.decode import media
    from gdsload.decode.audio import AudioDecoder, AudioTransform
    from gdsload.decode.video import VideoDecoder, VideoTransform

    ref = np.load(d / "ref.npz")
    meta = json.loads((d / "meta.json").read_text())
    rows = []
    on_dali = media.NVDEC_VIDEO if device == "mixed" else media.DALI_CPU_VIDEO
    t = VideoTransform(frames=6, stride=3, clips=2, sampling="random", size=None, dtype="uint8", layout="NTHWC")
    for name in CODECS:
        path = next(d.glob(f"{name}.*"))
        if name not in on_dali:
            rows.append({"step": f"video_{name}", "status": "SKIP", "figure": f"{device} decoding does not take {name}"})
            continue
        try:
            dec = VideoDecoder(t, batch_size=2, threads=2, device=device)
            enc = np.frombuffer(path.read_bytes(), np.uint8)
            u = media.draws(1, 0, np.arange(2), 0x7669, k=6)
            out = np.zeros((2, *t.output_shape((H, W))), np.uint8)
            idx = np.zeros((2, *t.frames_shape()), np.int64)
            kept = dec.decode_into([enc, enc], [f"{name}:0", f"{name}:1"], [meta[name], meta[name]], u, out, idx)
            psnrs = [_psnr(out[i, c, k], ref[name][idx[i, c, k]]) for i in kept for c in range(t.clips)
                     for k in range(t.frames) if idx[i, c, k] >= 0]
            ok = len(kept) == 2 and psnrs and min(psnrs) >= 30.0
            rows.append({"step": f"video_{name}", "status": "PASS" if ok else "FAIL",
                         "figure": f"{len(psnrs)} frames, PSNR min {min(psnrs):.1f} dB, median "
                                   f"{float(np.median(psnrs)):.1f} dB (frames {idx[0].tolist()})"})
        except Exception as exc:  # noqa: BLE001 (a step's failure is its row)
            rows.append({"step": f"video_{name}", "status": "FAIL", "figure": f"{type(exc).__name__}: {exc}"[:400]})
    for name in ("flac", "wav"):
        try:
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
            rows.append({"step": f"audio_{name}", "status": "PASS" if ok else "FAIL",
                         "figure": f"{m} samples, correlation with PyAV {corr:.4f}, log-mel {f.shape[1:]}"})
        except Exception as exc:  # noqa: BLE001
            rows.append({"step": f"audio_{name}", "status": "FAIL", "figure": f"{type(exc).__name__}: {exc}"[:400]})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["make", "check"])
    p.add_argument("dir", type=Path)
    p.add_argument("--device", choices=["mixed", "cpu"], default="mixed")
    a = p.parse_args(argv)
    if a.what == "make":
        make(a.dir)
        print(f"made {sorted(x.name for x in a.dir.iterdir())}, {sum(x.stat().st_size for x in a.dir.iterdir())} bytes")
        return 0
    rows = check(a.dir, a.device)
    for r in rows:
        print(json.dumps(r))
    return 1 if any(r["status"] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
