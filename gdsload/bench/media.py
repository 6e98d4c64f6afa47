"""Video and audio benchmark: gdsload against torch DataLoader + PyAV, SPDL and torchcodec.

Video: 16-frame clips, frames 2 apart, eval transform (short side resized to 256, centre crop
224, float32 normalised, NCTHW), clip positions `sampling="random"` drawn for each sample from
`gdsload.decode.media.draws(seed, epoch, id)` -- every contestant decodes the same frames.
Audio: 10 s at 16 kHz, mono, random crop from the same draws, log-mel (80 mels, n_fft 400, hop
160; the baselines with `torch.stft`). The same number of threads everywhere: gdsload's reader
and DALI threads, torch DataLoader's worker processes, SPDL's and torchcodec's thread pools.

Each run is a fresh subprocess (`python -m gdsload.bench.media RUN '{json}'`) whose process
tree's PSS is sampled for the peak; contestants are interleaved round by round. Printed: clips
(or recordings) per second per round, medians, gdsload's ratio to each, peak memory, and decode
amplification (frames decoded / frames returned) where the contestant can count it.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

FRAMES, STRIDE, SIZE, RESIZE = 16, 2, 224, 256
SR, SECONDS, N_MELS, N_FFT, HOP = 16000, 10.0, 80, 400, 160
MEAN = np.array([0.485, 0.456, 0.406], np.float32) * 255
STD = np.array([0.229, 0.224, 0.225], np.float32) * 255


# -- data --------------------------------------------------------------------------------------------
def make_sets(root: Path, *, videos: int, audios: int, width: int = 640, height: int = 360,
              video_frames: int = 60, audio_seconds: float = 12.0, log=print) -> dict[str, Path]:
    """Datasets under `root`: "h264" and "vp9" (videos / 2 each, `video_frames` at 30 fps, a
    moving pattern), "flac" (`audios` recordings); kept when already there."""
    from gdsload.bench import mediagen as mg
    from gdsload.convert.shards import DatasetWriter

    def pattern(i: int, h: int, w: int) -> np.ndarray:
        y, x = np.mgrid[0:h, 0:w]
        return np.stack([(x + 4 * i) % 256, (y + 2 * i) % 256, ((x + y) // 2 + i) % 256], -1).astype(np.uint8)

    out = {}
    for codec in ("h264", "vp9"):
        d = root / codec
        out[codec] = d
        if (d / "manifest.json").exists() or not videos:
            continue
        t0 = time.perf_counter()
        with DatasetWriter(d, shard_size=256 << 20) as w:
            for i in range(max(1, videos // 2)):
                w.write(f"v{i:05d}", {mg.EXT[codec]: mg.encode_video(codec, frames=video_frames, width=width,
                                                                     height=height, fps=30, gop=30,
                                                                     pattern=pattern),
                                      "cls": b"%d" % (i % 10)})
        log(f"made {d} in {time.perf_counter() - t0:.0f} s")
    d = root / "flac"
    out["flac"] = d
    if audios and not (d / "manifest.json").exists():
        t0 = time.perf_counter()
        with DatasetWriter(d, shard_size=256 << 20) as w:
            for i in range(audios):
                w.write(f"a{i:05d}", {"flac": mg.encode_audio("flac", seconds=audio_seconds, sample_rate=SR,
                                                              freq=200 + 10 * (i % 50)), "cls": b"%d" % (i % 10)})
        log(f"made {d} in {time.perf_counter() - t0:.0f} s")
    return out


def _members(dataset: str, field: str) -> list[tuple[str, int, int, int]]:
    """(shard path, offset, size, global id) of every sample's `field` member, in id order."""
    from gdsload.dataset.sharded import open_dataset

    out = []
    with open_dataset(dataset) as ds:
        gid = 0
        for s in range(len(ds.shards)):
            idx = ds.index(s)
            path = ds.shard_path(s)
            for j in range(idx.num_samples):
                o, n = next((o, n) for e, o, n in idx.members(j) if e == field)
                out.append((path, o, n, gid))
                gid += 1
    return out


def _field(dataset: str) -> tuple[str, str]:
    m = json.loads((Path(dataset) / "manifest.json").read_text())
    return next((f, k) for f, k in m["fields"].items() if k in ("video", "audio"))


# -- contestants (run in a subprocess) ---------------------------------------------------------------
def _indices(kind: str, field: str, n: int, gid: int, seed: int) -> Any:
    """The draws gdsload's loader uses for sample `gid` (epoch 0), so baselines sample alike."""
    from gdsload.decode import audio, video
    from gdsload.decode.media import clip_indices, draws
    from gdsload.loader.fill import zlib_crc

    salt = (video.SALT if kind == "video" else audio.SALT) + 0x10000 * zlib_crc(field)
    u = draws(seed, 0, np.array([gid]), salt, k=6)[0]
    if kind == "video":
        return clip_indices(n, FRAMES, STRIDE, 1, "random", float(u[0]))[0]
    return float(u[0])


def _crop_resize_torch(frames: np.ndarray) -> Any:
    """(T, H, W, 3) uint8 -> (3, T, 224, 224) float32: short side to 256, centre crop, normalised."""
    import torch
    import torch.nn.functional as F

    x = torch.from_numpy(frames).permute(0, 3, 1, 2).float()
    h, w = x.shape[2:]
    s = RESIZE / min(h, w)
    x = F.interpolate(x, size=(round(h * s), round(w * s)), mode="bilinear", antialias=True, align_corners=False)
    h, w = x.shape[2:]
    y0, x0 = (h - SIZE) // 2, (w - SIZE) // 2
    x = x[:, :, y0 : y0 + SIZE, x0 : x0 + SIZE]
    x = (x - torch.from_numpy(MEAN)[None, :, None, None]) / torch.from_numpy(STD)[None, :, None, None]
    return x.permute(1, 0, 2, 3).contiguous()


@functools.cache
def _torch_mel() -> tuple[Any, Any]:
    """The baselines' Hann window and mel filters as tensors, made once per process (as a user's
    `torchaudio.transforms.MelSpectrogram` holds them), not per recording."""
    import torch

    from gdsload.decode.audio import mel_filters

    return torch.hann_window(N_FFT), torch.from_numpy(mel_filters(SR, N_FFT, N_MELS))


def _logmel_torch(x: np.ndarray) -> Any:
    import torch

    window, fb = _torch_mel()
    t = torch.from_numpy(np.ascontiguousarray(x, np.float32))
    spec = torch.stft(t, N_FFT, HOP, window=window, center=True, pad_mode="reflect",
                      return_complex=True).abs().pow(2)
    return 10 * torch.log10(torch.clamp(fb @ spec, min=1e-10))


def _crop_audio(x: np.ndarray, u: float) -> np.ndarray:
    L = int(SR * SECONDS)
    room = max(0, len(x) - L)
    start = min(int(u * (room + 1)), room)
    out = np.zeros(L, np.float32)
    seg = x[start : start + L]
    out[: len(seg)] = seg
    return out


def _read(path: str, o: int, n: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(o)
        return f.read(n)


def _pyav_video(data: bytes, want: np.ndarray) -> tuple[np.ndarray, int]:
    import io

    import av

    from gdsload.decode.media import rgb24_scaler

    valid = want[want >= 0]
    last, need = int(valid.max()), set(valid.tolist())
    got: dict[int, np.ndarray] = {}
    n = 0
    rgb24 = rgb24_scaler()
    with av.open(io.BytesIO(data)) as c:
        for f in c.decode(c.streams.video[0]):
            if n in need:
                got[n] = rgb24(f)
            n += 1
            if n > last:
                break
    return np.stack([got[i] for i in valid.tolist()]), n


def _pyav_audio(data: bytes) -> np.ndarray:
    import io

    import av

    parts = []
    with av.open(io.BytesIO(data)) as c:
        rs = av.AudioResampler(format="flt", layout="mono", rate=SR)
        for f in c.decode(c.streams.audio[0]):
            parts += [g.to_ndarray().reshape(-1) for g in rs.resample(f)]
        parts += [g.to_ndarray().reshape(-1) for g in rs.resample(None)]
    return np.concatenate(parts)


class _TorchSet:
    """Map-style dataset for torch's DataLoader: bytes by the index, PyAV decode, torch transform."""

    def __init__(self, dataset: str, seed: int):
        self.field, self.kind = _field(dataset)
        self.members = _members(dataset, self.field)
        self.seed = seed
        self.meta = None
        if self.kind == "video":
            from gdsload.dataset.sharded import open_dataset

            with open_dataset(dataset) as ds:
                self.meta = [ds.index(s).media_info(self.field, j)["frames"]
                             for s in range(len(ds.shards)) for j in range(ds.index(s).num_samples)]

    def __len__(self) -> int:
        return len(self.members)

    def __getitem__(self, i: int) -> Any:
        import torch

        path, o, n, gid = self.members[i]
        data = _read(path, o, n)
        if self.kind == "video":
            want = _indices("video", self.field, self.meta[i], gid, self.seed)
            frames, decoded = _pyav_video(data, want)
            return _crop_resize_torch(frames), torch.tensor(decoded)
        u = _indices("audio", self.field, 0, gid, self.seed)
        return _logmel_torch(_crop_audio(_pyav_audio(data), u)), torch.tensor(0)


def run_contestant(a: dict[str, Any]) -> dict[str, Any]:
    name, dataset, B, threads, seed = a["contestant"], a["dataset"], a["batch_size"], a["threads"], a["seed"]
    field, kind = _field(dataset)
    t0 = time.perf_counter()
    clips = decoded = returned = 0
    first = None
    if name == "gdsload":
        import gdsload

        t = (gdsload.VideoTransform(frames=FRAMES, stride=STRIDE, size=SIZE, train=False, resize=RESIZE,
                                    sampling="random") if kind == "video" else
             gdsload.AudioTransform(sample_rate=SR, seconds=SECONDS, crop="random", features="logmel",
                                    n_mels=N_MELS, n_fft=N_FFT, hop=HOP))
        dl = gdsload.DataLoader(dataset, batch_size=B, num_workers=threads, decode_threads=threads, seed=seed,
                                fields=[field], transform={field: t}, output="torch", device="cpu")
        for (x,) in dl:
            first = first or time.perf_counter() - t0
            clips += x.shape[0]
        dec = dl._resources.media_decoder(dl._layout.fields[0])
        if kind == "video":
            decoded, returned = dec.frames_decoded, dec.frames_returned
        dl.close()
    elif name == "torch_pyav":
        import torch

        torch.set_num_threads(1)
        dl = torch.utils.data.DataLoader(_TorchSet(dataset, seed), batch_size=B, num_workers=threads,
                                         prefetch_factor=2, persistent_workers=False)
        for x, d in dl:
            first = first or time.perf_counter() - t0
            clips += x.shape[0]
            decoded += int(d.sum())
        returned = clips * FRAMES if kind == "video" else 0
    elif name in ("spdl", "torchcodec"):
        from concurrent.futures import ThreadPoolExecutor

        import torch

        torch.set_num_threads(1)
        ts = _TorchSet(dataset, seed)
        one = _spdl_one if name == "spdl" else _torchcodec_one
        with ThreadPoolExecutor(threads) as pool:
            for a0 in range(0, len(ts), B):
                rows = list(pool.map(lambda i: one(ts, i), range(a0, min(len(ts), a0 + B))))
                x = torch.stack(rows)
                first = first or time.perf_counter() - t0
                clips += x.shape[0]
    else:
        raise ValueError(f"unknown contestant {name!r}")
    wall = time.perf_counter() - t0
    return {"contestant": name, "kind": kind, "clips": clips, "wall_s": wall, "first_batch_s": first,
            "frames_decoded": decoded, "frames_returned": returned, "cpu_s": time.process_time()}


def _spdl_one(ts: _TorchSet, i: int) -> Any:
    import spdl.io

    path, o, n, gid = ts.members[i]
    data = _read(path, o, n)
    if ts.kind == "video":
        want = _indices("video", ts.field, ts.meta[i], gid, ts.seed)
        valid = want[want >= 0]
        packets = spdl.io.demux_video(data)
        frames = spdl.io.sample_decode_video(packets, sorted(set(valid.tolist())))
        arr = spdl.io.to_numpy(spdl.io.convert_frames(frames))  # (k, 3, H, W) or (k, H, W, 3)
        if arr.shape[-1] != 3:
            arr = arr.transpose(0, 2, 3, 1)
        return _crop_resize_torch(np.ascontiguousarray(arr))
    u = _indices("audio", ts.field, 0, gid, ts.seed)
    fd = spdl.io.get_audio_filter_desc(sample_rate=SR, num_channels=1, sample_fmt="flt")
    x = spdl.io.to_numpy(spdl.io.load_audio(data, filter_desc=fd)).reshape(-1)
    return _logmel_torch(_crop_audio(x, u))


def _torchcodec_one(ts: _TorchSet, i: int) -> Any:
    import torch
    from torchcodec.decoders import AudioDecoder, VideoDecoder

    path, o, n, gid = ts.members[i]
    data = _read(path, o, n)
    if ts.kind == "video":
        want = _indices("video", ts.field, ts.meta[i], gid, ts.seed)
        valid = want[want >= 0].tolist()
        frames = VideoDecoder(data, dimension_order="NHWC", num_ffmpeg_threads=1).get_frames_at(valid).data
        return _crop_resize_torch(frames.numpy())
    u = _indices("audio", ts.field, 0, gid, ts.seed)
    s = AudioDecoder(data, sample_rate=SR, num_channels=1).get_all_samples().data
    return _logmel_torch(_crop_audio(torch.as_tensor(s).reshape(-1).numpy(), u))


def missing(name: str) -> str | None:
    """Why contestant `name` cannot run here, or None."""
    if name == "spdl":
        from gdsload.bench.runners import spdl_missing

        return spdl_missing()
    if name == "torchcodec":
        try:
            import torchcodec.decoders  # noqa: F401
        except Exception as exc:  # noqa: BLE001 (any import failure is the reason) its PyPI wheel links a CUDA build of torch and FFmpeg's libraries
            return (f"{type(exc).__name__}: {str(exc)[:200]} (torchcodec's wheel needs the torch it was built "
                    f"against: run it from a bench-only virtual environment)")
    if name == "torch_pyav":
        try:
            import av  # noqa: F401
            import torch  # noqa: F401
        except ImportError as exc:
            return str(exc)
    return None


# -- the harness ----------------------------------------------------------------------------------------
def run_one(args: dict[str, Any], timeout_s: float = 3600) -> dict[str, Any]:
    from gdsload.bench.harness import run_measured

    return run_measured([sys.executable, "-m", "gdsload.bench.media", "RUN", json.dumps(args)],
                        f"media benchmark run {args['contestant']}", timeout_s)


def run_media(dataset: str, *, contestants: list[str], rounds: int = 5, batch_size: int = 16,
              threads: int | None = None, seed: int = 0, log=print) -> dict[str, Any]:
    threads = threads or os.cpu_count() or 1
    skipped = {}
    for c in list(contestants):
        why = missing(c)
        if why:
            log(f"skipping {c}: {why}")
            skipped[c] = why
            contestants = [x for x in contestants if x != c]
    field, kind = _field(dataset)
    args = {"dataset": str(dataset), "batch_size": batch_size, "threads": threads, "seed": seed}
    runs: dict[str, list[dict]] = {c: [] for c in contestants}
    for r in range(rounds):
        for c in contestants:
            runs[c].append(run_one({**args, "contestant": c}))
        log(f"{kind} round {r + 1}/{rounds}: " + " ".join(
            f"{c}={runs[c][-1]['clips'] / runs[c][-1]['wall_s']:.1f}/s" for c in contestants))
    out: dict[str, Any] = {"dataset": str(dataset), "field": field, "kind": kind, "rounds": rounds,
                           "batch_size": batch_size, "threads": threads, "skipped": skipped, "contestants": {}}
    for c, rs in runs.items():
        rates = [x["clips"] / x["wall_s"] for x in rs]
        # the first batch includes the run's imports (torch, DALI, SPDL) and pipeline builds; after
        # it, clips/s of the rest (the steady rate)
        first = [x["first_batch_s"] or 0.0 for x in rs]  # None: no batch
        steady = [max(0, x["clips"] - batch_size) / max(1e-9, x["wall_s"] - f) for x, f in zip(rs, first)]
        d = {"per_s": rates, "median_per_s": statistics.median(rates),
             "first_batch_s": statistics.median(first),
             "steady_per_s": statistics.median(steady),
             "peak_mem_mb": statistics.median(x["peak_mem_mb"] for x in rs),
             "clips": rs[0]["clips"]}
        if rs[0]["frames_returned"]:
            d["decode_amplification"] = rs[0]["frames_decoded"] / rs[0]["frames_returned"]
        if c != "gdsload" and "gdsload" in runs:  # ratios per round (interleaved pairs)
            rat = [g["clips"] / g["wall_s"] / (x["clips"] / x["wall_s"]) for g, x in zip(runs["gdsload"], rs)]
            d["gdsload_over_this"] = {"median": statistics.median(rat), "min": min(rat), "max": max(rat)}
        out["contestants"][c] = d
    return out


def format_media(r: dict[str, Any]) -> str:
    unit = "clips/s" if r["kind"] == "video" else "recordings/s"
    lines = [(f"{r['kind']} {r['dataset']} (field {r['field']}), batch {r['batch_size']}, {r['threads']} threads, "
              f"{r['rounds']} rounds"),
             f"{'contestant':<12}{unit:>14}{'gdsload/it (min-max)':>24}{'1st batch s':>12}{'steady/s':>10}"
             f"{'peak MB':>9}{'decode ampl.':>13}"]
    for c, d in r["contestants"].items():
        ratio = d.get("gdsload_over_this")
        rs = f"{ratio['median']:.2f} ({ratio['min']:.2f}-{ratio['max']:.2f})" if ratio else "-"
        amp = f"{d['decode_amplification']:.2f}" if "decode_amplification" in d else "n/a"
        lines.append(f"{c:<12}{d['median_per_s']:>14.1f}{rs:>24}{d.get('first_batch_s', 0):>12.2f}"
                     f"{d.get('steady_per_s', 0):>10.1f}{d['peak_mem_mb']:>9.0f}{amp:>13}")
    for c, why in r["skipped"].items():
        lines.append(f"{c:<12} skipped: {why}")
    return "\n".join(lines)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "RUN":
    print("RESULT " + json.dumps(run_contestant(json.loads(sys.argv[2]))), flush=True)
