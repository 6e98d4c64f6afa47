"""Tier T in steady state: CPU time per thread, gdsload's DataLoader against DALI's own pipeline.

Each contestant runs in its own process: one epoch to warm up (pipelines built, ring and DALI
buffers touched), then two epochs timed. CPU time is read per thread from /proc (user + system),
summed by thread name, so it shows where the cores went: DALI's thread pool ("[DALI][TP..."),
Python threads ("python": the consumer), DALI's executor and reader threads, and threads that
ended before the count (gdsload's reader threads, one set per epoch: the reads, CRC32s and the
copy out of DALI); and how many cores were busy on average (the process's CPU seconds ÷ wall).

    python bench/thread_profile.py --workdir /tmp/lbench --batch-size 64 --rounds 2

Same shards and transforms as `loader_bench.py` (run that first, same --workdir).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
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


def one(contestant: str, root: str, bs: int, workers: int) -> dict:
    import nvidia.dali  # noqa: F401  (imports before anything is timed)
    import torch  # noqa: F401

    man = json.loads((Path(root) / "manifest.json").read_text())
    n_total = man["num_samples"]
    if contestant == "gdsload":
        import gdsload
        from gdsload.decode.image import ImageTransform

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
    before, cpu0 = _thread_cpu(), sum(os.times()[:2])
    t0 = time.perf_counter()
    n = epoch() + epoch()
    wall = time.perf_counter() - t0
    total = sum(os.times()[:2]) - cpu0  # the whole process, threads that ended included
    by_name: dict[str, float] = collections.defaultdict(float)
    for tid, (name, cpu) in _thread_cpu().items():
        by_name[name] += cpu - before.get(tid, (name, 0.0))[1]
    pool = sum(c for name, c in by_name.items() if name.startswith("[DALI][TP"))
    groups = {"DALI thread pool": pool, **{k: v for k, v in by_name.items() if not k.startswith("[DALI][TP")},
              "threads that ended (gdsload's readers)": total - sum(by_name.values())}
    return {"contestant": contestant, "images_per_s": n / wall, "cores_busy": total / wall,
            "us_per_image": {k: v / n * 1e6 for k, v in groups.items() if v > 0.005 * total},
            "cpu_us_per_image": total / n * 1e6}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="/tmp/gdsload-loader-bench")
    ap.add_argument("--set", default="photo-shards", help="shard folder under --workdir (jpg-shards, photo-shards)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    workers = os.cpu_count() or 1
    root = Path(a.workdir) / a.set
    if a.one:
        print("RESULT " + json.dumps(one(a.one, str(root), a.batch_size, workers)), flush=True)
        return
    if not (root / "manifest.json").exists():
        sys.exit(f"no shards in {root}: run bench/loader_bench.py --workdir {a.workdir} --photos 3000 first")
    runs = []
    for _ in range(a.rounds):
        for c in ("gdsload", "dali"):
            proc = subprocess.run([sys.executable, __file__, "--workdir", a.workdir, "--set", a.set,
                                   "--batch-size", str(a.batch_size), "--one", c], capture_output=True, text=True)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"{c} failed: {proc.stderr[-2000:]}")
            r = json.loads(line[7:])
            runs.append(r)
            parts = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r["us_per_image"].items(), key=lambda x: -x[1]))
            print(f"{c:8} {r['images_per_s']:6.0f} img/s, {r['cores_busy']:.2f} cores busy, "
                  f"{r['cpu_us_per_image']:.0f} CPU µs/image: {parts}", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"command": "python bench/thread_profile.py " + " ".join(
            argv if argv is not None else sys.argv[1:]), "set": a.set, "batch_size": a.batch_size,
            "workers": workers, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
