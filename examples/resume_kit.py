"""What the three `*_resume.py` examples share: their tiny dataset, and the loader they train on,
local (`gdsload.DataLoader`) or, with `--feed`, pulled from a feed server on loopback
(`gdsload.RemoteLoader`: the same batches and the same resume, with no glue either).

The examples import it as a sibling module (`python examples/NAME.py` puts examples/ on the path).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

import gdsload

FEED: str | None = None  # --feed: "HOST:PORT" of the server `start_feed` started


def tiny_dataset(path: Path, n: int = 48) -> None:
    """`n` samples, each an 8-float `npy` row equal to its index and a `cls` label."""
    with gdsload.ShardWriter(str(path), shard_size="48KiB", classes=["a", "b", "c"]) as w:
        for i in range(n):
            w.write({"__key__": f"{i:04d}", "npy": np.full(8, i, np.float32), "cls": i % 3})


def open_loader(shards: str, **kw):
    """The training's loader: `gdsload.DataLoader(shards)`, or after `start_feed` a
    `gdsload.RemoteLoader` of the same dataset from that server."""
    if FEED is None:
        return gdsload.DataLoader(shards, **kw)
    return gdsload.RemoteLoader(FEED, dataset=Path(shards).name, **kw)


def start_feed(shards: str) -> object:
    """A feed server on loopback serving `shards` (--feed); `open_loader` reads from it from now on.
    Returns the server (shut it down with `server.stop(None)`)."""
    global FEED
    from gdsload.service import create_server

    server, port = create_server([str(Path(shards).parent)], address="127.0.0.1:0")
    server.start()
    FEED = f"127.0.0.1:{port}"
    return server
