"""Writing shards from a Parquet file: `gdsload convert` vs `litdata.optimize` vs
`webdataset.ShardWriter`, the same worker count for all three.

The source is one Parquet file of ImageNet-like JPEGs (made by `gdsload.sampledata`) in the
HuggingFace layout: an `image` struct `{bytes, path}` and an integer `label` with `ClassLabel`
names in the schema metadata, row groups of `--row-group` rows. Each contestant turns every row
into a sample (the JPEG bytes unchanged, the label) in shards of about `--shard-size`:

- `gdsload`: `python -m gdsload convert data.parquet DST --workers N` (row groups as the units of
  `gdsload.write`, written in input order: output bytes independent of N);
- `litdata`: `litdata.optimize(fn, inputs=row groups, num_workers=N, chunk_bytes=SIZE)`, `fn`
  reading its row group with pyarrow and yielding `{"image": bytes, "label": int}`;
- `webdataset`: N processes, each reading every N-th row group and writing its own
  `webdataset.ShardWriter(maxsize=SIZE)` tars (webdataset has no parallel writer).

Runs are interleaved (gdsload, litdata, webdataset, gdsload, ...) after one warm-up of each, each
in a fresh subprocess, page cache hot. Reported: samples/s (median and min-max over rounds), the
ratio gdsload / the better baseline per round, CPU seconds per GB of image bytes (the process and
all its children), and peak memory: the highest sum of RSS over the process tree, sampled every
50 ms (shared pages count once per process, so it is an upper bound).

    python bench/writer_bench.py --images 20000 --workers 2 --rounds 5     # the issue's setting
    python bench/writer_bench.py --tiny                                     # smoke run

Prints a table and writes JSON (`--out`, default bench/results/writer-<host>.json).
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
from pathlib import Path

LITDATA = r"""
import sys
import pyarrow.parquet as pq
from litdata import optimize

src, dst, workers, chunk_bytes = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])

def rows(group):
    t = pq.ParquetFile(src).read_row_group(group, columns=["image", "label"])
    for img, label in zip(t.column("image").to_pylist(), t.column("label").to_pylist()):
        yield {"image": img["bytes"], "label": label}

if __name__ == "__main__":
    groups = list(range(pq.ParquetFile(src).metadata.num_row_groups))
    optimize(fn=rows, inputs=groups, output_dir=dst, num_workers=workers, chunk_bytes=chunk_bytes,
             mode="overwrite")
"""

WEBDATASET = r"""
import multiprocessing as mp, os, sys
import pyarrow.parquet as pq
import webdataset as wds

src, dst, workers, maxsize = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])

def work(w):
    pf = pq.ParquetFile(src)
    n = 0
    with wds.ShardWriter(os.path.join(dst, f"w{w}-%06d.tar"), maxsize=maxsize, verbose=0) as sink:
        for g in range(w, pf.metadata.num_row_groups, workers):
            t = pf.read_row_group(g, columns=["image", "label"])
            first = sum(pf.metadata.row_group(i).num_rows for i in range(g))
            for r, (img, label) in enumerate(zip(t.column("image").to_pylist(), t.column("label").to_pylist())):
                sink.write({"__key__": f"{first + r:010d}", "jpg": img["bytes"], "cls": str(label).encode()})
                n += 1
    return n

if __name__ == "__main__":
    with mp.get_context("fork").Pool(workers) as pool:
        print(sum(pool.map(work, range(workers))))
"""


def tree_rss_mb(pid: int) -> float:
    """Sum of VmRSS over `pid` and its descendants (Linux /proc), in MB."""
    total, todo, seen = 0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
            for task in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in Path(f"/proc/{p}/task/{task}/children").read_text().split()]
        except (OSError, ValueError):
            continue
    return total / 1024


def run_child(argv: list[str]) -> dict:
    """Wall seconds, CPU seconds (it and its children), peak tree RSS of one subprocess."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    peak = [0.0]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.05):
            peak[0] = max(peak[0], tree_rss_mb(proc.pid))

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    out, err = proc.communicate()
    wall = time.perf_counter() - t0
    done.set()
    watcher.join()
    if proc.returncode:
        raise RuntimeError(f"{argv[:4]} failed ({proc.returncode}): {err.decode()[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu, "peak_tree_rss_mb": peak[0], "stdout": out.decode()}


def make_parquet(work: Path, images: int, classes: int, row_group: int, tiny: bool) -> dict:
    """The source Parquet file (made once per workdir and setting), HuggingFace layout."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from gdsload.sampledata import ensure_image_folder

    path = work / "data.parquet"
    marker = work / "data.parquet.json"
    setting = {"images": images, "classes": classes, "row_group": row_group, "tiny": tiny}
    if marker.exists():
        made = json.loads(marker.read_text())
        if made.get("setting") == setting:
            return made
    folder = work / "images"
    shutil.rmtree(folder, ignore_errors=True)
    kw = {"mean_size": (96, 72)} if tiny else {}
    ensure_image_folder(folder, num_images=images, num_classes=classes, seed=0, **kw)
    names = sorted(d.name for d in folder.iterdir() if d.is_dir())
    files = [(label, f) for label, c in enumerate(names) for f in sorted((folder / c).iterdir())]
    features = {"image": {"_type": "Image"}, "label": {"names": names, "_type": "ClassLabel"}}
    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema([("image", struct), ("label", pa.int64())],
                       metadata={"huggingface": json.dumps({"info": {"features": features}})})
    nbytes = 0
    with pq.ParquetWriter(path, schema) as w:
        for start in range(0, len(files), row_group):
            part = files[start:start + row_group]
            data = [f.read_bytes() for _, f in part]
            nbytes += sum(map(len, data))
            w.write_table(pa.table({"image": pa.array([{"bytes": d, "path": None} for d in data], struct),
                                    "label": [label for label, _ in part]}, schema=schema),
                          row_group_size=row_group)
    shutil.rmtree(folder)
    made = {"rows": len(files), "image_bytes": nbytes, "file_bytes": path.stat().st_size, "classes": len(names),
            "setting": setting}
    marker.write_text(json.dumps(made))
    return made


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=20000)
    ap.add_argument("--classes", type=int, default=100)
    ap.add_argument("--row-group", type=int, default=500, help="rows per Parquet row group")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="for every contestant")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shard-size", default="256MB")
    ap.add_argument("--contestants", default="gdsload,litdata,webdataset")
    ap.add_argument("--workdir", default=None, help="keep the source here (default: a temp dir)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--tiny", action="store_true", help="200 small images, 2 workers, 1 round: a smoke run")
    a = ap.parse_args(argv)
    if a.tiny:
        a.images, a.classes, a.row_group, a.workers, a.rounds, a.shard_size = 200, 4, 40, 2, 1, "1MB"

    from gdsload.sizes import parse_size

    shard_size = parse_size(a.shard_size)
    work = Path(a.workdir or tempfile.mkdtemp(prefix="gdsload-writer-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    src = make_parquet(work, a.images, a.classes, a.row_group, a.tiny)
    data = work / "data.parquet"
    print(f"source: {src['rows']} images, {src['image_bytes'] / 1e6:.0f} MB of JPEG in {data}", file=sys.stderr)
    names = a.contestants.split(",")
    unknown = set(names) - {"gdsload", "litdata", "webdataset"}
    if unknown:
        raise SystemExit(f"unknown contestants {sorted(unknown)}")
    env_py = [sys.executable]

    def out_dir(name: str) -> Path:
        d = work / f"out-{name}"
        shutil.rmtree(d, ignore_errors=True)
        return d

    def run(name: str) -> dict:
        dst = out_dir(name)
        if name == "gdsload":
            return run_child(env_py + ["-m", "gdsload", "convert", str(data), str(dst), "-q", "--workers",
                                       str(a.workers), "--shard-size", str(shard_size)])
        # as files, not `-c`: litdata's workers are spawned and import `fn` from the script
        script = work / f"{name}_job.py"
        script.write_text(LITDATA if name == "litdata" else WEBDATASET)
        if name == "webdataset":
            dst.mkdir()
        return run_child(env_py + [str(script), str(data), str(dst), str(a.workers), str(shard_size)])

    runs: dict[str, list[dict]] = {n: [] for n in names}
    for n in names:  # warm-up: page cache, imports
        run(n)
    for _ in range(a.rounds):
        for n in names:
            runs[n].append(run(n))

    counts = {}
    if "gdsload" in names:
        from gdsload.dataset.sharded import open_dataset

        counts["gdsload"] = len(open_dataset(work / "out-gdsload"))
    if "litdata" in names:
        index = json.loads((work / "out-litdata" / "index.json").read_text())
        counts["litdata"] = sum(c["chunk_size"] for c in index["chunks"])
    if "webdataset" in names:
        counts["webdataset"] = int(runs["webdataset"][-1]["stdout"].split()[-1])
    if set(counts.values()) != {src["rows"]}:
        raise SystemExit(f"sample counts differ: {counts}, source {src['rows']}")

    n, gb = src["rows"], src["image_bytes"] / 1e9

    def summary(rs: list[dict]) -> dict:
        rates = [n / r["wall_s"] for r in rs]
        return {"samples_per_s_median": statistics.median(rates), "samples_per_s_min": min(rates),
                "samples_per_s_max": max(rates), "cpu_s_per_gb": statistics.median(r["cpu_s"] / gb for r in rs),
                "peak_tree_rss_mb": max(r["peak_tree_rss_mb"] for r in rs),
                "wall_s": [round(r["wall_s"], 3) for r in rs]}

    result = {
        "bench": "writer",
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform()},
        "source": {**src, "row_group": a.row_group, "shard_size": shard_size},
        "workers": a.workers, "rounds": a.rounds,
        **{name: summary(runs[name]) for name in names},
    }
    baselines = [b for b in ("litdata", "webdataset") if b in names]
    if "gdsload" in names and baselines:
        ratios = [min(runs[b][i]["wall_s"] for b in baselines) / runs["gdsload"][i]["wall_s"] for i in range(a.rounds)]
        result["ratio_vs_better_baseline"] = {"median": statistics.median(ratios), "min": min(ratios),
                                              "max": max(ratios), "per_round": [round(r, 3) for r in ratios]}
    print(f"{'':<22}{'samples/s':>11}{'(min-max)':>18}{'CPU s/GB':>10}{'peak tree RSS MB':>18}")
    for name in names:
        s = result[name]
        spread = "({:.0f}-{:.0f})".format(s["samples_per_s_min"], s["samples_per_s_max"])
        print(f"{name:<22}{s['samples_per_s_median']:>11.0f}{spread:>18}"
              f"{s['cpu_s_per_gb']:>10.1f}{s['peak_tree_rss_mb']:>18.0f}")
    if "ratio_vs_better_baseline" in result:
        r = result["ratio_vs_better_baseline"]
        print(f"ratio gdsload / better baseline, samples/s: median {r['median']:.2f} (min {r['min']:.2f}, "
              f"max {r['max']:.2f}) over {a.rounds} rounds, {a.workers} workers each")
    from gdsload.bench.harness import write_result

    write_result(result, a.out, Path(__file__).parent / "results", "writer", tiny=a.tiny)
    if not a.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return result


if __name__ == "__main__":
    main()
