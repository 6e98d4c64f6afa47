"""`gdsload.process(src, dst, fn, ...)`: the driver of a pass.

It opens the source dataset, checks the options, prepares DST (new or empty; `resume=True`
continues the interrupted pass recorded there; `overwrite=True` replaces a gdsload dataset),
runs one unit per input shard (`gdsload.preprocess.unit`: here one after another, in `workers`
processes, or as Ray tasks with `engine="ray"`), then checks the units' outputs against each
other (the writer's field rule: the first output's fields; keys unique over the pass) and writes
`rejected.jsonl` and the manifest, last. Units are independent and their shards named by unit,
so the bytes are the same whichever way they run.

The resume record (`STATE_DIR/process.json`): the source's id (`dataset_id` of its shards) and
version, the options that decide the output (`PassOptions.record`) and `fn`'s `module:qualname`.
`resume=True` with another record is refused naming what differs; with the same, finished units
are kept and the others run again from their last recorded shard. A finished pass with the
same record is reported complete, nothing redone.

`feed=` decodes on a feed server: a `gdsload.service.client.passfeed.WindowFeed` (what
`gdsload.process(feed="HOST:PORT", priority=...)` makes of an address: this layer does not
import the feed). Each unit's windows come from one window request (`BatchRequest.windows`) at
the pass's priority, decoded there by the same code (`gdsload.decode.passmedia`), so the output
is the same, byte for byte; the source's manifest and indexes are still read here (the resume
record, the items, progress).

`device=` (frames only): on a GPU host a pass run here decodes its frames with NVDEC
(`gdsload.preprocess.gpu`: `device="auto"` takes the GPU where CUDA, DALI, CuPy and torch are
there; "cpu" keeps PyAV; "cuda[:N]" insists) and `fn` gets them as a torch tensor on that GPU.
NVDEC frames differ from PyAV's in their last bits, so the resume record then holds
`"decode": "nvdec"` and a resume across the two is refused.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from typing import Any

from gdsload.convert.engine import REJECTED, STATE_DIR, _clean, _ours, refuse_foreign
from gdsload.dataset.sharded import ShardedDataset
from gdsload.errors import DestinationError, InputError
from gdsload.format import manifest as mf
from gdsload.format.index import ShardIndex
from gdsload.io.store import LOCK, load_manifest, open_store, save_manifest
from gdsload.preprocess.options import MAX_HOURS, PassOptions, fn_name, load_fn, make_options
from gdsload.preprocess.unit import Remote, Stages, decode_threads, kill_point, run_unit, unit_name

RECORD = f"{STATE_DIR}/process.json"


def process(src: str | os.PathLike[str], dst: str | os.PathLike[str], fn: Any, *,
            frames: tuple[float, int] | None = None, speech: float | None = None,
            fields: list[str] | None = None, size: int | None = None, batch_size: int = 16,
            shard_size: int | str = "1GiB", workers: int | None = None, on_error: str = "raise",
            resume: bool = False, overwrite: bool = False, feed: str | None = None, priority: int = 0,
            engine: str = "local", max_hours: float = MAX_HOURS, ray_address: str | None = None,
            progress: bool | Callable[[dict[str, Any]], None] = False, device: str = "auto") -> dict[str, Any]:
    """Run `fn` over every window of the media in `src`, writing its outputs as a dataset at `dst`.

    Exactly one of `frames=(fps, window)` (windows of `window` frames sampled at `fps`) and
    `speech=chunk_s` (consecutive chunks of `chunk_s` seconds, mono float32 at 16 kHz). `fn` is
    called with one batch (a dict; docs/preprocessing.md) and returns one item per window: a dict,
    a list of dicts, or None. A class given as `fn` is instantiated once per process. `fn` may
    also be `"MODULE:FUNC"`. Returns a summary: counts, media hours, seconds per stage (read,
    decode, fn, write), `manifest`. `progress=True` prints media hours done to stderr (or give a
    callable: it gets the summary so far after each unit and, running here, each member).
    `feed`: decode on a feed server, a `gdsload.service.client.passfeed.WindowFeed` (which holds
    the pass's priority); `gdsload.process(feed="HOST:PORT", priority=...)` makes one of an
    address. The output is the same bytes as decoding here. `device`: where frames decode
    ("auto": NVDEC on a GPU host, the CPU elsewhere; "cpu"; "cuda[:N]"; module docstring).
    """
    opts = make_options(frames=frames, speech=speech, fields=fields, size=size, batch_size=batch_size,
                        shard_size=shard_size, on_error=on_error, max_hours=max_hours)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InputError(f"process(priority={priority!r}): an integer")
    if isinstance(feed, str):
        raise InputError(f"process(feed={feed!r}): gdsload.preprocess.run.process takes a feed object; call "
                         f"gdsload.process (which makes one of an address) or pass a passfeed.WindowFeed")
    if feed is not None and engine != "local":
        raise InputError(f"process(feed=..., engine={engine!r}): a pass decoded on a feed runs here or in "
                         f"workers (engine='local')")
    if engine not in ("local", "ray"):
        raise InputError(f"process(engine={engine!r}): 'local' or 'ray'")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise InputError(f"process(workers={workers!r}): a positive integer, or None to run in this process")
    if ray_address and engine != "ray":
        raise InputError(f"process(ray_address=...) applies to engine='ray' only (engine is {engine!r})")
    if isinstance(fn, str):
        fn = load_fn(fn)
    if not callable(fn):
        raise InputError(f"process(fn={fn!r}): a callable (a function or a class), or 'MODULE:FUNC'")
    t0 = time.perf_counter()
    src = str(src)
    ds = ShardedDataset(src)
    version = mf.versions(ds.manifest)[-1]["version"]
    sel = select_fields(ds, opts)
    record = {"source": {"id": mf.dataset_id(ds.shards), "version": version}, "options": opts.record(),
              "fn": fn_name(fn)}
    from gdsload.preprocess.gpu import NvdecFrames, pass_device

    ordinal = pass_device(device, engine=engine, workers=workers, feed=feed, mode=opts.mode)
    nvdec = NvdecFrames(ordinal) if ordinal is not None else None
    if nvdec is not None:
        record["decode"] = "nvdec"  # other bytes than PyAV's frames: a resume across the two is refused
    remote = Remote(feed, feed.check(record["source"]["id"]), record["source"]["id"], opts, sel) if feed else None
    store = open_store(str(dst))
    if store.is_file():
        raise DestinationError(f"{store.root}: exists and is not a folder")
    store.make_dirs()
    with store.lock():
        done = _prepare(store, record, resume, overwrite)
        if done is not None:
            return {**_summary(done, [], Stages(), t0, engine, workers), "complete": True}
        todo = [u for u in range(len(ds.shards)) if not store.exists(unit_name(u))]
        total_s = sum(it_seconds(ds, u, sel) for u in range(len(ds.shards)))
        report = _Progress(progress, total_s, len(ds.shards))
        for u in range(len(ds.shards)):
            if u not in todo:
                report.unit(json.loads(store.read(unit_name(u))))
        stages = Stages()
        resumed = len(ds.shards) - len(todo)
        if engine == "ray":
            from gdsload.preprocess.ray_engine import run_ray

            results = run_ray(src, str(dst), todo, opts, sel, fn, workers, ray_address, report.unit)
        elif workers:
            results = _run_pool(src, store.root, todo, opts, sel, fn, workers, report.unit, remote)
        else:
            results = []
            for u in todo:
                results.append(run_unit(ds, store, u, opts, sel, fn, progress=report.member, remote=remote,
                                        nvdec=nvdec))
                report.unit(results[-1])
        for r in results:
            stages.add(r["stages"])
        records = [json.loads(store.read(unit_name(u))) for u in range(len(ds.shards))]
        manifest = _finish(store, src, ds, records, record)
    ds.close()
    out = _summary(manifest, records, stages, t0, engine, workers)
    out["resumed_units"] = resumed
    out["decode"] = f"nvdec:cuda:{ordinal}" if nvdec is not None else "cpu"
    out["routes"] = dict(nvdec.routes) if nvdec is not None else {}
    report.close(out)
    return out


def select_fields(ds: ShardedDataset, opts: PassOptions) -> list[str]:
    """The fields a pass decodes: `fields=` (each must exist and be video or audio), else every
    video field (frames) or every audio and video field (speech), in the dataset's order."""
    kinds = ds.fields
    wanted = ("video",) if opts.mode == "frames" else ("audio", "video")
    if opts.fields is None:
        sel = [f for f, k in kinds.items() if k in wanted]
        if not sel:
            raise InputError(f"{ds.root}: no {' or '.join(wanted)} field to process (fields: {sorted(kinds)})")
        return sel
    for f in opts.fields:
        if f not in kinds:
            raise InputError(f"process(fields=[{f!r}, ...]): the dataset has no field {f!r} (fields: {sorted(kinds)})")
        if kinds[f] not in ("video", "audio"):
            raise InputError(f"process(fields=[{f!r}, ...]): {f!r} is a {kinds[f]} field; a pass decodes video "
                             f"and audio fields")
    return list(opts.fields)


def it_seconds(ds: ShardedDataset, unit: int, fields: list[str]) -> float:
    """Media seconds of a unit's selected members, from the index (progress's denominator)."""
    idx = ds.index(unit)
    total = 0.0
    for f in fields:
        got = idx.media.get(f)
        if got is not None:
            desc, table = got
            col = desc["columns"].index("duration") if "duration" in desc["columns"] else None
            if col is not None:
                v = table[:, col]
                total += float(v[v == v].sum())
    return total


def _prepare(store: Any, record: dict[str, Any], resume: bool, overwrite: bool) -> dict[str, Any] | None:
    """Make DST ready; the finished manifest where `resume=True` finds this very pass done."""
    entries = [n for n in store.list() if n != LOCK]
    has_manifest, has_state = mf.MANIFEST in entries, STATE_DIR in entries
    if has_manifest and resume and not overwrite:
        m = load_manifest(store)
        made = (m.get("created") or {}).get("process")
        if made == record:
            return m
        if made:
            raise DestinationError(f"{store.root} holds a finished pass with {_differs(made, record)}; pass "
                                   f"overwrite=True (--overwrite) to replace it")
    refuse_foreign(store.root, entries)
    if has_manifest and not overwrite:
        raise DestinationError(f"{store.root} already holds a dataset ({mf.MANIFEST} exists); pass overwrite=True "
                               f"(--overwrite) to replace it")
    if has_state and not (resume or overwrite):
        raise DestinationError(f"{store.root} holds an interrupted pass; pass resume=True (--resume) to continue it "
                               f"or overwrite=True (--overwrite) to start over")
    if has_state and resume and not has_manifest:
        try:
            old = json.loads(store.read(RECORD))
        except (OSError, json.JSONDecodeError):
            old = None
        if old is not None:
            diff = _differs(old, record)
            if diff:
                raise DestinationError(f"{store.root}: the interrupted pass had {diff}; resume it with the same, or "
                                       f"pass overwrite=True (--overwrite) to start over")
            for name in store.list():  # what a killed writer left half written
                if name.startswith(".") and ".tmp-" in name:
                    store.remove(name)
            return None
    if entries:
        _clean(store)
    store.make_dirs(f"{STATE_DIR}/done")
    store.make_dirs(f"{STATE_DIR}/units")
    store.write(RECORD, json.dumps(record).encode())
    return None


def _differs(old: dict[str, Any], new: dict[str, Any]) -> str:
    """What differs between two resume records, named ('' when nothing)."""
    if old.get("fn") != new["fn"]:
        return f"fn {old.get('fn')} (this one: {new['fn']})"
    if old.get("source") != new["source"]:
        o, n = old.get("source") or {}, new["source"]
        return (f"source dataset id {o.get('id')} version {o.get('version')} (this one: id {n['id']} version "
                f"{n['version']})")
    if old.get("decode", "cpu") != new.get("decode", "cpu"):
        return (f"decode {old.get('decode', 'cpu')} (this one: {new.get('decode', 'cpu')}; NVDEC frames differ "
                f"from the CPU's: pass device='cpu' or 'cuda' to match)")
    oo, no = old.get("options") or {}, new["options"]
    for k in no:
        if oo.get(k) != no[k]:
            return f"option {k}={oo.get(k)!r} (this one: {no[k]!r})"
    return ""


def _finish(store: Any, src: str, ds: ShardedDataset, records: list[dict[str, Any]],
            record: dict[str, Any]) -> dict[str, Any]:
    from gdsload.convert.shards import make_manifest

    fields: dict[str, str] = {}
    first = None
    for r in records:
        if not r["fields"]:
            continue
        if first is None:
            fields, first = r["fields"], r
        elif r["fields"].keys() != fields.keys():
            raise InputError(f"output {r['first_key']!r} has fields {sorted(r['fields'])}, the pass's are "
                             f"{sorted(fields)} (those of its first output, {first['first_key']!r}); every output "
                             f"has exactly those")
    shards = [e for r in records for e in r["shards"]]
    seen: dict[str, str] = {}
    for e in shards:  # keys unique over the pass (a unit checks its own shard; `__key__` may collide)
        for k in ShardIndex.from_bytes(store.read(e["index"])).keys():
            if k in seen:
                raise InputError(f"output key {k!r} is written twice, in {seen[k]} and {e['name']}: keys must be "
                                 f"unique (fn's '__key__')")
            seen[k] = e["name"]
    rejects = [x for r in records for x in r["rejects"]]
    listed = {n for e in shards for n in (e["name"], e["index"], e["dali_index"])}
    for name in store.list():  # shards a crashed run wrote that this pass does not list
        if name.startswith("part-") and _ours(name) and name not in listed:
            store.remove(name)
    m = make_manifest(shards, fields, created={"source_format": "process", "source": src,
                                               "rejected": len(rejects), "process": record})
    if rejects:
        store.write(REJECTED, "".join(json.dumps(x) + "\n" for x in rejects).encode())
    kill_point("manifest")
    save_manifest(store, m)
    store.remove_tree(STATE_DIR)
    return m


def _summary(manifest: dict[str, Any], records: list[dict[str, Any]], stages: Stages, t0: float,
             engine: str, workers: int | None) -> dict[str, Any]:
    counts: dict[str, float] = {}
    for r in records:
        for k, v in r["counts"].items():
            counts[k] = counts.get(k, 0) + v
    secs = time.perf_counter() - t0
    hours = counts.get("media_s", 0.0) / 3600
    return {"shards": len(manifest["shards"]), "outputs": manifest["num_samples"], "bytes": manifest["num_bytes"],
            "windows": int(counts.get("windows", 0)), "batches": int(counts.get("batches", 0)),
            "members": int(counts.get("members", 0)), "fields_without_stream": int(counts.get("no_stream", 0)),
            "rejected": sum(len(r["rejects"]) for r in records), "media_hours": hours, "seconds": secs,
            "media_hours_per_s": hours / secs if secs > 0 else 0.0,
            "stages": {k: round(v, 3) for k, v in stages.__dict__.items()}, "engine": engine,
            "workers": workers or 1, "manifest": manifest}


class _Progress:
    """Progress in media hours: printed to stderr (`progress=True`) or handed to a callable."""

    def __init__(self, progress: Any, total_s: float, units: int):
        self.progress, self.total_s, self.units = progress, total_s, units
        self.units_s = self.cur_s = 0.0  # media seconds of finished units, of the running one
        self.units_done = 0
        self._last = 0.0

    def _show(self, final: bool = False) -> None:
        if not self.progress:
            return
        info = {"media_hours": (self.units_s + self.cur_s) / 3600, "media_hours_total": self.total_s / 3600,
                "units": self.units_done, "units_total": self.units}
        if callable(self.progress):
            self.progress(info)
            return
        now = time.monotonic()
        if final or now - self._last > 0.5:
            self._last = now
            print(f"\rprocess: {info['media_hours']:.3f} / {info['media_hours_total']:.3f} media hours, "
                  f"{self.units_done} / {self.units} shards", end="\n" if final else "", file=sys.stderr, flush=True)

    def member(self, seconds: float) -> None:
        """A member of the unit running here finished."""
        self.cur_s += seconds
        self._show()

    def unit(self, rec: dict[str, Any]) -> None:
        """A unit finished (or was finished before a resume): its record's media seconds."""
        self.units_done += 1
        self.units_s += rec["counts"]["media_s"]
        self.cur_s = 0.0
        self._show()

    def close(self, summary: dict[str, Any]) -> None:
        self._show(final=True)


# -- workers -------------------------------------------------------------------------------------
_JOB: tuple | None = None  # (src, dst, opts, fields, fn, remote): set before forking the pool
_THREADS: int | None = None  # decoder threads per worker (cores // workers): set before forking


def _pool_unit(u: int) -> dict[str, Any]:
    src, dst, opts, fields, fn, remote = _JOB  # type: ignore[misc]
    with ShardedDataset(src) as ds:
        return run_unit(ds, open_store(dst), u, opts, fields, fn, threads=_THREADS, remote=remote)


def _run_pool(src: str, dst: str, todo: list[int], opts: PassOptions, fields: list[str], fn: Any,
              workers: int, on_unit: Callable[[dict[str, Any]], None], remote: Remote | None = None
              ) -> list[dict[str, Any]]:
    """Units in `workers` forked processes (`fn` inherited, never pickled); results in unit order."""
    global _JOB, _THREADS
    from gdsload.convert.engine import _stop_pool

    if not todo:
        return []
    _JOB = (src, dst, opts, fields, fn, remote)
    _THREADS = decode_threads(min(workers, len(todo)))
    from gdsload.preprocess.media import _av

    _av()  # PyAV imported once here, inherited by the forked workers (not imported again in each)
    if remote is not None:
        remote.close()  # no gRPC channel across the fork: each worker opens its own
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    pool = ProcessPoolExecutor(min(workers, len(todo)), mp_context=ctx)
    results: dict[int, dict[str, Any]] = {}
    try:
        running = {pool.submit(_pool_unit, u): u for u in todo}
        while running:
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for f in done:
                u = running.pop(f)
                results[u] = f.result()
                on_unit(results[u])
    except BaseException:
        _stop_pool(pool)
        raise
    finally:
        _JOB = None
    pool.shutdown()
    return [results[u] for u in todo]

