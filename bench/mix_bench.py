"""What mixing costs: `gdsload.Mix` of two halves of a `.npy` dataset vs the whole dataset.

Tier R (`.npy` tensors, no decode). The same samples are converted three times: the whole
dataset, and its first and second halves as two datasets. Contestants, interleaved over rounds
after one warm-up each (page cache hot for both): `single` (`DataLoader(Dataset(whole))`) and
`mix` (`DataLoader(Mix([half1, half2]))`, default weights = sizes, so the epoch has the same
samples). Both shuffle with the same window and batch size. Prints and writes JSON: per
contestant the median samples/s and bytes/s, and `ratio_mix_over_single` (median, min-max over
rounds, paired by round); 1.0 means mixing is free.

    python bench/mix_bench.py --workdir /tmp/mbench --samples 4000 --rounds 5 --out bench/results/mix-cpu2.json
    python bench/mix_bench.py --tiny      # smoke run; tests/dataset/test_mix.py runs it
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path


def ensure_data(work: Path, *, samples: int, shape: tuple[int, ...]) -> dict[str, Path]:
    """whole, half1, half2 converted from one generated folder (halves by hard link: convert refuses symbolic links), reused."""
    from gdsload.convert.engine import ConvertOptions, convert
    from gdsload.sampledata import make_npy_folder

    tag = f"n{samples}-" + "x".join(map(str, shape))
    base = work / tag
    out = {name: base / name for name in ("whole", "half1", "half2")}
    if all((p / "manifest.json").is_file() for p in out.values()):
        return out
    src = base / "src"
    if not (src / "labels.csv").is_file():
        make_npy_folder(src, num_samples=samples, shape=shape, dtype="uint8", seed=0)
    with open(src / "labels.csv") as f:
        rows = list(csv.DictReader(f))
    half = len(rows) // 2
    for name, part in (("half1", rows[:half]), ("half2", rows[half:])):
        folder = base / f"src-{name}"
        folder.mkdir(parents=True, exist_ok=True)
        for row in part:
            link = folder / f"{row['key']}.npy"
            if not link.exists():
                os.link(src / f"{row['key']}.npy", link)
        with open(folder / "labels.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["key", "label"])
            w.writeheader()
            w.writerows(part)
    for name, folder in (("whole", src), ("half1", base / "src-half1"), ("half2", base / "src-half2")):
        if not (out[name] / "manifest.json").is_file():
            convert(str(folder), str(out[name]), ConvertOptions(progress=False))
    return out


def run(kind: str, data: dict[str, Path], *, batch_size: int, workers: int) -> dict[str, float]:
    import gdsload

    if kind == "single":
        dataset = gdsload.Dataset(str(data["whole"]))
    else:
        dataset = gdsload.Mix([gdsload.Dataset(str(data["half1"])), gdsload.Dataset(str(data["half2"]))])
    dl = gdsload.DataLoader(dataset, batch_size=batch_size, shuffle=True, seed=1, num_workers=workers,
                            device="cpu", output="numpy")
    n = nbytes = 0
    t0 = time.perf_counter()
    for batch in dl:
        n += len(batch["__key__"])
        nbytes += batch["npy"].nbytes
    el = time.perf_counter() - t0
    dl.close()
    return {"samples": n, "seconds": el, "samples_per_s": n / el, "bytes_per_s": nbytes / el}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="/tmp/gdsload-mix-bench")
    ap.add_argument("--samples", type=int, default=4000)
    ap.add_argument("--shape", default="3,224,224")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--tiny", action="store_true", help="32 small samples, 1 round (smoke run)")
    a = ap.parse_args(argv)
    if a.tiny:
        a.samples, a.shape, a.rounds, a.batch_size = 32, "3,16,16", 1, 8
    shape = tuple(int(s) for s in a.shape.split(","))
    data = ensure_data(Path(a.workdir), samples=a.samples, shape=shape)
    kinds = ("single", "mix")
    for kind in kinds:  # warm-up: page cache, index loads, imports
        run(kind, data, batch_size=a.batch_size, workers=a.workers)
    rounds: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    for _ in range(a.rounds):
        for kind in kinds:
            rounds[kind].append(run(kind, data, batch_size=a.batch_size, workers=a.workers))
    if {r["samples"] for k in kinds for r in rounds[k]} != {a.samples}:
        raise SystemExit(f"contestants disagree on the samples per epoch: "
                         f"{ {k: [r['samples'] for r in rounds[k]] for k in kinds} }")
    ratios = [m["samples_per_s"] / s["samples_per_s"] for s, m in zip(rounds["single"], rounds["mix"])]
    result = {
        "machine": {"python": sys.version.split()[0], "platform": platform.platform()},
        "args": {"samples": a.samples, "shape": list(shape), "rounds": a.rounds, "batch_size": a.batch_size,
                 "workers": a.workers},
        **{k: {"samples_per_s": statistics.median(r["samples_per_s"] for r in rounds[k]),
               "bytes_per_s": statistics.median(r["bytes_per_s"] for r in rounds[k])} for k in kinds},
        "ratio_mix_over_single": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
    }
    print(f"tier R (.npy {list(shape)} uint8, {a.samples} samples, batch {a.batch_size}, {a.rounds} rounds)")
    for k in kinds:
        print(f"  {k:6s} {result[k]['samples_per_s']:10.0f} samples/s  {result[k]['bytes_per_s'] / 1e9:6.3f} GB/s")
    r = result["ratio_mix_over_single"]
    print(f"  mix / single: {r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f})")
    print(json.dumps(result))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
