"""`gdsload convert`: list the source, plan shards, write them in parallel, manifest last.

The unit of work is a pure function, `write_shard(dst, name, samples, validate)`: a slice of the
input in, one finished shard (tar, `.idx`, `.dali.idx`) plus its rejects out. The plan (which
samples go to which shard, in which order) is fixed before any shard is written, from file sizes
alone, so the output is byte-identical for any number of workers, and an interrupted conversion
can resume shard by shard.

SRC and DST may be local paths or fsspec URLs (`sources` lists, `gdsload.format.store` writes).

Crash safety: shards are published only when complete (a temporary name and a rename locally, one
upload to the final name at a URL); each finished shard leaves a record in
`DST/.gdsload-convert/done/`; `manifest.json` is written after every shard is in place. A killed
run therefore leaves either a dataset with a manifest, or a folder with no manifest and a
resumable state that `--resume` continues (and that plain `convert` refuses to touch without
`--resume` or `--overwrite`).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import re
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from gdsload.convert.sources import Listing, Ref, Sample, SourceFormat, list_source, read_range
from gdsload.errors import DestinationError, FormatError, InputError
from gdsload.format import manifest as mf
from gdsload.format.manifest import field_kind
from gdsload.format.store import Store, is_remote, local_path, open_store, url_to_fs
from gdsload.format.tar import ALIGN, BLOCK
from gdsload.format.writer import ShardWriter, make_manifest, shard_name

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
    store = open_store(dst)
    w = ShardWriter(store, name)
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
    if store.exists(f"{STATE_DIR}/{PLAN}"):  # inside a conversion: leave the done record
        store.write(f"{STATE_DIR}/done/{name}.json", json.dumps(result).encode())
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


def _clean(dst: Store) -> None:
    dst.remove(mf.MANIFEST)  # first: the folder stops looking complete
    for name in dst.list():
        if name == STATE_DIR:
            dst.remove_tree(name)
        elif _ours(name):
            dst.remove(name)


def prepare_destination(dst: Store, opts: ConvertOptions, fp: str) -> set[str]:
    """Make `dst` ready; return the names of shards a resumed run can keep."""
    where = dst.root
    if dst.is_file():
        raise DestinationError(f"{where}: exists and is not a folder")
    entries = dst.list()
    if entries:
        has_manifest, has_state = mf.MANIFEST in entries, STATE_DIR in entries
        ours = has_manifest or has_state
        foreign = sorted(n for n in entries if not (ours and _ours(n)))
        if has_manifest and not opts.overwrite:
            raise DestinationError(
                f"{where} already holds a dataset ({mf.MANIFEST} exists); pass --overwrite to replace it"
            )
        if has_state and not (opts.resume or opts.overwrite):
            raise DestinationError(
                f"{where} holds an interrupted conversion; pass --resume to continue it or "
                f"--overwrite to start over"
            )
        if foreign:
            raise DestinationError(
                f"{where} is not empty and holds files that are not gdsload's ({', '.join(foreign[:3])}"
                f"{', ...' if len(foreign) > 3 else ''}); choose an empty or new folder"
            )
        if opts.resume and has_state and not has_manifest:
            try:
                old = json.loads(dst.read(f"{STATE_DIR}/{PLAN}"))
            except (OSError, json.JSONDecodeError):
                old = {}
            if old.get("fingerprint") != fp:
                raise DestinationError(
                    f"{where}: the interrupted conversion used other inputs or options (its inputs "
                    f"changed since); re-run with the same options, or --overwrite to start over"
                )
            for name in entries:  # leftovers of writers that were killed
                if name.startswith(".") and ".tmp-" in name:
                    dst.remove(name)
            keep = set()
            for rec in dst.list(f"{STATE_DIR}/done"):
                if not rec.endswith(".json") or rec.startswith("."):
                    continue
                entry = json.loads(dst.read(f"{STATE_DIR}/done/{rec}")).get("entry")
                if entry is None or (
                    dst.size(entry["name"]) == entry["bytes"]
                    and dst.size(entry["index"]) is not None
                    and dst.size(entry["dali_index"]) is not None
                ):
                    keep.add(rec[: -len(".json")])
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


def convert(src: str, dst: str | Path, opts: ConvertOptions = ConvertOptions(),
            *, log: Callable[[str], None] | None = None, runner: UnitRunner | None = None) -> dict[str, Any]:
    """Convert `src` into a gdsload dataset at `dst`; returns a summary with the manifest.

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
    keep = prepare_destination(store, opts, fp)
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
        for _ in runner(store.root, [(names[i], plan[i]) for i in todo], opts.validate, workers, report):
            finished[0] += 1
    elif workers == 1:
        for i in todo:
            write_shard(store.root, names[i], plan[i], opts.validate, report)
            finished[0] += 1
    else:
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        queue = ctx.Queue()
        with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=(queue,)) as pool:
            futs = {pool.submit(write_shard, store.root, names[i], plan[i], opts.validate) for i in todo}
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
        r = json.loads(store.read(f"{STATE_DIR}/done/{name}.json"))
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
    mf.save(store, manifest)
    store.remove_tree(STATE_DIR)
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
