"""What planning costs: the first batch and the peak memory growth of an epoch of n samples, order 1
(built whole per epoch) against order 2 (computed per batch), issue 50.

The epoch is a `gdsload.Mix` of two small `.npy` datasets (3,000 and 2,000 rows of 64 uint8,
written once by `gdsload.ShardWriter` and reused) with `samples_per_epoch=n`, weights 0.7/0.3,
shuffled, batch 256, `decode=False`, CPU, NumPy output. Every measurement runs in a fresh process
(VmHWM is a process's peak): it imports gdsload and opens the two datasets, reads VmHWM, then
times `DataLoader(...)` up to its first batch and reads VmHWM again; the figure is the growth.
The same process then times the plan alone at the epoch's end: `state_dict()` after a resume to
the last step (`load_state_dict`), and `plan.batch` of the last step on 4 ranks and on 2 (the
elastic 4 -> 2 resume reads the same global batch: checked, `elastic_equal`). Order 1 is run only
up to `--order1-max` samples (past it the loader refuses an epoch whose order would not fit in
memory, 72 bytes per sample, or takes minutes); sizes beyond are reported as not run.

Prints a table and writes JSON (`--out`): per order and n, every round's seconds to the first
batch and VmHWM growth in MB, with the median.

    python bench/plan_bench.py --workdir /tmp/pbench --sizes 1e6,1e7,1e8,1e9,1e10 --rounds 5 \
        --order1-max 1e8 --order1-rounds 1 --out bench/results/plan-cpu2.json
    python bench/plan_bench.py --tiny     # smoke run (10^4 and 10^6, one round); tests/plan/test_plan_bench.py runs it

The feed's counterpart (issue 50's target: a `RemoteLoader` striped over two `gdsload serve`
processes, a mix of 10^10 samples per epoch in order 2; first batch and each server's VmHWM
growth) is a test that prints its figures:

    python -m pytest -s tests/service/test_order_feed.py -k striped_remote
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

BATCH = 256


def ensure_data(work: Path) -> dict[str, Path]:
    """The two small datasets of the mix, written once."""
    import numpy as np

    import gdsload

    out = {}
    for name, n in (("a", 3000), ("b", 2000)):
        path = work / f"plan-{name}"
        if not (path / "manifest.json").is_file():
            rng = np.random.default_rng(len(name) + n)
            with gdsload.ShardWriter(path, shard_size="64KiB", overwrite=True) as w:
                for i in range(n):
                    w.write({"__key__": f"{name}{i:05d}", "x.npy": rng.integers(0, 255, 64, dtype=np.uint8)})
        out[name] = path
    return out


def vm_hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def child(n: int, order: int, work: Path) -> dict:
    """One measurement (in its own process)."""
    from dataclasses import replace

    import numpy as np

    import gdsload

    data = ensure_data(work)
    parts = [gdsload.Dataset(str(data["a"])), gdsload.Dataset(str(data["b"]))]
    hwm0 = vm_hwm_bytes()
    t0 = time.perf_counter()
    mix = gdsload.Mix(parts, weights=[0.7, 0.3], samples_per_epoch=n, names=["a", "b"])
    dl = gdsload.DataLoader(mix, batch_size=BATCH, shuffle=True, seed=1, decode=False, order=order,
                            device="cpu", output="numpy", num_workers=2)
    it = iter(dl)
    first = next(it)
    first_s = time.perf_counter() - t0
    hwm1 = vm_hwm_bytes()
    it.close()
    assert len(first["__key__"]) == min(BATCH, n)
    # the epoch's end: resume there, and the last global batch on 4 ranks and on 2
    plan = dl.plan
    t1 = time.perf_counter()
    last = len(plan) - 1
    dl.load_state_dict(plan.state(0, last * plan.global_batch))
    four = replace(plan, batch_size=BATCH // 4, world_size=4, rank=0)
    two = replace(plan, batch_size=BATCH // 2, world_size=2, rank=0)

    def global_batch(p):
        out = np.full(BATCH, -1, np.int64)
        for r in range(p.world_size):
            b = replace(p, rank=r).batch(0, last)
            out[r + p.world_size * np.arange(len(b))] = b
        return out

    elastic_equal = bool(np.array_equal(global_batch(four), global_batch(two)))
    end_s = time.perf_counter() - t1
    hwm2 = vm_hwm_bytes()
    dl.close()
    return {"n": n, "order": order, "first_batch_s": first_s, "hwm_growth_mb": (hwm1 - hwm0) / 2**20,
            "end_resume_s": end_s, "hwm_growth_end_mb": (hwm2 - hwm0) / 2**20, "elastic_equal": elastic_equal}


def run_child(n: int, order: int, work: Path, timeout_s: float) -> dict:
    cmd = [sys.executable, __file__, "--child", str(n), str(order), str(work)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"n": n, "order": order, "error": f"over {timeout_s} s"}
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["?"]
        return {"n": n, "order": order, "error": tail[0][:300]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default="/tmp/plan-bench")
    ap.add_argument("--sizes", default=None, help="samples per epoch, comma-separated (default 1e6,...,1e10)")
    ap.add_argument("--orders", default="1,2")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of order 2 (and of order 1 unless --order1-rounds)")
    ap.add_argument("--order1-rounds", type=int, default=None)
    ap.add_argument("--order1-max", type=float, default=1e8, help="largest epoch order 1 is run at")
    ap.add_argument("--timeout-s", type=float, default=600)
    ap.add_argument("--out", default=None)
    ap.add_argument("--tiny", action="store_true", help="smoke run: 1e4 and 1e6, one round")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        n, order, work = args.child
        print(json.dumps(child(int(n), int(order), Path(work))))
        return {}
    if args.tiny:
        args.sizes, args.rounds, args.order1_rounds = args.sizes or "1e4,1e6", 1, 1
    args.sizes = args.sizes or "1e6,1e7,1e8,1e9,1e10"
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    ensure_data(work)
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    orders = [int(o) for o in args.orders.split(",")]
    rows = []
    for n in sizes:
        for order in orders:
            rounds = args.rounds if order == 2 else (args.order1_rounds or args.rounds)
            if order == 1 and n > args.order1_max:
                rows.append({"n": n, "order": order, "rounds": [], "note": f"not run (over --order1-max {args.order1_max:g})"})
                continue
            runs = [run_child(n, order, work, args.timeout_s) for _ in range(rounds)]
            ok = [r for r in runs if "error" not in r]
            row = {"n": n, "order": order, "rounds": runs}
            if ok:
                row["first_batch_s_median"] = statistics.median(r["first_batch_s"] for r in ok)
                row["hwm_growth_mb_median"] = statistics.median(r["hwm_growth_mb"] for r in ok)
                row["end_resume_s_median"] = statistics.median(r["end_resume_s"] for r in ok)
                row["elastic_equal"] = all(r["elastic_equal"] for r in ok)
            rows.append(row)
            print(_line(row), flush=True)
    result = {"bench": "plan_bench", "batch_size": BATCH, "machine": {"cpus": os.cpu_count(),
              "platform": platform.platform(), "python": platform.python_version()}, "rows": rows}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


def _line(row: dict) -> str:
    head = f"n={row['n']:.0e} order {row['order']}: "
    if "first_batch_s_median" not in row:
        errors = [r.get("error") for r in row["rounds"]]
        return head + (row.get("note") or f"failed: {errors}")
    firsts = ", ".join(f"{r['first_batch_s']:.3f}" for r in row["rounds"] if "error" not in r)
    growth = ", ".join(f"{r['hwm_growth_mb']:.1f}" for r in row["rounds"] if "error" not in r)
    return (head + f"first batch {row['first_batch_s_median']:.3f} s ({firsts}), VmHWM +{row['hwm_growth_mb_median']:.1f} MB "
            f"({growth}); resume at the last step + 4->2 {row['end_resume_s_median']:.3f} s, "
            f"elastic equal {row['elastic_equal']}")


if __name__ == "__main__":
    main()
