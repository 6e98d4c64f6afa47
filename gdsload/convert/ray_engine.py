"""`gdsload convert --engine ray`: the local engine's plan, its shard units run as Ray tasks.

Invariant: the driver lists the source, plans the shards, prepares DST and writes the manifest and
`rejected.jsonl` exactly as the local engine does (`engine.convert`); only the shard units
(`write_shard`: a slice of samples in, one finished shard with both indexes and its done record
out) run elsewhere, one Ray task each. The output is therefore byte-identical to the local
engine's for the same input and options; the manifest differs only in `created.at` and
`created.seconds`.

Failure handling: a task whose worker or node dies, or that raises `OSError`, is retried
(`MAX_RETRIES`); a shard is published only when complete and the manifest is written last, so
a lost task leaves at most hidden `.NAME.*.tmp-PID` files in a local DST, removed once every
unit has finished (or by `--resume`), and at a URL an unfinished upload that never appears as an
object (`gdsload.io.store`). A unit that still fails raises `GdsloadError` once the tasks still
in flight are cancelled and have ended (`CANCEL_WAIT_S` at most: none writes into DST after the
run returns) and their temporaries are removed; the done records of finished shards stay, and
`--resume` continues.

Where things run: tasks read inputs and write DST by the path or URL the driver was given. With
fsspec URLs (`s3://`, `gs://`, ...) for both, every node reads and writes the object store
directly and nothing needs to be shared but credentials (each worker resolves them as fsspec does:
environment, config files, instance roles). Local paths work on more than one node only on a
filesystem every node mounts at the same path (relative paths resolve in the driver's working
directory, which must then exist on every node).

Performance: one task per shard, at most `IN_FLIGHT_PER_CPU` x cluster CPUs submitted at once (a
unit's arguments are its sample list, ~200 bytes per sample); each task holds one sample at a
time. Progress is reported per finished shard.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from gdsload.convert.engine import ConvertOptions, convert, remove_temporaries, write_shard
from gdsload.convert.sources import Sample
from gdsload.errors import GdsloadError, InputError, require
from gdsload.io import is_remote, local_path
from gdsload.io.store import open_store

MAX_RETRIES = 3  # retries after the first attempt, per shard unit
IN_FLIGHT_PER_CPU = 2  # tasks submitted per cluster CPU, so a freed CPU never waits on the driver
CANCEL_WAIT_S = 30.0  # how long a failed run waits for the tasks it cancelled to end
FAULTS_ENV = "GDSLOAD_RAY_FAULTS"  # test hook: a folder of fault markers, see `_fault_hook`

log = logging.getLogger(__name__)


def import_ray() -> Any:
    """Ray, or `MissingDependencyError` with the install hint."""
    return require("ray", extra="ray", purpose="gdsload convert --engine ray")


# -- the task ------------------------------------------------------------------------------------
def _fault_hook(name: str) -> Callable[[int, int], None] | None:
    """Fault injection for tests: `$GDSLOAD_RAY_FAULTS/NAME.exit` makes the task writing shard
    NAME exit its worker process mid-shard (`NAME.hang`: sleep for an hour) the first time it
    reports progress. The marker is renamed (atomic) before it fires, so exactly one attempt fails.
    """
    folder = os.environ.get(FAULTS_ENV)
    if not folder:
        return None

    def report(n: int, nbytes: int) -> None:
        for kind in ("exit", "hang"):
            marker = Path(folder) / f"{name}.{kind}"
            try:
                os.rename(marker, marker.with_name(f"{marker.name}-fired"))
            except FileNotFoundError:
                continue
            if kind == "exit":
                os._exit(1)  # the shard's temporary tar is left behind, half written
            time.sleep(3600)

    return report


def run_unit(dst: str, name: str, samples: list[Sample], validate: bool, cwd: str) -> dict[str, Any]:
    """One shard unit inside a Ray worker: `write_shard`, with relative inputs read from `cwd`."""
    if any(r.path and not is_remote(r.path) and not local_path(r.path).is_absolute() for s in samples for _, r in s.fields):
        if not os.path.isdir(cwd):
            raise InputError(
                f"shard {name}: relative input paths need the driver's working directory {cwd} on "
                f"every node; give the source as an absolute path"
            )
        os.chdir(cwd)  # a Ray worker runs one task at a time, so this is the task's own cwd
    try:
        return write_shard(dst, name, samples, validate, _fault_hook(name))
    except BaseException:  # `ray.cancel` raises KeyboardInterrupt here: leave no temporary behind
        remove_temporaries(open_store(dst), [name])
        raise


# -- the runner ----------------------------------------------------------------------------------
class RaySession:
    """A Ray connection made on first use: `address` (or `$RAY_ADDRESS`) joins a cluster, else a
    private local instance with `num_cpus` is started; `close()` ends what `ensure()` began. A
    process already connected to Ray is used as it is and left connected."""

    def __init__(self, address: str | None, num_cpus: int):
        self.address = address or os.environ.get("RAY_ADDRESS") or None
        self.num_cpus = num_cpus
        self._ray: Any = None
        self._started = False

    def ensure(self) -> Any:
        if self._ray is None:
            ray = import_ray()
            if not ray.is_initialized():
                kw: dict[str, Any] = {"logging_level": logging.WARNING}
                if self.address:
                    ray.init(address=self.address, **kw)
                else:
                    ray.init(address="local", num_cpus=self.num_cpus, include_dashboard=False, **kw)
                self._started = True
            self._ray = ray
        return self._ray

    def close(self) -> None:
        if self._started:
            self._ray.shutdown()
        self._ray, self._started = None, False


class RayRunner:
    """`engine.UnitRunner` that runs each shard unit as a Ray task (see the module docstring)."""

    def __init__(self, session: RaySession):
        self.session = session
        self.cpus = 0  # CPUs of the cluster the last run used

    def __call__(self, dst: str, units: list[tuple[str, list[Sample]]], validate: bool, workers: int,
                 report: Callable[[int, int], None]) -> Iterator[str]:
        if not units:
            return
        ray = self.session.ensure()
        task = ray.remote(max_retries=MAX_RETRIES, retry_exceptions=[OSError])(run_unit)
        self.cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
        store = open_store(dst)
        dst_abs = store.root if is_remote(dst) else str(Path(store.root).absolute())
        cwd = os.getcwd()
        sizes = dict(units)
        queue = list(reversed(units))
        pending: dict[Any, str] = {}
        try:
            while queue or pending:
                while queue and len(pending) < IN_FLIGHT_PER_CPU * self.cpus:
                    name, samples = queue.pop()
                    pending[task.remote(dst_abs, name, samples, validate, cwd)] = name
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)
                for ref in ready:
                    name = pending.pop(ref)
                    result = self._result(ray, ref, name)
                    yield name
                    entry = result["entry"]
                    report(len(sizes[name]), entry["bytes"] if entry else 0)
        finally:
            if pending:  # an error or Ctrl-C: stop the rest (their writers abort)
                for ref in pending:
                    ray.cancel(ref)
                # A cancel only asks: wait for the tasks to end, so that none is still writing into
                # DST after this returns (a `--resume` started next would race it).
                _, running = ray.wait(list(pending), num_returns=len(pending), timeout=CANCEL_WAIT_S)
                if running:
                    log.warning("%d cancelled Ray task(s) still running after %.0f s; --resume removes "
                                "what they leave", len(running), CANCEL_WAIT_S)
            remove_temporaries(store, [name for name, _ in units], any_process=True)

    @staticmethod
    def _result(ray: Any, ref: Any, name: str) -> dict[str, Any]:
        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as exc:  # the unit raised (after retries, for OSError)
            cause = exc.cause if isinstance(exc.cause, BaseException) else exc
            if hasattr(cause, "add_note"):  # Python 3.11+
                cause.add_note(f"while writing shard {name} in a Ray task")
            raise cause from None
        except ray.exceptions.RayError as exc:  # worker or node lost more than MAX_RETRIES times
            raise GdsloadError(
                f"shard {name}: its Ray task was lost {MAX_RETRIES + 1} time(s) ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}); the finished shards are kept, "
                f"re-run with --resume to continue"
            ) from exc


# -- entry point ---------------------------------------------------------------------------------
def convert_ray(src: str, dst: str | Path, opts: ConvertOptions | None = None, *,
                address: str | None = None) -> dict[str, Any]:
    """`engine.convert` with the shard units run as Ray tasks; the same summary, plus `engine`.

    `address`: a Ray cluster to join (as `ray.init(address=...)`); default `$RAY_ADDRESS`, else a
    local instance with `opts.workers` CPUs (default all cores), shut down when done. Ray starts
    only once there are shards to write.
    """
    import_ray()  # fail before any work when Ray is missing
    opts = opts or ConvertOptions()
    session = RaySession(address, opts.workers or os.cpu_count() or 1)
    runner = RayRunner(session)
    try:
        r = convert(src, dst, opts, runner=runner)
    finally:
        session.close()
    r["engine"] = "ray"
    r["workers"] = runner.cpus or r["workers"]
    return r
