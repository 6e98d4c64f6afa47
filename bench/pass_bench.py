"""A preprocessing pass (`gdsload.process`) against Ray Data and a plain PyAV process pool, in media
hours per second, and the pass's peak RSS on a long video (issue 54 item 5).

Corpus (generated once, cached under `--cache`): `--hours` media hours (default 2) of 360p H.264 at
30 fps with AAC stereo (44.1 kHz), in videos of `--video-min` minutes (default 10): a moving
gradient with a noisy block, so the encoder has work, and a tone with noise, muxed interleaved
(each second's audio beside its video, as a recorder writes them); x264 `ultrafast`
(P-frames only, x264's 250-frame groups), or `--x264 PRESET[:PARAMS]` for another cached corpus
(e.g. `veryfast:keyint=60`: B-frames, 2 s groups, closer to published video). The same videos as
files (`files/*.mp4`: what Ray Data and the PyAV pool read) and as a gdsload dataset, one video per
input shard (`shards/`: what the pass reads).

The stated cheap NumPy `fn` (`frames_fn`, `speech_fn`): per window, each frame's mean and a
16-bin luma histogram (float32 (T, 17)); per speech chunk, the RMS of each second. Every
contestant writes its outputs (one sample per window):

- `gdsload`: `gdsload.process(shards, out, fn, frames=(fps, window) | speech=chunk, size=SIZE,
  workers=2)`: a dataset of `.npy` outputs (each worker's decoder single-threaded on 2 cores).
- `ray_data`: `ray.data.read_binary_files(files).map_batches(UDF, batch_size=1, concurrency=2)`
  where the UDF decodes the video bytes with PyAV (the same frame rule, resize and `fn`), then
  `.write_parquet(out)`. Ray's start-up (`ray.init`, a 2-CPU local instance) is timed apart and
  not in its media hours/s. Needs `ray[data]` (pandas, pyarrow): install it in a bench venv, never
  in CI; without it the contestant is skipped with that hint.
- `pyav_pool`: a 2-process `multiprocessing.Pool` over the files, PyAV with
  `thread_type="AUTO"`, frames picked by timestamp (the last frame shown at or before k/fps, the
  rule `gdsload.process` follows), the same resize (swscale bilinear, short side to SIZE), the
  same `fn` per batch of `--batch-size` windows, outputs written to one tar per video.

Rounds (`--rounds`, default 5, at least 5 for figures) interleave the contestants after one
warm-up each; the medians and the ratios gdsload / each are printed and written as JSON, with
the CPU seconds per media hour of gdsload and the pool (user + system of this process and its
waited-for workers; Ray's workers are not this process's children and are not counted)
(`--out`, default bench/results/pass-<host>.json). Targets on 2 cores: frames >= 1.5x Ray Data
and >= 1.2x the PyAV pool; speech >= 1.5x Ray Data and >= 1.0x the PyAV pool.

Peak RSS (`--rss`): a pass with a NumPy no-op `fn` (every item None) over a 60-minute video, a
10-minute one and a 1-minute one (`--rss-long-min`, `--rss-mid-min`, `--rss-short-min`), each in
a fresh process; its VmHWM. Target: the 60-minute pass <= 600 MB and <= 1.2x the 1-minute one.
The RSS passes sample `--rss-sample-fps` (default 4) frames a second in windows of `--window`, so
that the 1-minute video fills a whole batch of 16 (30 windows): what the ratio compares is then
what grows with a video's length, as the target means, not the batch. At 1 fps a 1-minute video
gives 8 windows, half a batch, and the longer passes hold a full batch (`batch_mb`, 33 MB at 224
px) that it never fills (measured at 1 fps, stop 58: 128.4 MB against 99.0 MB, 1.30x; the 60-
over the 10-minute video 1.09x). The 60- over the 10-minute ratio shows what grows with length
(FFmpeg's sample index of the MP4, read from its moov), and `decode_hwm_mb` the decoding alone
(every window decoded and dropped, no batch) of each video.

    python bench/pass_bench.py --mode frames --rounds 5          # frames: 2 media hours, all three
    python bench/pass_bench.py --mode speech --rounds 5          # speech (30 s chunks)
    python bench/pass_bench.py --rss                              # peak RSS, 60 vs 1 minute
    python bench/pass_bench.py --tiny                             # smoke run (seconds)

Generating the 2-hour corpus takes minutes (x264 ultrafast, 2 processes); it is reused while
`--cache` holds it (default `~/.cache/gdsload-pass-bench/`: `2h-10m-640x360-30-i/` for the rounds,
`1h-60m-640x360-30-i/` and `0.0166667h-1m-640x360-30-i/` for `--rss`). Ray Data in a bench venv:
`python3 -m venv /work/passbenchvenv && /work/passbenchvenv/bin/pip install -e '.[cpu,test]'
'ray[data]'` (never in the project's extras).
"""

from __future__ import annotations

import argparse
import io
import json
import math
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from fractions import Fraction
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


# -- the corpus ---------------------------------------------------------------------------------
def make_video(path: Path, seconds: float, width: int, height: int, fps: int, seed: int,
               x264: str = "ultrafast") -> None:
    """`x264`: PRESET or PRESET:PARAMS (x264-params, e.g. `veryfast:keyint=60`)."""
    import av

    rng = np.random.default_rng(seed)
    base = (np.linspace(0, 255, width)[None, :, None] + np.linspace(0, 64, height)[:, None, None]) % 256
    base = np.repeat(base, 3, axis=2).astype(np.uint8)
    noise = rng.integers(0, 255, (32, height // 4, width // 4, 3), dtype=np.uint8)
    with av.open(str(path), "w", format="mp4") as c:
        v = c.add_stream("libx264", rate=fps)
        v.width, v.height, v.pix_fmt = width, height, "yuv420p"
        preset, _, params = x264.partition(":")
        v.options = {"preset": preset, **({"x264-params": params} if params else {})}
        a = c.add_stream("aac", rate=44100)
        a.layout = "stereo"
        n, total, sr = round(seconds * fps), round(seconds * 44100), 44100

        def audio_second(s0: int) -> None:  # one second of a 220 Hz tone with noise
            m = min(sr, total - s0)
            t = (s0 + np.arange(m)) / sr
            x = (0.2 * np.sin(2 * np.pi * 220 * t) + 0.05 * rng.standard_normal(m)).astype(np.float32)
            for k in range(0, m, 1024):
                fr = av.AudioFrame.from_ndarray(np.stack([x[k : k + 1024]] * 2), format="fltp", layout="stereo")
                fr.sample_rate, fr.pts = sr, s0 + k
                for p in a.encode(fr):
                    c.mux(p)

        s0 = 0
        for i in range(n):
            img = np.roll(base, 4 * i, axis=1)
            y, x = (i * 2) % (height - height // 4), (i * 3) % (width - width // 4)
            img[y : y + height // 4, x : x + width // 4] = noise[i % 32]
            for p in v.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                c.mux(p)
            while s0 < total and s0 <= (i + 1) * sr // fps:  # audio beside its video, as a recorder muxes
                audio_second(s0)
                s0 += sr
        for p in v.encode():
            c.mux(p)
        while s0 < total:
            audio_second(s0)
            s0 += sr
        for p in a.encode():
            c.mux(p)


def _make_one(args: tuple) -> None:
    make_video(*args)


def corpus(cache: Path, hours: float, video_min: float, width: int, height: int, fps: int,
           log=print, x264: str = "ultrafast") -> tuple[Path, list[Path], float]:
    """(shards, files, media seconds): generated into `cache` unless it holds them already."""
    tag = f"{hours:g}h-{video_min:g}m-{width}x{height}-{fps}-i"  # -i: video and audio interleaved (1 s)
    if x264 != "ultrafast":
        tag += "-" + "".join(ch if ch.isalnum() or ch in "=." else "_" for ch in x264)
    root = cache / tag
    files_dir, shards = root / "files", root / "shards"
    n = max(1, round(hours * 60 / video_min))
    seconds = video_min * 60
    if not (shards / "manifest.json").is_file():
        shutil.rmtree(root, ignore_errors=True)
        files_dir.mkdir(parents=True)
        t0 = time.perf_counter()
        jobs = [(files_dir / f"v{i:04d}.mp4", seconds, width, height, fps, i, x264) for i in range(n)]
        with mp.get_context("fork").Pool(min(2, n)) as pool:
            pool.map(_make_one, jobs)
        import gdsload

        with gdsload.ShardWriter(shards, shard_size="64KiB") as w:  # one video per input shard
            for p, *_ in jobs:
                w.write({"__key__": p.stem, "mp4": p.read_bytes()})
        log(f"corpus {tag}: {n} videos made in {time.perf_counter() - t0:.0f} s")
    return shards, sorted(files_dir.glob("*.mp4")), n * seconds


# -- the stated fn ------------------------------------------------------------------------------
def frames_fn(batch: dict) -> list:
    """Per window: each frame's mean and 16-bin luma histogram, float32 (T, 17)."""
    out = []
    for frames in batch["frames"]:
        luma = frames.mean(axis=3)
        hist = np.stack([np.bincount((f >> 4).ravel().astype(np.int64), minlength=16)[:16] for f in luma.astype(np.uint8)])
        out.append({"stats.npy": np.concatenate([luma.mean(axis=(1, 2))[:, None], hist], 1).astype(np.float32)})
    return out


def speech_fn(batch: dict) -> list:
    """Per chunk: the RMS of each second, float32."""
    out = []
    for a, n in zip(batch["audio"], batch["length"]):
        x = a[: n - n % 16000].reshape(-1, 16000)
        out.append({"rms.npy": np.sqrt((x**2).mean(axis=1)).astype(np.float32)})
    return out


def noop_fn(batch: dict) -> list:
    return [None] * len(batch["window"])


# -- a plain PyAV decode (Ray Data's UDF and the pool's worker) --------------------------------
def _short(w: int, h: int, size: int | None) -> tuple[int, int]:
    if size is None:
        return w, h
    return (size, round(h * size / w)) if w <= h else (round(w * size / h), size)


def pyav_windows(src, mode: str, fps: float, window: int, size: int | None, chunk_s: float):
    """Windows of one video as `gdsload.process` makes them (its rules, in a plain loop), scaled
    with one scaler per video as the pass does (not PyAV 18's per-thread one, which a process
    forked after a scale in its parent cannot use: `gdsload.decode.media.rgb24_scaler`)."""
    import av
    from av.video.reformatter import VideoReformatter

    sws = VideoReformatter()
    with av.open(src) as c:
        if mode == "frames":
            s = c.streams.video[0]
            s.thread_type = "AUTO"
            tb, step = s.time_base, Fraction(fps).limit_denominator(1 << 20)
            origin = min(Fraction(x.start_time) * x.time_base for x in c.streams if x.start_time is not None)
            k, buf, prev, wh = 0, [], None, None
            for fr in c.decode(s):
                t = Fraction(fr.pts) * tb - origin
                while Fraction(k) / step < t:
                    buf.append(prev if prev is not None else fr)
                    k += 1
                    if len(buf) == window:
                        wh = wh or _short(buf[0].width, buf[0].height, size)
                        yield np.stack([sws.reformat(f, width=wh[0], height=wh[1], format="rgb24",
                                                     interpolation="BILINEAR").to_ndarray() for f in buf])
                        buf = []
                prev = fr
            if buf:
                wh = wh or _short(buf[0].width, buf[0].height, size)
                arr = np.stack([sws.reformat(f, width=wh[0], height=wh[1], format="rgb24",
                                             interpolation="BILINEAR").to_ndarray() for f in buf])
                pad = np.zeros((window - len(buf), *arr.shape[1:]), np.uint8)
                yield np.concatenate([arr, pad])
        else:
            s = c.streams.audio[0]
            rs = av.AudioResampler(format="flt", layout="mono", rate=16000)
            n = round(chunk_s * 16000)
            parts, have = [], 0
            for fr in c.decode(s):
                for g in rs.resample(fr):
                    parts.append(g.to_ndarray().reshape(-1))
                    have += len(parts[-1])
                    while have >= n:
                        x = np.concatenate(parts)
                        yield x[:n], n
                        parts, have = [x[n:]], have - n
            x = np.concatenate(parts) if parts else np.zeros(0, np.float32)
            if len(x):
                yield np.concatenate([x, np.zeros(n - len(x), np.float32)]), len(x)


def _batches(wins, mode: str, batch_size: int):
    group = []
    for w in wins:
        group.append(w)
        if len(group) == batch_size:
            yield group
            group = []
    if group:
        yield group


def _run_fn(group, mode: str) -> list:
    if mode == "frames":
        return frames_fn({"frames": np.stack(group), "window": np.arange(len(group))})
    return speech_fn({"audio": np.stack([a for a, _ in group]), "length": np.array([n for _, n in group]),
                      "window": np.arange(len(group))})


def _pool_video(args: tuple) -> int:
    path, out, mode, fps, window, size, chunk_s, batch_size = args
    n = 0
    with tarfile.open(out, "w") as tf:
        for group in _batches(pyav_windows(str(path), mode, fps, window, size, chunk_s), mode, batch_size):
            for item in _run_fn(group, mode):
                for name, arr in item.items():
                    b = io.BytesIO()
                    np.save(b, arr)
                    ti = tarfile.TarInfo(f"{Path(path).stem}/{n:06d}.{name}")
                    ti.size = b.tell()
                    b.seek(0)
                    tf.addfile(ti, b)
                n += 1
    return n


# -- contestants --------------------------------------------------------------------------------
def cpu_s() -> float:
    """User + system seconds of this process and its waited-for children (the pools' workers)."""
    import resource

    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))


def run_gdsload(shards: Path, out: Path, a) -> dict:
    import gdsload

    shutil.rmtree(out, ignore_errors=True)
    kw = dict(frames=(a.sample_fps, a.window), size=a.size) if a.mode == "frames" else dict(speech=a.chunk_s)
    t0, c0 = time.perf_counter(), cpu_s()
    r = gdsload.process(shards, out, frames_fn if a.mode == "frames" else speech_fn, batch_size=a.batch_size,
                        workers=a.workers, **kw)
    return {"seconds": time.perf_counter() - t0, "cpu_s": cpu_s() - c0, "outputs": r["outputs"],
            "stages": r["stages"]}


def run_pyav_pool(files: list[Path], out: Path, a) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    jobs = [(p, out / f"{p.stem}.tar", a.mode, a.sample_fps, a.window, a.size if a.mode == "frames" else None,
             a.chunk_s, a.batch_size) for p in files]
    t0, c0 = time.perf_counter(), cpu_s()
    pool = mp.get_context("fork").Pool(a.workers)
    n = sum(pool.map(_pool_video, jobs, chunksize=1))
    pool.close()
    pool.join()  # its workers waited for: their CPU time is in RUSAGE_CHILDREN
    return {"seconds": time.perf_counter() - t0, "cpu_s": cpu_s() - c0, "outputs": n}


def ray_available() -> str | None:
    try:
        import ray.data  # noqa: F401
    except ImportError as exc:
        return f"ray[data] is not installed here ({exc}); pip install 'ray[data]' in a bench venv"
    return None


def run_ray_data(files: list[Path], out: Path, a, state: dict) -> dict:
    import ray

    if not ray.is_initialized():
        t0 = time.perf_counter()
        ray.init(num_cpus=a.workers, include_dashboard=False, logging_level="WARNING")
        state["startup_s"] = time.perf_counter() - t0
    shutil.rmtree(out, ignore_errors=True)
    mode, fps, window, size, chunk_s, bs = a.mode, a.sample_fps, a.window, a.size, a.chunk_s, a.batch_size

    def udf(batch: dict) -> dict:
        rows = []
        for data in batch["bytes"]:
            wins = pyav_windows(io.BytesIO(data), mode, fps, window, size if mode == "frames" else None, chunk_s)
            for group in _batches(wins, mode, bs):
                for item in _run_fn(group, mode):
                    rows += [np.asarray(v).tobytes() for v in item.values()]
        return {"out": np.array(rows, dtype=object)}

    t0 = time.perf_counter()
    ds = ray.data.read_binary_files([str(p) for p in files]).map_batches(udf, batch_size=1, concurrency=a.workers)
    ds.write_parquet(str(out))
    return {"seconds": time.perf_counter() - t0}


# -- peak RSS -----------------------------------------------------------------------------------
def vm_hwm_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def rss_child(shards: str, out: str, fps: float, window: int, size: int | None) -> None:
    import gdsload

    gdsload.process(shards, out, noop_fn, frames=(fps, window), size=size, batch_size=16)
    print(json.dumps({"vm_hwm_mb": vm_hwm_mb()}))


def open_child(shards: str) -> None:
    """The memory FFmpeg's demuxer holds for the corpus's first member once opened (its sample
    index of every track, read from the MP4's moov before any stream can be left out): VmRSS
    after `av.open` over the member (read by range, as a pass does) less before."""
    import av

    import gdsload
    from gdsload.decode.passmedia import RangeFile

    def rss_mb() -> float:
        return int(next(ln for ln in Path("/proc/self/status").read_text().splitlines()
                        if ln.startswith("VmRSS:")).split()[1]) / 1024

    ds = gdsload.ShardedDataset(shards)
    idx = ds.index(0)
    ext, off, size = next(m for m in idx.members(0) if m[0] == "mp4")
    before = rss_mb()
    with av.open(RangeFile(lambda o, n: ds.read_extent(0, o, n), off, size), "r") as c:
        after = rss_mb()
        samples = sum(s.frames for s in c.streams)
    print(json.dumps({"demux_open_mb": after - before, "samples": samples}))


def decode_child(shards: str, fps: float, window: int, size: int | None) -> None:
    """The decoding alone, no batch: every window of the corpus's first member (read by range,
    as a pass does) decoded and dropped; its VmHWM. What grows here with length is FFmpeg's."""
    import gdsload
    from gdsload.decode.passmedia import RangeFile, frame_windows

    ds = gdsload.ShardedDataset(shards)
    ext, off, nbytes = next(m for m in ds.index(0).members(0) if m[0] == "mp4")
    f = RangeFile(lambda o, k: ds.read_extent(0, o, k), off, nbytes)
    n = sum(1 for _ in frame_windows(f, fps, window, size))
    print(json.dumps({"decode_hwm_mb": vm_hwm_mb(), "decode_windows": n}))


def rss_mode(a, work: Path, log) -> dict:
    res = {}
    for name, minutes in (("long", a.rss_long_min), ("mid", a.rss_mid_min), ("short", a.rss_short_min)):
        shards, _, _ = corpus(Path(a.cache), minutes / 60, minutes, a.width, a.height, a.fps, log, a.x264)
        out = work / f"rss-{name}"
        shutil.rmtree(out, ignore_errors=True)
        p = subprocess.run([sys.executable, __file__, "--rss-child", str(shards), str(out), str(a.rss_sample_fps),
                            str(a.window), str(a.size or 0)], capture_output=True, text=True, check=True)
        res[name] = {"minutes": minutes, **json.loads(p.stdout.strip().splitlines()[-1])}
        p = subprocess.run([sys.executable, __file__, "--rss-open", str(shards)], capture_output=True, text=True,
                           check=True)
        res[name].update(json.loads(p.stdout.strip().splitlines()[-1]))
        p = subprocess.run([sys.executable, __file__, "--rss-decode", str(shards), str(a.rss_sample_fps), str(a.window),
                            str(a.size or 0)], capture_output=True, text=True, check=True)
        res[name].update(json.loads(p.stdout.strip().splitlines()[-1]))
        log(f"rss {name} ({minutes:g} min): VmHWM {res[name]['vm_hwm_mb']:.0f} MB; the demuxer's index (open) "
            f"{res[name]['demux_open_mb']:.1f} MB for {res[name]['samples']} samples; decoding alone (no batch) "
            f"{res[name]['decode_hwm_mb']:.0f} MB")
    res["ratio_long_over_short"] = res["long"]["vm_hwm_mb"] / res["short"]["vm_hwm_mb"]
    res["ratio_long_over_mid"] = res["long"]["vm_hwm_mb"] / res["mid"]["vm_hwm_mb"]  # both fill whole batches
    res["decode_ratio_long_over_short"] = res["long"]["decode_hwm_mb"] / res["short"]["decode_hwm_mb"]
    h, w = (a.size, round(a.width * a.size / a.height)) if a.size else (a.height, a.width)
    res["batch_mb"] = 16 * a.window * h * w * 3 / 2**20  # a full batch's frames (the short video may not fill one)
    # the long pass less what it holds because it is long: FFmpeg's index beyond the short video's
    # and the half batch a 1-minute video never fills (8 windows of 16 at 1 fps, windows of 8)
    short_windows = math.ceil(a.rss_short_min * 60 * a.rss_sample_fps / a.window)
    unfilled = max(0, 16 - short_windows) / 16 * res["batch_mb"]
    index = res["long"]["demux_open_mb"] - res["short"]["demux_open_mb"]
    res["long_less_index_and_batch_mb"] = res["long"]["vm_hwm_mb"] - index - unfilled
    res["ratio_without_index_and_batch"] = res["long_less_index_and_batch_mb"] / res["short"]["vm_hwm_mb"]
    log(f"rss: long / short {res['ratio_long_over_short']:.2f}, long / mid {res['ratio_long_over_mid']:.2f}; a full "
        f"batch (16 windows) holds {res['batch_mb']:.0f} MB")
    log(f"rss: the long pass less the demuxer's extra index ({index:.1f} MB) and the batch the short one never "
        f"fills ({unfilled:.1f} MB): {res['ratio_without_index_and_batch']:.2f} x the short one")
    grown = res["long"]["decode_hwm_mb"] - res["short"]["decode_hwm_mb"]  # what decoding holds more, at its peak
    res["ratio_without_decode_growth_and_batch"] = ((res["long"]["vm_hwm_mb"] - grown - unfilled)
                                                    / res["short"]["vm_hwm_mb"])
    log(f"rss: decoding alone, long / short {res['decode_ratio_long_over_short']:.2f} ({grown:.1f} MB more); the long "
        f"pass less that and the unfilled batch: {res['ratio_without_decode_growth_and_batch']:.2f} x the short one")
    res["targets"] = {"long_mb_max": 600, "ratio_max": 1.2}
    return res


# -- main ---------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["frames", "speech"], default="frames")
    ap.add_argument("--hours", type=float, default=2.0)
    ap.add_argument("--video-min", type=float, default=10.0)
    ap.add_argument("--width", type=int, default=640)
    ap.add_argument("--height", type=int, default=360)
    ap.add_argument("--fps", type=int, default=30)
    ap.add_argument("--x264", default="ultrafast", help="the corpus's encoding: PRESET[:X264-PARAMS], e.g. "
                    "veryfast:keyint=60 (B-frames, 2 s groups: another cached corpus)")
    ap.add_argument("--sample-fps", type=float, default=1.0)
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--size", type=int, default=224, help="short side of the frames fn gets")
    ap.add_argument("--chunk-s", type=float, default=30.0)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--contestants", default="gdsload,ray_data,pyav_pool")
    ap.add_argument("--cache", default=str(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gdsload-pass-bench"))
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--rss", action="store_true", help="peak RSS: a 60-minute video against a 1-minute one")
    ap.add_argument("--rss-long-min", type=float, default=60.0)
    ap.add_argument("--rss-mid-min", type=float, default=10.0, help="a third video: past one full batch")
    ap.add_argument("--rss-short-min", type=float, default=1.0)
    ap.add_argument("--rss-sample-fps", type=float, default=4.0,
                    help="frames a second the RSS passes sample (4: a 1-minute video fills a batch of 16)")
    ap.add_argument("--rss-open", metavar="SHARDS", help=argparse.SUPPRESS)
    ap.add_argument("--rss-decode", nargs=4, metavar=("SHARDS", "FPS", "WINDOW", "SIZE"), help=argparse.SUPPRESS)
    ap.add_argument("--rss-child", nargs=5, metavar=("SHARDS", "OUT", "FPS", "WINDOW", "SIZE"), help=argparse.SUPPRESS)
    ap.add_argument("--tiny", action="store_true", help="smoke run: seconds of tiny video, one round")
    a = ap.parse_args(argv)
    if a.rss_open:
        open_child(a.rss_open)
        return {}
    if a.rss_decode:
        s, f, w, z = a.rss_decode
        decode_child(s, float(f), int(w), int(z) or None)
        return {}
    if a.rss_child:
        s, o, f, w, z = a.rss_child
        rss_child(s, o, float(f), int(w), int(z) or None)
        return {}
    if a.tiny:
        a.hours, a.video_min, a.width, a.height, a.fps, a.rounds = 4 / 3600 * 3, 4 / 60, 160, 90, 10, 1
        a.size, a.chunk_s, a.rss_long_min, a.rss_mid_min, a.rss_short_min = 45, 2.0, 0.2, 0.1, 0.05
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    work = Path(a.workdir or Path(a.cache) / "work")
    work.mkdir(parents=True, exist_ok=True)
    result: dict = {"bench": "pass", "host": platform.node(), "cpus": os.cpu_count(), "mode": a.mode,
                    "args": {k: v for k, v in vars(a).items() if k not in ("rss_child", "rss_decode")}}
    if a.rss:
        result["rss"] = rss_mode(a, work, log)
    else:
        shards, files, media_s = corpus(Path(a.cache), a.hours, a.video_min, a.width, a.height, a.fps, log,
                                        a.x264)
        result["media_hours"] = media_s / 3600
        names = [c for c in a.contestants.split(",") if c]
        skipped = {}
        if "ray_data" in names and (why := ray_available()):
            skipped["ray_data"] = why
            names.remove("ray_data")
            log(f"ray_data skipped: {why}")
        ray_state: dict = {}
        runs = {
            "gdsload": lambda: run_gdsload(shards, work / "gdsload", a),
            "pyav_pool": lambda: run_pyav_pool(files, work / "pyav_pool", a),
            "ray_data": lambda: run_ray_data(files, work / "ray_data", a, ray_state),
        }
        times: dict[str, list[float]] = {n: [] for n in names}
        cpus: dict[str, list[float]] = {n: [] for n in names}
        extra: dict[str, dict] = {}
        for rnd in range(a.rounds + 1):  # round 0: warm-up
            for n in names:
                r = runs[n]()
                if rnd:
                    times[n].append(r["seconds"])
                    if "cpu_s" in r:
                        cpus[n].append(r["cpu_s"])
                    extra[n] = r
                    log(f"round {rnd} {n}: {r['seconds']:.2f} s, {media_s / 3600 / r['seconds']:.4f} media h/s")
        result["contestants"] = {n: {"seconds": t, "median_s": statistics.median(t),
                                     "media_hours_per_s": media_s / 3600 / statistics.median(t),
                                     **{k: v for k, v in extra[n].items() if k not in ("seconds", "cpu_s")},
                                     **({"cpu_s": cpus[n], "cpu_s_per_media_hour":
                                         statistics.median(cpus[n]) / (media_s / 3600)} if cpus[n] else {})}
                                 for n, t in times.items() if t}
        if "startup_s" in ray_state:
            result["contestants"]["ray_data"]["startup_s"] = ray_state["startup_s"]
        result["skipped"] = skipped
        g = result["contestants"].get("gdsload")
        if g:
            result["ratio_gdsload_over"] = {n: g["media_hours_per_s"] / c["media_hours_per_s"]
                                            for n, c in result["contestants"].items() if n != "gdsload"}
        for n, c in result["contestants"].items():
            print(f"{n:<10} {c['media_hours_per_s']:.4f} media h/s (median of {len(c['seconds'])})"
                  + (f", {c['cpu_s_per_media_hour']:.0f} CPU-s per media hour" if "cpu_s_per_media_hour" in c else "")
                  + (f", Ray start-up {c['startup_s']:.1f} s apart" if "startup_s" in c else ""))
        for n, v in result.get("ratio_gdsload_over", {}).items():
            print(f"gdsload / {n}: {v:.2f}x")
    out = Path(a.out or ROOT / "bench" / "results" / f"pass-{platform.node()}.json")
    if not a.tiny or a.out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
