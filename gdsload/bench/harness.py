"""The benchmark harness: contestants interleaved over the same shards, ratios in one run.

For each tier, after one warm-up run of every contestant, it runs rounds of (gdsload, torch,
dali, read, ...) in that order, each in a fresh subprocess, and reports for every contestant the
median throughput, the ratio gdsload / contestant (median, min-max over rounds, paired by round),
CPU seconds per 1,000 samples, peak memory and time to first batch. It fails if contestants
disagree on the number of samples or the label histogram.

Peak memory is the peak of the summed PSS (proportional set size, from /proc/PID/smaps_rollup)
of the run's whole process tree, sampled every 50 ms: multi-process loaders are charged for all
their workers, and shared libraries are not counted once per process.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from gdsload.errors import GdsloadError


def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def _pss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def run_one(args: dict[str, Any], timeout_s: float = 1800) -> dict[str, Any]:
    """Run a contestant in a subprocess, sampling its process tree's memory."""
    return run_measured([sys.executable, "-m", "gdsload.bench.runners", json.dumps(args)],
                        f"benchmark run {args['contestant']}/{args['tier']}", timeout_s)


def run_measured(cmd: list[str], what: str, timeout_s: float) -> dict[str, Any]:
    """Run `cmd`, whose last `RESULT {json}` line is its result, with the peak PSS of its process
    tree (`peak_mem_mb`) added; a failure raises naming `what`."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.05):
            peak[0] = max(peak[0], sum(_pss_kb(p) for p in _tree(proc.pid)))

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        out, err = proc.communicate(timeout=timeout_s)
    finally:
        done.set()
        t.join()
    line = next((ln for ln in reversed(out.splitlines()) if ln.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise GdsloadError(f"{what} failed (exit {proc.returncode}): {err.strip()[-1500:]}")
    r = json.loads(line[len("RESULT "):])
    r["peak_mem_mb"] = peak[0] / 1024
    return r


def _ratio_stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def run_suite(dataset: str, *, kind: str, tiers: list[str], contestants: list[str], rounds: int = 5,
              batch_size: int = 256, workers: int | None = None, step_ms: float = 0.0,
              warmup: bool = True, log=print, prefetch: Any = None) -> dict[str, Any]:
    """Benchmark `contestants` on `dataset` for each tier; returns the JSON-able result.
    A contestant that cannot run here (`spdl` not installed) is skipped with a message."""
    workers = workers or os.cpu_count() or 1
    if "spdl" in contestants:
        from gdsload.bench.runners import spdl_missing

        why = spdl_missing()
        if why:
            log(f"skipping spdl (pip install spdl, and FFmpeg's shared libraries): {why}")
            contestants = [c for c in contestants if c != "spdl"]
    m = json.loads((Path(dataset) / "manifest.json").read_text())
    if "cls" not in m["fields"]:
        raise GdsloadError(f"{dataset}: the benchmark checks labels and needs a 'cls' field "
                           f"(fields: {sorted(m['fields'])})")
    image_field = next((f for f, k in m["fields"].items() if k == "image"), None)
    result: dict[str, Any] = {
        "dataset": str(dataset), "kind": kind, "samples": m["num_samples"], "bytes": m["num_bytes"],
        "batch_size": batch_size, "workers": workers, "rounds": rounds, "step_ms": step_ms,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform(), "node": platform.node()},
        "tiers": {},
    }
    for tier in tiers:
        names = [c for c in contestants if not (c in ("dali", "dali_torch") and kind == "tensor")]
        if tier == "R":  # encoded bytes of varied sizes: no tensors for DALI's PyTorch iterator
            names = [c for c in names if c not in ("decode1", "dali_torch")]
        else:  # the CRC32 cost and the storage's own speed show where bytes are not decoded
            names = [c for c in names if c not in ("gdsload_noverify", "read_warm")]

        def args(c: str, **kw: Any) -> dict[str, Any]:
            return {"contestant": c, "tier": tier, "dataset": str(dataset), "kind": kind,
                    "image_field": image_field,
                    "batch_size": batch_size, "workers": workers, "step_ms": step_ms,
                    "prefetch": prefetch, **kw}

        runs: dict[str, list[dict]] = {c: [] for c in names}
        if warmup:
            log(f"tier {tier}: warm-up")
            for c in names:
                run_one(args(c))
        for r in range(rounds):
            for c in names:
                runs[c].append(run_one(args(c)))
            log(f"tier {tier}: round {r + 1}/{rounds} " + " ".join(
                f"{c}={runs[c][-1]['samples'] / runs[c][-1]['wall_s']:.0f}/s" for c in names))
        if "read" in names:  # the cold read once per round is costly; measure it once at the end
            runs["read_cold"] = [run_one(args("read", cold=True))]
        # every loader must have delivered the same samples and labels
        ref = runs["gdsload"][0] if "gdsload" in runs else None
        for c in names:
            if c in ("read", "read_warm", "decode1") or ref is None:
                continue
            for r in runs[c]:
                if r["samples"] != ref["samples"] or r["labels"] != ref["labels"]:
                    raise GdsloadError(f"tier {tier}: {c} delivered {r['samples']} samples / labels "
                                       f"{r['labels']}, gdsload {ref['samples']} / {ref['labels']}")
        tier_out: dict[str, Any] = {}
        for c, rs in runs.items():
            sps = [r["samples"] / r["wall_s"] for r in rs]
            entry: dict[str, Any] = {
                "samples_per_s": statistics.median(sps),
                "cpu_s_per_1000": statistics.median(1000 * r["cpu_s"] / r["samples"] for r in rs),
                "peak_mem_mb": max(r["peak_mem_mb"] for r in rs),
                "wall_s": [round(r["wall_s"], 3) for r in rs],
            }
            if rs[0].get("bytes"):
                entry["bytes_per_s"] = statistics.median(r["bytes"] / r["wall_s"] for r in rs)
            if rs[0].get("first_batch_s") is not None:
                entry["first_batch_s"] = statistics.median(r["first_batch_s"] for r in rs)
                entry["wait_fraction"] = statistics.median(r["wait_s"] / r["wall_s"] for r in rs)
            if c == "decode1":
                entry["samples_per_s_x_cores"] = entry["samples_per_s"] * workers
            if c == "gdsload" and rs[0].get("stats"):
                entry["io_path"] = rs[0]["stats"].get("io_path")
                entry["decode_device"] = rs[0]["stats"].get("decode_device")
                entry["bytes_per_s"] = statistics.median(r["stats"]["bytes_per_s"] for r in rs)
            tier_out[c] = entry
        if "gdsload" in runs:
            ours = runs["gdsload"]
            for c in runs:
                if c == "gdsload" or len(runs[c]) != len(ours):
                    continue
                pair = list(zip(ours, runs[c]))
                tier_out[c]["ratio_gdsload_over"] = _ratio_stats(
                    [(o["samples"] / o["wall_s"]) / (b["samples"] / b["wall_s"]) for o, b in pair])
                if c in ("read", "read_warm"):
                    tier_out[c]["ratio_bytes_gdsload_over"] = _ratio_stats(
                        [o["stats"]["bytes_per_s"] / (b["bytes"] / b["wall_s"]) for o, b in pair])
                if ours[0].get("first_batch_s") is not None and runs[c][0].get("first_batch_s"):
                    tier_out[c]["first_batch_ratio"] = statistics.median(
                        o["first_batch_s"] / b["first_batch_s"] for o, b in pair)
                    tier_out[c]["peak_mem_ratio"] = statistics.median(
                        o["peak_mem_mb"] / b["peak_mem_mb"] for o, b in pair)
        result["tiers"][tier] = tier_out
    return result


def format_table(result: dict[str, Any]) -> str:
    lines = [f"dataset {result['dataset']} ({result['kind']}, {result['samples']} samples, "
             f"{result['bytes'] / 1e6:.0f} MB), batch {result['batch_size']}, {result['workers']} workers, "
             f"{result['rounds']} rounds, step {result['step_ms']} ms"]
    hdr = (f"{'tier':<5}{'contestant':<11}{'samples/s':>10}{'MB/s':>8}{'ours/it (min-max)':>22}"
           f"{'CPU s/1k':>9}{'peak MB':>9}{'1st batch s':>12}{'wait':>7}")
    lines.append(hdr)
    for tier, cs in result["tiers"].items():
        for c, e in cs.items():
            r = e.get("ratio_gdsload_over")
            rtxt = f"{r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})" if r else "-"
            mbs = e.get("bytes_per_s")
            fb = e.get("first_batch_s")
            wf = e.get("wait_fraction")
            sps = e["samples_per_s"]
            extra = f"  (x cores: {e['samples_per_s_x_cores']:.0f}/s)" if "samples_per_s_x_cores" in e else ""
            lines.append(f"{tier:<5}{c:<11}{sps:>10.0f}{(mbs or 0) / 1e6:>8.0f}{rtxt:>22}"
                         f"{e['cpu_s_per_1000']:>9.2f}{e['peak_mem_mb']:>9.0f}"
                         f"{(f'{fb:.2f}' if fb is not None else '-'):>12}"
                         f"{(f'{wf:.2f}' if wf is not None else '-'):>7}{extra}")
    return "\n".join(lines)


def write_result(result: dict[str, Any], out: str | None, results_dir: Path, name: str, *,
                 tiny: bool) -> Path | None:
    """Write a benchmark's JSON to `out`, or to `results_dir/NAME-<node>.json`; tiny runs write
    only where `out` is given (so the test suite leaves no results behind)."""
    if tiny and not out:
        return None
    dest = Path(out) if out else results_dir / f"{name}-{platform.node() or 'host'}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {dest}", file=sys.stderr)
    return dest
