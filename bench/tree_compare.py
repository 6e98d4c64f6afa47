"""gdsload against an earlier gdsload: did a change make the existing tiers slower?

Two source trees, this checkout ("head") and a git revision ("base", extracted with `git archive`),
run the same loaders over the same images, each in a fresh process, interleaved (base, head, base,
head, ...) after one warm-up run of each. Each tree converts the images with its own `gdsload
convert`, so each reads the shard format it writes. Imports (NumPy, torch, DALI) and a full garbage
collection happen before the clock (the process's first one after importing torch otherwise lands
in whichever tree's epoch crosses the threshold first: `bench/first_epoch.py`); the clock covers
building the `DataLoader` and one shuffled epoch in threads, no `map`. Children read compiled
modules from `--workdir`/pycache (written in the warm-up round), as an installed package does,
even where `PYTHONDONTWRITEBYTECODE=1` is set (`child_env`; `--no-pycache`: as the environment says).

Tiers (as in bench/loader_bench.py):
  R   encoded JPEG bytes and labels (`decode=False`), samples/s
  N   `.npy` uint8[3, 224, 224] rows and labels, samples/s (x 150,528 bytes = bytes/s)
  T   decode + random resized crop 224 + flip + normalize (`ImageTransform(size=224)`, DALI CPU)

Reported per tier: head / base samples/s, median (min-max) over rounds paired by round, the
per-round ratios, CPU seconds per 1,000 samples of each, and the time from the constructor to the
first batch (`first_batch_s`; `first_over_base` is head / base of it, lower is better).
`bench/guard.py` runs this A/B and an A/A of the base against itself and gives a verdict per
figure. Example (issue 17: "with threads and no map, the existing
tiers do not get slower"; 739255f is the last commit before map/collate_fn/worker_mode):

    python bench/tree_compare.py --base 739255f --workdir /tmp/tcmp --rounds 5 \
        --out bench/results/tree-compare-premap-cpu2.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# The start of every child: `tree`'s gdsload, not the one an editable install's import hook finds.
USE_TREE = r'''
import json, sys, time
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "").lower()
                    and "editable" not in repr(f).lower()]
sys.path.insert(0, TREE)
'''

# One contestant run; prints one JSON line.
RUNNER = USE_TREE.replace("TREE", "json.loads(sys.argv[1])['tree']") + r'''
a = json.loads(sys.argv[1])
import numpy, torch  # noqa: F401  (outside the clock)
if a["tier"] == "T":
    import nvidia.dali  # noqa: F401
import gdsload
kw = dict(batch_size=a["batch_size"], shuffle=True, seed=1, num_workers=2, device="cpu", output="numpy",
          fields=(a["field"], "cls"))
if a["tier"] == "R":
    kw["decode"] = False
if a["tier"] == "T":
    kw["transform"] = gdsload.ImageTransform(size=224)
# A fresh process that imported torch holds ~170k GC-tracked objects, and its first full
# collection (75-140 ms on the 2-core VM) is due soon after: whichever tree allocates a few hundred
# more objects takes it inside its one measured epoch (bench/first_epoch.py showed it: 0.69x for
# tier R with it, equal without), the other in a later epoch. Collected here, outside the clock.
import gc
gc.collect()
cpu0, t0 = time.process_time(), time.perf_counter()
loader = gdsload.DataLoader(gdsload.Dataset(a["dataset"]), **kw)
n = 0
labels = 0
first = None
for batch in loader:
    if first is None:
        first = time.perf_counter() - t0
    n += len(batch[-1])
    labels += int(numpy.asarray(batch[-1]).sum())
wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
print(json.dumps({"samples": n, "label_sum": labels, "wall_s": wall, "cpu_s": cpu, "first_s": first,
                  "gdsload": gdsload.__file__}))
'''


def child_env(tree: Path, pycache: Path | None) -> dict:
    """A child's environment: `tree` first on the path and, with `pycache`, compiled modules read
    from (and written to) that folder, as an installed package's are, instead of every fresh process
    compiling the tree's sources inside the clock, as `PYTHONDONTWRITEBYTECODE=1` (set in this
    sandbox) makes it: measured so, a tree with more or longer modules paid for their compilation
    in every round's constructor and first batch (issue 55: 64 `compile` calls in the clock at
    fa3d3a1's successor against 4 at 0d29bb3). The warm-up round writes them."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    if pycache is not None:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(pycache)
    return env


PYCACHE: Path | None = None  # set by main(): `--workdir`/pycache unless --no-pycache


def run(tree: Path, args: dict, timeout_s: float) -> dict:
    env = child_env(tree, PYCACHE)
    args = {**args, "tree": str(tree)}
    r = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(args)], capture_output=True, text=True,
                       timeout=timeout_s, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"{tree} {args['tier']}: exit {r.returncode}\n{r.stderr[-3000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if not out["gdsload"].startswith(str(tree)):
        raise RuntimeError(f"ran {out['gdsload']}, not the tree {tree}")
    return out


# `gdsload convert` of that tree: argv[1] is the tree, the rest the command line.
CONVERT = USE_TREE.replace("TREE", "sys.argv[1]") + "from gdsload.cli import main\nsys.exit(main(sys.argv[2:]))\n"


def convert(tree: Path, src: Path, dst: Path) -> None:
    if (dst / "manifest.json").exists():
        return
    subprocess.run([sys.executable, "-c", CONVERT, str(tree), "convert", str(src), str(dst), "--shard-size", "64MB",
                    "-q", "--overwrite"], check=True)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="git revision of the earlier gdsload")
    ap.add_argument("--head", default=None,
                    help="git revision to run as head (default: this checkout); --head REV --base REV is "
                         "an A/A run, which shows the noise of the same code in two trees")
    ap.add_argument("--workdir", default="/tmp/tree-compare")
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--rows", type=int, default=2000, help=".npy rows for tier N")
    ap.add_argument("--tiers", default="R,N,T")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--timeout-s", type=float, default=900)
    ap.add_argument("--no-pycache", action="store_true",
                    help="children compile sources as the environment says (PYTHONDONTWRITEBYTECODE) instead of "
                         "reading compiled modules from --workdir/pycache")
    ap.add_argument("--images-dir", default=None, help="an image folder to use (default: generated in --workdir)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from gdsload.sampledata import make_image_folder, make_npy_folder

    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    global PYCACHE
    PYCACHE = None if a.no_pycache else work / "pycache"
    base = work / f"base-{a.base}"
    if not base.exists():
        base.mkdir()
        archive = subprocess.run(["git", "-C", str(REPO), "archive", a.base], check=True, capture_output=True).stdout
        subprocess.run(["tar", "xf", "-", "-C", str(base)], input=archive, check=True)
    head = REPO
    if a.head:
        head = work / f"head-{a.head}"
        if not head.exists():
            head.mkdir()
            archive = subprocess.run(["git", "-C", str(REPO), "archive", a.head], check=True,
                                     capture_output=True).stdout
            subprocess.run(["tar", "xf", "-", "-C", str(head)], input=archive, check=True)
    trees = {"base": base, "head": head}
    images, rows = Path(a.images_dir) if a.images_dir else work / "images", work / "rows"
    if not images.exists():
        make_image_folder(images, num_images=a.images, num_classes=10, seed=1)
    if not rows.exists() and "N" in a.tiers.split(","):
        make_npy_folder(rows, num_samples=a.rows, shape=(3, 224, 224), dtype="uint8", seed=1)
    sets = {}
    for name, tree in trees.items():
        convert(tree, images, work / f"{name}-jpg")
        if "N" in a.tiers.split(","):
            convert(tree, rows, work / f"{name}-npy")
        sets[name] = {"R": (work / f"{name}-jpg", "jpg"), "T": (work / f"{name}-jpg", "jpg"),
                      "N": (work / f"{name}-npy", "npy")}
    results: dict = {"base": a.base, "head": a.head or "checkout", "batch_size": a.batch_size, "rounds": a.rounds, "tiers": {},
                     "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}}
    for tier in a.tiers.split(","):
        runs: dict[str, list[dict]] = {"base": [], "head": []}
        for rnd in range(a.rounds + 1):  # round 0: warm-up, not counted
            for name, tree in trees.items():
                path, field = sets[name][tier]
                r = run(tree, {"tier": tier, "dataset": str(path), "field": field, "batch_size": a.batch_size},
                        a.timeout_s)
                if rnd:
                    runs[name].append(r)
        for key in ("samples", "label_sum"):
            seen = {r[key] for rs in runs.values() for r in rs}
            if len(seen) != 1:
                raise RuntimeError(f"tier {tier}: the two trees disagree on {key}: {seen}")
        rate = {n: [r["samples"] / r["wall_s"] for r in rs] for n, rs in runs.items()}
        ratios = [h / b for h, b in zip(rate["head"], rate["base"])]
        firsts = [h["first_s"] / b["first_s"] for h, b in zip(runs["head"], runs["base"])]
        row = {"samples": runs["head"][0]["samples"], "ratios": ratios,
               "first_batch_s": {n: statistics.median(r["first_s"] for r in rs) for n, rs in runs.items()},
               "first_over_base": {"median": statistics.median(firsts), "min": min(firsts), "max": max(firsts),
                                   "ratios": firsts},
               "samples_per_s": {n: statistics.median(v) for n, v in rate.items()},
               "cpu_s_per_1k": {n: statistics.median(1000 * r["cpu_s"] / r["samples"] for r in rs)
                                for n, rs in runs.items()},
               "head_over_base": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}}
        results["tiers"][tier] = row
        hb = row["head_over_base"]
        print(f"tier {tier}: head {row['samples_per_s']['head']:,.0f}/s, base {row['samples_per_s']['base']:,.0f}/s, "
              f"head/base {hb['median']:.2f} ({hb['min']:.2f}-{hb['max']:.2f}); CPU s/1k head "
              f"{row['cpu_s_per_1k']['head']:.2f}, base {row['cpu_s_per_1k']['base']:.2f}", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
