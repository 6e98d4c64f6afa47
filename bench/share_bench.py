"""Jobs sharing one server's reading and decoding (issue 29): `RemoteLoader(share=...)`.

Every case runs on a fresh `python -m gdsload.service` process held to one core (pinned to the last
CPU; `--server-cores` below 1 also limits it with `remote_scale_bench.Throttle`: a cgroup v1 CPU
quota, else a SIGSTOP/SIGCONT duty cycle), decoded tier (`ImageTransform(train=True)`, 224 px),
and the jobs are client processes pinned to the other CPUs, one per job, started together. Each
round runs every case once, in a rotating order (`--rounds`, >= 5 for the figures):

- solo:     one job alone (no share name: today's path): its throughput (samples/s, from its
            first batch to its last) and the server's CPU seconds.
- shared:   `--jobs` (4) jobs with the same spec under one share name. Figures: the server's CPU-s
            for all of them / solo's (target <= 1.3) and each job's throughput / solo's of the
            same round (target >= 0.8); `shared_batches` says how many batches each got as a copy.
- unshared: the same jobs without a share name (the control: what sharing saves).
- pause:    the jobs shared; the last one stops reading for `--pause-s` (10) after `--pause-after`
            batches, then finishes its epoch; the others read until it has resumed. Figures: each
            other job's throughput while it is paused (the whole pause, including the server's
            `--share-hold` wait before it detaches the paused job; `--settle-s` skips a start of
            it) / that job's throughput in `shared` of the same round (target >= 0.9: slowed by at
            most 10%); and whether the paused job got exactly its epoch in plan order.

Throughput and server CPU are steady state, as in a training job that runs for many epochs: every
job first reads `--warmup-epochs` (1) epochs untimed, then all start the timed epochs together
(the server's CPU is read at that moment); throughput is the samples after a job's first timed
batch over the time from it to its last. What the warm-up leaves out, in every case alike: the
server's loaders and DALI pipelines being built, and the first touch of the memory it then reuses
(rings, the share window). On this VM that first touch is expensive: writing 380 MB of memory a
process never touched took 1.9 s (~200 MB/s, the hypervisor backing the pages), against ~1 ms per
19 MB once they are there, so in a 2-epoch case it was up to a third of the server's CPU, and
varied from run to run. `--warmup-epochs 0` measures from the jobs' start, as before.

    python bench/share_bench.py --rounds 5          # the lead's run (~10 min on 2 cores)
    python bench/share_bench.py --tiny              # smoke run (< 1 min; figures mean nothing)

Prints a table to stderr and JSON to stdout and `--out` (default bench/results/share-<host>.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from remote_bench import _free_port, _proc_cpu_s, _self_cpu_s, image_dataset
from remote_scale_bench import Throttle, _plan_keys, _wait_serving, popen_pinned


# -- one job (a client process) -------------------------------------------------------------------
def _client(a) -> None:
    """Build the loader, say "ready", wait for "go" on stdin, read; the result as JSON to a file.
    `--job-pause-after K`: after K batches print "paused", sleep `--job-pause-s`, print "resumed". With
    `--until-stop` read epochs until "stop" arrives on stdin."""
    from gdsload.decode.image import ImageTransform
    from gdsload.service.client import RemoteLoader

    tf = ImageTransform(size=a.size, train=True, dtype=a.dtype)
    loader = RemoteLoader(a.address, dataset="imgs", batch_size=a.batch_size, shuffle=True, seed=0, rank=0,
                          world_size=1, output="numpy", decode=True, transform=tf, share=a.share or None,
                          backoff_s=0.05, max_backoff_s=0.5)
    len(loader)  # the plan (ListDatasets) before the clock
    stop = threading.Event()
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    if a.warmup_epochs:  # untimed; then wait for every job to be there
        for _ in range(a.warmup_epochs):
            for _batch in loader:
                pass
        print("warm", flush=True)
        if sys.stdin.readline().strip() != "go":
            return

    def watch_stdin() -> None:
        for line in sys.stdin:
            if line.strip() == "stop":
                stop.set()
                return

    threading.Thread(target=watch_stdin, daemon=True).start()
    times: list[tuple[float, int]] = []
    keys: list[list[str]] = []
    pause: dict[str, float] = {}
    t0, c0 = time.time(), _self_cpu_s()
    n = 0
    epoch = 0
    while not stop.is_set() and (a.until_stop or epoch < a.epochs):
        ek: list[str] = []
        for batch in loader:
            ek.extend(batch["__key__"])
            times.append((time.time(), len(batch["__key__"])))
            n += 1
            if a.job_pause_after and n == a.job_pause_after:
                pause["start"] = time.time()
                print("paused", flush=True)
                time.sleep(a.job_pause_s)
                pause["end"] = time.time()
                print("resumed", flush=True)
            if stop.is_set():
                break
        keys.append(ek)
        epoch += 1
    result = {"t0": t0, "wall_s": time.time() - t0, "cpu_s": _self_cpu_s() - c0, "times": times, "keys": keys,
              "pause": pause, "stats": {k: v for k, v in loader.stats().items() if k != "servers"}}
    loader.close()
    Path(a.result).write_text(json.dumps(result))


# -- the driver -------------------------------------------------------------------------------------
class Case:
    """One server and its jobs for one case."""

    def __init__(self, a, root: Path, work: Path, throttle: Throttle | None, server_cpus, client_cpus):
        self.a, self.root, self.work = a, root, work
        self.throttle, self.server_cpus, self.client_cpus = throttle, server_cpus, client_cpus
        self.proc: subprocess.Popen | None = None
        self.address = ""

    def start_server(self) -> None:
        a, cpus = self.a, self.server_cpus
        self.address = f"127.0.0.1:{_free_port()}"

        cmd = [sys.executable, "-m", "gdsload.service", str(self.root), "--listen", self.address,
               "--log-level", "WARNING", "--grace", "1", "--share-window", str(a.share_window),
               "--decode-pool", str(a.decode_pool)]
        with open(self.work / "server.log", "ab") as err:
            self.proc = popen_pinned(cmd, cpus, stdout=subprocess.DEVNULL, stderr=err)
        _wait_serving(self.address, self.proc, self.work / "server.log")
        if self.throttle is not None:
            self.throttle.limit(self.proc.pid, a.server_cores)

    def stop_server(self) -> None:
        if self.proc is not None:
            if self.throttle is not None:
                self.throttle.release(self.proc.pid)
            self.proc.kill()
            self.proc.wait(timeout=15)
            self.proc = None

    def run(self, jobs: int, share: str | None, *, epochs: int, pause_job: bool = False) -> dict:
        """Start `jobs` clients together; with `pause_job` the last one pauses and the others read
        until it has resumed. Returns the clients' results and the server's CPU-s."""
        a = self.a
        self.start_server()
        try:
            procs, files = [], []
            for j in range(jobs):
                f = self.work / f"job{j}.json"
                f.unlink(missing_ok=True)
                files.append(f)
                cmd = [sys.executable, __file__, "--client-role", "--address", self.address, "--result", str(f),
                       "--batch-size", str(a.batch_size), "--size", str(a.size), "--dtype", a.dtype,
                       "--epochs", str(epochs)]
                if share:
                    cmd += ["--share", share]
                if pause_job and j == jobs - 1:
                    cmd += ["--job-pause-after", str(a.pause_after), "--job-pause-s", str(a.pause_s)]
                elif pause_job:
                    cmd += ["--until-stop"]
                # pinned from exec on (taskset): a thread started while importing, before an
                # affinity set by the job itself, kept every CPU (seen: one per job on the server's)
                procs.append(popen_pinned(cmd, self.client_cpus, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          text=True))
            lines = [_Lines(p) for p in procs]
            for x in lines:
                x.expect("ready", 120)
            for i in range(2 if a.warmup_epochs else 1):
                if i:  # the second "go": every job has read its warm-up epochs
                    for x in lines:
                        x.expect("warm", 600)
                s0 = _proc_cpu_s(self.proc.pid)
                for p in procs:
                    p.stdin.write("go\n")
                    p.stdin.flush()
            if pause_job:
                lines[-1].expect("paused", 600)
                lines[-1].expect("resumed", a.pause_s + 60)
                for p in procs[:-1]:
                    p.stdin.write("stop\n")
                    p.stdin.flush()
            for p in procs:
                if p.wait(timeout=900) != 0:
                    raise SystemExit(f"a job failed (exit {p.returncode}); see above")
            server_cpu = _proc_cpu_s(self.proc.pid) - s0
            return {"server_cpu_s": server_cpu, "jobs": [json.loads(f.read_text()) for f in files]}
        finally:
            self.stop_server()


class _Lines:
    """The lines a job prints ("ready", "paused", "resumed"), read by a thread."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.q: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.q.put(line.strip())
        self.q.put(None)

    def expect(self, word: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.q.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line == word:
                return
            if line is None or time.monotonic() > deadline:
                self.proc.kill()
                raise SystemExit(f"a job did not say {word!r} within {timeout_s} s (exit {self.proc.poll()})")


def _rate(job: dict, t_from: float | None = None, t_to: float | None = None) -> float:
    """Samples/s of a job: steady state, from its first batch to its last (the server's start-up
    of a stream, a loader and a DALI pipeline, is left out of every case alike), or over the
    wall-clock window [t_from, t_to]."""
    if t_from is None:
        times = job["times"]
        if len(times) < 2:
            return 0.0
        return sum(n for _, n in times[1:]) / max(1e-9, times[-1][0] - times[0][0])
    n = sum(k for t, k in job["times"] if t_from <= t <= t_to)
    return n / max(1e-9, t_to - t_from)


def _span(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else {}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=512, help="images in the dataset (~105 KB each)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--size", type=int, default=224, help="output side of the train transform")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float16", "uint8"),
                    help="output dtype (uint8: a quarter of the bytes to send)")
    ap.add_argument("--epochs", type=int, default=2, help="epochs per job in solo, shared, unshared")
    ap.add_argument("--warmup-epochs", type=int, default=1,
                    help="epochs every job reads before the clock starts, all together (0: none)")
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--share-window", type=int, default=4, help="gdsload serve --share-window")
    ap.add_argument("--decode-pool", type=int, default=0, help="gdsload serve --decode-pool")
    ap.add_argument("--server-cores", type=float, default=1.0, help="CPU of the server (< 1: also a quota)")
    ap.add_argument("--pause-s", type=float, default=10.0)
    ap.add_argument("--pause-after", type=int, default=4, help="batches the paused job reads first")
    ap.add_argument("--settle-s", type=float, default=0.0,
                    help="pause: seconds after the pause began before the measured window (0: all of it)")
    ap.add_argument("--cases", default="solo,shared,unshared,pause")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--tiny", action="store_true", help="48 small images, 1 round, 1 s pause: a smoke run")
    # the client role
    ap.add_argument("--client-role", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--share", default="", help=argparse.SUPPRESS)
    ap.add_argument("--until-stop", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--job-pause-after", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--job-pause-s", type=float, default=0.0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.client_role:
        _client(a)
        return {}
    if a.tiny:
        a.images, a.batch_size, a.epochs, a.rounds, a.pause_s, a.pause_after = 48, 4, 1, 1, 1.0, 2

    from gdsload.loader.dataloader import Dataset

    work = Path(a.workdir or tempfile.mkdtemp(prefix="gdsload-share-bench-"))
    root = work / "root"
    ds = image_dataset(work, a.images, a.tiny)
    n = len(Dataset(str(ds)))
    ncpu = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    server_cpus = {ncpu[-1]} if len(ncpu) >= 2 else None
    client_cpus = set(ncpu[:-1]) if len(ncpu) >= 2 else None
    throttle = Throttle() if a.server_cores < 1.0 else None
    cases = a.cases.split(",")
    # seed 0, shuffled: the jobs' first timed epoch (after the warm-up)
    plan = [[k for k in _plan_keys(ds, a.batch_size, epoch=a.warmup_epochs)]]
    print(f"dataset: {n} images; server CPUs {server_cpus}, clients {client_cpus}; throttle: "
          f"{throttle.kind if throttle else 'pinned only'}", file=sys.stderr)
    runs: dict[str, list[dict]] = {c: [] for c in cases}
    load_start = os.getloadavg()
    try:
        for r in range(a.rounds):
            order = cases[r % len(cases):] + cases[: r % len(cases)]
            for case in order:
                c = Case(a, root, work, throttle, server_cpus, client_cpus)
                if case == "solo":  # a job alone, as without sharing (the private path)
                    res = c.run(1, None, epochs=a.epochs)
                elif case == "shared":
                    res = c.run(a.jobs, "bench", epochs=a.epochs)
                elif case == "unshared":
                    res = c.run(a.jobs, None, epochs=a.epochs)
                elif case == "pause":
                    res = c.run(a.jobs, "bench", epochs=1, pause_job=True)
                else:
                    raise SystemExit(f"unknown case {case!r}")
                res["round"] = r
                runs[case].append(res)
                print(f"round {r} {case}: server {res['server_cpu_s']:.1f} CPU-s, jobs "
                      f"{[round(_rate(j)) for j in res['jobs']]} samples/s", file=sys.stderr)
    finally:
        if throttle is not None:
            throttle.close()

    # -- figures, per round against the same round's solo / shared -------------------------------------
    def by_round(case: str) -> dict[int, dict]:
        return {x["round"]: x for x in runs.get(case, [])}

    solo, shared, unshared, pause = by_round("solo"), by_round("shared"), by_round("unshared"), by_round("pause")
    out: dict = {"settings": {k: v for k, v in vars(a).items() if k not in (
                     "client_role", "address", "result", "share", "cpus", "until_stop", "job_pause_after", "job_pause_s")},
                 "images": n, "host": platform.node(), "cpus": len(ncpu), "load_start": load_start,
                 "load_end": os.getloadavg(), "throttle": throttle.kind if throttle else "pinned"}
    figures: dict[str, list[float]] = {"shared_cpu_ratio": [], "shared_job_ratio_min": [], "unshared_cpu_ratio": [],
                                       "unshared_job_ratio_min": [], "pause_others_ratio_min": []}
    exact: list[bool] = []
    copies: list[int] = []
    for r, s in solo.items():
        base_rate, base_cpu = _rate(s["jobs"][0]), s["server_cpu_s"]
        if r in shared:
            figures["shared_cpu_ratio"].append(shared[r]["server_cpu_s"] / base_cpu)
            figures["shared_job_ratio_min"].append(min(_rate(j) for j in shared[r]["jobs"]) / base_rate)
            copies.append(sum(j["stats"].get("shared_batches", 0) for j in shared[r]["jobs"]))
        if r in unshared:
            figures["unshared_cpu_ratio"].append(unshared[r]["server_cpu_s"] / base_cpu)
            figures["unshared_job_ratio_min"].append(min(_rate(j) for j in unshared[r]["jobs"]) / base_rate)
    for r, p in pause.items():
        paused = p["jobs"][-1]
        t_from, t_to = paused["pause"]["start"] + a.settle_s, paused["pause"]["end"]
        ref = shared.get(r)
        if ref is not None and t_to > t_from:
            figures["pause_others_ratio_min"].append(min(
                _rate(j, t_from, t_to) / _rate(rj) for j, rj in zip(p["jobs"][:-1], ref["jobs"][:-1])))
        exact.append(paused["keys"][:1] == plan)
    out["figures"] = {k: _span(v) for k, v in figures.items()}
    out["figures"]["targets"] = {"shared_cpu_ratio": "<= 1.3", "shared_job_ratio_min": ">= 0.8",
                                 "pause_others_ratio_min": ">= 0.9"}
    out["pause_exact_epoch_in_order"] = exact
    out["shared_copies_per_round"] = copies
    out["runs"] = {case: [{"round": x["round"], "server_cpu_s": x["server_cpu_s"],
                           "job_samples_per_s": [_rate(j) for j in x["jobs"]],
                           "job_cpu_s": [j["cpu_s"] for j in x["jobs"]],
                           "shared_batches": [j["stats"].get("shared_batches", 0) for j in x["jobs"]]}
                          for x in xs] for case, xs in runs.items()}
    print("\nfigure                       median   min     max    (target)", file=sys.stderr)
    for k, v in out["figures"].items():
        if k != "targets" and v:
            print(f"{k:28s} {v['median']:6.2f} {v['min']:6.2f} {v['max']:6.2f}   "
                  f"{out['figures']['targets'].get(k, '')}", file=sys.stderr)
    print(f"paused job got exactly its epoch in order: {exact}", file=sys.stderr)
    dest = Path(a.out) if a.out else Path(__file__).parent / "results" / f"share-{platform.node()}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(out, indent=1))
    print(json.dumps({k: out[k] for k in ("figures", "pause_exact_epoch_in_order", "shared_copies_per_round")}))
    return out


if __name__ == "__main__":
    main()
