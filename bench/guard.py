"""The loader's regression guard: tiers R and T and the first batch of this checkout against a
named baseline commit, each judged against the noise of the baseline run against itself.

    python bench/guard.py --base 0d29bb3 --rounds 5 --images 2000 --workdir /tmp/guard \\
        --versus --out bench/results/guard-0d29bb3-cpu2.json

Every issue that touches the loader (gdsload/loader, frontend, decode, ring, io, plan) runs it
before it resolves (bench/README.md, "Guard"), with the last release, or the commit before the
issue's first, as `--base`.

What it runs, each loader in a fresh process over the same generated ImageNet-like JPEGs
(`bench/tree_compare.py`: each tree converts them with its own `gdsload convert`, imports outside
the clock, a fresh loader per round, batch 64, 2 reader threads, shuffled, no map; compiled modules
read from --workdir/pycache as an installed package's are, even under PYTHONDONTWRITEBYTECODE=1):
  1. A/B: this checkout ("head") against `--base`, interleaved per round after a warm-up: tier R
     (encoded bytes and labels) and tier T (decode + random resized crop 224 + flip + normalize, DALI
     CPU) samples/s, and the time from the constructor to the first batch of each tier.
  2. A/A: `--base` against a second copy of itself, the same way: how far the same code moves
     between two trees on this machine now (the control).
  3. With `--versus`: tier T of this checkout against DALI's own pipeline (`fn.readers.webdataset`
     with the same operators) and torch's DataLoader + webdataset + Pillow, and the first batch
     against torch's (`bench/loader_bench.py`'s harness, interleaved rounds): the issue-55 targets
     (T >= 0.95x DALI and >= 1.6x torch, first batch <= 0.5x torch's).
  4. The modules each tree imports from the constructor to the first batch of each tier (one more
     fresh process per tree and tier, imports outside the clock as in the rounds): a count with no
     noise, so a first batch that grew by imports shows even where its time is inside the A/A
     (issue 55: tier R 57 modules at 70b9300 against 49 at 0d29bb3, `numpy.random`'s among them).
Verdict per figure: head / base (median over the paired rounds) inside the A/A's range of the same
ratio ("inside": no change this run can show), above it ("faster") or below it ("slower": a
regression to explain before resolving). For the first batch the ratio is of times (lower is
better; "slower" means a longer first batch). The A/B ran before the A/A, not interleaved with it.

The JSON (`--out`, default bench/results/guard-<base>-<node>.json) holds every round of both runs.
`--rounds 1 --images 128 --tiers R` is a smoke run that proves the script runs; its figures mean
nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))


def verdict(ab: float, aa_min: float, aa_max: float, *, higher_is_better: bool = True) -> str:
    """head / base against the A/A's range of the same ratio."""
    if aa_min <= ab <= aa_max:
        return "inside the A/A spread"
    better = ab > aa_max if higher_is_better else ab < aa_min
    return "outside the A/A spread: " + ("faster" if better else "SLOWER (a regression: explain it before resolving)")


# One tree's modules imported from the constructor to the first batch (argv[1]: JSON with tree,
# tier, dataset): the rounds' imports first (tree_compare.RUNNER), then the loader.
IMPORTS = r'''
import numpy
try:
    import torch  # noqa: F401  (imported before the clock in the rounds)
except ImportError:
    pass
a = json.loads(sys.argv[1])
if a["tier"] == "T":
    import nvidia.dali  # noqa: F401
import gdsload
kw = dict(batch_size=64, shuffle=True, seed=1, num_workers=2, device="cpu", output="numpy", fields=("jpg", "cls"))
if a["tier"] == "R":
    kw["decode"] = False
if a["tier"] == "T":
    kw["transform"] = gdsload.ImageTransform(size=224)
before = set(sys.modules)
loader = gdsload.DataLoader(gdsload.Dataset(a["dataset"]), **kw)
next(iter(loader))
print(json.dumps({"modules": sorted(set(sys.modules) - before), "gdsload": gdsload.__file__}))
loader.close()
'''


def first_batch_imports(tree: Path, dataset: Path, tier: str, pycache: Path, timeout_s: float) -> list[str]:
    """The modules `tree`'s loader imports from its constructor to its first batch of `tier`."""
    import subprocess

    import tree_compare

    code = tree_compare.USE_TREE.replace("TREE", "json.loads(sys.argv[1])['tree']") + IMPORTS
    arg = json.dumps({"tree": str(tree), "tier": tier, "dataset": str(dataset)})
    r = subprocess.run([sys.executable, "-c", code, arg], capture_output=True, text=True, timeout=timeout_s,
                       env=tree_compare.child_env(tree, pycache))
    if r.returncode != 0:
        raise RuntimeError(f"{tree} {tier} imports: exit {r.returncode}\n{r.stderr[-3000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if not out["gdsload"].startswith(str(tree)):
        raise RuntimeError(f"ran {out['gdsload']}, not the tree {tree}")
    return out["modules"]


def _imports(work: Path, base: str, tiers: list[str], timeout_s: float) -> dict:
    """`first_batch_imports` of this checkout and of `base` (the A/B's trees and shards), per tier."""
    ab = work / "ab"
    out = {}
    for tier in tiers:
        head = first_batch_imports(REPO, ab / "head-jpg", tier, ab / "pycache", timeout_s)
        old = first_batch_imports(ab / f"base-{base}", ab / "base-jpg", tier, ab / "pycache", timeout_s)
        out[tier] = {"head": len(head), "base": len(old), "only_head": sorted(set(head) - set(old)),
                     "only_base": sorted(set(old) - set(head))}
    return out


def _figures(tc: dict) -> dict:
    """One tree_compare result as figures: name -> (median, min, max, higher is better)."""
    out = {}
    for tier, row in tc["tiers"].items():
        hb = row["head_over_base"]
        out[f"tier {tier} samples/s, head/base"] = (hb["median"], hb["min"], hb["max"], True)
        fb = row["first_over_base"]
        out[f"tier {tier} first batch s, head/base"] = (fb["median"], fb["min"], fb["max"], False)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="git revision to compare against (a commit, tag or branch)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--tiers", default="R,T")
    ap.add_argument("--workdir", default="/tmp/gdsload-guard")
    ap.add_argument("--versus", action="store_true",
                    help="also tier T against DALI's own pipeline and torch+webdataset+Pillow, and the first batch")
    ap.add_argument("--timeout-s", type=float, default=900)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    import subprocess

    import tree_compare
    from gdsload.sampledata import make_image_folder

    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    images = work / f"images-{a.images}"
    if not images.exists():
        make_image_folder(images, num_images=a.images, num_classes=10, seed=1)
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True).stdout.strip())
    common = ["--rounds", str(a.rounds), "--tiers", a.tiers, "--batch-size", str(a.batch_size),
              "--images-dir", str(images), "--timeout-s", str(a.timeout_s)]
    t0 = time.time()
    print(f"A/B: this checkout ({head}{', uncommitted changes' if dirty else ''}) against {a.base}", flush=True)
    ab = tree_compare.main(["--base", a.base, "--workdir", str(work / "ab"), *common])
    print(f"A/A: {a.base} against itself (the control)", flush=True)
    aa = tree_compare.main(["--base", a.base, "--head", a.base, "--workdir", str(work / "aa"), *common])
    result: dict = {"bench": "guard", "base": a.base, "head": head, "head_dirty": dirty, "rounds": a.rounds,
                    "images": a.images, "batch_size": a.batch_size,
                    "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
                    "machine": {"node": platform.node(), "cpus": os.cpu_count(), "platform": platform.platform()},
                    "command": "python bench/guard.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                    "ab": ab, "aa": aa, "verdicts": {}}
    fa, fb = _figures(ab), _figures(aa)
    print(f"\nverdicts ({a.rounds} rounds; head/base median (min-max), A/A range):")
    for name, (med, lo, hi, up) in fa.items():
        _, aa_lo, aa_hi, _ = fb[name]
        v = verdict(med, aa_lo, aa_hi, higher_is_better=up)
        result["verdicts"][name] = {"head_over_base": {"median": med, "min": lo, "max": hi},
                                    "aa": {"min": aa_lo, "max": aa_hi}, "verdict": v}
        print(f"  {name}: {med:.3f} ({lo:.3f}-{hi:.3f}); A/A {aa_lo:.3f}-{aa_hi:.3f}: {v}")
    result["first_batch_imports"] = imports = _imports(work, a.base, a.tiers.split(","), a.timeout_s)
    print("\nmodules imported from the constructor to the first batch (a count: no A/A needed):")
    for tier, row in imports.items():  # gdsload's own modules are renamed between trees: the others told
        extra = [m for m in row["only_head"] if not m.startswith("gdsload.")]
        print(f"  tier {tier}: head {row['head']}, base {row['base']}; not gdsload's, only in head: "
              f"{', '.join(extra) or '-'}")
    if a.versus:
        from gdsload.bench.harness import run_suite

        # its children (every contestant) read compiled modules, as tree_compare's do (`child_env`)
        os.environ.update(tree_compare.child_env(REPO, work / "pycache"))
        os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
        jpg = work / "ab" / "head-jpg"  # this checkout's shards of the same images
        suite = run_suite(str(jpg), kind="image", tiers=["T"], batch_size=a.batch_size, rounds=a.rounds,
                          contestants=["gdsload", "dali", "torch"], log=lambda m: print(m, flush=True))
        t = suite["tiers"]["T"]
        targets = {"tier T / DALI's pipeline (target >= 0.95)": (t["dali"]["ratio_gdsload_over"], 0.95, True),
                   "tier T / torch+webdataset+Pillow (target >= 1.6)": (t["torch"]["ratio_gdsload_over"], 1.6, True)}
        result["versus"] = suite
        print("\nagainst the baselines (this checkout; median (min-max) of paired rounds):")
        for name, (r, target, up) in targets.items():
            ok = r["median"] >= target if up else r["median"] <= target
            result["verdicts"][name] = {"ratio": r, "target": target, "met": ok}
            print(f"  {name}: {r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f}): {'met' if ok else 'NOT met'}")
        fr = t["torch"].get("first_batch_ratio")
        if fr is not None:
            ok = fr <= 0.5
            result["verdicts"]["first batch / torch's (target <= 0.5)"] = {"ratio": fr, "target": 0.5, "met": ok}
            print(f"  first batch / torch's (target <= 0.5): {fr:.3f}: {'met' if ok else 'NOT met'}")
    result["seconds"] = time.time() - t0
    out = Path(a.out) if a.out else REPO / "bench" / "results" / f"guard-{a.base}-{platform.node()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {out}")
    return result


if __name__ == "__main__":
    main()
