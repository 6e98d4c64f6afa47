"""`gdsload process SRC DST --fn MODULE:FUNC (--frames FPS:WINDOW | --speech CHUNK_S)`: a pass.

One flag per keyword of `gdsload.process` (`gdsload.preprocess.run`). MODULE is imported with the
current directory first on `sys.path` (as `python -m` would), so `--fn mymodel:ocr` finds
`./mymodel.py`. Prints the summary (media hours, seconds per stage) or, with `--json`, writes it.
`gdsload/cli/__init__.py` registers the command with `add_process_parser`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from gdsload.cli.signals import sigterm_interrupts


def _frames(text: str) -> tuple[float, int]:
    fps, sep, window = text.partition(":")
    try:
        f, w = float(fps), int(window)
    except ValueError:
        f = w = 0
    if not sep or f <= 0 or w <= 0:
        raise argparse.ArgumentTypeError(f"invalid --frames {text!r}: FPS:WINDOW, e.g. 1.0:8")
    return f, w


def add_process_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from gdsload.sizes import argparse_size

    p = subparsers.add_parser(
        "process", help="run a function over every video/recording of a dataset, write its outputs (a pass)",
        description="Every member of the dataset's video (and audio) fields once, in stored order: frames "
        "sampled at FPS in windows of WINDOW frames, or speech in chunks of CHUNK_S seconds (mono, 16 kHz); "
        "FUNC is called per batch and its outputs are written to DST as a dataset. Crash-safe: --resume "
        "continues exactly. See docs/preprocessing.md.")
    p.add_argument("src", help="source dataset (folder or fsspec URL)")
    p.add_argument("dst", help="output dataset folder (new or empty, unless --resume/--overwrite)")
    p.add_argument("--fn", required=True, metavar="MODULE:FUNC",
                   help="the function (or class: instantiated once per process) called per batch")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--frames", type=_frames, metavar="FPS:WINDOW", help="frames at FPS, WINDOW per window")
    mode.add_argument("--speech", type=float, metavar="CHUNK_S", help="speech chunks of CHUNK_S seconds")
    p.add_argument("--fields", metavar="F1,F2", help="fields to decode (default: every video field; speech: "
                   "every audio and video field)")
    p.add_argument("--size", type=int, help="resize frames: the short side to SIZE pixels")
    p.add_argument("--batch-size", type=int, default=16, help="windows per call of FUNC (default 16)")
    p.add_argument("--shard-size", type=argparse_size, default=argparse_size("1GiB"), metavar="SIZE",
                   help="output shard size, e.g. 512MB (default 1GiB); shards are cut per input shard")
    p.add_argument("--workers", type=int, help="worker processes (default: this process)")
    p.add_argument("--on-error", choices=["raise", "skip"], default="raise",
                   help="undecodable media: fail, or skip and list in DST/rejected.jsonl")
    p.add_argument("--max-hours", type=float, default=None, help="longest member decoded, hours (default 24)")
    p.add_argument("--resume", action="store_true", help="continue an interrupted pass into DST")
    p.add_argument("--overwrite", action="store_true", help="replace the gdsload dataset in DST")
    p.add_argument("--feed", metavar="HOST:PORT", help="decode on this feed server (gdsload serve), at --priority")
    p.add_argument("--priority", type=int, default=0, help="the pass's priority on the feed (with --feed)")
    p.add_argument("--feed-token-file", metavar="PATH",
                   help="a file holding this client's token for the feed (with --feed; gdsload serve --token-file)")
    p.add_argument("--engine", choices=["local", "ray"], default="local",
                   help="where units run: here / --workers processes, or Ray tasks (pip install 'gdsload[ray]')")
    p.add_argument("--ray-address", metavar="ADDR", help="Ray cluster to join with --engine ray")
    p.add_argument("--device", default="auto", metavar="auto|cpu|cuda[:N]",
                   help="where frames decode: auto (NVDEC on a GPU host, else the CPU), cpu, or cuda[:N] (insists)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress")
    p.add_argument("--json", metavar="PATH", help="also write the summary here")
    p.set_defaults(func=cmd_process)
    return p


def process(src: Any, dst: Any, fn: Any, *, feed: Any = None, priority: int = 0, feed_token: str | None = None,
            **kwargs: Any) -> dict[str, Any]:
    """`gdsload.process`: `gdsload.preprocess.run.process` (its docstring) with `feed` given as a
    feed server's address, `HOST:PORT`: the pass's windows are decoded there, at `priority`, with
    `feed_token` where the server wants one (`gdsload.service.client.passfeed.WindowFeed`; run
    training at priority >= 1 so the pass yields to it). Here because the pass and the feed's
    client are peers that do not import each other (tests/test_layers.py)."""
    from gdsload.errors import InputError
    from gdsload.preprocess.run import process as run_process

    if feed_token is not None and not isinstance(feed, str):
        raise InputError("process(feed_token=) goes with feed= given as an address (a WindowFeed has its own token)")
    if isinstance(feed, str):
        from gdsload.service.client.passfeed import WindowFeed

        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InputError(f"process(priority={priority!r}): an integer")
        feed = WindowFeed(feed, priority=priority, token=feed_token)
    return run_process(src, dst, fn, feed=feed, priority=priority, **kwargs)


def cmd_process(a: argparse.Namespace) -> int:
    from gdsload.preprocess.options import MAX_HOURS

    sys.path.insert(0, os.getcwd())
    with sigterm_interrupts():
        r = process(a.src, a.dst, a.fn, frames=a.frames, speech=a.speech, fields=a.fields, size=a.size,
                    batch_size=a.batch_size, shard_size=a.shard_size, workers=a.workers, on_error=a.on_error,
                    resume=a.resume, overwrite=a.overwrite, feed=a.feed, priority=a.priority, engine=a.engine,
                    feed_token=Path(a.feed_token_file).read_text().strip() if a.feed_token_file else None,
                    max_hours=a.max_hours if a.max_hours is not None else MAX_HOURS, ray_address=a.ray_address,
                    progress=not a.quiet, device=a.device)
    print(summary_text(r, a.dst))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({k: v for k, v in r.items() if k != "manifest"}, f, indent=1)
    return 0


def summary_text(r: dict[str, Any], dst: str) -> str:
    if r.get("complete"):
        return f"{dst}: already complete ({r['outputs']} outputs in {r['shards']} shards, the same pass); nothing to resume"
    st = r["stages"]
    lines = [f"processed {r['media_hours']:.3f} media hours ({r['members']} members, {r['windows']} windows, "
             f"{r['batches']} batches) into {r['outputs']} outputs in {r['shards']} shards in {r['seconds']:.1f} s: "
             f"{r['media_hours_per_s'] * 3600:.0f} media s/s, {r['workers']} worker(s), engine {r['engine']}",
             f"stages (s): read {st['read']:.2f}, decode {st['decode']:.2f}, fn {st['fn']:.2f}, write {st['write']:.2f}"]
    if r.get("resumed_units"):
        lines.append(f"{r['resumed_units']} input shards kept from the interrupted pass")
    if r["fields_without_stream"]:
        lines.append(f"{r['fields_without_stream']} members had no stream to decode (counted, not rejected)")
    if r["rejected"]:
        lines.append(f"{r['rejected']} members rejected: see {os.path.join(dst, 'rejected.jsonl')}")
    return "\n".join(lines)
