"""`gdsload convert`: list the source, plan shards, write them in parallel, manifest last.

The unit of work is a pure function, `write_shard(dst, name, samples, validate)`: a slice of the
input in, one finished shard (tar, `.idx`, `.dali.idx`) plus its rejects out. The plan (which
samples go to which shard, in which order) is fixed before any shard is written, from file sizes
alone, so the output is byte-identical for any number of workers, and an interrupted conversion
can resume shard by shard.

SRC and DST may be local paths or fsspec URLs (`sources` lists, `gdsload.io.store` writes).

Crash safety: shards are published only when complete (a temporary name and a rename locally, one
upload to the final name at a URL); each finished shard leaves a record in
`DST/.gdsload-convert/done/`; `manifest.json` is written after every shard is in place. A killed
run therefore leaves either a dataset with a manifest, or a folder with no manifest and a
resumable state that `--resume` continues (and that plain `convert` refuses to touch without
`--resume` or `--overwrite`). The manifest records the run's fingerprint, so `--resume` on a
finished dataset made from the same inputs and options is a no-op that succeeds.

What `--resume` takes as "the same inputs": the fingerprint (options, the plan, every input's
size and mtime) must match, and, for every shard it keeps (all of them for a finished dataset),
the SHA-256 of that shard's input bytes, recorded when the shard was written (done record,
manifest `created.inputs_sha256`), must match the inputs read again now. So bytes rewritten
with the same size and mtime are refused too, at the cost of reading the finished shards'
inputs once more (no writing). Datasets from before this record are matched by the fingerprint.

One conversion per destination: a local DST is locked for the whole run (`Store.lock`; not at a
URL). Disk full (ENOSPC, EDQUOT) is a `DestinationError` naming DST; the unfinished shard is
removed, so `--resume` continues once there is space.

Worker processes (`workers > 1`) never outlive the driver: they ignore SIGINT and leave stopping
to the driver, which terminates them when it stops for any reason (an error, Ctrl-C, the CLI's
SIGTERM); a worker whose driver dies (SIGKILL) gets SIGTERM from the kernel (Linux
`PR_SET_PDEATHSIG`; elsewhere a thread polls the parent pid). On SIGTERM a worker removes the
files it was writing and exits.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import multiprocessing as mp
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from gdsload.convert.sources import Listing, Ref, Sample, SourceFormat, list_source, read_range
from gdsload.errors import DestinationError, FormatError, InputError
from gdsload.format import manifest as mf
from gdsload.format.manifest import field_kind
from gdsload.io import is_remote, local_path
from gdsload.io.store import LOCK, Store, load_manifest, open_store, save_manifest, url_to_fs
from gdsload.format.tar import ALIGN, BLOCK
from gdsload.convert.shards import ShardFile, make_manifest, shard_name

STATE_DIR = ".gdsload-convert"
PLAN = "plan.json"
REJECTED = "rejected.jsonl"


@dataclass(frozen=True)
class ConvertOptions:
    """What `gdsload convert` does; every field that changes the output is in the fingerprint."""

    shard_size: int = 1 << 30
    workers: int | None = None  # None: all cores
    shuffle: bool = False
    seed: int = 0
    validate: bool = False
    resume: bool = False
    overwrite: bool = False
    format: SourceFormat | None = None
    labels: str | None = None
    prefix: str = "shard"
    progress: bool = True
    columns: str | None = None  # Parquet/Arrow inputs: "image:jpg,label:cls" (`columnar`)
    append: bool = False  # add to the dataset at DST as a new version (`route`, `writer`)

    def output_affecting(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("workers", "resume", "overwrite", "progress"):
            d.pop(k)
        for k in ("columns", "append"):  # newer options: absent when unused, as in older fingerprints
            if not d[k]:
                d.pop(k)
        return d


# -- planning ------------------------------------------------------------------------------------
def shard_nbytes(sample: Sample) -> int:
    """Expected bytes a sample takes in a shard: headers, mean alignment padding, payloads."""
    total = 0
    for ext, ref in sample.fields:
        n = ref.shard_nbytes
        # header block, payload rounded to blocks, and for aligned payloads the mean PAX padding
        total += BLOCK + -(-n // BLOCK) * BLOCK + (BLOCK + ALIGN // 2 if n >= ALIGN else 0)
    return total


def plan_shards(samples: list[Sample], shard_size: int) -> list[list[Sample]]:
    """Cut the sample sequence into shards of about `shard_size` bytes (at least one sample).

    Sizes are estimated from `shard_nbytes`, so a shard can differ from the target by the PAX
    padding's deviation from its mean (at most a few KiB per sample, averaging out).
    """
    shards: list[list[Sample]] = []
    cur: list[Sample] = []
    size = 0
    for s in samples:
        n = shard_nbytes(s)
        if cur and size + n > shard_size:
            shards.append(cur)
            cur, size = [], 0
        cur.append(s)
        size += n
    if cur:
        shards.append(cur)
    return shards


def fingerprint(listing: Listing, shards: list[list[Sample]], opts: ConvertOptions) -> str:
    """Hash of everything the output depends on: options, the plan, and input sizes and mtimes."""
    h = hashlib.sha256(json.dumps(opts.output_affecting(), sort_keys=True).encode())
    for shard in shards:
        for s in shard:
            h.update(s.key.encode())
            for ext, r in s.fields:
                h.update(f"|{ext}|{r.path}|{r.offset}|{r.size}|".encode())
                if r.data is not None:
                    h.update(r.data)
        h.update(b"\n")
    for path, stamp in listing.inputs:
        h.update(f"{path}|{stamp}\n".encode())
    return h.hexdigest()


# -- the unit of work ----------------------------------------------------------------------------
def read_ref(ref: Ref) -> bytes:
    if ref.data is not None:
        return ref.data
    data = read_range(ref.path, ref.offset, ref.size)  # type: ignore[arg-type]
    if ref.size >= 0 and len(data) != ref.size:
        raise OSError(f"expected {ref.size} bytes, read {len(data)} (file changed during conversion?)")
    return data


# Pillow's names for the formats DALI's decoder reads (no GIF); MPO is Pillow's name for some JPEGs
_DALI_FORMATS = frozenset({"JPEG", "MPO", "PNG", "WEBP", "BMP", "TIFF", "JPEG2000", "PPM"})


def validate_image(data: bytes) -> None:
    """Decode an image fully with Pillow; raises ValueError on anything the loader's decoder
    (DALI) would not decode: a corrupt bitstream, a type DALI lacks, a decompression bomb."""
    import io

    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as im:
            if im.format not in _DALI_FORMATS:
                raise ValueError(f"{im.format} images are not decoded by DALI (gdsload's decoder)")
            im.load()
    except UnidentifiedImageError:
        raise ValueError("not a decodable image (Pillow cannot identify the format)") from None
    except Image.DecompressionBombError as exc:  # raised by open() from the header alone
        raise ValueError(f"too large to decode safely: {exc}") from None
    except OSError as exc:  # truncated or corrupt bitstream
        raise ValueError(f"corrupt image: {exc}") from None


_progress: Any = None  # a multiprocessing queue in worker processes, set by _init_worker
_in_unit = False  # a worker is inside `_pool_unit`: SIGTERM unwinds it instead of exiting at once
_stop_requested = False  # a worker got SIGTERM inside a unit (see `_on_sigterm`)
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
PARENT_POLL_S = 1.0  # where there is no parent-death signal: how often a worker checks its parent


class _Stopped(BaseException):
    """Raised by a worker's SIGTERM handler inside a unit, so that the unit's temporary files are
    removed on the way out (`write_shard`, `write_atomic`) before the worker exits."""


def _on_sigterm(signum: int, frame: Any) -> None:
    """A worker told to stop (by the driver, or by the kernel as its driver died). It exits with
    `os._exit`, skipping the interpreter's exit handlers: they would wait on queues that no one
    reads any more.

    Inside a unit it raises `_Stopped` to unwind the unit's writers. The exception can land while
    the interpreter runs a finalizer (a weakref callback, a `__del__`), which swallows it: the
    unit then goes on to its end. `_stop_requested` remembers the signal, so `_pool_unit` exits
    once the unit is over either way (its shard is then whole, which `--resume` keeps)."""
    global _stop_requested
    if _in_unit:
        _stop_requested = True
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the pool's own teardown sends another
        raise _Stopped
    os._exit(128 + signum)


def _quiet_stop(args: Any) -> None:
    """`sys.unraisablehook` of a worker: a `_Stopped` swallowed by a finalizer is not an error
    to print (see `_on_sigterm`); anything else goes to the default hook."""
    if not isinstance(args.exc_value, _Stopped):
        sys.__unraisablehook__(args)


def _pool_unit(dst: str, name: str, samples: list[Sample], validate: bool) -> dict[str, Any]:
    """`write_shard` in a pool worker, stoppable by SIGTERM (see `_on_sigterm`)."""
    global _in_unit
    try:
        _in_unit = True
        return write_shard(dst, name, samples, validate)
    except _Stopped:
        pass  # the exit below
    finally:
        _in_unit = False
        if _stop_requested:  # also when a finalizer swallowed `_Stopped` and the unit went on
            remove_temporaries(open_store(dst), [name])
            os._exit(128 + signal.SIGTERM)
    raise AssertionError("unreachable: _Stopped is raised only after _stop_requested is set")


def remove_temporaries(dst: Store, names: Iterable[str], *, any_process: bool = False) -> None:
    """Remove the temporary files of shard units `names` (`.NAME.*.tmp-PID`: the tar, both
    indexes and the done record, see `gdsload.io.store`) written by this process (`any_process`:
    by any). Unwinding an interrupted unit removes the files it was writing, except one opened in
    the instant before its writer object existed: this removes that one. A driver whose workers
    were lost removes theirs with `any_process=True`. One listing of each folder, however many
    units (DST may be a shared filesystem)."""
    wanted = set(names)
    owner = str(os.getpid())
    for folder in ("", f"{STATE_DIR}/done"):
        for n in dst.list(folder):
            stem, sep, writer = n.partition(".tmp-")
            if not sep or not stem.startswith(".") or (not any_process and writer != owner):
                continue
            parts = stem[1:].split(".")  # NAME.ext: NAME may hold dots itself
            if any(".".join(parts[:k]) in wanted for k in range(1, len(parts))):
                dst.remove(f"{folder}/{n}" if folder else n)


def _die_with_parent(parent_pid: int) -> None:
    """Have this process get SIGTERM when `parent_pid` (the driver) exits."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            ok = libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) == 0
        except (OSError, AttributeError):
            ok = False
        if ok:
            if os.getppid() != parent_pid:  # it died before prctl took effect
                os.kill(os.getpid(), signal.SIGTERM)
            return

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="gdsload-parent-watch", daemon=True).start()


def _init_worker(queue: Any, parent_pid: int) -> None:
    global _progress
    _progress = queue
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group: the driver stops us
    signal.signal(signal.SIGTERM, _on_sigterm)
    sys.unraisablehook = _quiet_stop
    _die_with_parent(parent_pid)


def write_shard(dst: str, name: str, samples: list[Sample], validate: bool,
                report: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Write one shard; returns `{"entry": ShardEntry | None, "rejects": [...], "fields": {...}}`.

    A sample whose file cannot be read, or (with `validate`) whose image does not decode, is left
    out and reported with its reason; every other sample is written in plan order.
    """
    if report is None and _progress is not None:
        report = lambda n, b: _progress.put((n, b))  # noqa: E731
    rejects: list[dict[str, str]] = []
    fields: dict[str, str] = {}
    pending = [0, 0]
    store = open_store(dst)
    w = ShardFile(store, name)
    digest = hashlib.sha256()  # of the inputs' bytes as read: what `--resume` checks them against
    try:
        for s in samples:
            try:
                payloads = {ext: read_ref(ref) for ext, ref in s.fields}
            except OSError as exc:
                rejects.append({"source": s.source, "key": s.key, "reason": f"unreadable: {exc}"})
                _digest_sample(digest, s, None)
                continue
            _digest_sample(digest, s, payloads)
            try:
                if validate:
                    for ext, data in payloads.items():
                        kind = field_kind(ext)
                        if kind == "image":
                            validate_image(data)
                        elif kind in ("video", "audio"):  # every frame decoded with PyAV
                            from gdsload.decode.media import validate as validate_media

                            validate_media(data, kind)
                w.add(s.key, payloads)
            except (FormatError, ValueError) as exc:  # a corrupt image, an invalid .npy
                rejects.append({"source": s.source, "key": s.key, "reason": f"invalid: {exc}"})
                continue
            for ext in payloads:
                fields.setdefault(ext, field_kind(ext))
            pending[0] += 1
            pending[1] += sum(len(p) for p in payloads.values())
            if report and pending[0] >= 64:
                report(*pending)
                pending[:] = [0, 0]
        if report and pending[0]:
            report(*pending)
        if w.num_samples == 0:
            w.abort()
            entry = None
        else:
            entry = w.close()
    except BaseException:
        w.abort()
        raise
    result = {"entry": entry, "rejects": rejects, "fields": fields, "inputs_sha256": digest.hexdigest()}
    if store.exists(f"{STATE_DIR}/{PLAN}"):  # inside a conversion: leave the done record
        store.write(f"{STATE_DIR}/done/{name}.json", json.dumps(result).encode())
    return result


def _digest_sample(h: Any, s: Sample, payloads: dict[str, bytes] | None) -> None:
    h.update(f"{s.key}\n".encode())
    if payloads is None:
        h.update(b"!unreadable\n")
        return
    for ext, data in payloads.items():
        h.update(f"{ext}|{len(data)}|".encode())
        h.update(data)


def inputs_digest(samples: list[Sample]) -> str:
    """SHA-256 of the bytes of `samples`' inputs, read now, as `write_shard` records it."""
    h = hashlib.sha256()
    for s in samples:
        try:
            payloads = {ext: read_ref(ref) for ext, ref in s.fields}
        except OSError:
            payloads = None
        _digest_sample(h, s, payloads)
    return h.hexdigest()


def check_inputs_unchanged(where: str, units: list[tuple[str, list[Sample]]], recorded: dict[str, str]) -> None:
    """`--resume`'s content check: the inputs of every finished shard (`units`: name, samples)
    must hash as when it was written (`recorded`: name -> SHA-256; a shard without one, from an
    older gdsload, is matched by sizes and mtimes only). Sizes and mtimes are compared first
    (the fingerprint); this catches bytes rewritten with the same size and mtime."""
    for name, samples in units:
        want = recorded.get(name)
        if want is not None and inputs_digest(samples) != want:
            files = sorted({r.path for smp in samples for _, r in smp.fields if r.path})
            shown = ", ".join(str(f) for f in files[:3]) + (f", ... ({len(files)} files)" if len(files) > 3 else "")
            raise DestinationError(
                f"{where}: the inputs changed since (the bytes of the inputs of {name} differ from those it "
                f"was written from, with the same sizes and mtimes: {shown or 'inline data'}); --resume "
                f"continues only the same conversion: pass --overwrite to convert again"
            )


class UnitRunner(Protocol):
    """Runs shard units outside this process's pool, e.g. as tasks of a Ray cluster.

    Called once, with the units still to write in plan order as `(name, samples)`; yields each
    unit's name once its shard is in place under its final name and its done record is written
    (`write_shard` writes the record itself where it sees `DST/.gdsload-convert/done/`). Calls
    `report(samples, nbytes)` from the calling thread as work completes; once per unit is enough.
    Raises a `GdsloadError` when a unit fails for good; the done records of finished units stay,
    so `--resume` continues. `workers` is the parallelism the driver would use on this host.
    """

    def __call__(self, dst: str, units: list[tuple[str, list[Sample]]], validate: bool, workers: int,
                 report: Callable[[int, int], None]) -> Iterator[str]: ...


# -- destination handling ------------------------------------------------------------------------
_SHARD_FILE = re.compile(r"^[\w.-]+-\d{6}\.(tar|idx|dali\.idx)$")


def _ours(name: str) -> bool:
    """Files gdsload writes into a dataset folder (only trusted where a manifest or state exists)."""
    return (
        name in (mf.MANIFEST, REJECTED, STATE_DIR)
        or bool(_SHARD_FILE.match(name))
        or (name.startswith(".") and ".tmp-" in name)
    )


def refuse_foreign(where: str, entries: list[str]) -> None:
    """Refuse a destination holding files gdsload does not write (gdsload's own names are trusted
    only beside a manifest or an interrupted run's state): convert, the writer and a pass."""
    ours = mf.MANIFEST in entries or STATE_DIR in entries
    foreign = sorted(n for n in entries if not (ours and _ours(n)))
    if foreign:
        raise DestinationError(
            f"{where} is not empty and holds files that are not gdsload's ({', '.join(foreign[:3])}"
            f"{', ...' if len(foreign) > 3 else ''}); choose an empty or new folder"
        )


def _clean(dst: Store) -> None:
    dst.remove(mf.MANIFEST)  # first: the folder stops looking complete
    for name in dst.list():
        if name == STATE_DIR:
            dst.remove_tree(name)
        elif _ours(name):
            dst.remove(name)


def _what_differs(made: dict[str, Any], src: str, opts: ConvertOptions) -> str:
    """Why a finished dataset's recorded run is not this one, for the refusal of `--resume`."""
    old = made.get("options") or {}
    changed = [f"--{k.replace('_', '-')} was {old.get(k)!r}, now {v!r}"
               for k, v in opts.output_affecting().items() if old.get(k) != v]
    if changed:
        return "other options: " + "; ".join(changed)
    if made.get("source") != src:
        return f"another source: it was made from {made.get('source')}, not {src}"
    if "fingerprint" not in made:
        return "its manifest records no input fingerprint (made by an older gdsload), so it cannot be matched"
    return "the inputs changed since (files added, removed, resized or modified)"


def finished_dataset(dst: Store, src: str, opts: ConvertOptions, fp: str) -> dict[str, Any] | None:
    """For `--resume`: the manifest of a dataset at `dst` that this very run (same inputs, options,
    fingerprint) already finished, with its files in place; None where `dst` holds no manifest.
    A finished dataset from another run, or one with files missing, is refused."""
    if not opts.resume or opts.overwrite or not dst.exists(mf.MANIFEST):
        return None
    manifest = load_manifest(dst)
    made = manifest.get("created") or {}
    if made.get("fingerprint") != fp:
        raise DestinationError(
            f"{dst.root} already holds a dataset ({mf.MANIFEST} exists) from another conversion "
            f"({_what_differs(made, src, opts)}); "
            f"--resume continues only the same conversion: re-run with the same inputs and options, "
            f"or pass --overwrite to replace it"
        )
    for s in manifest["shards"]:
        for name, want in ((s["name"], s["bytes"]), (s["index"], None), (s["dali_index"], None)):
            size = dst.size(name)
            if size is None or (want is not None and size != want):
                raise DestinationError(
                    f"{dst.root} holds a finished dataset whose file {name} is "
                    f"{'missing' if size is None else f'{size} bytes, not {want}'}; run gdsload verify, "
                    f"or pass --overwrite to convert again"
                )
    return manifest


def prepare_destination(dst: Store, opts: ConvertOptions, fp: str,
                        units: dict[str, list[Sample]] | None = None) -> set[str]:
    """Make `dst` ready; return the names of shards a resumed run can keep (with `units`, the
    plan's samples by shard name, only when their inputs' bytes are unchanged)."""
    where = dst.root
    entries = [n for n in dst.list() if n != LOCK]
    if entries:
        has_manifest, has_state = mf.MANIFEST in entries, STATE_DIR in entries
        if has_manifest and not opts.overwrite:
            raise DestinationError(
                f"{where} already holds a dataset ({mf.MANIFEST} exists); pass --overwrite to replace it"
            )
        if has_state and not (opts.resume or opts.overwrite):
            raise DestinationError(
                f"{where} holds an interrupted conversion; pass --resume to continue it or "
                f"--overwrite to start over"
            )
        refuse_foreign(where, entries)
        if opts.resume and has_state and not has_manifest and dst.exists(f"{STATE_DIR}/{PLAN}"):
            # (no plan: the run stopped before writing it, e.g. on a full disk, and wrote no
            # shard record either, since those are written only next to a plan: start afresh)
            try:
                old = json.loads(dst.read(f"{STATE_DIR}/{PLAN}"))
            except (OSError, json.JSONDecodeError):
                old = {}
            if old.get("fingerprint") != fp:
                raise DestinationError(
                    f"{where}: the interrupted conversion used other inputs or options (its inputs "
                    f"changed since); re-run with the same options, or --overwrite to start over"
                )
            keep = set()
            recorded: dict[str, str] = {}
            for rec in dst.list(f"{STATE_DIR}/done"):
                if not rec.endswith(".json") or rec.startswith("."):
                    continue
                done = json.loads(dst.read(f"{STATE_DIR}/done/{rec}"))
                entry = done.get("entry")
                if entry is None or (
                    dst.size(entry["name"]) == entry["bytes"]
                    and dst.size(entry["index"]) is not None
                    and dst.size(entry["dali_index"]) is not None
                ):
                    keep.add(rec[: -len(".json")])
                    if done.get("inputs_sha256"):
                        recorded[rec[: -len(".json")]] = done["inputs_sha256"]
            if units is not None:  # before anything is touched: a refusal leaves DST as it was
                check_inputs_unchanged(where, [(n, units[n]) for n in sorted(keep) if n in units], recorded)
            for name in entries:  # leftovers of writers that were killed
                if name.startswith(".") and ".tmp-" in name:
                    dst.remove(name)
            return keep
        _clean(dst)
    dst.make_dirs(f"{STATE_DIR}/done")
    dst.write(f"{STATE_DIR}/{PLAN}", json.dumps({"fingerprint": fp}).encode())
    return set()


# -- driver --------------------------------------------------------------------------------------
def _canon(path: str) -> str:
    """An absolute form of a local path or fsspec URL, for comparing locations."""
    if is_remote(path):
        fs, p = url_to_fs(path)
        return fs.unstrip_protocol(p.rstrip("/"))
    return str(local_path(path).resolve())


def _within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _check_paths(src: str, dst: str, inputs: list[tuple[str, str]]) -> None:
    """Refuse a destination inside the source, or inputs inside the destination."""
    d = _canon(dst)
    if "{" in src:
        inside = [p for p, _ in inputs if _within(_canon(p), d)]  # a pattern names few tars
    else:
        s = _canon(src)
        if _within(d, s):
            raise InputError(f"destination {dst} is inside the source {src}; choose a folder outside it")
        inside = [src] if _within(s, d) else []
    if inside:
        raise InputError(f"input {inside[0]} is inside the destination {dst}; choose another destination")


IN_FLIGHT_PER_WORKER = 2  # units submitted to the pool per worker: a freed worker never waits
POLL_S = 0.2  # how often the driver looks at progress and at a stop signal


class _DeferredStop:
    """SIGINT and SIGTERM, noted while the driver runs its pool and acted on at `check()`.

    An exception raised by a signal handler lands at whatever bytecode runs, which can be inside
    `concurrent.futures.wait` while it holds futures' locks; the pool's manager thread then
    waits on such a lock forever and the interpreter hangs at exit. So the handlers only note
    the signal, and `check()`, called where nothing is held, runs the handler that was in place
    (KeyboardInterrupt for SIGINT, the CLI's `Terminated` for SIGTERM); a default SIGTERM ends
    the run with `SystemExit(143)` once the workers are stopped. Only the main thread can set
    handlers; elsewhere nothing changes."""

    _SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __enter__(self) -> "_DeferredStop":
        self.signum: int | None = None
        self.previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in self._SIGNALS:
                self.previous[sig] = signal.signal(sig, self._note)
        return self

    def _note(self, signum: int, frame: Any) -> None:
        self.signum = self.signum or signum

    def check(self) -> None:
        signum, self.signum = self.signum, None
        if signum is None:
            return
        previous = self.previous.get(signum)
        if callable(previous):
            previous(signum, None)
        elif previous != signal.SIG_IGN:
            raise SystemExit(128 + signum)

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        if exc_type is None:  # a signal noted after the last `check()` is acted on, not lost
            self.check()


def _run_pool(dst: str, units: list[tuple[str, list[Sample]]], validate: bool, workers: int,
              report: Callable[[int, int], None]) -> Iterator[str]:
    """Write `units` in a process pool, in plan order, at most `IN_FLIGHT_PER_WORKER` per worker
    submitted at a time; yields each unit's name as it finishes. However this stops (a unit's
    error, a signal, a generator closed early), no worker outlives it (module docstring)."""
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    queue = ctx.Queue()
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                               initargs=(queue, os.getpid()))
    todo = list(reversed(units))
    running: dict[Any, str] = {}
    try:
        with _DeferredStop() as stop:
            while todo or running:
                while todo and len(running) < IN_FLIGHT_PER_WORKER * workers:
                    name, samples = todo.pop()
                    running[pool.submit(_pool_unit, dst, name, samples, validate)] = name
                done, _ = wait(running, timeout=POLL_S, return_when=FIRST_COMPLETED)
                stop.check()
                while not queue.empty():
                    report(*queue.get())
                for f in done:
                    name = running.pop(f)
                    f.result()  # re-raise a worker's error here
                    yield name
    except BaseException:
        _stop_pool(pool)
        raise
    pool.shutdown()


def _stop_pool(pool: ProcessPoolExecutor, timeout_s: float = 10.0) -> None:
    """Stop a pool's workers now: queued units are dropped, running ones get SIGTERM (a worker
    then removes its unfinished shard and exits; SIGKILL after `timeout_s`)."""
    procs = list((getattr(pool, "_processes", None) or {}).values())  # no public API before 3.14
    pool.shutdown(wait=False, cancel_futures=True)
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def _disk_full(exc: OSError, dst: Store) -> DestinationError | None:
    """A full disk or quota (at DST: inputs are only read) as an error naming DST and the way on."""
    if exc.errno not in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        return None
    return DestinationError(
        f"{dst.root}: {exc.strerror or 'no space left on device'} (writing {exc.filename or 'a file there'}); "
        f"the unfinished file was removed and finished shards are kept: free space there, then run "
        f"the same command with --resume to continue"
    )


def convert(src: str, dst: str | Path, opts: ConvertOptions = ConvertOptions(),
            *, log: Callable[[str], None] | None = None, runner: UnitRunner | None = None) -> dict[str, Any]:
    """Convert `src` into a gdsload dataset at `dst`; returns a summary with the manifest
    (`"complete": True` where `--resume` found this very conversion already finished).

    `runner` writes the shard units elsewhere (see `UnitRunner`); by default they are written by
    this process (`workers == 1`) or a process pool. The output does not depend on the runner.
    """
    t0 = time.perf_counter()
    store = open_store(dst)
    if opts.shard_size < 4 * ALIGN:
        raise InputError(f"--shard-size {opts.shard_size} is too small (minimum {4 * ALIGN} bytes)")
    listing = list_source(src, opts.format, labels=opts.labels)
    _check_paths(src, store.root, listing.inputs)
    samples = listing.samples
    if opts.shuffle:
        order = np.random.default_rng(opts.seed).permutation(len(samples))
        samples = [samples[i] for i in order]
    plan = plan_shards(samples, opts.shard_size)
    names = [shard_name(opts.prefix, i) for i in range(len(plan))]
    fp = fingerprint(listing, plan, opts)
    if not samples:
        raise InputError(
            f"{src}: nothing to convert: all {len(listing.rejects)} inputs were rejected, first: "
            f"{listing.rejects[0]['source'] if listing.rejects else '-'} "
            f"({listing.rejects[0]['reason'] if listing.rejects else 'no inputs'})"
        )
    if store.is_file():
        raise DestinationError(f"{store.root}: exists and is not a folder")
    try:
        with store.lock():
            finished = finished_dataset(store, src, opts, fp)
            if finished is not None:
                check_inputs_unchanged(store.root, list(zip(names, plan)),
                                       (finished.get("created") or {}).get("inputs_sha256") or {})
                return _summary(finished, t0, resumed=len(finished["shards"]), workers=0, complete=True)
            keep = prepare_destination(store, opts, fp, dict(zip(names, plan)))
            todo = [i for i, n in enumerate(names) if n not in keep]
            workers = max(1, min(opts.workers or os.cpu_count() or 1, len(todo) or 1))
            _write_units(store, [(names[i], plan[i]) for i in todo], opts, workers, runner)
            manifest = _finish(store, src, listing, names, opts, fp, t0)
    except OSError as exc:
        full = _disk_full(exc, store)
        if full is None:
            raise
        raise full from exc
    return _summary(manifest, t0, resumed=len(keep), workers=workers)


def _write_units(store: Store, units: list[tuple[str, list[Sample]]], opts: ConvertOptions, workers: int,
                 runner: UnitRunner | None) -> None:
    """Write every unit's shard and done record, with a progress bar unless `opts.progress` is off."""
    total_samples = sum(len(samples) for _, samples in units)
    bar = None
    if opts.progress:
        from tqdm import tqdm

        bar = tqdm(total=total_samples, unit="sample", desc="convert", dynamic_ncols=True, smoothing=0.1)
    moved = [0]
    finished = [0]  # shards done in this run
    tb = time.perf_counter()

    def report(n: int, nbytes: int) -> None:
        moved[0] += nbytes
        if bar is not None:
            bar.update(n)
            bar.set_postfix_str(f"{moved[0] / 1e6 / max(time.perf_counter() - tb, 1e-9):.0f} MB/s, "
                                f"{finished[0]}/{len(units)} shards", refresh=False)

    def here() -> Iterator[str]:
        for name, samples in units:
            try:
                write_shard(store.root, name, samples, opts.validate, report)
            except BaseException:  # Ctrl-C, SIGTERM (the CLI's `Terminated`), a full disk
                remove_temporaries(store, [name])
                raise
            yield name

    if runner is not None:
        done: Iterator[str] = runner(store.root, units, opts.validate, workers, report)
    else:
        done = here() if workers == 1 else _run_pool(store.root, units, opts.validate, workers, report)
    try:
        for _ in done:
            finished[0] += 1
    finally:
        getattr(done, "close", lambda: None)()  # a pool stops its workers now, not when collected
    if bar is not None:
        bar.update(total_samples - bar.n)  # progress messages still in flight when the pool ended
        bar.close()


def _finish(store: Store, src: str, listing: Listing, names: list[str], opts: ConvertOptions, fp: str,
            t0: float) -> dict[str, Any]:
    """Gather the shard records in plan order (every shard has one now), write `rejected.jsonl`
    and, last, the manifest; remove the conversion state."""
    shards: list[mf.ShardEntry] = []
    fields: dict[str, str] = {}
    rejects = list(listing.rejects)
    digests: dict[str, str] = {}
    for name in names:
        r = json.loads(store.read(f"{STATE_DIR}/done/{name}.json"))
        if r.get("inputs_sha256"):
            digests[name] = r["inputs_sha256"]
        if r["entry"] is not None:
            shards.append(r["entry"])
        rejects += r["rejects"]
        fields.update(r["fields"])
    if rejects:
        store.write(REJECTED, "".join(json.dumps(r) + "\n" for r in rejects).encode())
    else:
        store.remove(REJECTED)
    if not shards:
        raise InputError(f"{src}: every sample was rejected; see {store.where(REJECTED)}")
    manifest = make_manifest(
        shards,
        fields,
        classes=listing.classes,
        created={
            "source": src,
            "source_format": listing.format,
            "options": opts.output_affecting(),
            "fingerprint": fp,  # what `--resume` compares against (see `finished_dataset`)
            "inputs_sha256": digests,  # per shard unit: its inputs' bytes (`check_inputs_unchanged`)
            "rejected": len(rejects),
            "seconds": round(time.perf_counter() - t0, 3),
        },
    )
    save_manifest(store, manifest)
    store.remove_tree(STATE_DIR)
    return manifest


def _summary(manifest: dict[str, Any], t0: float, *, resumed: int, workers: int,
             complete: bool = False) -> dict[str, Any]:
    seconds = time.perf_counter() - t0
    n = manifest["num_samples"]
    return {
        "manifest": manifest,
        "complete": complete,
        "samples": n,
        "rejected": manifest.get("created", {}).get("rejected", 0),
        "shards": len(manifest["shards"]),
        "bytes": manifest["num_bytes"],
        "seconds": seconds,
        "samples_per_s": n / seconds if seconds else 0.0,
        "mb_per_s": manifest["num_bytes"] / 1e6 / seconds if seconds else 0.0,
        "resumed_shards": resumed,
        "workers": workers,
    }
