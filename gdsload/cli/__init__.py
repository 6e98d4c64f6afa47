"""The `gdsload` command: convert, inspect, verify, doctor, demo, bench, serve, process.

Exit status: 0 on success, 1 when gdsload refuses or fails with a message (bad input, a
destination that holds a dataset, a shard that fails verification), 2 for usage errors, 130 on
Ctrl-C (SIGINT), 143 on SIGTERM during `convert`. Errors print one line naming the problem to stderr, never a traceback
(`GDSLOAD_DEBUG=1` shows it).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gdsload import sizes
from gdsload.cli.signals import Terminated, sigterm_interrupts  # noqa: F401  (gdsload.cli.Terminated)
from gdsload.errors import GdsloadError

parse_size = sizes.argparse_size  # a size argument (`512MB`, `1GiB`; rules in `gdsload.sizes`)


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n}"


# -- commands ------------------------------------------------------------------------------------
def cmd_convert(a: argparse.Namespace) -> int:
    from gdsload.host.malloc import keep_large_blocks

    keep_large_blocks()  # megabyte batches and write buffers: no page faults each (gdsload.host.malloc)
    with sigterm_interrupts():
        return _convert(a)


def _convert(a: argparse.Namespace) -> int:
    from gdsload.convert.engine import ConvertOptions

    opts = ConvertOptions(
        shard_size=a.shard_size, workers=a.workers, shuffle=a.shuffle, seed=a.seed,
        validate=a.validate, resume=a.resume, overwrite=a.overwrite, format=a.format,
        labels=a.labels, prefix=a.prefix, progress=not a.quiet, columns=a.columns, append=a.append,
    )
    if a.tokenizer or a.text_field or a.src.endswith((".jsonl", ".jsonl.gz")):
        return _convert_corpus(a)
    if a.engine == "ray":
        from gdsload.convert.columnar import is_columnar
        from gdsload.convert.ray_engine import convert_ray

        if a.append or a.columns or a.format in ("parquet", "arrow") or (not a.format and is_columnar(a.src)):
            raise GdsloadError("--engine ray converts file sources into a new dataset; Parquet/Arrow inputs and "
                               "--append run with the local engine")

        r = convert_ray(a.src, a.dst, opts, address=a.ray_address)
    elif a.ray_address:
        raise GdsloadError(f"--ray-address {a.ray_address} applies to --engine ray only (engine is {a.engine!r})")
    else:
        from gdsload.convert.route import convert_any

        r = convert_any(a.src, a.dst, opts)
    if r.get("complete"):
        print(f"{a.dst}: already complete ({r['samples']} samples in {r['shards']} shards, made from the "
              f"same inputs and options); nothing to resume")
        return 0
    print(
        f"{'appended' if r.get('appended') else 'converted'} {r['samples']} samples into {r['shards']} shards ({_human(r['bytes'])}) in "
        f"{r['seconds']:.1f} s: {r['samples_per_s']:.0f} samples/s, {r['mb_per_s']:.1f} MB/s, "
        f"{r['workers']} worker(s)"
        + (f"; {r['resumed_shards']} shards kept from the interrupted run" if r["resumed_shards"] else "")
    )
    m = r["manifest"]
    n = len(m.get("classes") or [])
    classes = f"{n} class{'es' if n != 1 else ''}" if n else "no classes"
    print(f"input: {m['created']['source_format']} ({'--format' if a.format else 'detected'}), {classes}"
          + (", labels from .cls" if "cls" in m["fields"] and not m.get("classes") else ""))
    print(convert_fields(m))
    if r["rejected"]:
        print(f"{r['rejected']} inputs rejected and left out: see {os.path.join(a.dst, 'rejected.jsonl')}")
    for field, count in m["created"].get("fortran_to_c", {}).items():
        print(f"{count} Fortran-ordered .{field} arrays stored in C order (same values)")
    return 0


def _convert_corpus(a: argparse.Namespace) -> int:
    """A text corpus (JSON lines, or Parquet/Arrow with --tokenizer): `gdsload.convert.tokens`."""
    from gdsload.convert.tokens import convert_corpus

    for flag, on in (("--append", a.append), ("--resume", a.resume), ("--shuffle", a.shuffle),
                     ("--validate", a.validate), ("--labels", a.labels), ("--engine ray", a.engine == "ray")):
        if on:
            raise GdsloadError(f"{flag} does not apply to a text corpus (.jsonl or --tokenizer)")
    r = convert_corpus(a.src, a.dst, tokenizer=a.tokenizer, text_field=a.text_field or "text", columns=a.columns,
                       shard_size=a.shard_size, workers=a.workers, prefix=a.prefix, overwrite=a.overwrite)
    what = f"{r['tokens']} tokens of {r['samples']} documents" if "tokens" in r else f"{r['samples']} documents"
    print(f"converted {what} into {r['shards']} shards ({_human(r['bytes'])}) in {r['seconds']:.1f} s, "
          f"{r['workers']} worker(s)")
    return 0


def convert_fields(m: dict[str, Any]) -> str:
    """The summary's line naming the dataset's fields (the keys of a loader's batches), each with
    its kind and, for a Parquet/Arrow input, the column it came from: an HF `Image` column is named
    by its images' type (`png`), which a user looking for `jpg` needs to see."""
    columns = {f: c for c, f in (m["created"].get("columns") or {}).items()}
    return "fields: " + ", ".join(f"{f} ({kind}" + (f", column {columns[f]!r})" if f in columns else ")")
                                  for f, kind in m["fields"].items())


def media_summary(ds: Any) -> dict[str, Any]:
    """Per video/audio field: codecs (with counts) and the ranges of the probed metadata, from the
    indexes' media columns (`gdsload.format.index`); `unprobed`: members converted before probing."""
    import numpy as np

    out: dict[str, Any] = {}
    for name, kind in ds.manifest["fields"].items():
        if kind not in ("video", "audio"):
            continue
        md: dict[str, Any] = {"kind": kind, "codecs": {}, "unprobed": 0}
        for s in range(len(ds.shards)):
            idx = ds.index(s)
            got = idx.media.get(name)
            has = sum(1 for j in range(idx.num_samples) if any(e == name for e, _, _ in idx.members(j)))
            if got is None:
                md["unprobed"] += has
                continue
            desc, table = got
            rows = table[~np.isnan(table[:, 0])]
            for c, n in zip(*np.unique(rows[:, 0].astype(int), return_counts=True)):
                md["codecs"][desc["codecs"][c]] = md["codecs"].get(desc["codecs"][c], 0) + int(n)
            for k, col in enumerate(desc["columns"]):
                if col in ("codec", "full_range") or not len(rows) or np.isnan(rows[:, k]).all():
                    continue
                if col in desc.get("values", {}):  # text: the values seen
                    seen = md.setdefault(col, {})
                    for v in rows[:, k][~np.isnan(rows[:, k])].astype(int).tolist():
                        seen[desc["values"][col][v]] = seen.get(desc["values"][col][v], 0) + 1
                    continue
                lo, hi = float(np.nanmin(rows[:, k])), float(np.nanmax(rows[:, k]))
                old = md.get(col)
                md[col] = [lo, hi] if old is None else [min(old[0], lo), max(old[1], hi)]
        out[name] = md
    return out


def cmd_inspect(a: argparse.Namespace) -> int:
    from gdsload.dataset.sharded import open_dataset

    with open_dataset(a.dataset) as ds:
        m = ds.manifest
        info = {
            "path": ds.root,
            "samples": len(ds),
            "shards": len(ds.shards),
            "bytes": m["num_bytes"],
            "fields": m["fields"],
            "classes": len(ds.classes) if ds.classes else None,
            "alignment": ds.alignment(),
            "created": m.get("created", {}),
            "versions": m.get("versions"),  # after appends: one entry per version (Dataset(version=K))
        }
        media = media_summary(ds)
        if media:
            info["media"] = media
        if "cls" in ds.fields:
            hist = ds.class_histogram()
            names = ds.classes or []
            info["class_histogram"] = {
                (names[k] if 0 <= k < len(names) else str(k)): v for k, v in sorted(hist.items())
            }
    if a.json:
        print(json.dumps(info, indent=1))
        return 0
    al = info["alignment"]
    print(f"dataset   {info['path']}")
    print(f"samples   {info['samples']}")
    print(f"shards    {info['shards']}  ({_human(info['bytes'])}, mean {_human(info['bytes'] / max(info['shards'], 1))})")
    print("fields    " + ", ".join(f"{k} ({v})" for k, v in info["fields"].items()))
    print(f"alignment {al['aligned']}/{al['payloads_4k_or_more']} payloads of 4 KiB or more start 4096-aligned "
          f"({al['smaller_payloads']} smaller payloads need no alignment)")
    for name, md in info.get("media", {}).items():
        ranges = ", ".join([f"{k} {v[0]:g}..{v[1]:g}" for k, v in md.items() if isinstance(v, list)]
                           + [f"{k} {'/'.join(v)}" for k, v in md.items() if isinstance(v, dict) and k != "codecs"])
        codecs = ", ".join(f"{c} x{n}" for c, n in md["codecs"].items())
        print(f"{md['kind']:<9} {name}: {codecs}; {ranges}" + (f"; {md['unprobed']} not probed" if md["unprobed"] else ""))
    c = info["created"]
    if c:
        print(f"created   {c.get('at', '?')} by {c.get('by', '?')} from {c.get('source_format', '?')} "
              f"{c.get('source', '')} ({c.get('rejected', 0)} rejected)")
    for v in info["versions"] or []:
        print(f"version   {v['version']}: {v['num_samples']} samples in {v['shards']} shards, {v.get('at', '?')}"
              + (f" (+{v['appended']} appended from {v.get('source', v.get('source_format', '?'))})"
                 if v.get("appended") else ""))
    hist = info.get("class_histogram")
    if hist:
        print(f"classes   {len(hist)}")
        top = max(hist.values())
        for name, n in list(hist.items())[: a.max_classes]:
            print(f"  {name:<24} {n:>8}  {'#' * max(1, round(30 * n / top))}")
        if len(hist) > a.max_classes:
            print(f"  ... {len(hist) - a.max_classes} more (use --max-classes)")
    return 0


def cmd_verify(a: argparse.Namespace) -> int:
    from gdsload.dataset.sharded import open_dataset

    with open_dataset(a.dataset) as ds:
        bad = ds.verify(hashes=not a.no_hash)
        listed = {s["name"] for s in ds.shards}
        n = len(ds.shards)
    if not bad:
        print(f"ok: {n} shards verified (sizes, {'' if a.no_hash else 'hashes, '}index against tar, "
              f"alignment, DALI index; no shard files outside the manifest)")
        return 0
    for name, problems in bad.items():
        for p in problems:
            print(f"BAD {name}: {p}", file=sys.stderr)
    shards = sum(name in listed for name in bad)
    extra = len(bad) - shards
    print(f"{shards} of {n} shards failed verification"
          + (f"; {extra} files in the folder are not listed in the manifest" if extra else ""), file=sys.stderr)
    return 1


def cmd_doctor(a: argparse.Namespace) -> int:
    from gdsload import doctor

    report = doctor.collect()
    print(json.dumps(report, indent=1) if a.json else doctor.render(report))
    return 0


def cmd_demo(a: argparse.Namespace) -> int:
    from gdsload import demo

    overrides = {k: v for k, v in (("num_images", a.images), ("num_classes", a.classes), ("steps", a.steps),
                                    ("batch_size", a.batch_size), ("seed", a.seed)) if v is not None}
    result = demo.run(a.workdir, tiny=a.tiny, **overrides)
    if a.json:
        demo.write_json(result, a.json)
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    import json as _json

    from gdsload.bench.harness import format_table, run_suite
    from gdsload.dataset.sharded import open_dataset

    with open_dataset(a.dataset) as ds:
        kind = "image" if "image" in ds.fields.values() else "tensor"
        media = next((k for k in ds.manifest["fields"].values() if k in ("video", "audio")), None)
    if media:  # clips or log-mel against torch + PyAV, SPDL, torchcodec (gdsload.bench.media)
        from gdsload.bench.media import format_media, run_media

        r = run_media(a.dataset, contestants=["gdsload", "torch_pyav", "spdl", "torchcodec"], rounds=a.rounds,
                      batch_size=min(a.batch_size, 16), log=lambda m: print(m, file=sys.stderr))
        print(format_media(r))
        if a.json:
            Path(a.json).write_text(_json.dumps(r, indent=1))
        return 0
    contestants = ["gdsload", "torch", "read"] + (["dali", "decode1"] if kind == "image" else [])
    r = run_suite(a.dataset, kind=kind, tiers=a.tiers.split(",") if kind == "image" else ["R"],
                  contestants=contestants, rounds=a.rounds, batch_size=a.batch_size,
                  step_ms=a.step_ms, log=lambda m: print(m, file=sys.stderr))
    print(format_table(r))
    if a.json:
        Path(a.json).write_text(_json.dumps(r, indent=1) + "\n")
    return 0


# -- parser --------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gdsload", description="GPU-direct data pipeline for training.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    c = sub.add_parser("convert", help="convert a dataset into aligned WebDataset shards",
                       description="Convert an image folder (CLASS/IMAGE), a folder of KEY.EXT files, "
                       "WebDataset tars (file, folder or brace pattern), a folder of .npy files, a Parquet file "
                       "or folder, or a HuggingFace datasets save_to_disk folder.")
    c.add_argument("src", help="source folder, .tar file, or pattern like 'train-{000000..000099}.tar'; "
                   "a local path or an fsspec URL (s3://bucket/train)")
    c.add_argument("dst", help="destination folder or fsspec URL (new or empty, unless --resume/--overwrite)")
    c.add_argument("--format", choices=["imagefolder", "files", "tar", "npy", "parquet", "arrow"],
                   help="source layout (default: detected); arrow: a datasets save_to_disk folder")
    c.add_argument("--columns", metavar="COL:FIELD,...",
                   help="Parquet/Arrow: which columns become which fields, e.g. image:jpg,label:cls,caption:txt "
                   "(id:__key__ for the keys; default: detected)")
    c.add_argument("--tokenizer", metavar="TOKENIZER_JSON",
                   help="a text corpus (.jsonl[.gz], or Parquet/Arrow with --columns COL:txt) into token shards, "
                        "tokenized with this local HF tokenizers tokenizer.json (without it: text shards)")
    c.add_argument("--text-field", metavar="FIELD", help="the text field of a .jsonl corpus (default 'text')")
    c.add_argument("--append", action="store_true",
                   help="add the samples to the dataset in DST as a new version (its shards are kept as they are)")
    c.add_argument("--shard-size", type=parse_size, default=parse_size("1GiB"), metavar="SIZE",
                   help="target shard size, e.g. 512MB, 1GiB (default 1GiB)")
    c.add_argument("--workers", type=int, default=None, help="parallel writers (default: all cores)")
    c.add_argument("--shuffle", action="store_true", help="pre-shuffle samples across shards")
    c.add_argument("--seed", type=int, default=0, help="seed for --shuffle (default 0)")
    c.add_argument("--validate", action="store_true",
                   help="decode every image; rejects go to DST/rejected.jsonl and are left out")
    c.add_argument("--labels", help="labels file for an .npy folder (CSV 'key,label' or JSON {key: label})")
    c.add_argument("--prefix", default="shard", help="shard file name prefix (default 'shard')")
    c.add_argument("--resume", action="store_true", help="continue an interrupted conversion into DST")
    c.add_argument("--overwrite", action="store_true", help="replace the gdsload dataset in DST")
    c.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    c.add_argument("--engine", choices=["local", "ray"], default="local",
                   help="where shards are written: local processes (default) or Ray tasks "
                   "(pip install 'gdsload[ray]'); the output is the same")
    c.add_argument("--ray-address", metavar="ADDR",
                   help="Ray cluster to join with --engine ray (default: $RAY_ADDRESS, else a local instance)")
    c.set_defaults(func=cmd_convert)

    i = sub.add_parser("inspect", help="summarise a dataset: samples, shards, fields, classes, alignment")
    i.add_argument("dataset")
    i.add_argument("--json", action="store_true", help="machine-readable output")
    i.add_argument("--max-classes", type=int, default=20, help="classes shown in the histogram")
    i.set_defaults(func=cmd_inspect)

    v = sub.add_parser("verify", help="check hashes, index against tar, alignment; non-zero if bad")
    v.add_argument("dataset")
    v.add_argument("--no-hash", action="store_true", help="skip SHA-256 (faster)")
    v.set_defaults(func=cmd_verify)

    m = sub.add_parser("demo", help="the whole product on sample data: convert, serve, train, resume, compare",
                       description="Generate an ImageNet-like JPEG folder, convert and verify it, train a tiny "
                       "torch model fed by gdsload.DataLoader, by RemoteLoader from a loopback server and by "
                       "PyTorch's DataLoader, checkpoint and resume mid-epoch, and print a report. Needs "
                       "torch, webdataset and the cpu (or cudaNN), demo and serve extras.")
    m.add_argument("--workdir", default="gdsload-demo", help="where the sample data goes (default ./gdsload-demo)")
    m.add_argument("--tiny", action="store_true", help="tiny sizes: the whole demo in a few seconds (for tests)")
    m.add_argument("--images", type=int, help="number of images (default 800; 48 with --tiny)")
    m.add_argument("--classes", type=int, help="number of classes (default 10; 3 with --tiny)")
    m.add_argument("--steps", type=int, help="training steps per loader (default 100; 8 with --tiny)")
    m.add_argument("--batch-size", type=int, help="batch size (default 32; 8 with --tiny)")
    m.add_argument("--seed", type=int)
    m.add_argument("--json", help="also write every figure of the run here")
    m.set_defaults(func=cmd_demo)

    b = sub.add_parser("bench", help="benchmark gdsload against PyTorch+webdataset, DALI and raw reads on a dataset "
                                     "(video/audio datasets: against torch+PyAV, SPDL and torchcodec)")
    b.add_argument("dataset")
    b.add_argument("--tiers", default="R,D,T", help="R raw bytes, D decode+resize, T decode+train transform")
    b.add_argument("--rounds", type=int, default=5)
    b.add_argument("--batch-size", type=int, default=256)
    b.add_argument("--step-ms", type=float, default=0.0, help="synthetic training step per batch (ms)")
    b.add_argument("--json", help="also write the results here")
    b.set_defaults(func=cmd_bench)

    d = sub.add_parser("doctor", help="what this host can do: CUDA, GDS, KvikIO, CuPy, DALI, torch")
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=cmd_doctor)

    from gdsload.cli.serve import (
        add_serve_parser,  # stdlib-only at import; grpc on first use
    )

    add_serve_parser(sub)
    from gdsload.cli.process import add_process_parser

    add_process_parser(sub)
    return p


def run(args: argparse.Namespace, command: str) -> int:
    """Run a parsed command, turning the errors a user can cause into one line on stderr and an
    exit status (`GDSLOAD_DEBUG=1` re-raises them). Shared by `gdsload` and `python -m gdsload.service`."""
    try:
        return args.func(args)
    except GdsloadError as exc:
        if os.environ.get("GDSLOAD_DEBUG"):
            raise
        print(f"gdsload {command}: error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `gdsload inspect ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt as exc:
        print(f"gdsload {command}: interrupted", file=sys.stderr)
        return 128 + getattr(exc, "signum", signal.SIGINT)
    except OSError as exc:  # storage the user pointed at: permissions, a missing bucket, the network
        if os.environ.get("GDSLOAD_DEBUG"):
            raise
        print(f"gdsload {command}: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run(args, args.command)


if __name__ == "__main__":
    sys.exit(main())
