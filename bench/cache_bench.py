"""Training from an object store: gdsload's plan-driven shard cache vs range reads vs LitData and
MosaicML Streaming, over the same images from the same local S3 server.

The server is moto's S3 app (in its own process) behind a WSGI wrapper that adds `--latency-ms` to
every request and caps the bytes it sends with one shared token bucket (`--mbps`, a link all
connections share), standing in for a cloud store. The images (`gdsload.sampledata`, deterministic)
are converted three times, each with its own tool: `gdsload convert` (tar shards), `litdata.optimize`
(LitData chunks) and `streaming.MDSWriter` (MDS shards), all about `--shard-mb` per shard, and
uploaded to the server. Contestants, each in a fresh process, interleaved per round, every one with a
fresh cache folder and shuffling on:

    gdsload-cache   gdsload.Dataset(s3://..., cache_dir=<fresh>): its first epoch   (cold cache)
    gdsload-warm    the same loader's second epoch                                  (warm cache)
    gdsload-ranges  gdsload.Dataset(s3://..., cache_dir=False): ranged GETs per batch
    gdsload-local   gdsload.Dataset(<local copy>): second epoch, page cache hot     (the ceiling)
    litdata         litdata.StreamingDataset + StreamingDataLoader(num_workers=cores): first epoch
    mosaic          streaming.StreamingDataset + torch DataLoader(num_workers=cores): first epoch

Tiers: R (encoded bytes + label, no decode) and T (decode, random resized crop 224, flip,
normalize; DALI CPU for gdsload, Pillow in the workers for the others, as in bench/loader_bench.py).
Ratios per round, median (min-max): gdsload-cache / the better of litdata and mosaic (target >= 1.5),
gdsload-warm / gdsload-local (target >= 0.9), gdsload-cache / gdsload-ranges. Every contestant's
sample count and label histogram must agree.

LitData (`litdata`) and MosaicML Streaming (`streaming-community` on PyPI, import name
`streaming`) run under `--other-python` (default: /work/venv-cache/bin/python when it exists);
a contestant whose package does not import there is skipped, and the output says so.

    python bench/cache_bench.py --images 4000 --rounds 3            # the real run (minutes)
    python bench/cache_bench.py --tiny --contestants gdsload        # smoke run (the tests use it)

Prints a table and writes JSON (`--out`, default bench/results/cache-<host>.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUCKET = "bench"
ENV = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
       "AWS_EC2_METADATA_DISABLED": "true", "AWS_ALLOW_HTTP": "true"}  # obstore (LitData) refuses http otherwise
GDSLOAD = ("gdsload-cache", "gdsload-warm", "gdsload-ranges", "gdsload-local")
OTHERS = ("litdata", "mosaic")


# -- the store ------------------------------------------------------------------------------------
class _Link:
    """One shared link of `bytes_per_s`: each chunk leaves when the link is free (FIFO)."""

    def __init__(self, bytes_per_s: float):
        self.rate = bytes_per_s
        self.free_at = time.monotonic()
        self.lock = threading.Lock()

    def send(self, n: int) -> None:
        with self.lock:
            now = time.monotonic()
            self.free_at = max(self.free_at, now) + n / self.rate
            wait = self.free_at - now
        if wait > 0:
            time.sleep(wait)


def serve(latency_ms: float, mbps: float, port_file: str) -> None:
    """Moto's S3 app with `latency_ms` per request and GET bodies through one `mbps` link."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    app = DomainDispatcherApplication(create_backend_app)
    link = _Link(mbps * 1e6)

    def throttled(body):
        try:
            for block in body:
                for i in range(0, len(block), 256 * 1024):
                    chunk = block[i : i + 256 * 1024]
                    link.send(len(chunk))
                    yield chunk
        finally:
            close = getattr(body, "close", None)
            if close is not None:
                close()

    def wrapped(environ, start_response):
        time.sleep(latency_ms / 1000)
        body = app(environ, start_response)
        return throttled(body) if environ["REQUEST_METHOD"] == "GET" else body

    server = make_server("127.0.0.1", 0, wrapped, True, request_handler=MotoRequestHandler)
    Path(port_file).write_text(str(server.server_address[1]))
    server.serve_forever()


def start_store(work: Path, latency_ms: float, mbps: float) -> tuple[subprocess.Popen, str]:
    port_file = work / "store.port"
    port_file.unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, __file__, "--serve", json.dumps([latency_ms, mbps, str(port_file)])],
                            stdout=subprocess.DEVNULL, stderr=open(work / "store.log", "ab"))
    deadline = time.monotonic() + 60
    while not port_file.exists() or not port_file.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the S3 server did not start; see {work / 'store.log'}")
        time.sleep(0.05)
    return proc, f"http://127.0.0.1:{port_file.read_text()}"


# -- the data, converted three ways ---------------------------------------------------------------
def prepare(work: Path, images: int, shard_mb: float, tiny: bool, others: list[str], other_python: str,
            endpoint: str) -> dict:
    from gdsload.convert.engine import ConvertOptions, convert
    from gdsload.sampledata import ensure_image_folder

    src = work / "images"
    kw = {"mean_size": (64, 48)} if tiny else {}
    ensure_image_folder(src, num_images=images, num_classes=10, workers=os.cpu_count() or 1, **kw)
    files = sorted(p for p in src.rglob("*.jpg"))
    classes = sorted({p.parent.name for p in files})
    listing = work / "listing.json"
    listing.write_text(json.dumps([[str(p), classes.index(p.parent.name)] for p in files]))
    shard_bytes = int(shard_mb * 1e6)
    local = work / "gdsload"
    if not (local / "manifest.json").exists():
        shutil.rmtree(local, ignore_errors=True)
        convert(str(src), local, ConvertOptions(shard_size=shard_bytes, workers=os.cpu_count() or 1, progress=False))
    import fsspec

    fs = fsspec.filesystem("s3", client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True)
    fs.mkdir(BUCKET)
    fs.put(str(local), f"{BUCKET}/gdsload", recursive=True)
    out = {"local": str(local), "gdsload": f"s3://{BUCKET}/gdsload", "files": len(files),
           "bytes": sum(p.stat().st_size for p in files)}
    for name in others:  # converted with their own tools, under the other interpreter
        dst = work / name
        if not dst.exists():  # written under a temporary name: a failed conversion is redone
            tmp = work / f"{name}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            r = subprocess.run([other_python, __file__, "--convert", json.dumps([name, str(listing), str(tmp), shard_bytes])],
                               capture_output=True, text=True, env={**os.environ, **ENV})
            if r.returncode:
                raise SystemExit(f"converting with {name} failed:\n{r.stderr[-3000:]}")
            tmp.rename(dst)
        fs.put(str(dst), f"{BUCKET}/{name}", recursive=True)
        out[name] = f"s3://{BUCKET}/{name}"
    return out


def _litdata_item(item):
    path, label = item
    return {"image": Path(path).read_bytes(), "cls": int(label)}


def convert_other(name: str, listing: str, dst: str, shard_bytes: int) -> None:
    items = json.loads(Path(listing).read_text())
    if name == "litdata":
        import litdata

        litdata.optimize(fn=_litdata_item, inputs=items, output_dir=dst, chunk_bytes=shard_bytes, num_workers=1,
                         mode="overwrite")
    else:
        from streaming import MDSWriter

        with MDSWriter(out=dst, columns={"image": "bytes", "cls": "int"}, size_limit=shard_bytes) as w:
            for path, label in items:
                w.write({"image": Path(path).read_bytes(), "cls": int(label)})


# -- contestants (each in a fresh process) --------------------------------------------------------
def _cpu_s() -> float:
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def _epoch(it, labels_of, t0: float | None = None) -> dict:
    """Iterate one epoch; the clock starts at `t0` (default now), so set-up can be counted."""
    labels: Counter = Counter()
    t0 = time.perf_counter() if t0 is None else t0
    first = None
    for batch in it:
        if first is None:
            first = time.perf_counter() - t0
        labels.update(int(x) for x in labels_of(batch))
    wall = time.perf_counter() - t0
    n = sum(labels.values())
    return {"samples": n, "wall_s": wall, "samples_per_s": n / wall, "first_batch_s": first,
            "labels": dict(sorted(labels.items()))}


def run_gdsload(a: dict) -> dict:
    import gdsload
    from gdsload.decode.image import ImageTransform

    kw = {"decode": False} if a["tier"] == "R" else {"transform": ImageTransform()}
    which = a["contestant"]
    t_setup = time.perf_counter()  # a first epoch counts opening the dataset (manifest, indexes)
    if which == "gdsload-local":
        ds = gdsload.Dataset(a["local"])
    else:
        ds = gdsload.Dataset(a["gdsload"], cache_dir=False if which == "gdsload-ranges" else a["cache"],
                             cache_limit=a["cache_limit"])
    dl = gdsload.DataLoader(ds, batch_size=a["batch_size"], shuffle=True, seed=a["seed"], num_workers=a["workers"],
                            device="cpu", output="numpy", **kw)
    epochs = [0, 1] if which in ("gdsload-warm", "gdsload-local") else [0]
    out = {}
    for e in epochs:  # warm and local: the second epoch is measured
        dl.set_epoch(e)
        c0 = _cpu_s()
        t0 = t_setup if e == 0 else time.perf_counter()
        out = _epoch(iter(dl), lambda b: b["cls"].tolist(), t0)
        out["cpu_s"] = _cpu_s() - c0
    out["stats"] = {k: v for k, v in dl.stats().items() if isinstance(v, (int, float, str, dict))}
    dl.close()
    return out


def _pil_t(seed: int):
    from gdsload.bench.runners import pil_transform

    return pil_transform("T", seed=seed)


def run_other(a: dict) -> dict:
    import torch

    tier, which = a["tier"], a["contestant"]
    cores = os.cpu_count() or 1
    t_setup = time.perf_counter()  # as for gdsload: opening the dataset counts
    if which == "litdata":
        import litdata
        from litdata.streaming import downloader

        # the local store speaks http: obstore (LitData's chunk downloader) must be allowed to
        downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = True

        class DS(litdata.StreamingDataset):
            def __getitem__(self, index):
                s = super().__getitem__(index)
                img = bytes(s["image"])  # a memoryview into the chunk, which workers cannot pickle
                if tier == "T":
                    import io

                    from PIL import Image

                    if not hasattr(self, "_t"):
                        self._t = _pil_t(a["seed"])
                    img = self._t(Image.open(io.BytesIO(img)).convert("RGB"))
                return img, s["cls"]

        ds = DS(a["litdata"], cache_dir=a["cache"], shuffle=True, seed=a["seed"],
                storage_options={"endpoint_url": os.environ["AWS_ENDPOINT_URL"]})
        dl = litdata.StreamingDataLoader(ds, batch_size=a["batch_size"], num_workers=cores,
                                         collate_fn=_collate(tier))
    else:
        from streaming import StreamingDataset

        class DS(StreamingDataset):
            def __getitem__(self, index):
                s = super().__getitem__(index)
                img = s["image"]
                if tier == "T":
                    import io

                    from PIL import Image

                    if not hasattr(self, "_t"):
                        self._t = _pil_t(a["seed"])
                    img = self._t(Image.open(io.BytesIO(img)).convert("RGB"))
                return img, s["cls"]

        ds = DS(remote=a["mosaic"], local=a["cache"], shuffle=True, shuffle_seed=a["seed"], batch_size=a["batch_size"])
        dl = torch.utils.data.DataLoader(ds, batch_size=a["batch_size"], num_workers=cores, collate_fn=_collate(tier))
    c0 = _cpu_s()
    out = _epoch(iter(dl), lambda b: b[1], t_setup)
    out["cpu_s"] = _cpu_s() - c0
    return out


def _collate(tier: str):
    return _collate_t if tier == "T" else _collate_r


def _collate_r(items):
    return [i[0] for i in items], [int(i[1]) for i in items]


def _collate_t(items):
    import numpy as np

    return np.stack([np.asarray(i[0]) for i in items]), [int(i[1]) for i in items]


def run_one(python: str, args: dict, timeout_s: float) -> dict:
    t0 = time.perf_counter()
    try:
        r = subprocess.run([python, __file__, "--run", json.dumps(args)], capture_output=True, text=True,
                           timeout=timeout_s, env={**os.environ, **ENV, "PYTHONPATH": str(REPO)})
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
        raise SystemExit(f"{args['contestant']} (tier {args['tier']}) ran past {timeout_s:.0f} s:\n{err[-4000:]}") from None
    if r.returncode:
        raise SystemExit(f"{args['contestant']} (tier {args['tier']}) failed:\n{r.stderr[-4000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["process_s"] = time.perf_counter() - t0
    return out


def _importable(python: str, module: str) -> bool:
    r = subprocess.run([python, "-c", f"import {module}"], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    return r.returncode == 0


def _ratios(num: list[float], den: list[float]) -> dict:
    rs = [a / b for a, b in zip(num, den) if b]
    return {"median": statistics.median(rs), "min": min(rs), "max": max(rs)} if rs else {}


# -- main ----------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--images", type=int, default=4000)
    ap.add_argument("--shard-mb", type=float, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tiers", default="R,T")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--latency-ms", type=float, default=20)
    ap.add_argument("--mbps", type=float, default=200, help="store bandwidth cap, MB/s (shared by all connections)")
    ap.add_argument("--cache-limit", default="50GB")
    ap.add_argument("--contestants", default="gdsload,litdata,mosaic",
                    help="gdsload (its four runs), litdata, mosaic; comma-separated")
    default_other = "/work/venv-cache/bin/python" if Path("/work/venv-cache/bin/python").exists() else sys.executable
    ap.add_argument("--other-python", default=default_other, help="interpreter with litdata / streaming installed")
    ap.add_argument("--timeout-s", type=float, default=1800)
    ap.add_argument("--tiny", action="store_true", help="smoke run: few small images, one round, tier R")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.tiny:
        a.images, a.shard_mb, a.rounds, a.tiers, a.batch_size = 48, 0.05, 1, "R", 8
    chosen = [c.strip() for c in a.contestants.split(",") if c.strip()]
    contestants = list(GDSLOAD) if "gdsload" in chosen else []
    skipped = {}
    others = []
    for name, module in (("litdata", "litdata"), ("mosaic", "streaming")):
        if name not in chosen:
            continue
        if _importable(a.other_python, module):
            others.append(name)
        else:
            skipped[name] = f"the Python module {module!r} does not import under {a.other_python}"
            print(f"skipping {name}: {skipped[name]}")
    contestants += others
    work = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="cache-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    store, endpoint = start_store(work, a.latency_ms, a.mbps)
    # this process's fsspec finds the store through the environment; put it back afterwards (a
    # test suite that runs main() keeps its own S3 endpoint there)
    env = {**ENV, "AWS_ENDPOINT_URL": endpoint, "S3_ENDPOINT_URL": endpoint}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        data = prepare(work, a.images, a.shard_mb, a.tiny, others, a.other_python, endpoint)
        results: dict = {t: {c: [] for c in contestants} for t in a.tiers.split(",")}
        for rnd in range(a.rounds):
            for tier in results:
                for c in contestants:  # interleaved: A B C ... per round
                    cache = work / "caches" / f"{tier}-{c}-{rnd}"
                    shutil.rmtree(cache, ignore_errors=True)
                    args = {**data, "contestant": c, "tier": tier, "cache": str(cache), "seed": rnd,
                            "batch_size": a.batch_size, "workers": max(2, os.cpu_count() or 2),
                            "cache_limit": a.cache_limit}
                    python = sys.executable if c in GDSLOAD else a.other_python
                    r = run_one(python, args, a.timeout_s)
                    results[tier][c].append(r)
                    shutil.rmtree(cache, ignore_errors=True)
                    print(f"round {rnd} tier {tier} {c:15s} {r['samples_per_s']:10.1f} samples/s "
                          f"({r['samples']} samples, {r['wall_s']:.2f} s)", flush=True)
    finally:
        store.terminate()
        store.wait()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    report = {"machine": {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()},
              "config": {k: v for k, v in vars(a).items() if k != "out"}, "skipped": skipped,
              "dataset": {k: data[k] for k in ("files", "bytes")}, "tiers": {}}
    for tier, by in results.items():
        t: dict = {}
        hist = {c: runs[0]["labels"] for c, runs in by.items() if runs}
        counts = {c: runs[0]["samples"] for c, runs in by.items() if runs}
        t["agree"] = len({json.dumps(h, sort_keys=True) for h in hist.values()}) <= 1
        if not t["agree"]:
            print(f"WARNING tier {tier}: contestants disagree on samples: {counts}")
        rate = {c: [r["samples_per_s"] for r in runs] for c, runs in by.items()}
        for c, runs in by.items():
            t[c] = {"samples_per_s": statistics.median(rate[c]),
                    "cpu_s_per_1k": statistics.median(r["cpu_s"] * 1000 / max(r["samples"], 1) for r in runs),
                    "samples": counts[c], "runs": [{k: v for k, v in r.items() if k != "labels"} for r in runs]}
        if "gdsload-cache" in rate:
            if others:
                best = [max(rate[o][i] for o in others) for i in range(a.rounds)]
                t["cache_over_best_other"] = _ratios(rate["gdsload-cache"], best)
            t["cache_over_ranges"] = _ratios(rate["gdsload-cache"], rate["gdsload-ranges"])
            t["warm_over_local"] = _ratios(rate["gdsload-warm"], rate["gdsload-local"])
        report["tiers"][tier] = t
    print(f"\n{'tier':4s} {'contestant':15s} {'samples/s':>10s} {'CPU s/1k':>9s}")
    for tier, t in report["tiers"].items():
        for c in contestants:
            print(f"{tier:4s} {c:15s} {t[c]['samples_per_s']:10.1f} {t[c]['cpu_s_per_1k']:9.2f}")
        for k in ("cache_over_best_other", "cache_over_ranges", "warm_over_local"):
            if t.get(k):
                r = t[k]
                print(f"{tier:4s} {k:24s} {r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f})")
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    out = Path(a.out) if a.out else REPO / "bench" / "results" / f"cache-{platform.node()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    if not a.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return report


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--serve":
        serve(*json.loads(sys.argv[2]))
    elif len(sys.argv) == 3 and sys.argv[1] == "--convert":
        convert_other(*json.loads(sys.argv[2]))
    elif len(sys.argv) == 3 and sys.argv[1] == "--run":
        args = json.loads(sys.argv[2])
        fn = run_gdsload if args["contestant"] in GDSLOAD else run_other
        print(json.dumps(fn(args)))
    else:
        main()
