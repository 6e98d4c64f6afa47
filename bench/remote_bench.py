"""Remote feed throughput: `RemoteLoader` over loopback gRPC vs the local `DataLoader`, same shards.

Payloads: raw (encoded JPEG bytes + labels; MB/s of batch bodies) and decoded (DALI CPU, eval
transform to 224x224 float32; images/s). Consumers: 1 (world size 1) and 4 (ranks of world size 4,
one thread and one loader each, all in this process). The feed server is `python -m
gdsload.service` in its own process, so its CPU time is measured apart (/proc/PID/stat): CPU
seconds per GB sent, for the server and for the consuming process. Runs are interleaved (local,
remote, local, remote, ...) after a warm-up of each; ratios are remote/local per round, reported as
median with min-max.

    python bench/remote_bench.py --images 800 --rounds 5        # about 2 minutes on 2 cores
    python bench/remote_bench.py --tiny                         # smoke run (used by the tests)

Prints a table and writes JSON (`--out`, default bench/results/remote-<host>.json).
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def _proc_cpu_s(pid: int) -> float:
    """utime + stime of a process, seconds (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _self_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(root: Path, port: int, log: Path, *extra: str) -> subprocess.Popen:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with open(log, "ab") as err:  # the child keeps its own descriptor
        proc = subprocess.Popen([sys.executable, "-m", "gdsload.service", str(root), "--listen",
                                 f"127.0.0.1:{port}", "--log-level", "WARNING", *extra],
                                stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.monotonic() + 60
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"server exited: {log.read_text()[-2000:]}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=0.5).status == 1:
                    return proc
            except grpc.RpcError:
                time.sleep(0.1)
    proc.kill()
    raise SystemExit("server did not start")


def _body_nbytes(batch: dict) -> int:
    n = 0
    for k, v in batch.items():
        if k == "__key__":
            continue
        n += sum(len(x) for x in v) if isinstance(v, list) else v.nbytes
    return n


def _consume(make, consumers: int, max_batches: int | None) -> dict:
    """Run `consumers` loaders (ranks of that world size) in threads; samples, bytes, wall."""
    loaders = [make(rank, consumers) for rank in range(consumers)]
    for x in loaders:
        len(x)  # plan (and for remote loaders, the ListDatasets call) before the clock starts
    counts = [[0, 0] for _ in loaders]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            it = iter(loaders[i])
            for batch in itertools.islice(it, max_batches):
                counts[i][0] += len(batch["__key__"])
                counts[i][1] += _body_nbytes(batch)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(consumers)]
    t0, c0 = time.perf_counter(), _self_cpu_s()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall, cpu = time.perf_counter() - t0, _self_cpu_s() - c0
    for x in loaders:
        x.close()
    if errors:
        raise errors[0]
    return {"samples": sum(c[0] for c in counts), "bytes": sum(c[1] for c in counts), "wall_s": wall, "cpu_s": cpu}


def image_dataset(work: Path, images: int, tiny: bool) -> Path:
    """`work`/root/imgs: `images` ImageNet-like JPEGs (small ones with `tiny`) converted once; the
    remote benchmarks' dataset."""
    from gdsload.convert.engine import ConvertOptions, convert
    from gdsload.sampledata import make_image_folder

    ds = work / "root" / "imgs"
    if not (ds / "manifest.json").exists():
        kw = {"mean_size": (160, 120)} if tiny else {}
        make_image_folder(work / "src", num_images=images, num_classes=10, seed=0, **kw)
        convert(str(work / "src"), str(ds), ConvertOptions(workers=os.cpu_count(), progress=False,
                                                           shard_size=2_000_000 if tiny else 16_000_000))
    return ds


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=800, help="images in the dataset (~105 KB each)")
    ap.add_argument("--batch-size", type=int, default=32, help="per consumer")
    ap.add_argument("--raw-epochs", type=int, default=5, help="epochs per raw run")
    ap.add_argument("--decoded-images", type=int, default=256, help="images per decoded run (all consumers)")
    ap.add_argument("--consumers", default="1,4", help="comma-separated consumer counts")
    ap.add_argument("--payloads", default="raw,decoded", help="comma-separated: raw, decoded")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--workdir", default=None, help="keep data here (default: a temp dir)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--decode-pool", type=int, default=None,
                    help="the server's --decode-pool (default: the server's default; 0: a pipeline per stream)")
    ap.add_argument("--tiny", action="store_true", help="48 small images, 1 round: a smoke run")
    a = ap.parse_args(argv)
    if a.tiny:
        a.images, a.batch_size, a.raw_epochs, a.decoded_images, a.rounds = 48, 4, 1, 16, 1

    from gdsload.decode.image import ImageTransform
    from gdsload.loader.dataloader import DataLoader, Dataset
    from gdsload.service.client import RemoteLoader

    work = Path(a.workdir or tempfile.mkdtemp(prefix="gdsload-remote-bench-"))
    root = work / "root"
    ds = image_dataset(work, a.images, a.tiny)
    dataset = Dataset(str(ds))
    n = len(dataset)
    print(f"dataset: {n} images, {len(dataset.shards.shards)} shards in {ds}", file=sys.stderr)
    eval_tf = ImageTransform(size=224, train=False, resize=256)
    port = _free_port()
    address = f"127.0.0.1:{port}"
    extra = ("--decode-pool", str(a.decode_pool)) if a.decode_pool is not None else ()
    server = _start_server(root, port, work / "server.log", *extra)
    consumers = [int(c) for c in a.consumers.split(",")]
    B = a.batch_size

    def make(kind: str, decode: bool):
        common = dict(batch_size=B, shuffle=True, seed=0, decode=decode, transform=eval_tf if decode else None)
        if kind == "local":
            return lambda r, w: DataLoader(dataset, rank=r, world_size=w, device="cpu", output="numpy",
                                           copy=False, **common)
        return lambda r, w: RemoteLoader(address, dataset="imgs", rank=r, world_size=w, output="numpy", **common)

    def measure(kind: str, payload: str, c: int) -> dict:
        decode = payload == "decoded"
        if decode:
            per_rank = max(1, a.decoded_images // (c * B))
            max_batches, epochs = per_rank, 1
        else:
            max_batches, epochs = None, a.raw_epochs
        s0 = _proc_cpu_s(server.pid)
        total = {"samples": 0, "bytes": 0, "wall_s": 0.0, "cpu_s": 0.0}
        for _ in range(epochs):
            r = _consume(make(kind, decode), c, max_batches)
            for k in total:
                total[k] += r[k]
        total["server_cpu_s"] = _proc_cpu_s(server.pid) - s0 if kind == "remote" else 0.0
        return total

    cases = [(p, c) for p in a.payloads.split(",") for c in consumers]
    load_start = os.getloadavg()
    runs: dict[tuple, dict[str, list]] = {case: {"local": [], "remote": []} for case in cases}
    try:
        for case in cases:  # warm-up: imports, DALI, page cache, server first stream
            measure("local", case[0], case[1]), measure("remote", case[0], case[1])
        for rnd in range(a.rounds):
            for case in cases:
                order = ("local", "remote") if rnd % 2 == 0 else ("remote", "local")
                for kind in order:
                    runs[case][kind].append(measure(kind, *case))
    finally:
        server.terminate()
        server.wait(timeout=30)

    def rate(r: dict, payload: str) -> float:
        return (r["bytes"] / 1e6 if payload == "raw" else r["samples"]) / r["wall_s"]

    rows = []
    for (payload, c), rs in runs.items():
        loc = [rate(r, payload) for r in rs["local"]]
        rem = [rate(r, payload) for r in rs["remote"]]
        ratios = [x / y for x, y in zip(rem, loc)]
        gb = sum(r["bytes"] for r in rs["remote"]) / 1e9
        rows.append({
            "payload": payload, "consumers": c, "unit": "MB/s" if payload == "raw" else "images/s",
            "local_median": statistics.median(loc), "remote_median": statistics.median(rem),
            "ratio": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
            "server_cpu_s_per_gb": sum(r["server_cpu_s"] for r in rs["remote"]) / gb,
            "client_cpu_s_per_gb": sum(r["cpu_s"] for r in rs["remote"]) / gb,
            "local_cpu_s_per_gb": sum(r["cpu_s"] for r in rs["local"]) / (sum(r["bytes"] for r in rs["local"]) / 1e9),
            "gb_sent_per_run": gb / len(rs["remote"]),
            "samples_per_run": rs["remote"][0]["samples"],
        })
    result = {
        "bench": "remote",
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform(),
                    "loadavg_1m_start_end": [round(load_start[0], 2), round(os.getloadavg()[0], 2)]},
        "dataset": {"images": n, "bytes": dataset.shards.manifest["num_bytes"], "shards": len(dataset.shards.shards)},
        "settings": {"batch_size": B, "raw_epochs": a.raw_epochs, "decoded_images": a.decoded_images,
                     "transform": "eval 224 (resize 256, center crop), float32 NCHW", "rounds": a.rounds,
                     "server": "python -m gdsload.service, defaults (2 reader threads x 2 prefetch per stream)"
                               + (f", --decode-pool {a.decode_pool}" if a.decode_pool is not None else
                                  ", default --decode-pool"),
                     "transport": "loopback TCP, insecure, 4 MiB messages"},
        "rows": rows,
        "note": "ratio = remote / local throughput in the same round; CPU s/GB counts the bytes of the "
                "batch bodies the server sent (decoded: float32 tensors); client CPU is the consuming "
                "process (all consumer threads), server CPU the server process",
    }
    print(f"{'payload':<9}{'consumers':>10}{'unit':>10}{'local':>10}{'remote':>10}{'ratio (min-max)':>22}"
          f"{'server CPU s/GB':>17}{'client CPU s/GB':>17}{'local CPU s/GB':>16}")
    for r in rows:
        q = r["ratio"]
        print(f"{r['payload']:<9}{r['consumers']:>10}{r['unit']:>10}{r['local_median']:>10.1f}{r['remote_median']:>10.1f}"
              f"{q['median']:>10.2f} ({q['min']:.2f}-{q['max']:.2f})"
              f"{r['server_cpu_s_per_gb']:>17.2f}{r['client_cpu_s_per_gb']:>17.2f}{r['local_cpu_s_per_gb']:>16.2f}")
    print(f"load average (1 min) at start and end: {result['machine']['loadavg_1m_start_end']} on "
          f"{os.cpu_count()} CPUs; other work on the host widens the min-max ranges")
    from gdsload.bench.harness import write_result

    write_result(result, a.out, Path(__file__).parent / "results", "remote", tiny=a.tiny)
    if not a.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return result


if __name__ == "__main__":
    main()
