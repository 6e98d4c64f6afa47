"""Tier T in steady state: CPU time per thread, gdsload's DataLoader against DALI's own pipeline.

Each contestant runs in its own process: one epoch to warm up (pipelines built, ring and DALI
buffers touched), then two epochs timed. CPU time is read per thread from /proc (user + system),
summed by thread name, so it shows where the cores went: DALI's thread pool ("[DALI][TP..."),
Python threads ("python": the consumer), DALI's executor and reader threads, and threads that
ended before the count (gdsload's reader threads, one set per epoch: the reads, CRC32s and the
copy out of DALI); and how many cores were busy on average (the process's CPU seconds ÷ wall).
For gdsload it also times its DALI runs: their mean length and the median time from the end of
one to the start of the next, when DALI's thread pool has nothing to do (the copy out of DALI is
in that time, with the next run's feeding).

    python bench/thread_profile.py --workdir /tmp/lbench --batch-size 64 --rounds 2

`--contestants gdsload,gdsload-nocopy,dali` adds a probe: the same `DataLoader` with the copy of
each decoded run out of DALI into its ring slot skipped (`ImageDecoder.copy_into` does nothing),
so its image tensors hold whatever the slot held before. It is not a mode of the loader: it
measures what that copy costs in the running loader. `--perf` adds one more run of each
contestant with Linux `perf record` attached to it for the timed epochs (not the warm-up), and
prints its hottest symbols (samples per symbol, all threads; timings of that run are not used).

Same shards and transforms as `loader_bench.py` (run that first, same --workdir).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gdsload.bench.runners import dali_train_transform, shard_paths


def _thread_cpu() -> dict[str, tuple[str, float]]:
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                st = f.read()
        except OSError:
            continue
        rest = st[st.rindex(")") + 2 :].split()
        out[tid] = (st[st.index("(") + 1 : st.rindex(")")], (int(rest[11]) + int(rest[12])) / tick)
    return out


def _perf_top(data: str, n: int = 12) -> list[tuple[float, str, str]]:
    """The `n` symbols with most samples in a `perf record` file: (percent, library, symbol)."""
    rep = subprocess.run(["perf", "report", "-i", data, "--sort", "dso,sym", "--stdio", "--no-children"],
                         capture_output=True, text=True, check=True).stdout
    top = []
    for line in rep.splitlines():
        parts = line.split(None, 2)
        if len(parts) == 3 and parts[0].endswith("%") and not line.startswith("#"):
            sym = parts[2].split("] ", 1)[-1].strip()
            top.append((float(parts[0][:-1]), parts[1], sym))
        if len(top) == n:
            break
    return top


def one(contestant: str, root: str, bs: int, workers: int, perf: bool = False) -> dict:
    import nvidia.dali  # noqa: F401  (imports before anything is timed)
    import torch  # noqa: F401

    man = json.loads((Path(root) / "manifest.json").read_text())
    n_total = man["num_samples"]
    spans: list[tuple[float, float]] = []  # gdsload's DALI runs: (start, end)
    if contestant in ("gdsload", "gdsload-nocopy"):
        import gdsload
        from gdsload.decode.image import ImageDecoder, ImageTransform

        if contestant == "gdsload-nocopy":  # the probe (module docstring): wrong pixels, same work otherwise
            ImageDecoder.copy_into = lambda self, out, dst, *, stream=None: None
        dali_run = ImageDecoder._run

        def timed_run(self, encoded):
            t = time.perf_counter()
            out = dali_run(self, encoded)
            spans.append((t, time.perf_counter()))
            return out

        ImageDecoder._run = timed_run

        dl = gdsload.DataLoader(gdsload.Dataset(root), batch_size=bs, num_workers=workers, shuffle=False,
                                transform=ImageTransform())

        def epoch() -> int:
            return sum(len(b["cls"]) for b in dl)
    else:
        from nvidia.dali import fn, pipeline_def, types

        tars, idx, _ = shard_paths(root)
        field = next(f for f, k in man["fields"].items() if k == "image")

        @pipeline_def(batch_size=bs, num_threads=workers, device_id=None)
        def pipe():
            img, cls = fn.readers.webdataset(paths=tars, index_paths=idx, ext=[field, "cls"],
                                             dtypes=[types.UINT8, types.UINT8], pad_last_batch=True)
            return dali_train_transform(img), cls

        p = pipe()
        p.build()

        def epoch() -> int:
            n = 0
            while n < n_total:
                _, cls = p.run()
                n += len(cls)
            return min(n, n_total)

    epoch()
    recorder = None
    if perf:
        data = os.path.join(tempfile.gettempdir(), f"thread-profile-{os.getpid()}.perf")
        recorder = subprocess.Popen(["perf", "record", "-q", "-F", "499", "-p", str(os.getpid()), "-o", data],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # perf attaches to every thread before the clock starts
    spans.clear()  # the warm-up's runs
    before, cpu0 = _thread_cpu(), sum(os.times()[:2])
    t0 = time.perf_counter()
    n = epoch() + epoch()
    wall = time.perf_counter() - t0
    top = None
    if recorder is not None:
        recorder.send_signal(signal.SIGINT)
        recorder.wait()
        top = _perf_top(data)
        os.unlink(data)
    total = sum(os.times()[:2]) - cpu0  # the whole process, threads that ended included
    by_name: dict[str, float] = collections.defaultdict(float)
    for tid, (name, cpu) in _thread_cpu().items():
        by_name[name] += cpu - before.get(tid, (name, 0.0))[1]
    pool = sum(c for name, c in by_name.items() if name.startswith("[DALI][TP"))
    groups = {"DALI thread pool": pool, **{k: v for k, v in by_name.items() if not k.startswith("[DALI][TP")},
              "threads that ended (gdsload's readers)": total - sum(by_name.values())}
    runs = {}
    if len(spans) > 1:  # DALI's pool is idle between one run's end and the next one's start
        gaps = [b[0] - a[1] for a, b in zip(spans, spans[1:])]
        runs = {"dali_runs": len(spans), "run_ms": 1e3 * sum(e - s for s, e in spans) / len(spans),
                "between_runs_ms": 1e3 * statistics.median(gaps)}  # median: an epoch's end is one long gap
    return {"contestant": contestant, "images_per_s": n / wall, "cores_busy": total / wall, **runs,
            "us_per_image": {k: v / n * 1e6 for k, v in groups.items() if v > 0.005 * total},
            "cpu_us_per_image": total / n * 1e6, **({"perf_top": top} if top is not None else {})}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="/tmp/gdsload-loader-bench")
    ap.add_argument("--set", default="photo-shards", help="shard folder under --workdir (jpg-shards, photo-shards)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--contestants", default="gdsload,dali",
                    help="comma-separated: gdsload, gdsload-nocopy (the probe), dali")
    ap.add_argument("--perf", action="store_true", help="one more run of each contestant under perf record")
    ap.add_argument("--out", default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    workers = os.cpu_count() or 1
    root = Path(a.workdir) / a.set
    if a.one:
        print("RESULT " + json.dumps(one(a.one, str(root), a.batch_size, workers, a.perf)), flush=True)
        return
    if not (root / "manifest.json").exists():
        sys.exit(f"no shards in {root}: run bench/loader_bench.py --workdir {a.workdir} --photos 3000 first")
    if a.perf and shutil.which("perf") is None:
        sys.exit("--perf needs Linux perf on PATH (e.g. the linux-tools package); not found")
    contestants = a.contestants.split(",")
    unknown = set(contestants) - {"gdsload", "gdsload-nocopy", "dali"}
    if unknown:
        sys.exit(f"unknown contestants {sorted(unknown)}: choose from gdsload, gdsload-nocopy, dali")

    def run(c: str, perf: bool) -> dict:
        proc = subprocess.run([sys.executable, __file__, "--workdir", a.workdir, "--set", a.set, "--batch-size",
                               str(a.batch_size), "--one", c] + (["--perf"] if perf else []),
                              capture_output=True, text=True)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            sys.exit(f"{c} failed: {proc.stderr[-2000:]}")
        return json.loads(line[7:])

    runs, profiles = [], []
    for _ in range(a.rounds):
        for c in contestants:
            r = run(c, False)
            runs.append(r)
            parts = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r["us_per_image"].items(), key=lambda x: -x[1]))
            between = (f", DALI run {r['run_ms']:.1f} ms, idle {r['between_runs_ms']:.2f} ms between runs"
                       if "run_ms" in r else "")
            print(f"{c:14} {r['images_per_s']:6.0f} img/s, {r['cores_busy']:.2f} cores busy, "
                  f"{r['cpu_us_per_image']:.0f} CPU µs/image: {parts}{between}", flush=True)
    if "dali" in contestants and len(contestants) > 1:
        for c in contestants:
            if c == "dali":
                continue
            ours = [r["images_per_s"] for r in runs if r["contestant"] == c]
            theirs = [r["images_per_s"] for r in runs if r["contestant"] == "dali"]
            ratios = [x / y for x, y in zip(ours, theirs)]
            print(f"{c} ÷ dali, paired by round: median {statistics.median(ratios):.2f} "
                  f"({min(ratios):.2f}-{max(ratios):.2f})", flush=True)
    if a.perf:
        for c in contestants:
            r = run(c, True)
            profiles.append(r)
            print(f"perf, {c} ({r['images_per_s']:.0f} img/s under perf): % of samples, library, symbol")
            for pct, dso, sym in r["perf_top"]:
                print(f"  {pct:6.2f}  {dso[:28]:28}  {sym[:110]}")
    if a.out:
        Path(a.out).write_text(json.dumps({"command": "python bench/thread_profile.py " + " ".join(
            argv if argv is not None else sys.argv[1:]), "set": a.set, "batch_size": a.batch_size,
            "workers": workers, "runs": runs, "perf": profiles}, indent=1))


if __name__ == "__main__":
    main()
