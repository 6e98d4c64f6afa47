"""A fresh process's first epoch, this checkout against an earlier gdsload: where does the time go?

`bench/tree_compare.py` times building a `DataLoader` plus one epoch in a fresh process; this
script splits that time for tier R (encoded bytes and labels, `decode=False`) or N (`.npy` rows):
importing the loader's modules inside the clock (`gdsload.DataLoader` is imported lazily), the
loader's construction, the first `iter()` (layout, ring, threads), time to the first batch, and the
wall of the first `--samples` samples. With `--trace` the loader modules are imported before the
clock and every batch's fill (reader thread, start, end) and every consumer wait are recorded, so
a stall shows as a gap. Each tree reads the dataset its own `gdsload convert` wrote
(`tree_compare.py`'s workdir has both). Runs alternate trees, fresh processes, after a warm-up each.

    python bench/first_epoch.py --base-tree /tmp/tcmp2/base-0d29bb3 --base-data /tmp/tcmp2/base-jpg \
        --head-data /tmp/tcmp2/head-jpg --samples 2000 --rounds 5 [--trace] [--out result.json]

Prints per tree the medians of each part (ms), the garbage collections inside the clock (total ms
per round; full ones with when and how long) and, with `--trace`, the longest gap between a
reader's fills and the longest consumer wait of each round. `--gc-freeze` runs both trees with
`gc.freeze()` before the clock (what is alive then, torch's objects, is never scanned again).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = r'''
import json, sys, time, threading
a = json.loads(sys.argv[1])
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "").lower()
                    and "editable" not in repr(f).lower()]
sys.path.insert(0, a["tree"])
import numpy, torch  # noqa: F401  (outside the clock, as in tree_compare)
import gdsload
fills, gets = [], []
if a["trace"]:  # the loader's modules before the clock, their fill and the consumer's wait wrapped
    gdsload.DataLoader, gdsload.Dataset
    try:
        from gdsload.loader.fill import SlotFiller as F
        fill_name = "fill"
        from gdsload.ring.ring import Ring
    except ImportError:  # the old flat layout
        from gdsload.epoch import Epoch as F
        fill_name = "_fill"
        from gdsload.ring import Ring
    real_fill, real_get = getattr(F, fill_name), Ring.get

    def fill(self, slot, seq, ids, *r, **k):
        s = time.perf_counter()
        try:
            return real_fill(self, slot, seq, ids, *r, **k)
        finally:
            fills.append((seq, threading.current_thread().name, s - T0, time.perf_counter() - T0))

    def get(self, seq, *r, **k):
        s = time.perf_counter()
        try:
            return real_get(self, seq, *r, **k)
        finally:
            gets.append((seq, s - T0, time.perf_counter() - T0))

    setattr(F, fill_name, fill)
    Ring.get = get
import gc
gcs, gc_t = [], {}


def on_gc(phase, info):  # garbage collections inside the clock: (generation, start, ms)
    if phase == "start":
        gc_t["s"] = time.perf_counter()
    elif "s" in gc_t and "T0" in globals():
        gcs.append((info["generation"], gc_t["s"] - T0, 1000 * (time.perf_counter() - gc_t["s"])))


gc.callbacks.append(on_gc)
if a["gc_freeze"]:  # what is alive now (torch's objects) out of every later collection
    gc.freeze()
before = set(sys.modules)
kw = dict(batch_size=a["batch_size"], shuffle=True, seed=1, num_workers=2, device="cpu", output="numpy",
          fields=(a["field"], "cls"))
if a["tier"] == "R":
    kw["decode"] = False
T0 = time.perf_counter()
cpu0 = time.process_time()
loader = gdsload.DataLoader(gdsload.Dataset(a["dataset"]), **kw)
t_ctor = time.perf_counter() - T0
it = iter(loader)
t_iter = time.perf_counter() - T0
n = 0
t_first = None
for batch in it:
    if t_first is None:
        t_first = time.perf_counter() - T0
    n += len(batch[-1])
    if n >= a["samples"]:
        break
wall = time.perf_counter() - T0
cpu = time.process_time() - cpu0
it.close() if hasattr(it, "close") else None
loader.close()
print(json.dumps({"samples": n, "ctor_s": t_ctor, "iter_s": t_iter, "first_s": t_first, "wall_s": wall,
                  "cpu_s": cpu, "modules_in_clock": len(set(sys.modules) - before),
                  "fills": fills, "gets": gets, "gcs": gcs, "gdsload": gdsload.__file__}))
'''


def run(tree: Path, args: dict, timeout_s: float) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    r = subprocess.run([sys.executable, "-c", CHILD, json.dumps({**args, "tree": str(tree)})],
                       capture_output=True, text=True, timeout=timeout_s, env=env, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"{tree}: exit {r.returncode}\n{r.stderr[-3000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if not out["gdsload"].startswith(str(tree)):
        raise RuntimeError(f"ran {out['gdsload']}, not the tree {tree}")
    return out


def gaps(r: dict) -> dict:
    """The longest idle gap of any reader between its fills (from the clock's start for its
    first), and the longest consumer wait, in ms."""
    by_thread: dict[str, list] = {}
    for seq, name, s, e in r["fills"]:
        by_thread.setdefault(name, []).append((s, e))
    idle = 0.0
    for spans in by_thread.values():
        spans.sort()
        last = r["iter_s"]
        for s, e in spans:
            idle = max(idle, s - last)
            last = e
    wait = max((e - s for _, s, e in r["gets"]), default=0.0)
    return {"reader_gap_ms": 1000 * idle, "longest_wait_ms": 1000 * wait,
            "first_fill_ms": 1000 * min((s for _, _, s, _ in r["fills"]), default=0.0)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-tree", required=True, help="an extracted earlier tree (tree_compare's workdir has it)")
    ap.add_argument("--head-tree", default=str(REPO))
    ap.add_argument("--base-data", required=True)
    ap.add_argument("--head-data", required=True)
    ap.add_argument("--tier", default="R", choices=["R", "N"])
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--trace", action="store_true")
    ap.add_argument("--gc-freeze", action="store_true", help="gc.freeze() before the clock in both trees")
    ap.add_argument("--timeout-s", type=float, default=300)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    trees = {"base": (Path(a.base_tree), a.base_data), "head": (Path(a.head_tree), a.head_data)}
    field = "jpg" if a.tier == "R" else "npy"
    runs: dict[str, list[dict]] = {"base": [], "head": []}
    for rnd in range(a.rounds + 1):  # round 0: warm-up (page cache, pyc), not counted
        for name, (tree, data) in trees.items():
            r = run(tree, {"tier": a.tier, "dataset": data, "field": field, "batch_size": a.batch_size,
                           "samples": a.samples, "trace": a.trace, "gc_freeze": a.gc_freeze}, a.timeout_s)
            if rnd:
                r.update(gaps(r) if a.trace else {})
                runs[name].append(r)
    keys = ["ctor_s", "iter_s", "first_s", "wall_s", "cpu_s"]
    summary: dict = {"samples": a.samples, "tier": a.tier, "rounds": a.rounds, "trace": a.trace, "trees": {}}
    for name, rs in runs.items():
        row = {k: 1000 * statistics.median(r[k] for r in rs) for k in keys}
        row["modules_in_clock"] = rs[0]["modules_in_clock"]
        row["gc_ms"] = [round(sum(ms for _, _, ms in r["gcs"]), 1) for r in rs]  # per round
        row["gc2"] = [[(round(t * 1000, 1), round(ms, 1)) for g, t, ms in r["gcs"] if g == 2] for r in rs]
        if a.trace:
            for k in ("reader_gap_ms", "longest_wait_ms", "first_fill_ms"):
                row[k] = [round(r[k], 1) for r in rs]
        summary["trees"][name] = row
        print(f"{name}: ctor {row['ctor_s']:.1f} ms, iter {row['iter_s']:.1f}, first batch {row['first_s']:.1f}, "
              f"{a.samples} samples {row['wall_s']:.1f} ms (CPU {row['cpu_s']:.1f}); modules imported in the clock "
              f"{row['modules_in_clock']}; GC ms per round {row['gc_ms']}, full GCs (at ms, ms) {row['gc2']}" + (f"; reader gap {row['reader_gap_ms']}, longest wait "
                                             f"{row['longest_wait_ms']}, first fill at {row['first_fill_ms']}"
                                             if a.trace else ""), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"summary": summary, "runs": runs}, indent=1) + "\n")
    return summary


if __name__ == "__main__":
    main()
