"""Helpers shared by the conversion tests (imported as `convertkit`, like `tests/service/feedkit`)."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path


def write(path: Path, data: bytes) -> Path:
    """`data` at `path`, creating its folders."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def shard_list(dst: Path) -> list[tuple[str, int, str]]:
    """(name, bytes, sha256) of each shard in the manifest at `dst`, in its order."""
    m = json.loads((dst / "manifest.json").read_text())
    return [(s["name"], s["bytes"], s["sha256"]) for s in m["shards"]]


def random_jpeg_folder(root: Path, *, classes: int, per_class: int, seed: int, digits: int) -> Path:
    """`root/c{k}/im{i}.jpg` files of 20-40 KB of random bytes (not decodable: for conversions
    that run long, not for the loader)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    for c in range(classes):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(per_class):
            (root / f"c{c}" / f"im{i:0{digits}d}.jpg").write_bytes(rng.bytes(int(rng.integers(20_000, 40_000))))
    return root


def make_tar(path: Path, members: list[tuple[str, bytes]]) -> Path:
    """A ustar file at `path` holding `members` (name, bytes) in order, with a fixed mtime."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tf:
        for name, data in members:
            ti = tarfile.TarInfo(name)
            ti.size, ti.mtime = len(data), 1_600_000_000
            tf.addfile(ti, io.BytesIO(data))
    return path


def convert_and_kill(argv: list[str], ready: Callable[[], bool], *, timeout: float, poll: float) -> None:
    """Run `python -m gdsload convert ARGV...` and SIGKILL it as soon as `ready()` holds (checked
    every `poll` seconds); fails the test unless it really was killed mid-run within `timeout`."""
    proc = subprocess.Popen([sys.executable, "-m", "gdsload", "convert", *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if ready():
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(poll)
    finally:
        if proc.poll() is None and time.monotonic() >= deadline:
            proc.kill()
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL, (
        f"the conversion was not killed mid-run (rc {proc.returncode}): {out.decode()[-2000:]} {err.decode()[-2000:]}"
    )


def die(writer) -> None:
    """A `ShardWriter`'s process "dies" after the shards it finished are in place: its publisher
    thread has ended (a real death ends it too), its lock is released, and nothing else runs."""
    writer._published(wait=True)
    writer._stack.close()
