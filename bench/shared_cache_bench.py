"""N training jobs on one node sharing one shard-cache folder with a tight `cache_limit`, against
one job alone (issue 34, row 1: "one folder serves every process on a node").

The store is bench/cache_bench.py's: moto's S3 app in its own process with `--latency-ms` per
request and one `--mbps` link. A dataset of `.npy` samples (`gdsload.sampledata`) is converted into
shards of about `--shard-kb` and uploaded. Per round, each with fresh cache folders:

    alone    one process reads `--epochs` shuffled epochs through its own folder
    shared   `--jobs` processes, started together, each reading the same epochs through one
             folder (each job is a separate Python process, as on a node)

The limit is the `--jobs * shuffle_window + 1` largest shards (what the sizing rule in docs/training/object-stores.md asks
for N jobs), unless `--limit-shards` says otherwise. Every job's keys must equal the alone job's
(the order is the plan's); a refused job (CacheFullError) is reported, not timed. Reported per
round: wall time of the alone job, the slowest shared job, their ratio (target <= 2.0), and the
downloads (fetch.log lines) of each.

    python bench/shared_cache_bench.py --rounds 3                 # the real run (a few minutes)
    python bench/shared_cache_bench.py --tiny --rounds 1          # smoke run (seconds)

Prints a table and writes JSON (`--out`, default bench/results/shared-cache-<host>.json).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BUCKET = "gdsload-shared-bench"
ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
       "AWS_EC2_METADATA_DISABLED": "true"}

_JOB = textwrap.dedent("""
    import json, os, sys, time
    from gdsload import DataLoader, Dataset
    from gdsload.errors import GdsloadError
    url, folder, limit, go, epochs, window, batch = sys.argv[1:8]
    loader = DataLoader(Dataset(url, cache_dir=folder, cache_limit=int(limit)), batch_size=int(batch), shuffle=True,
                        seed=5, shuffle_window=int(window), output="numpy", device="cpu", num_workers=2)
    open(f"{go}.ready-{os.getpid()}", "w").close()
    while not os.path.exists(go):
        time.sleep(0.005)
    t0 = time.perf_counter()
    keys = []
    try:
        for epoch in range(int(epochs)):
            loader.set_epoch(epoch)
            keys += [k for b in loader for k in b["__key__"]]
    except GdsloadError as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        sys.exit(0)
    print(json.dumps({"keys": keys, "wall_s": time.perf_counter() - t0, "fetches": loader.stats()["cache"]["fetches"]}))
""")


def _jobs(url: str, folder: Path, limit: int, n: int, work: Path, epochs: int, window: int, batch: int,
          env: dict) -> list[dict]:
    go = work / f"go-{folder.name}"
    procs = [subprocess.Popen([sys.executable, "-c", _JOB, url, str(folder), str(limit), str(go), str(epochs),
                               str(window), str(batch)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(n)]
    try:
        deadline = time.monotonic() + 120
        while len(list(work.glob(f"{go.name}.ready-*"))) < n:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise SystemExit("a job did not start: " + " ".join(p.communicate()[1][-2000:] for p in procs
                                                                    if p.poll() is not None))
            time.sleep(0.01)
        go.touch()
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=1800)
            if p.returncode:
                raise SystemExit(f"a job failed:\n{err[-3000:]}")
            outs.append(json.loads(out))
        return outs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--shard-kb", type=int, default=2000)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--limit-shards", type=int, default=None, help="limit = this many largest shards")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--latency-ms", type=float, default=20)
    ap.add_argument("--mbps", type=float, default=200)
    ap.add_argument("--tiny", action="store_true", help="smoke run: few small samples")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.tiny:
        a.samples, a.shard_kb, a.window, a.batch_size = 96, 60, 2, 4
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(HERE))
    from cache_bench import start_store

    from gdsload.convert.engine import ConvertOptions, convert
    from gdsload.dataset.sharded import ShardedDataset
    from gdsload.sampledata import make_npy_folder

    work = Path(a.workdir or tempfile.mkdtemp(prefix="gdsload-shared-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ.update(ENV)
    store, endpoint = start_store(work, a.latency_ms, a.mbps)
    env = {**os.environ, "AWS_ENDPOINT_URL": endpoint, "PYTHONPATH": str(REPO)}
    try:
        local = work / "ds"
        if not (local / "manifest.json").exists():
            make_npy_folder(work / "src", num_samples=a.samples, shape=(3, 64, 64), dtype="uint8", seed=1)
            convert(str(work / "src"), local, ConvertOptions(workers=1, progress=False, shard_size=a.shard_kb * 1000))
        import fsspec

        fs = fsspec.filesystem("s3", client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True)
        if not fs.exists(BUCKET):
            fs.mkdir(BUCKET)
        fs.put(str(local), f"{BUCKET}/ds", recursive=True)
        url = f"s3://{BUCKET}/ds"
        sizes = sorted((s["bytes"] for s in ShardedDataset(local).shards), reverse=True)
        k = a.limit_shards or a.jobs * a.window + 1
        limit = sum(sizes[:k])
        rounds = []
        for r in range(a.rounds):
            alone = _jobs(url, work / f"alone-{r}", limit, 1, work, a.epochs, a.window, a.batch_size, env)[0]
            if "error" in alone:
                raise SystemExit(f"the job alone was refused: {alone['error']}")
            shared = _jobs(url, work / f"shared-{r}", limit, a.jobs, work, a.epochs, a.window, a.batch_size, env)
            ran = [o for o in shared if "keys" in o]
            exact = all(o["keys"] == alone["keys"] for o in ran)
            slowest = max((o["wall_s"] for o in ran), default=float("nan"))
            rounds.append({"alone_s": alone["wall_s"], "shared_slowest_s": slowest,
                           "ratio": slowest / alone["wall_s"], "ran": len(ran),
                           "refused": [o["error"] for o in shared if "error" in o], "key_exact": exact,
                           "fetches_alone": alone["fetches"], "fetches_shared": sum(o["fetches"] for o in ran)})
            print(f"round {r}: alone {alone['wall_s']:.2f} s, slowest of {len(ran)} shared {slowest:.2f} s, "
                  f"ratio {slowest / alone['wall_s']:.2f}, key-exact {exact}, downloads {alone['fetches']} alone / "
                  f"{rounds[-1]['fetches_shared']} shared, refused {len(rounds[-1]['refused'])}")
            for f in (work / f"alone-{r}", work / f"shared-{r}"):
                shutil.rmtree(f, ignore_errors=True)
        ratios = [x["ratio"] for x in rounds]
        result = {"args": vars(a), "shards": len(sizes), "limit_bytes": limit, "limit_shards": k, "rounds": rounds,
                  "ratio": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
                  "all_key_exact": all(x["key_exact"] for x in rounds)}
        print(f"{a.jobs} jobs sharing {k} shards of room ({len(sizes)} shards): slowest/alone median "
              f"{result['ratio']['median']:.2f} ({result['ratio']['min']:.2f}-{result['ratio']['max']:.2f}), "
              f"target <= 2.0; key-exact {result['all_key_exact']}")
        out = Path(a.out or HERE / "results" / f"shared-cache-{socket.gethostname()}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        return result
    finally:
        store.kill()
        store.wait()


if __name__ == "__main__":
    main()
