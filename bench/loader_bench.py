"""Loader benchmark: gdsload.DataLoader against PyTorch DataLoader + webdataset, DALI's own reader
and the raw read limit, on generated ImageNet-like JPEG shards and raw `.npy` tensor shards.

    python bench/loader_bench.py                       # default size, 5 rounds (~15 min on 2 cores)
    python bench/loader_bench.py --tiny                # smoke run (the test suite runs it)
    python bench/loader_bench.py --stall 0,20,80       # data-stall fraction at these step lengths (ms)

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
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--tiers", default="R,D,T")
    ap.add_argument("--stall", default="", help="comma-separated step lengths in ms for the stall table")
    ap.add_argument("--out", default=None)
    ap.add_argument("--tiny", action="store_true")
    a = ap.parse_args(argv)
    if a.tiny:
        a.images, a.tensors, a.rounds, a.batch_size, a.tiers = 48, 48, 1, 16, "T"
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
    out["images"] = run_suite(str(jpg), kind="image", tiers=tiers, batch_size=a.batch_size, rounds=a.rounds,
                              contestants=["gdsload", "torch", "dali", "read", "decode1"], warmup=not a.tiny, log=log)
    print(format_table(out["images"]))
    out["tensors"] = run_suite(str(npy), kind="tensor", tiers=["R"], batch_size=a.batch_size, rounds=a.rounds,
                               contestants=["gdsload", "torch", "read"], warmup=not a.tiny, log=log)
    print(format_table(out["tensors"]))
    if a.stall:
        out["stall"] = {}
        for ms in [float(x) for x in a.stall.split(",")]:
            r = run_suite(str(jpg), kind="image", tiers=["T"], batch_size=a.batch_size, rounds=max(1, a.rounds // 2),
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


if __name__ == "__main__":
    main()
