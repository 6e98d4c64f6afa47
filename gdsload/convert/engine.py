"""`gdsload convert`: list the source, plan shards, write them in parallel, manifest last.

The unit of work is a pure function, `write_shard(dst, name, samples, validate)`: a slice of the
input in, one finished shard (tar, `.idx`, `.dali.idx`) plus its rejects out. The plan (which
samples go to which shard, in which order) is fixed before any shard is written, from file sizes
alone, so the output is byte-identical for any number of workers, and an interrupted conversion
can resume shard by shard.

Crash safety: shards are written under temporary names and renamed when complete; each finished
shard leaves a record in `DST/.gdsload-convert/done/`; `manifest.json` is written after every
shard is in place. A killed run therefore leaves either a dataset with a manifest, or a folder with
no manifest and a resumable state that `--resume` continues (and that plain `convert` refuses to
touch without `--resume` or `--overwrite`).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from gdsload.convert.sources import Listing, Ref, Sample, SourceFormat, list_source
from gdsload.errors import DestinationError, FormatError, InputError
from gdsload.format import manifest as mf
from gdsload.format.manifest import field_kind
from gdsload.format.tar import ALIGN, BLOCK
from gdsload.format.writer import ShardWriter, make_manifest, shard_name

STATE_DIR = ".gdsload-convert"
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

    def output_affecting(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("workers", "resume", "overwrite", "progress"):
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
    for path in listing.inputs:
        try:
            st = os.stat(path)
            h.update(f"{path}|{st.st_size}|{st.st_mtime_ns}\n".encode())
        except OSError:
            h.update(f"{path}|missing\n".encode())
    return h.hexdigest()


# -- the unit of work ----------------------------------------------------------------------------
def read_ref(ref: Ref) -> bytes:
    if ref.data is not None:
        return ref.data
    with open(ref.path, "rb") as f:  # type: ignore[arg-type]
        f.seek(ref.offset)
        data = f.read() if ref.size < 0 else f.read(ref.size)
    if ref.size >= 0 and len(data) != ref.size:
        raise OSError(f"expected {ref.size} bytes, read {len(data)} (file changed during conversion?)")
    return data


def validate_image(data: bytes) -> None:
    """Decode an image fully with Pillow; raises on anything that would not decode."""
    import io

    from PIL import Image

    from PIL import UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()
    except UnidentifiedImageError:
        raise ValueError("not a decodable image (Pillow cannot identify the format)") from None
    except OSError as exc:  # truncated or corrupt bitstream
        raise ValueError(f"corrupt image: {exc}") from None


_progress: Any = None  # a multiprocessing queue in worker processes, set by _init_worker


def _init_worker(queue: Any) -> None:
    global _progress
    _progress = queue


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
    w = ShardWriter(dst, name)
    try:
        for s in samples:
            try:
                payloads = {ext: read_ref(ref) for ext, ref in s.fields}
            except OSError as exc:
                rejects.append({"source": s.source, "key": s.key, "reason": f"unreadable: {exc}"})
                continue
            try:
                if validate:
                    for ext, data in payloads.items():
                        if field_kind(ext) == "image":
                            validate_image(data)
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
    result = {"entry": entry, "rejects": rejects, "fields": fields}
    done = Path(dst) / STATE_DIR / "done"
    if done.is_dir():
        mf.write_atomic(done / f"{name}.json", json.dumps(result).encode())
    return result


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


def _clean(dst: Path) -> None:
    (dst / mf.MANIFEST).unlink(missing_ok=True)  # first: the folder stops looking complete
    for e in dst.iterdir():
        if e.name == STATE_DIR:
            shutil.rmtree(e)
        elif _ours(e.name):
            e.unlink()


def prepare_destination(dst: Path, opts: ConvertOptions, fp: str) -> set[str]:
    """Make `dst` ready; return the names of shards a resumed run can keep."""
    state = dst / STATE_DIR
    if dst.exists() and not dst.is_dir():
        raise DestinationError(f"{dst}: exists and is not a folder")
    if dst.is_dir():
        entries = [e.name for e in dst.iterdir()]
        ours = (dst / mf.MANIFEST).exists() or state.exists()
        foreign = sorted(n for n in entries if not (ours and _ours(n)))
        if (dst / mf.MANIFEST).exists() and not opts.overwrite:
            raise DestinationError(
                f"{dst} already holds a dataset ({mf.MANIFEST} exists); pass --overwrite to replace it"
            )
        if state.exists() and not (opts.resume or opts.overwrite):
            raise DestinationError(
                f"{dst} holds an interrupted conversion; pass --resume to continue it or "
                f"--overwrite to start over"
            )
        if foreign:
            raise DestinationError(
                f"{dst} is not empty and holds files that are not gdsload's ({', '.join(foreign[:3])}"
                f"{', ...' if len(foreign) > 3 else ''}); choose an empty or new folder"
            )
        if opts.resume and state.exists() and not (dst / mf.MANIFEST).exists():
            try:
                old = json.loads((state / "plan.json").read_text())
            except (OSError, json.JSONDecodeError):
                old = {}
            if old.get("fingerprint") != fp:
                raise DestinationError(
                    f"{dst}: the interrupted conversion used other inputs or options (its inputs "
                    f"changed since); re-run with the same options, or --overwrite to start over"
                )
            for e in dst.iterdir():  # leftovers of writers that were killed
                if e.name.startswith(".") and ".tmp-" in e.name:
                    e.unlink()
            keep = set()
            for rec in (state / "done").glob("*.json"):
                name = rec.name[: -len(".json")]
                r = json.loads(rec.read_text())
                entry = r.get("entry")
                if entry is None or (
                    (dst / entry["name"]).is_file()
                    and (dst / entry["name"]).stat().st_size == entry["bytes"]
                    and (dst / entry["index"]).is_file()
                    and (dst / entry["dali_index"]).is_file()
                ):
                    keep.add(name)
            return keep
        if entries:
            _clean(dst)
    dst.mkdir(parents=True, exist_ok=True)
    (state / "done").mkdir(parents=True, exist_ok=True)
    mf.write_atomic(state / "plan.json", json.dumps({"fingerprint": fp}).encode())
    return set()


# -- driver --------------------------------------------------------------------------------------
def _check_paths(src: str, dst: Path, inputs: list[str]) -> None:
    """Refuse a destination inside the source, or inputs inside the destination."""
    d = dst.resolve()
    if "{" in src:
        inside = [p for p in inputs if d in Path(p).resolve().parents]  # a pattern names few tars
    else:
        s = Path(src).resolve()
        if d == s or s in d.parents:
            raise InputError(f"destination {dst} is inside the source {src}; choose a folder outside it")
        inside = [src] if d in s.parents or (s.is_file() and d == s.parent) else []
    if inside:
        raise InputError(f"input {inside[0]} is inside the destination {dst}; choose another destination")


def convert(src: str, dst: str | Path, opts: ConvertOptions = ConvertOptions(),
            *, log: Callable[[str], None] | None = None, runner: UnitRunner | None = None) -> dict[str, Any]:
    """Convert `src` into a gdsload dataset at `dst`; returns a summary with the manifest.

    `runner` writes the shard units elsewhere (see `UnitRunner`); by default they are written by
    this process (`workers == 1`) or a process pool. The output does not depend on the runner.
    """
    t0 = time.perf_counter()
    dst = Path(dst)
    if opts.shard_size < 4 * ALIGN:
        raise InputError(f"--shard-size {opts.shard_size} is too small (minimum {4 * ALIGN} bytes)")
    listing = list_source(src, opts.format, labels=opts.labels)
    _check_paths(src, dst, listing.inputs)
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
    keep = prepare_destination(dst, opts, fp)
    todo = [i for i, n in enumerate(names) if n not in keep]
    workers = max(1, min(opts.workers or os.cpu_count() or 1, len(todo) or 1))

    total_samples = sum(len(plan[i]) for i in todo)
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
                                f"{finished[0]}/{len(todo)} shards", refresh=False)

    if runner is not None:
        for _ in runner(str(dst), [(names[i], plan[i]) for i in todo], opts.validate, workers, report):
            finished[0] += 1
    elif workers == 1:
        for i in todo:
            write_shard(str(dst), names[i], plan[i], opts.validate, report)
            finished[0] += 1
    else:
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        queue = ctx.Queue()
        with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=(queue,)) as pool:
            futs = {pool.submit(write_shard, str(dst), names[i], plan[i], opts.validate) for i in todo}
            while futs:
                done, futs = wait(futs, timeout=0.2, return_when=FIRST_COMPLETED)
                while not queue.empty():
                    report(*queue.get())
                for f in done:
                    f.result()  # re-raise a worker's error here
                    finished[0] += 1
    if bar is not None:
        bar.update(total_samples - bar.n)  # progress messages still in flight when the pool ended
        bar.close()

    # gather the shard records in plan order; every shard has one now
    shards: list[mf.ShardEntry] = []
    fields: dict[str, str] = {}
    rejects = list(listing.rejects)
    for name in names:
        r = json.loads((dst / STATE_DIR / "done" / f"{name}.json").read_text())
        if r["entry"] is not None:
            shards.append(r["entry"])
        rejects += r["rejects"]
        fields.update(r["fields"])
    if rejects:
        mf.write_atomic(dst / REJECTED, "".join(json.dumps(r) + "\n" for r in rejects).encode())
    else:
        (dst / REJECTED).unlink(missing_ok=True)
    if not shards:
        raise InputError(f"{src}: every sample was rejected; see {dst / REJECTED}")
    seconds = time.perf_counter() - t0
    manifest = make_manifest(
        shards,
        fields,
        classes=listing.classes,
        created={
            "source": src,
            "source_format": listing.format,
            "options": opts.output_affecting(),
            "rejected": len(rejects),
            "seconds": round(seconds, 3),
        },
    )
    mf.save(dst, manifest)
    shutil.rmtree(dst / STATE_DIR, ignore_errors=True)
    n = manifest["num_samples"]
    return {
        "manifest": manifest,
        "samples": n,
        "rejected": len(rejects),
        "shards": len(shards),
        "bytes": manifest["num_bytes"],
        "seconds": seconds,
        "samples_per_s": n / seconds if seconds else 0.0,
        "mb_per_s": manifest["num_bytes"] / 1e6 / seconds if seconds else 0.0,
        "resumed_shards": len(keep),
        "workers": workers,
    }
