"""Where tier T's last gap to DALI goes: DALI pipelines alone, with and without copying each batch.

gdsload hands out batches in ring memory that stays valid while the next batch is decoded, so it
copies each DALI run's output into a ring slot. The `dali` contestant of `loader_bench.py` keeps
DALI's output buffer, which its next run overwrites. This measures what that difference costs,
and what handing DALI's buffers out instead would cost in memory, on the same shards as
`loader_bench.py` (run that first, same --workdir). Every contestant is a fresh process; the
encoded bytes are loaded before the clock; rounds are interleaved.

    copy         external_source, synchronous executor, runs of <= 64, each copied into one of two
                 slot buffers (what gdsload's DataLoader does)
    handoff      external_source, DALI's pipelined executor (exec_dynamic=False), 2 output buffers,
                 one run per batch, each output handed out uncopied: valid until the next one
    dynamic      external_source, DALI's dynamic executor, outputs handed out uncopied, kept
                 alive by reference (the consumer holds 2)
    reader       readers.webdataset, DALI's default executor, outputs not copied (`dali` in
                 loader_bench.py)
    reader_copy  the same, each output copied into one of two slot buffers
    handoff_copy, dynamic_copy
                 handoff and dynamic with each output copied into one of two slot buffers while
                 the pipeline runs the next batch (the copy overlapped, the ring kept)

    python bench/dali_handoff_bench.py --workdir /tmp/lbench --rounds 5 --batch-size 64,256

"pipeline MB" is the process's peak RSS less its RSS before the pipeline was built (so the
encoded bytes held for external_source are not counted), slot buffers included.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from gdsload.bench.runners import SIZE, dali_train_transform, shard_paths
from gdsload.decode.image import RUN_SIZE as RUN

VARIANTS = ["copy", "handoff", "dynamic", "reader", "reader_copy", "handoff_copy", "dynamic_copy"]


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def one(variant: str, root: str, bs: int, threads: int) -> dict:
    """One contestant, in this process (run in a fresh one by `main`)."""
    import tarfile

    import numpy as np
    from nvidia.dali import fn, pipeline_def, types

    tars, idx, man = shard_paths(root)
    field = next(f for f, k in man["fields"].items() if k == "image")
    enc: list = []
    if not variant.startswith("reader"):
        for t in tars:
            with tarfile.open(t) as tf:
                enc += [np.frombuffer(tf.extractfile(m).read(), np.uint8) for m in tf if m.name.endswith("." + field)]
    n = man["num_samples"]

    run = min(RUN, bs) if variant == "copy" else bs
    kw = {"copy": dict(exec_async=False, exec_pipelined=False, prefetch_queue_depth=1),
          "handoff": dict(exec_dynamic=False, exec_async=True, exec_pipelined=True, prefetch_queue_depth=2),
          "dynamic": dict(exec_dynamic=True, prefetch_queue_depth=1)}.get(variant.replace("_copy", ""), {})

    @pipeline_def(batch_size=run, num_threads=threads, device_id=None, **kw)
    def pipe():
        if variant.startswith("reader"):
            img, _ = fn.readers.webdataset(paths=tars, index_paths=idx, ext=[field, "cls"],
                                           dtypes=[types.UINT8, types.UINT8], pad_last_batch=True)
            return dali_train_transform(img)
        return dali_train_transform(fn.external_source(name="enc", dtype=types.UINT8, ndim=1))

    before = _rss_mb()
    t0, c0 = time.perf_counter(), time.process_time()
    p = pipe()
    p.build()
    slots = [np.empty((bs, 3, SIZE, SIZE), np.float32) for _ in range(2)] if "copy" in variant else []
    batches = [enc[a : a + bs] for a in range(0, len(enc), bs)]
    held: list = []
    copy_s = 0.0

    def copy(out, address: int) -> None:
        nonlocal copy_s
        t = time.perf_counter()
        out.copy_to_external(ctypes.c_void_p(address))
        copy_s += time.perf_counter() - t

    for k in range(-(-n // bs)):
        if variant == "copy":
            slot = slots[k % 2]
            for a in range(0, len(batches[k]), run):
                p.feed_input("enc", batches[k][a : a + run])
                (out,) = p.run()
                copy(out, slot[a:].ctypes.data)
        elif variant.startswith("reader"):
            (out,) = p.run()
            if variant == "reader_copy":
                copy(out, slots[k % 2].ctypes.data)
        else:  # hand-off: feed one batch ahead, take outputs in order, never copy
            if k == 0:
                for j in range(kw["prefetch_queue_depth"]):
                    p.feed_input("enc", batches[j])
                p.schedule_run()
            (out,) = p.outputs()
            if k + kw["prefetch_queue_depth"] < len(batches):  # the next run starts before this one is copied
                p.feed_input("enc", batches[k + kw["prefetch_queue_depth"]])
                p.schedule_run()
            if "copy" in variant:
                copy(out, slots[k % 2].ctypes.data)
            else:
                held = (held + [np.asarray(out.as_tensor())])[-2:]  # the batch in use and the one before
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"variant": variant, "images_per_s": n / wall, "cpu_ms_per_image": cpu / n * 1e3,
            "copy_us_per_image": copy_s / n * 1e6,
            "pipeline_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="/tmp/gdsload-loader-bench")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch-size", default="64,256")
    ap.add_argument("--threads", type=int, default=None, help="DALI threads (default: the cores)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # variant,root,bs,threads: a child run
    a = ap.parse_args(argv)
    if a.one:
        v, root, bs, threads = a.one.split(",")
        print("RESULT " + json.dumps(one(v, root, int(bs), int(threads))), flush=True)
        return {}
    threads = a.threads or os.cpu_count() or 1
    sets = [(name, Path(a.workdir) / d) for name, d in (("images", "jpg-shards"), ("photos", "photo-shards"))
            if (Path(a.workdir) / d / "manifest.json").exists()]
    if not sets:
        sys.exit(f"no shards under {a.workdir}: run bench/loader_bench.py --workdir {a.workdir} --photos 3000 first")
    variants = a.variants.split(",")
    t0 = time.time()
    result: dict = {"bench": "dali_handoff", "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "command": "python bench/dali_handoff_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                    "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}, "threads": threads, "sets": {}}
    for bs in [int(b) for b in a.batch_size.split(",")]:
        for name, root in sets:
            runs: dict[str, list[dict]] = {v: [] for v in variants}
            for r in range(a.rounds + 1):  # round 0 warms the page cache and is dropped
                for v in variants:
                    proc = subprocess.run([sys.executable, __file__, "--one", f"{v},{root},{bs},{threads}"],
                                          capture_output=True, text=True)
                    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
                    if line is None:
                        sys.exit(f"{v} failed: {proc.stderr[-2000:]}")
                    if r:
                        runs[v].append(json.loads(line[7:]))
            key = f"{name}@{bs}"
            result["sets"][key] = runs
            print(f"{key}: {threads} DALI threads, {a.rounds} rounds (median, min-max of the ratio per round)")
            print(f"  {'variant':12} {'img/s':>7} {'÷ copy':>18} {'÷ reader':>18} {'CPU ms/img':>11} "
                  f"{'copy µs/img':>12} {'pipeline MB':>12}")
            for v in variants:
                ips = [x["images_per_s"] for x in runs[v]]

                def ratio(ref: str) -> str:
                    if ref not in runs:
                        return "-"
                    q = [x / y["images_per_s"] for x, y in zip(ips, runs[ref])]
                    return f"{statistics.median(q):.2f} ({min(q):.2f}-{max(q):.2f})"

                print(f"  {v:12} {statistics.median(ips):7.0f} {ratio('copy'):>18} {ratio('reader'):>18} "
                      f"{statistics.median(x['cpu_ms_per_image'] for x in runs[v]):11.2f} "
                      f"{statistics.median(x['copy_us_per_image'] for x in runs[v]):12.1f} "
                      f"{statistics.median(x['pipeline_mb'] for x in runs[v]):12.0f}", flush=True)
    result["seconds"] = time.time() - t0
    out = Path(a.out or Path(__file__).parent / "results" / f"dali-handoff-{platform.node()}.json")
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
