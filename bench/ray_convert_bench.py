"""Conversion speed of `gdsload convert --engine ray` ÷ the local engine on one node, and the
figures for scaling out.

Contestants, each a fresh `gdsload convert` subprocess over the same image folder (made by
`gdsload.sampledata`), interleaved (local, ray, ray-joined, local, ...) after one warm-up each, page
cache hot for all:

- `local`: the default engine, a process pool on all cores;
- `ray`: `--engine ray`, starting and stopping a private Ray instance (what a one-off command on
  one box pays);
- `ray-joined`: `--engine ray --ray-address A`, joining a Ray instance this script keeps running
  (the engine's own overhead: task dispatch, argument transfer, per-shard progress).

Every run's shards are checked to be byte-identical to the local engine's (manifest SHA-256s).
Samples/s counts the whole command. `CPU s/1k` is machine-wide busy CPU time (/proc/stat) per
1,000 samples, since Ray's workers are not children of the command.

    python bench/ray_convert_bench.py --images 4000 --rounds 3      # ~1.5 min on 2 cores
    python bench/ray_convert_bench.py --images 1000 --rounds 3 --s3 # SRC and DST on s3://
    python bench/ray_convert_bench.py --tiny --ray-address HOST:PORT # smoke run (the tests)

`--s3` puts the source and every destination on a local S3 server (moto on loopback, started
here; needs `moto[server]` and `s3fs`), so that listing, reads and writes all go through fsspec
as they would on a cluster reading and writing an object store. Moto is a Python server sharing
this machine's cores: the figures show the engines' relative cost with URL I/O, not S3's speed.

Prints a table and writes JSON (`--out`, default bench/results/ray-convert-<host>.json).

Scale-out plan
--------------
How the work divides: the driver lists the source (names, sizes, tar headers; no payload reads),
plans shards of `--shard-size` bytes and submits one task per shard. Tasks are independent (no
shuffle, no communication); each needs one CPU and one sample's memory. A 10 M-image,
~1.1 TB ImageNet-like set at 1 GiB shards is ~1,100 tasks: enough for clusters up to ~1,000
CPUs, with a tail of at most one shard's time (1 GiB at the per-core rate below).

What each node reads and writes: a task reads exactly its shard's input bytes and writes the
shard (about the same bytes), its two indexes (tens of bytes per sample) and a done record, all
on the shared filesystem (same path on every node). Per node that is its share of the dataset in
and the same out. The driver reads only metadata, and writes `plan.json`, the manifest and
`rejected.jsonl`; it sends each task its sample list (~200 B per sample, at most
2 x cluster-CPUs tasks in flight) and receives ~300 B back.

Where the single-node ceiling is: the cluster's rate is per-core rate x cores until the shared
filesystem's bandwidth (2 x dataset bytes move through it) is reached; the serial part is the
driver's listing and planning (`listing samples/s` below, measured here on a local disk; on
NFS or an object store each stat is a round trip, so it is far lower), plus reading back one done
record per shard. Total time is about T_list + samples / (per-core rate x cores); the JSON
holds a projection from the measured figures.

With SRC and DST on an object store (s3://, gs://) nothing is shared between nodes but the
bucket: the driver's listing is one recursive listing (`find`: ~1,000 keys per request on S3),
not one stat per file; tasks read each input with one ranged GET and write each shard as one
multipart upload. The ceiling moves to the store's request rate for small inputs (one GET per
image: an image folder of 100 KB files at 5,500 GET/s per S3 prefix is ~550 MB/s per prefix) and
to the nodes' network bandwidth for large ones; tar inputs are read with one GET per member.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def busy_cpu_s() -> float | None:
    """Machine-wide busy CPU seconds so far (user+nice+system+irq+softirq+steal), Linux only."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _remove(dst: str) -> None:
    from gdsload.io import is_remote

    if is_remote(dst):
        import fsspec

        fs, path = fsspec.core.url_to_fs(dst)
        if fs.exists(path):
            fs.rm(path, recursive=True)
        fs.invalidate_cache()
    else:
        shutil.rmtree(dst, ignore_errors=True)


def _manifest(dst: str) -> dict:
    from gdsload.io.store import load_manifest

    return load_manifest(dst)


def run_convert(src: str, dst: str, shard_size: int, extra: list[str]) -> dict:
    _remove(dst)
    argv = [sys.executable, "-m", "gdsload", "convert", str(src), str(dst), "-q", "--format", "imagefolder",
            "--shard-size", str(shard_size), *extra]
    c0, t0 = busy_cpu_s(), time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    wall, c1 = time.perf_counter() - t0, busy_cpu_s()
    if proc.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    shards = [s["sha256"] for s in _manifest(dst)["shards"]]
    return {"wall_s": wall, "cpu_s": None if c0 is None else c1 - c0, "shards": shards}


def listing_rate(src: str, shard_size: int) -> dict:
    """The driver's serial part: listing and planning, in this process (page cache hot)."""
    from gdsload.convert.engine import plan_shards
    from gdsload.convert.sources import list_source

    t0 = time.perf_counter()
    listing = list_source(str(src), "imagefolder")
    plan = plan_shards(listing.samples, shard_size)
    s = time.perf_counter() - t0
    return {"samples": len(listing.samples), "shards": len(plan), "seconds": s,
            "samples_per_s": len(listing.samples) / s}


def start_s3():
    """moto's S3 server on loopback, its endpoint and dummy credentials in the environment (so
    the convert subprocesses and Ray workers find it)."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      AWS_EC2_METADATA_DISABLED="true", AWS_ENDPOINT_URL=f"http://{host}:{port}")
    return server


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=4000, help="images in the source folder (~105 KB each)")
    ap.add_argument("--classes", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shard-size", default="32MB", help="small shards, so there are tasks to spread")
    ap.add_argument("--contestants", default="local,ray,ray-joined")
    ap.add_argument("--ray-address", help="join this Ray instance for ray-joined (default: start one here)")
    ap.add_argument("--workdir", default=None, help="keep data here (default: a temp dir)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--s3", action="store_true", help="source and destinations on a local S3 server (moto)")
    ap.add_argument("--tiny", action="store_true", help="40 small images, 1 round: a smoke run")
    a = ap.parse_args(argv)
    if a.tiny:
        a.images, a.classes, a.rounds, a.shard_size = 40, 4, 1, "64KB"
    names = a.contestants.split(",")
    unknown = set(names) - {"local", "ray", "ray-joined"}
    if unknown or "local" not in names:
        ap.error(f"--contestants: {', '.join(sorted(unknown)) or 'local is required (the baseline)'}; "
                 f"choose from local, ray, ray-joined")

    from gdsload.cli import parse_size
    from gdsload.sampledata import ensure_image_folder

    shard_size = parse_size(a.shard_size)
    work = Path(a.workdir or tempfile.mkdtemp(prefix="gdsload-ray-bench-"))
    src = work / "images"
    kw = {"mean_size": (160, 120)} if a.tiny else {}
    made = ensure_image_folder(src, num_images=a.images, num_classes=a.classes, seed=0, **kw)
    n = made["num_images"]
    print(f"source: {n} images, {made['total_bytes'] / 1e6:.0f} MB in {src}", file=sys.stderr)
    server = start_s3() if a.s3 else None  # before Ray starts: its workers inherit the endpoint
    root = str(work)
    if server is not None:
        import fsspec

        fs = fsspec.filesystem("s3")
        fs.mkdir("bench")
        fs.put(str(src), "bench/images", recursive=True)
        root = "s3://bench"
    src_at = f"{root}/images"

    ray, address = None, a.ray_address
    if "ray-joined" in names and not address:
        import ray  # the instance ray-joined runs join; kept up for the whole benchmark

        ctx = ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="warning")
        address = ctx.address_info["gcs_address"]
    extra = {"local": [], "ray": ["--engine", "ray"], "ray-joined": ["--engine", "ray", "--ray-address", str(address)]}
    try:
        runs: dict[str, list[dict]] = {c: [] for c in names}
        for c in names:  # warm-up: page cache, imports
            run_convert(src_at, f"{root}/out-{c}", shard_size, extra[c])
        for _ in range(a.rounds):
            for c in names:
                runs[c].append(run_convert(src_at, f"{root}/out-{c}", shard_size, extra[c]))
                print(f"  {c:<11} {runs[c][-1]['wall_s']:.2f} s", file=sys.stderr)
        lst = listing_rate(src_at, shard_size)
    finally:
        if ray is not None:
            ray.shutdown()
        if server is not None:
            server.stop()
    for c in names:
        if any(r["shards"] != runs["local"][0]["shards"] for r in runs[c]):
            raise SystemExit(f"{c}: shards differ from the local engine's")

    result: dict = {
        "bench": "ray-convert",
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform()},
        "source": {"images": n, "bytes": made["total_bytes"], "shard_size": shard_size,
                   "storage": "s3 (moto on loopback)" if a.s3 else "local disk",
                   "shards": len(runs["local"][0]["shards"])},
        "rounds": a.rounds,
        "contestants": {},
        "listing": lst,
    }
    for c in names:
        rs = runs[c]
        ratios = [lo["wall_s"] / r["wall_s"] for lo, r in zip(runs["local"], rs)]  # paired by round
        cpu = [r["cpu_s"] for r in rs if r["cpu_s"] is not None]
        result["contestants"][c] = {
            "samples_per_s_median": statistics.median(n / r["wall_s"] for r in rs),
            "ratio_over_local": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
            "cpu_s_per_1000_machine": statistics.median(1000 * x / n for x in cpu) if cpu else None,
            "wall_s": [round(r["wall_s"], 3) for r in rs],
        }
    local = result["contestants"]["local"]
    per_core = local["samples_per_s_median"] / (os.cpu_count() or 1)
    cores, samples = 8 * 16, 10_000_000
    result["projection"] = {
        "note": "from the figures above; assumes the shared filesystem keeps up and listing is as "
                "fast as here (it is not on NFS/object stores): T = T_list + samples / (per-core rate x cores)",
        "per_core_samples_per_s": per_core,
        "example": {"samples": samples, "nodes_x_cores": "8 x 16",
                    "listing_s": samples / lst["samples_per_s"],
                    "convert_s": samples / (per_core * cores),
                    "one_node_16_cores_s": samples / lst["samples_per_s"] + samples / (per_core * 16)},
    }
    print(f"{'engine':<12}{'samples/s':>11}{'÷ local':>9}{'(min-max)':>14}{'CPU s/1k':>10}")
    for c in names:
        r = result["contestants"][c]
        q, cpu = r["ratio_over_local"], r["cpu_s_per_1000_machine"]
        spread = f"{q['min']:.2f}-{q['max']:.2f}"
        print(f"{c:<12}{r['samples_per_s_median']:>11.0f}{q['median']:>9.2f}{spread:>14}"
              f"{'-' if cpu is None else f'{cpu:.2f}':>10}")
    print(f"driver listing+planning: {lst['samples_per_s']:.0f} samples/s ({lst['samples']} samples, "
          f"{lst['shards']} shards); per-core conversion rate {per_core:.0f} samples/s")
    from gdsload.bench.harness import write_result

    write_result(result, a.out, Path(__file__).parent / "results", "ray-convert-s3" if a.s3 else "ray-convert",
                 tiny=a.tiny)
    if not a.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return result


if __name__ == "__main__":
    main()
