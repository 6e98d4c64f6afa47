"""Conversion speed: `gdsload convert` (all cores) vs a single-process `webdataset.ShardWriter` loop.

Both convert the same ImageNet-like image folder (made by `gdsload.sampledata`) into ~same-size
shards. Runs are interleaved (ours, baseline, ours, baseline, ...) after one warm-up of each, each
run in a fresh subprocess, so the page cache is equally hot for both. Reports the median ratio of
samples/s with min-max, CPU seconds per 1,000 samples and peak RSS of the converting process.

    python bench/convert_bench.py --images 9000 --rounds 3          # about 0.95 GB of JPEGs
    python bench/convert_bench.py --tiny                            # smoke run (used by the tests)

Prints a table and writes JSON (`--out`, default bench/results/convert-<host>.json).
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BASELINE = r"""
import os, sys, webdataset as wds
src, dst, maxsize = sys.argv[1], sys.argv[2], int(sys.argv[3])
classes = sorted(d for d in os.listdir(src) if os.path.isdir(os.path.join(src, d)))
n = 0
with wds.ShardWriter(os.path.join(dst, "wds-%06d.tar"), maxsize=maxsize, verbose=0) as sink:
    for label, c in enumerate(classes):
        for f in sorted(os.listdir(os.path.join(src, c))):
            with open(os.path.join(src, c, f), "rb") as fh:
                data = fh.read()
            sink.write({"__key__": f"{c}/{f.rsplit('.', 1)[0]}", "jpg": data, "cls": str(label).encode()})
            n += 1
print(n)
"""


def run_child(argv: list[str]) -> dict[str, float]:
    """Run a subprocess; wall seconds, CPU seconds of it and its children, its peak RSS."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, status, ru = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    out, err = proc.stdout.read(), proc.stderr.read()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"{argv[:3]} failed ({proc.returncode}): {err.decode()[-2000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu, "peak_rss_mb": ru.ru_maxrss / 1024, "stdout": out.decode()}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=9000, help="images in the source folder (~105 KB each)")
    ap.add_argument("--classes", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shard-size", default="256MB")
    ap.add_argument("--workdir", default=None, help="keep data here (default: a temp dir)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--tiny", action="store_true", help="40 small images, 1 round: a smoke run")
    a = ap.parse_args(argv)
    if a.tiny:
        a.images, a.classes, a.rounds, a.shard_size = 40, 4, 1, "1MB"

    from gdsload.cli import parse_size
    from gdsload.sampledata import ensure_image_folder

    shard_size = parse_size(a.shard_size)
    work = Path(a.workdir or tempfile.mkdtemp(prefix="gdsload-convert-bench-"))
    src = work / "images"
    kw = {"mean_size": (160, 120)} if a.tiny else {}
    made = ensure_image_folder(src, num_images=a.images, num_classes=a.classes, seed=0, **kw)
    print(f"source: {made['num_images']} images, {made['total_bytes'] / 1e6:.0f} MB in {src}", file=sys.stderr)

    def ours() -> dict:
        dst = work / "out-gdsload"
        shutil.rmtree(dst, ignore_errors=True)
        return run_child([sys.executable, "-m", "gdsload", "convert", str(src), str(dst), "-q",
                          "--format", "imagefolder", "--shard-size", str(shard_size)])

    def baseline() -> dict:
        dst = work / "out-wds"
        shutil.rmtree(dst, ignore_errors=True)
        dst.mkdir()
        return run_child([sys.executable, "-c", BASELINE, str(src), str(dst), str(shard_size)])

    runs: dict[str, list[dict]] = {"gdsload": [], "webdataset": []}
    ours(), baseline()  # warm-up: page cache, imports
    for _ in range(a.rounds):
        runs["gdsload"].append(ours())
        runs["webdataset"].append(baseline())
    n = made["num_images"]
    out_files = sorted((work / "out-wds").glob("*.tar"))
    wds_count = int(runs["webdataset"][-1]["stdout"].strip())
    from gdsload.dataset.sharded import open_dataset

    ours_count = len(open_dataset(work / "out-gdsload"))
    if not (ours_count == wds_count == n):
        raise SystemExit(f"sample counts differ: gdsload {ours_count}, webdataset {wds_count}, source {n}")

    ratios = [b["wall_s"] / o["wall_s"] for o, b in zip(runs["gdsload"], runs["webdataset"])]

    def summary(rs: list[dict]) -> dict:
        return {
            "samples_per_s_median": statistics.median(n / r["wall_s"] for r in rs),
            "cpu_s_per_1000": statistics.median(1000 * r["cpu_s"] / n for r in rs),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in rs),
            "wall_s": [round(r["wall_s"], 3) for r in rs],
        }

    result = {
        "bench": "convert",
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform()},
        "source": {"images": n, "bytes": made["total_bytes"], "shard_size": shard_size},
        "rounds": a.rounds,
        "gdsload": summary(runs["gdsload"]),
        "webdataset_shardwriter": summary(runs["webdataset"]),
        "ratio_samples_per_s": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
        "baseline_shards": len(out_files),
        "note": "page cache hot for both (same files, interleaved); peak RSS is the converting "
                "process itself (gdsload's worker processes are separate, each holds one sample)",
    }
    g, w = result["gdsload"], result["webdataset_shardwriter"]
    r = result["ratio_samples_per_s"]
    print(f"{'':<26}{'samples/s':>12}{'CPU s/1k':>10}{'peak RSS MB':>13}")
    print(f"{'gdsload convert':<26}{g['samples_per_s_median']:>12.0f}{g['cpu_s_per_1000']:>10.2f}{g['peak_rss_mb']:>13.0f}")
    print(f"{'webdataset.ShardWriter':<26}{w['samples_per_s_median']:>12.0f}{w['cpu_s_per_1000']:>10.2f}{w['peak_rss_mb']:>13.0f}")
    print(f"ratio gdsload/webdataset samples/s: median {r['median']:.2f} (min {r['min']:.2f}, max {r['max']:.2f}) over {a.rounds} rounds")
    from gdsload.bench.harness import write_result

    write_result(result, a.out, Path(__file__).parent / "results", "convert", tiny=a.tiny)
    if not a.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return result


if __name__ == "__main__":
    main()
