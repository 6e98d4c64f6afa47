"""Loader benchmark: gdsload.DataLoader against PyTorch DataLoader + webdataset, DALI's own reader,
SPDL's pipeline and the raw read limit, on generated JPEG shards (ImageNet-like ~105 KB, and
smaller ~35 KB photos) and raw `.npy` tensor shards.

    python bench/loader_bench.py                       # default size, 5 rounds (~15 min on 2 cores)
    python bench/loader_bench.py --tiny                # smoke run (the test suite runs it)
    python bench/loader_bench.py --stall 0,20,80       # data-stall fraction at these step lengths (ms)
    python bench/loader_bench.py --prefetch-sweep 20,200   # prefetch_factor="auto" vs fixed settings

Run it with an interpreter that has `spdl` (see bench/README.md); without it SPDL is skipped.

Data is generated once into --workdir (deterministic by seed) and reused. Prints tables and writes
JSON to --out (default bench/results/loader-<node>.json). See bench/README.md for how to read it.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path


PHOTO_SIZE = (270, 200)  # mean width, height of the small-photo set: ~35 KB JPEGs at quality 90


def ensure_photos(work: Path, *, images: int) -> Path:
    """The ~35 KB photo set (same generator, smaller images)."""
    from gdsload.convert.engine import ConvertOptions, convert
    from gdsload.sampledata import make_image_folder

    out = work / "photo-shards"
    if not (out / "manifest.json").exists():
        make_image_folder(work / "photos", num_images=images, num_classes=10, seed=1, mean_size=PHOTO_SIZE)
        convert(str(work / "photos"), out, ConvertOptions(shard_size=32_000_000, progress=False, overwrite=True))
    return out


def ensure_data(work: Path, *, images: int, tensors: int, tiny: bool) -> tuple[Path, Path]:
    from gdsload.convert.engine import ConvertOptions, convert
    from gdsload.sampledata import make_image_folder, make_npy_folder

    jpg, npy = work / "jpg-shards", work / "npy-shards"
    shard = 4_000_000 if tiny else 64_000_000  # >= 4 shards so every baseline worker gets one
    if not (jpg / "manifest.json").exists():
        kw = {"mean_size": (160, 120)} if tiny else {}
        make_image_folder(work / "jpg", num_images=images, num_classes=10, seed=0, **kw)
        convert(str(work / "jpg"), jpg, ConvertOptions(shard_size=shard, progress=False, overwrite=True))
    if not (npy / "manifest.json").exists():
        shape = (3, 32, 32) if tiny else (3, 224, 224)
        make_npy_folder(work / "npy", num_samples=tensors, shape=shape, dtype="uint8", seed=0)
        convert(str(work / "npy"), npy, ConvertOptions(shard_size=shard, progress=False, overwrite=True))
    return jpg, npy


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="/tmp/gdsload-loader-bench")
    ap.add_argument("--images", type=int, default=3000)
    ap.add_argument("--tensors", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch-size", default="256", help="comma-separated, e.g. 64,256")
    ap.add_argument("--photos", type=int, default=0, help="also this many ~35 KB photos (a second image set)")
    ap.add_argument("--prefetch-sweep", default="",
                    help="comma-separated step lengths in ms: data stall of prefetch_factor='auto' vs fixed")
    ap.add_argument("--sweep-rounds", type=int, default=3)
    ap.add_argument("--tiers", default="R,D,T")
    ap.add_argument("--stall", default="", help="comma-separated step lengths in ms for the stall table")
    ap.add_argument("--out", default=None)
    ap.add_argument("--tiny", action="store_true")
    a = ap.parse_args(argv)
    if a.tiny:
        a.images, a.tensors, a.rounds, a.batch_size, a.tiers = 48, 48, 1, "16", "T"
    batch_sizes = [int(b) for b in str(a.batch_size).split(",")]
    from gdsload.bench.harness import format_table, run_suite

    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    jpg, npy = ensure_data(work, images=a.images, tensors=a.tensors, tiny=a.tiny)
    tiers = a.tiers.split(",")
    out: dict = {"bench": "loader", "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "machine": {"node": platform.node(), "cpus": os.cpu_count(), "gpu": None,
                             "platform": platform.platform(), "python": platform.python_version()},
                 "command": "python bench/loader_bench.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    log = (lambda *x: None) if a.tiny else (lambda m: print(m, file=sys.stderr))
    images = ["gdsload", "gdsload_noverify", "torch", "dali", "dali_torch", "spdl", "read", "read_warm", "decode1"]
    sets = [("images", jpg)] + ([("photos", ensure_photos(work, images=a.photos))] if a.photos else [])
    for bs in batch_sizes:
        tag = "" if len(batch_sizes) == 1 else f"@{bs}"
        for name, root in sets:
            out[name + tag] = run_suite(str(root), kind="image", tiers=tiers, batch_size=bs, rounds=a.rounds,
                                        contestants=images, warmup=not a.tiny, log=log)
            print(format_table(out[name + tag]))
        out["tensors" + tag] = run_suite(str(npy), kind="tensor", tiers=["R"], batch_size=bs, rounds=a.rounds,
                                         contestants=["gdsload", "torch", "spdl", "read", "read_warm"], warmup=not a.tiny, log=log)
        print(format_table(out["tensors" + tag]))
    if a.prefetch_sweep:
        out["prefetch_sweep"] = prefetch_sweep(jpg, [float(x) for x in a.prefetch_sweep.split(",")],
                                               batch_size=batch_sizes[0], rounds=a.sweep_rounds, log=log)
    if a.stall:
        out["stall"] = {}
        for ms in [float(x) for x in a.stall.split(",")]:
            r = run_suite(str(jpg), kind="image", tiers=["T"], batch_size=batch_sizes[0], rounds=max(1, a.rounds // 2),
                          contestants=["gdsload", "torch"], step_ms=ms, log=log)
            out["stall"][str(ms)] = {c: e["wait_fraction"] for c, e in r["tiers"]["T"].items()}
        print("data stall (fraction of wall time the consumer waited), tier T, by step length:")
        print(f"{'step ms':>8}{'gdsload':>10}{'torch':>10}")
        for ms, d in out["stall"].items():
            print(f"{float(ms):>8.0f}{d['gdsload']:>10.2f}{d['torch']:>10.2f}")
    out["seconds"] = time.time() - t0
    from gdsload.bench.harness import write_result

    write_result(out, a.out, Path(__file__).parent / "results", "loader", tiny=a.tiny)
    return out


SWEEP = ["auto", 1, 2, 4, 8]


def prefetch_sweep(jpg: Path, steps_ms: list[float], *, batch_size: int, rounds: int, log) -> dict:
    """Tier T with a sleeping training step: the data stall (fraction of wall time the consumer
    waited) of prefetch_factor="auto" against each fixed setting, interleaved rounds; prints,
    per step, each setting's median (min-max) and auto's distance from the best fixed one."""
    import json
    import statistics

    from gdsload.bench.harness import run_one

    m = json.loads((jpg / "manifest.json").read_text())
    field = next(f for f, k in m["fields"].items() if k == "image")
    out: dict = {}
    for ms in steps_ms:
        waits: dict[str, list[float]] = {str(p): [] for p in SWEEP}
        chosen: list = []
        for r in range(rounds):
            for p in SWEEP:
                res = run_one({"contestant": "gdsload", "tier": "T", "dataset": str(jpg), "kind": "image",
                               "image_field": field, "batch_size": batch_size, "workers": os.cpu_count() or 1,
                               "step_ms": ms, "prefetch": p})
                waits[str(p)].append(res["wait_s"] / res["wall_s"])
                if p == "auto":
                    chosen.append(res["stats"].get("prefetch_factor"))
            log(f"prefetch sweep, step {ms:.0f} ms: round {r + 1}/{rounds}")
        med = {p: statistics.median(w) for p, w in waits.items()}
        best = min((p for p in med if p != "auto"), key=med.get)
        out[str(ms)] = {"wait_fraction": {p: {"median": med[p], "min": min(w), "max": max(w)}
                                          for p, w in waits.items()},
                        "best_fixed": best, "auto_minus_best_points": 100 * (med["auto"] - med[best]),
                        "auto_chose": chosen}
        print(f"step {ms:.0f} ms, batch {batch_size}: data stall by prefetch_factor (median, min-max)")
        for p, w in waits.items():
            print(f"  {p:>5}: {med[p]:.3f} ({min(w):.3f}-{max(w):.3f})")
        print(f"  auto chose {chosen}; best fixed {best}; auto - best = {out[str(ms)]['auto_minus_best_points']:+.1f} points")
    return out


if __name__ == "__main__":
    main()
