"""Which writer a `gdsload convert` goes through.

File sources (image folders, `KEY.EXT` folders, tars, `.npy` folders) into a new dataset go
through `engine.convert`, which plans shards from file sizes and writes them in parallel.
Columnar sources (Parquet, `datasets` Arrow folders) and every `--append` go through the public
writer (`writer.write`): rows have no sizes before they are read, and an append continues the
dataset's shard sequence. Both give output bytes that do not depend on the worker count.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from gdsload.convert import columnar
from gdsload.convert.engine import ConvertOptions, convert, read_ref
from gdsload.convert.sources import Sample, list_source
from gdsload.convert.writer import write
from gdsload.errors import InputError


def convert_any(src: str, dst: str, opts: ConvertOptions = ConvertOptions(), *,
                log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """`gdsload convert SRC DST` with every option; returns the summary `engine.convert` returns."""
    fmt = opts.format
    kind = fmt if fmt in ("parquet", "arrow") else (None if fmt else columnar.is_columnar(src))
    if kind is not None:
        return convert_columnar(src, dst, opts, kind=kind)
    if opts.columns:
        raise InputError("--columns applies to Parquet and Arrow inputs only")
    if opts.append:
        return append_files(src, dst, opts)
    return convert(src, dst, opts, log=log)


def _workers(opts: ConvertOptions) -> int:
    return max(1, opts.workers or os.cpu_count() or 1)


def convert_columnar(src: str, dst: str, opts: ConvertOptions = ConvertOptions(), *, kind: str | None = None,
                     batch_nbytes: int = columnar.BATCH_NBYTES) -> dict[str, Any]:
    """Convert a Parquet or `datasets` Arrow source (see `columnar`); every column and option is
    checked before anything is written."""
    if opts.shuffle:
        raise InputError("--shuffle is not supported for Parquet and Arrow inputs (rows are written in order)")
    t0 = time.perf_counter()
    source = columnar.open_columnar(src, kind)
    cols, classes = columnar.plan_columns(source, opts.columns)
    rows = columnar.Rows(source, cols, batch_nbytes)
    workers = min(_workers(opts), len(source.units))
    m = write(rows, source.units, dst, workers=workers, shard_size=opts.shard_size, prefix=opts.prefix,
              classes=classes, append=opts.append, resume=opts.resume, overwrite=opts.overwrite,
              validate=opts.validate, progress=opts.progress, source_format=source.kind, executor="thread",
              created={"source": src, "columns": {c.name: c.field for c in cols}})
    return summary(m, t0, workers)


def _sample_dict(sample: Sample) -> dict[str, Any]:
    out: dict[str, Any] = {"__key__": sample.key}
    try:
        for ext, ref in sample.fields:
            out[ext] = read_ref(ref)
    except OSError as exc:
        return {"__key__": sample.key, "__reject__": f"unreadable: {exc}"}
    return out


def append_files(src: str, dst: str, opts: ConvertOptions = ConvertOptions()) -> dict[str, Any]:
    """`--append` of a file source: its samples, listed as `convert` lists them, added as a new
    version of the dataset at `dst` (labels renumbered into the dataset's class list)."""
    t0 = time.perf_counter()
    listing = list_source(src, opts.format, labels=opts.labels)  # type: ignore[arg-type]
    if not listing.samples:
        raise InputError(f"{src}: nothing to append (all {len(listing.rejects)} inputs were rejected)")
    workers = min(_workers(opts), len(listing.samples))
    m = write(_sample_dict, listing.samples, dst, workers=workers, shard_size=opts.shard_size,
              prefix=opts.prefix, classes=listing.classes, append=True, resume=opts.resume,
              validate=opts.validate, progress=opts.progress, source_format=listing.format, executor="thread",
              created={"source": src})
    return summary(m, t0, workers)


def summary(manifest: dict[str, Any], t0: float, workers: int) -> dict[str, Any]:
    """What `engine.convert` returns, for a dataset written by `write` (on an append: the new
    version's samples, shards and bytes)."""
    seconds = time.perf_counter() - t0
    history = manifest.get("versions") or []
    last = history[-1] if history else {}
    new = manifest["shards"][history[-2]["shards"] if len(history) > 1 else 0:]
    n = sum(s["samples"] for s in new)
    nbytes = sum(s["bytes"] for s in new)
    return {"manifest": manifest, "complete": False, "samples": n,
            "rejected": last.get("rejected", manifest.get("created", {}).get("rejected", 0)),
            "shards": len(new), "bytes": nbytes,
            "seconds": seconds, "samples_per_s": n / seconds if seconds else 0.0,
            "mb_per_s": nbytes / 1e6 / seconds if seconds else 0.0, "resumed_shards": 0, "workers": workers,
            "appended": len(manifest.get("versions") or []) > 1}
