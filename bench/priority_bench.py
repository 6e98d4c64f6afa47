"""Priorities in the feed (issue 49): a high job among three low ones, servers capacity-limited.

Servers are limited as `remote_scale_bench` limits them (`Throttle`: a cgroup v1 CPU quota of
`--server-cores` each for decoded runs and `--raw-server-cores` for raw ones, period
`--quota-period-ms`, else a SIGSTOP/SIGCONT duty cycle; with `--pin`, the default on >= 2 CPUs,
the servers run on CPU 1 and the clients on CPU 0), so the servers, not the clients, bound every
run: each job is a process of its own (a `RemoteLoader` striping over the `--servers` servers).
Each phase reports the clients' CPU seconds as a share of their one core and the servers' (from
/proc) as a share of their limit (`cpu`): the servers bound a run when theirs is near 1 and the
clients' well below (raw runs at 0.25 core per server were client-bound: four jobs' clients used
their whole core, partly checking each epoch against a local loader that read the whole dataset;
the check now takes the epoch's keys from its plan, reading nothing). Each round (`--rounds`,
default 5), per payload (raw, decoded), runs in a rotating order:

- solo:      the high job (priority 10) alone reads `--batches` (raw: `--raw-batches`) batches flat out: its rate and its
             median batch time (the time between batches).
- contended: three low jobs (priority 0) read flat out; after `--warmup-s` (decoded:
             `--decoded-warmup-s`) the high job reads
             `--batches` batches (a) flat out and (b) as a training loop whose step takes 1.1x
             its solo batch time (wall per batch; a sleep per batch): its rate against solo (target
             >= 0.9x, median of the rounds) and its data stall (the loop's wait over its wall
             time; target <= 5 %). The same loop alone (no low job, after solo) gives the stall
             the client's own delivery costs (`solo.training_stall`): measured 14-16 % raw (each
             75-batch epoch begins with a new pass: 0.3-0.4 s at a twentieth of a core) and 6-8 %
             decoded (the first blocks), so the contended stall is read against it. After the high job leaves, how long until the low jobs' summed
             rate over a window of about 10 of their batches (at least 1 s) is back to 0.9x their
             rate over the warm-up before the high job came (target: 2 s raw, 5 s decoded);
             `low_rates` has both rates and the window (the lows stay `--after-s`, decoded
             `--decoded-after-s`, after the high job left).
- equal:     four jobs at priority 0 read flat out; after the warm-up of the contended phase
             (from the last job's first batch) each job's batches over the next `--equal-s`
             (decoded: times `--equal-decoded-factor`, ~4 batches/s in all), max/min (target <=
             1.2x). The warm-up leaves out the start: the four jobs' first decoded batches come
             6.5-12.8 s after they start (DALI's first run, four jobs' first decodes at a quarter
             core), and within a level a job that comes starts level with the least-served job
             there, so the job first served is ahead in seconds and gets fewer batches while the
             others catch up. `since_first` keeps the older measure (from the last job's first
             batch to the first job's last), `per_server` each job's batches, stalls and failures
             per server (whole run), `first_wait_s` each job's wait for its first batch.

Every job checks every epoch it finished against the local loader's keys in plan order (a
partial last epoch as a prefix); any difference fails the run. The servers' memory in use
(`ServerInfo.memory_in_use_bytes`) is sampled every 0.2 s and compared with `--max-memory`.

The lead's run (a quiet 2-core machine, ~37 min):

    python bench/priority_bench.py --rounds 5 --out bench/results/priority-cpu2.json

Smoke run (one round, tiny data, < 2 min; its figures mean nothing):

    python bench/priority_bench.py --tiny

Prints a table and writes JSON (`--out`, default bench/results/priority-<host>.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from remote_bench import _free_port, _self_cpu_s, image_dataset
from remote_scale_bench import Throttle, _wait_serving, popen_pinned

from gdsload.service.client.stripe.policy import StripePolicy

HIGH, LOW = 10, 0


# -- one job (a child process) ------------------------------------------------------------------------
def run_job(spec: dict) -> dict:
    """Read as `spec` says (a RemoteLoader of its own); return batch times, waits, CPU, exactness."""
    from gdsload import RemoteLoader
    from gdsload.loader.dataloader import DataLoader, Dataset

    kw = dict(dataset="imgs", batch_size=spec["batch_size"], shuffle=True, seed=0, decode=spec["decoded"],
              output="numpy")
    if spec["decoded"]:
        from gdsload.decode.image import ImageTransform

        kw["transform"] = ImageTransform(size=64, train=False)
    loader = RemoteLoader(spec["addresses"], priority=spec["priority"], job=spec["name"], stall_timeout_s=30,
                          prefetch_next_epoch=spec["priority"] == HIGH, **kw)  # (the training job: the lows
    # stand for preprocessing passes, which read one epoch, and loop here only to stay present)
    plan = DataLoader(Dataset(spec["dataset"]), batch_size=spec["batch_size"], shuffle=True, seed=0,
                      decode=False, device="cpu", output="numpy")
    every = plan.dataset.shards.keys()  # by sample id; an epoch's keys are its plan's ids' (nothing read:
    stop = Path(spec["stop"])  # iterating the local loader read the whole dataset per epoch, client CPU)
    times, exact, epochs, waits = [], True, 0, []
    c0, t_wait, first_wait = _self_cpu_s(), 0.0, 0.0
    while True:
        want = [every[i] for ids in plan.plan.batches(epochs) for i in ids.tolist()]
        got: list[str] = []
        it = iter(loader)
        while True:
            t0 = time.monotonic()
            try:
                batch = next(it)
            except StopIteration:
                break
            waited = time.monotonic() - t0
            t_wait += waited
            first_wait = t_wait if not times else first_wait
            if times and waited > 0.01:  # (where a training loop's stall comes from: batch, seconds)
                waits.append((len(times), round(waited, 4)))
            got += list(batch["__key__"])
            times.append(time.monotonic())
            if len(times) == 1:
                Path(f"{spec['stop']}.started-{spec['name']}").touch()  # (the orchestrator times from here)
            if spec["step_s"]:
                time.sleep(spec["step_s"])
            if (spec["batches"] and len(times) >= spec["batches"]) or stop.exists():
                break
        exact = exact and got == want[:len(got)] and (len(got) == len(want) or len(times) >= spec["batches"]
                                                        or stop.exists())
        if (spec["batches"] and len(times) >= spec["batches"]) or stop.exists():
            break
        epochs += 1
    stats = loader.stats()
    loader.close()
    plan.close()
    return {"name": spec["name"], "times": times, "wait_s": t_wait - first_wait, "first_wait_s": first_wait,
            "waits": waits,
            "cpu_s": _self_cpu_s() - c0,
            "exact": exact, "epochs": epochs, "pauses": sum(r.get("pauses", 0) for r in stats["servers"].values()),
            "paused_s": sum(r.get("paused_s", 0.0) for r in stats["servers"].values()),
            "servers_needed": stats.get("servers_needed"),
            "per_server": {a: {k: r.get(k, 0) for k in ("batches", "duplicates", "stalls", "failures")}
                           for a, r in stats["servers"].items()}}


class Jobs:
    """Job processes on the client CPU; `start(name, priority, ...)`, `stop_all()`, `results()`."""

    def __init__(self, a, addresses: list[str], dataset: Path, work: Path, cpus, servers: list[int]):
        self.a, self.addresses, self.dataset, self.work, self.cpus = a, addresses, dataset, work, cpus
        self.servers = servers  # the server processes' pids
        self.cores = a.server_cores  # each server's CPU limit now (per payload)
        self.fill = len(addresses) * StripePolicy().stripe_batches  # the first block of each server
        self.procs: dict[str, tuple[subprocess.Popen, Path]] = {}
        self.stop = work / f"stop-{time.monotonic_ns()}"

    def start(self, name: str, priority: int, *, decoded: bool, batches: int = 0, step_s: float = 0.0) -> None:
        spec = dict(addresses=self.addresses, dataset=str(self.dataset), batch_size=self.a.batch_size,
                    decoded=decoded, priority=priority, name=name, batches=batches, step_s=step_s,
                    stop=str(self.stop))
        out = self.work / f"job-{name}-{time.monotonic_ns()}.json"
        proc = popen_pinned([sys.executable, __file__, "--job", json.dumps(spec), "--job-out", str(out)], self.cpus)
        self.procs[name] = (proc, out)

    def cpu(self) -> Cpu:
        return Cpu(self.servers, self.cores)

    def started(self, *names: str, timeout: float = 120) -> None:
        """Wait until each job `names` has its first batch (imports and plans are not timed)."""
        deadline = time.monotonic() + timeout
        while not all(Path(f"{self.stop}.started-{n}").exists() for n in names):
            if time.monotonic() > deadline:
                raise SystemExit(f"jobs {names} did not start within {timeout} s")
            time.sleep(0.05)

    def wait(self, name: str, timeout: float = 900) -> dict:
        proc, out = self.procs.pop(name)
        if proc.wait(timeout=timeout) != 0:
            raise SystemExit(f"job {name} failed with status {proc.returncode}")
        return json.loads(out.read_text())

    def stop_all(self) -> dict[str, dict]:
        self.stop.touch()
        done = {name: self.wait(name) for name in list(self.procs)}
        self.stop.unlink()
        for marker in self.work.glob(f"{self.stop.name}.started-*"):
            marker.unlink()
        return done


def _rate(times: list[float], t0: float | None = None, t1: float | None = None) -> float:
    ts = [t for t in times if (t0 is None or t >= t0) and (t1 is None or t <= t1)]
    return (len(ts) - 1) / (ts[-1] - ts[0]) if len(ts) >= 2 and ts[-1] > ts[0] else 0.0


def _recovery_s(lows: list[dict], before: float, after: float, span_s: float) -> tuple[float | None, dict]:
    """Seconds after `after` (the high job left) until the low jobs' summed rate over a window is
    back to 0.9x their rate before `before` (the high job came), and the figures: the rate before
    is over the warm-up's last `span_s` (all lows reading), the window holds about 10 of their
    batches at that rate (at least 1 s: a 1-s window of a decoded job's few batches/s measured its
    phase, not its rate), the rate after is over the window. None: not within the run (decoded
    runs keep the lows `--decoded-after-s`, long enough for a window from 5 s after)."""
    times = sorted(t for r in lows for t in r["times"])
    earlier = sum(1 for t in times if before - span_s <= t < before) / span_s
    info = {"rate_before": earlier, "window_s": None, "rate_after": None}
    if not earlier:
        return None, info
    w = info["window_s"] = max(1.0, 10.0 / earlier)
    late = [t for t in times if t >= after]
    info["rate_after"] = (sum(1 for t in late if t >= late[-1] - w) / w) if late else 0.0  # its last window
    for t in late:
        if t + w > late[-1]:
            break
        if sum(1 for u in late if t <= u < t + w) / w >= 0.9 * earlier:
            return t - after, info
    return None, info


def _proc_cpu_s(pids: list[int]) -> float:
    """CPU seconds the processes `pids` used so far (/proc; 0 where unreadable)."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            pass
    return total


class Cpu:
    """CPU used by the clients (the jobs' own figures) and the servers (/proc) over one phase,
    each as a share of what its side may use (clients: one core; servers: their limit): which
    side bounded the run (the servers must, near 1.0, the clients well below)."""

    def __init__(self, servers: list[int], limit_cores: float):
        self.servers, self.limit = servers, limit_cores
        self.t0, self.s0 = time.monotonic(), _proc_cpu_s(servers)

    def done(self, jobs: list[dict]) -> dict:
        wall = time.monotonic() - self.t0
        server_s = _proc_cpu_s(self.servers) - self.s0
        client_s = sum(r["cpu_s"] for r in jobs)
        return {"wall_s": wall, "client_cpu_s": client_s, "server_cpu_s": server_s,
                "client_share": client_s / wall if wall else None,
                "server_share": server_s / (wall * self.limit * len(self.servers)) if wall and self.limit else None}


# -- the scenarios ------------------------------------------------------------------------------------
def solo(jobs: Jobs, decoded: bool, batches: int) -> dict:
    cpu = jobs.cpu()
    jobs.start("high", HIGH, decoded=decoded, batches=batches)
    r = jobs.wait("high")
    used = cpu.done([r])
    gaps = [b - a for a, b in zip(r["times"], r["times"][1:])]
    rate = _rate(r["times"])
    # The training loop's step is 1.1x the solo batch time, its wall per batch (1 / rate): a stripe
    # delivers batches in bursts, so the median gap between batches is no batch time (raw, in
    # bench/results/priority-cpu2.json: 0.04-0.09 ms against 2-4 ms per batch, which made the
    # "training loop" read flat out and its stall meaningless).
    return {"rate": rate, "batch_s": 1 / rate if rate else 0.0,
            "median_batch_s": statistics.median(gaps) if gaps else 0.0,
            "cpu_s": r["cpu_s"], "exact": r["exact"], "cpu": used}


def _after_fill(r: dict, took: float, fill: int) -> float | None:
    """The loop's stall without its waits for the first `fill` batches (the servers' first
    blocks, which come at one server's pace each: a stripe's fill, paid once per run)."""
    return sum(w for i, w in r["waits"] if i >= fill) / took if took else None


def solo_training(jobs: Jobs, decoded: bool, batches: int, step_s: float) -> tuple[float, list]:
    """The training loop of `contended` with no other job: its data stall alone (the client's own
    delivery: raw epochs of 75 batches each begin with a new pass, ~0.3-0.4 s at a twentieth of a
    core; decoded, the second server's first block), the floor the contended stall is read against."""
    jobs.start("high", HIGH, decoded=decoded, batches=batches, step_s=step_s)
    r = jobs.wait("high")
    took = r["times"][-1] - r["times"][0] if len(r["times"]) >= 2 else 0.0
    return (r["wait_s"] / took if took else 0.0), r["waits"]


def contended(jobs: Jobs, decoded: bool, batches: int, step_s: float, warmup_s: float, after_s: float) -> dict:
    for i in range(3):
        jobs.start(f"low{i}", LOW, decoded=decoded)
    jobs.started("low0", "low1", "low2")
    warm = time.monotonic()
    time.sleep(warmup_s)
    came = time.monotonic()
    cpu = jobs.cpu()
    jobs.start("high", HIGH, decoded=decoded, batches=batches, step_s=step_s)
    high = jobs.wait("high")
    left = time.monotonic()
    time.sleep(after_s)
    lows = list(jobs.stop_all().values())
    used = cpu.done([high] + lows)  # (the lows' CPU from their start: the clients' share is an upper bound)
    took = high["times"][-1] - high["times"][0] if len(high["times"]) >= 2 else 0.0
    recovery, rates = _recovery_s(lows, came, left, max(1.0, came - warm - 1.0))
    return {"rate": _rate(high["times"]), "stall": high["wait_s"] / took if took else None, "waits": high["waits"],
            "stall_after_fill": _after_fill(high, took, jobs.fill),
            "recovery_s": recovery, "low_rates": rates, "cpu": used,
            "exact": high["exact"] and all(r["exact"] for r in lows),
            "high_cpu_s": high["cpu_s"], "low_cpu_s": sum(r["cpu_s"] for r in lows),
            "low_pauses": sum(r["pauses"] for r in lows), "low_paused_s": sum(r["paused_s"] for r in lows),
            "servers_needed": high["servers_needed"]}


def equal(jobs: Jobs, decoded: bool, seconds: float, warmup_s: float) -> dict:
    for i in range(4):
        jobs.start(f"eq{i}", LOW, decoded=decoded)
    jobs.started("eq0", "eq1", "eq2", "eq3")
    time.sleep(warmup_s)  # (the contended phase's warm-up: see `equal` in the module docstring)
    cpu = jobs.cpu()
    t0 = time.monotonic()
    time.sleep(seconds)
    t1 = time.monotonic()
    done = list(jobs.stop_all().values())
    used = cpu.done(done)
    counts = [sum(1 for t in r["times"] if t0 <= t <= t1) for r in done]
    first = max(r["times"][0] for r in done if r["times"])  # the old measure: from the last job's first batch
    last = min(r["times"][-1] for r in done if r["times"])
    since_first = [sum(1 for t in r["times"] if first <= t <= last) for r in done]
    return {"counts": counts, "max_over_min": max(counts) / max(1, min(counts)),
            "since_first": since_first, "since_first_max_over_min": max(since_first) / max(1, min(since_first)),
            "first_wait_s": [r["first_wait_s"] for r in done], "per_server": [r["per_server"] for r in done],
            "exact": all(r["exact"] for r in done), "cpu_s": sum(r["cpu_s"] for r in done), "cpu": used}


class MemoryWatch:
    """Samples every server's `memory_in_use_bytes` every 0.2 s; `peak` and `limit` per server."""

    def __init__(self, addresses: list[str]):
        import grpc

        from gdsload.v1 import feed_pb2 as pb
        from gdsload.v1 import feed_pb2_grpc as pb_grpc

        self.peak = dict.fromkeys(addresses, 0)
        self.limit: dict[str, int] = {}
        self._stop = threading.Event()
        chans = {a: grpc.insecure_channel(a) for a in addresses}

        def run():
            while not self._stop.wait(0.2):
                for a, ch in chans.items():
                    try:
                        info = pb_grpc.FeedStub(ch).GetServerInfo(pb.GetServerInfoRequest(), timeout=2)
                    except grpc.RpcError:
                        continue
                    self.peak[a] = max(self.peak[a], info.memory_in_use_bytes)
                    self.limit[a] = info.max_memory_bytes
            for ch in chans.values():
                ch.close()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def close(self) -> dict:
        self._stop.set()
        self._thread.join(10)
        return {a: {"peak": self.peak[a], "limit": self.limit.get(a)} for a in self.peak}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=2400)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--batches", type=int, default=120,
                    help="batches the high job reads per decoded run (60 before: the first two blocks' fill, when "
                         "batches come at one server's pace, was 4-6 %% of the loop's time on its own)")
    ap.add_argument("--raw-batches", type=int, default=300,
                    help="batches the high job reads per raw run (60 at 0.05 core gave solo rates of 14 to 51/s "
                         "across rounds: a run of 1-4 s measured its start)")
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--server-cores", type=float, default=0.25, help="each server's CPU limit, decoded runs")
    ap.add_argument("--raw-server-cores", type=float, default=0.05,
                    help="each server's CPU limit, raw runs (lower: four raw clients on one core outran 0.25)")
    ap.add_argument("--equal-decoded-factor", type=float, default=4.0,
                    help="the equal phase of decoded runs is this many times --equal-s (~4 batches/s in all, handed out "
                         "in blocks of 4 a job: at 2x, ~30 batches a job, one block more or less is 1.15x)")
    ap.add_argument("--max-memory", default="1GB", help="each server's --max-memory")
    ap.add_argument("--payloads", default="raw,decoded")
    ap.add_argument("--warmup-s", type=float, default=4.0)
    ap.add_argument("--after-s", type=float, default=8.0, help="low jobs kept after the high one left")
    ap.add_argument("--decoded-warmup-s", type=float, default=10.0,
                    help="decoded runs: the low jobs' warm-up (their pipelines built before their rate is taken)")
    ap.add_argument("--decoded-after-s", type=float, default=18.0,
                    help="decoded runs: low jobs kept after the high one left (a window of ~10 of their ~1 "
                         "batches/s, from up to 5 s after: the 8 s of raw runs could not show a recovery)")
    ap.add_argument("--equal-s", type=float, default=15.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--throttle", choices=("auto", "cgroup", "sigstop"), default="auto")
    ap.add_argument("--quota-period-ms", type=float, default=20.0,
                    help="the cgroup quota's period (the kernel's smallest quota is 1 ms: 0.05 core needs <= 20 ms;"
                         " a shorter period is steadier than 100 ms, which held a server still 95 ms at a time)")
    ap.add_argument("--pin", choices=("auto", "yes", "no"), default="auto")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--tiny", action="store_true", help="a smoke run: small data, one round, short phases")
    ap.add_argument("--job", help=argparse.SUPPRESS)
    ap.add_argument("--job-out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.job:
        Path(a.job_out).write_text(json.dumps(run_job(json.loads(a.job))))
        return {}
    if a.tiny:
        a.images, a.batch_size, a.batches, a.raw_batches, a.rounds = 64, 4, 12, 12, 1
        a.warmup_s, a.after_s, a.equal_s = 1.0, 2.0, 2.0
        a.decoded_warmup_s, a.decoded_after_s = 1.0, 2.0
    work = Path(a.workdir or tempfile.mkdtemp(prefix="gdsload-priority-"))
    work.mkdir(parents=True, exist_ok=True)
    dataset = image_dataset(work, a.images, a.tiny)
    pin = a.pin == "yes" or (a.pin == "auto" and (os.cpu_count() or 1) >= 2)
    server_cpus, client_cpus = ({1}, {0}) if pin else (None, None)
    throttle = Throttle(a.throttle, period_ms=a.quota_period_ms)
    procs, addresses = [], []
    out: dict = {"host": platform.node(), "cpus": os.cpu_count(), "throttle": throttle.kind, "args": vars(a),
                 "rounds": []}
    try:
        for _ in range(a.servers):
            address = f"127.0.0.1:{_free_port()}"
            with open(work / "servers.log", "ab") as err:
                proc = popen_pinned([sys.executable, "-m", "gdsload.service", str(dataset.parent), "--listen", address,
                                     "--log-level", "WARNING", "--grace", "1", "--max-memory", a.max_memory],
                                    server_cpus, stdout=subprocess.DEVNULL, stderr=err)
            procs.append(proc)
            _wait_serving(address, proc, work / "servers.log")
            throttle.limit(proc.pid, a.server_cores)
            addresses.append(address)
        jobs = Jobs(a, addresses, dataset, work, client_cpus, [p.pid for p in procs])
        memory = MemoryWatch(addresses)
        payloads = a.payloads.split(",")
        for r in range(a.rounds):
            row: dict = {}
            for payload in payloads[r % len(payloads):] + payloads[:r % len(payloads)]:  # rotating order
                decoded = payload == "decoded"
                jobs.cores = a.server_cores if decoded else a.raw_server_cores
                for proc in procs:  # raw is held harder: the servers, not the four clients, must bound it
                    throttle.limit(proc.pid, jobs.cores)
                batches = a.batches if decoded else a.raw_batches
                s = solo(jobs, decoded, batches)
                s["training_stall"], s["training_waits"] = solo_training(jobs, decoded, batches, 1.1 * s["batch_s"])
                warmup_s, after_s = (a.decoded_warmup_s, a.decoded_after_s) if decoded else (a.warmup_s, a.after_s)
                c = contended(jobs, decoded, batches, 0.0, warmup_s, after_s)
                t = contended(jobs, decoded, batches, 1.1 * s["batch_s"], warmup_s, after_s)
                e = equal(jobs, decoded, a.equal_s * (a.equal_decoded_factor if decoded else 1.0), warmup_s)
                row[payload] = {"solo": s, "contended": c, "training": t, "equal": e,
                                "rate_vs_solo": c["rate"] / s["rate"] if s["rate"] else None}
                print(f"round {r + 1} {payload}: high {c['rate']:.1f}/s vs solo {s['rate']:.1f}/s "
                      f"({row[payload]['rate_vs_solo'] or 0:.2f}x), training stall {100 * (t['stall'] or 0):.1f} % "
                      f"(after the fill {100 * (t['stall_after_fill'] or 0):.1f} %) "
                      f"(alone {100 * s['training_stall']:.1f} %), "
                      f"low recovery {c['recovery_s']} s, equal max/min {e['max_over_min']:.2f}, exact "
                      f"{s['exact'] and c['exact'] and t['exact'] and e['exact']}; CPU share contended: clients "
                      f"{c['cpu']['client_share'] or 0:.2f} of a core, servers {c['cpu']['server_share'] or 0:.2f} "
                      f"of their limit", flush=True)
            out["rounds"].append(row)
        out["memory"] = memory.close()
    finally:
        throttle.close()
        for proc in procs:
            proc.kill()
            proc.wait(timeout=15)
    out["summary"] = {p: {
        "rate_vs_solo_median": statistics.median(r[p]["rate_vs_solo"] or 0 for r in out["rounds"]),
        "training_stall_median": statistics.median(r[p]["training"]["stall"] or 0 for r in out["rounds"]),
        "training_stall_after_fill_median": statistics.median(r[p]["training"]["stall_after_fill"] or 0
                                                              for r in out["rounds"]),
        "solo_training_stall_median": statistics.median(r[p]["solo"]["training_stall"] for r in out["rounds"]),
        "recovery_s": [r[p]["contended"]["recovery_s"] for r in out["rounds"]],
        "client_share_median": statistics.median(r[p]["contended"]["cpu"]["client_share"] or 0 for r in out["rounds"]),
        "server_share_median": statistics.median(r[p]["contended"]["cpu"]["server_share"] or 0 for r in out["rounds"]),
        "equal_max_over_min_median": statistics.median(r[p]["equal"]["max_over_min"] for r in out["rounds"]),
        "equal_since_first_max_over_min_median": statistics.median(r[p]["equal"]["since_first_max_over_min"]
                                                                   for r in out["rounds"]),
        "all_exact": all(r[p][k]["exact"] for r in out["rounds"] for k in ("solo", "contended", "training", "equal")),
    } for p in a.payloads.split(",")}
    print(json.dumps(out["summary"], indent=1))
    path = Path(a.out or Path(__file__).parent / "results" / f"priority-{platform.node()}.json")
    if not a.tiny or a.out:
        path.write_text(json.dumps(out, separators=(",", ":")) + "\n")  # (compact: the tree travels to the GPU)
        print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
