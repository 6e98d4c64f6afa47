"""A Python-heavy `map` (about `--map-ms` of pure-Python work per sample): gdsload with process
workers vs `torch.utils.data.DataLoader` over webdataset doing the same work.

Data: `--samples` samples of `txt` (a caption), `npy` (float32[64]) and `cls`, converted by
gdsload into several shards; both contestants read those shards (they are standard tars). The
per-sample function is `gdsload.bench.mapwork.busy_map` (calibrated here to `--map-ms`), then the
default collate. Contestants, interleaved over rounds after one warm-up each, a full epoch each
(worker start included: gdsload spawns its workers per epoch, torch forks them per iterator):
- `gdsload`: `DataLoader(..., map=busy_map, worker_mode="process", num_workers=W)`
- `torch`: `DataLoader(wds.WebDataset(shards).decode().map(busy_map), num_workers=W)`
Prints and writes JSON: per contestant the median samples/s, and `ratio_gdsload_over_torch`
(median, min-max over rounds, paired by round). The target is >= 0.9 with W=2.

    python bench/map_bench.py --workdir /tmp/mapbench --samples 8000 --rounds 5   # JSON to bench/results/
    python bench/map_bench.py --tiny     # smoke run; tests/test_bench_smoke.py runs it
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def ensure_data(work: Path, samples: int) -> Path:
    """`samples` KEY.txt / KEY.npy / KEY.cls converted into about 8 shards (reused)."""
    import numpy as np

    from gdsload.convert.engine import ConvertOptions, convert

    dst = work / f"captions-n{samples}"
    if (dst / "manifest.json").is_file():
        return dst
    src = work / f"captions-src-n{samples}"
    src.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    words = ["a", "red", "green", "dog", "cat", "on", "the", "grass", "under", "sky", "small", "large"]
    for i in range(samples):
        key = f"{i:07d}"
        (src / f"{key}.txt").write_text(" ".join(rng.choice(words, 8)))
        np.save(src / f"{key}.npy", rng.standard_normal(64).astype(np.float32))
        (src / f"{key}.cls").write_text(str(i % 10))
    per_sample = 4096 + 512 + 3 * 1024  # aligned npy payload plus the small members, in the tar
    convert(str(src), str(dst), ConvertOptions(workers=1, progress=False,
                                               shard_size=max(per_sample * samples // 8, 64 * 1024)))
    return dst


def run_gdsload(data: Path, fn, *, batch_size: int, workers: int) -> dict[str, float]:
    import gdsload

    dl = gdsload.DataLoader(str(data), batch_size=batch_size, num_workers=workers, device="cpu",
                            map=fn, worker_mode="process")
    n, t0 = 0, time.perf_counter()
    for batch in dl:
        n += len(batch["cls"])
    el = time.perf_counter() - t0
    dl.close()
    return {"samples": n, "seconds": el, "samples_per_s": n / el}


def run_torch(data: Path, fn, *, batch_size: int, workers: int) -> dict[str, float]:
    import torch
    import webdataset as wds

    shards = sorted(str(p) for p in data.glob("*.tar"))
    ds = wds.WebDataset(shards, shardshuffle=False, empty_check=False).decode().map(fn)
    dl = torch.utils.data.DataLoader(ds, batch_size=batch_size, num_workers=workers)
    n, t0 = 0, time.perf_counter()
    for batch in dl:
        n += len(batch["cls"])
    el = time.perf_counter() - t0
    return {"samples": n, "seconds": el, "samples_per_s": n / el}


def main(argv: list[str] | None = None) -> dict:
    from gdsload.bench.harness import write_result
    from gdsload.bench.mapwork import busy_map, calibrate

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="/tmp/gdsload-map-bench")
    ap.add_argument("--samples", type=int, default=8000)
    ap.add_argument("--map-ms", type=float, default=1.0, help="pure-Python work per sample")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default=None, help="JSON path (default: bench/results/map-<host>.json)")
    ap.add_argument("--tiny", action="store_true", help="64 samples, 0.05 ms, 1 round (smoke run)")
    a = ap.parse_args(argv)
    if a.tiny:
        a.samples, a.map_ms, a.rounds, a.batch_size = 64, 0.05, 1, 8
    data = ensure_data(Path(a.workdir), a.samples)
    iters = calibrate(a.map_ms)
    fn = functools.partial(busy_map, iters=iters)
    runners = {"gdsload": run_gdsload, "torch": run_torch}
    for name, run in runners.items():  # warm-up: page cache, imports
        run(data, fn, batch_size=a.batch_size, workers=a.workers)
    rounds: dict[str, list[dict[str, float]]] = {k: [] for k in runners}
    for r in range(a.rounds):
        order = list(runners) if r % 2 == 0 else list(runners)[::-1]  # interleaved, alternating first
        for name in order:
            rounds[name].append(runners[name](data, fn, batch_size=a.batch_size, workers=a.workers))
    counts = {k: {x["samples"] for x in v} for k, v in rounds.items()}
    if counts["gdsload"] != {a.samples} or counts["torch"] != {a.samples}:
        raise SystemExit(f"contestants disagree on the samples per epoch: {counts}")
    ratios = [g["samples_per_s"] / t["samples_per_s"] for g, t in zip(rounds["gdsload"], rounds["torch"])]
    result = {
        "machine": {"python": sys.version.split()[0], "platform": platform.platform()},
        "args": {"samples": a.samples, "map_ms": a.map_ms, "map_iters": iters, "rounds": a.rounds,
                 "batch_size": a.batch_size, "workers": a.workers},
        **{k: {"samples_per_s": statistics.median(x["samples_per_s"] for x in v),
               "rounds": [round(x["samples_per_s"], 1) for x in v]} for k, v in rounds.items()},
        "ratio_gdsload_over_torch": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
    }
    print(f"map ~{a.map_ms} ms/sample, {a.samples} samples, batch {a.batch_size}, {a.workers} workers, {a.rounds} rounds")
    for k in runners:
        print(f"  {k:8s} {result[k]['samples_per_s']:10.0f} samples/s")
    q = result["ratio_gdsload_over_torch"]
    print(f"  gdsload / torch: {q['median']:.3f} ({q['min']:.3f}-{q['max']:.3f})")
    print(json.dumps(result))
    write_result(result, a.out, RESULTS, "map", tiny=a.tiny)
    return result


if __name__ == "__main__":
    main()
