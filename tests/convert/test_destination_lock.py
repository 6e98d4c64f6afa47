"""One conversion per destination: a second `gdsload convert` into a DST that another is writing
fails at once (exit 1), naming the holder (pid and host), and touches nothing.

The holder is a real conversion, stopped (SIGSTOP) while it holds the lock, so the test does not
race it; then killed, which releases the lock (the kernel drops it with the process), so a stale
lock file blocks no one.
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from convertkit import random_jpeg_folder
import pytest

import gdsload
from gdsload.cli import main
from gdsload.errors import DestinationError
from gdsload.io.store import LOCK, LocalStore

OPTS = ["--shard-size", "64KB", "--workers", "1", "-q"]


def snapshot(root: Path) -> dict[str, tuple]:
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != LOCK:
            st = p.stat()
            out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
    return out


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return random_jpeg_folder(tmp_path_factory.mktemp("lock") / "src", classes=2, per_class=100, seed=11, digits=3)


@pytest.fixture
def stopped_holder(src, tmp_path):
    """A `gdsload convert --overwrite` into `dst` (which holds a finished dataset), stopped while
    it writes; yields (process, dst). Killed at the end."""
    dst = tmp_path / "dst"
    assert main(["convert", str(src), str(dst), *OPTS]) == 0
    proc = subprocess.Popen([sys.executable, "-m", "gdsload", "convert", str(src), str(dst), *OPTS, "--overwrite"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not (dst / ".gdsload-convert" / "done").is_dir() or not any((dst / ".gdsload-convert" / "done").iterdir()):
            assert proc.poll() is None and time.monotonic() < deadline, "the holder never got going"
            time.sleep(0.002)
        proc.send_signal(signal.SIGSTOP)
        yield proc, dst
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)


@pytest.mark.parametrize("mode", ["--overwrite", "--resume"])
def test_second_run_fails_at_once_naming_the_holder(src, stopped_holder, capsys, mode):
    holder, dst = stopped_holder
    before = snapshot(dst)
    t0 = time.monotonic()
    assert main(["convert", str(src), str(dst), *OPTS, mode]) == 1
    assert time.monotonic() - t0 < 10  # no waiting for the holder
    err = capsys.readouterr().err
    assert "being written by another gdsload conversion" in err, err
    assert f"pid {holder.pid} on host {socket.gethostname()}" in err and str(dst) in err, err
    assert snapshot(dst) == before


def test_lock_goes_with_a_killed_holder_and_resume_finishes(src, stopped_holder, capsys):
    holder, dst = stopped_holder
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    assert (dst / LOCK).exists()  # left behind by the kill, but no longer locked
    assert main(["convert", str(src), str(dst), *OPTS, "--resume"]) == 0, capsys.readouterr().err
    assert not (dst / LOCK).exists()
    assert main(["verify", str(dst)]) == 0
    with gdsload.open_dataset(dst) as ds:
        assert len(ds) == 200


def test_two_overwrites_at_once_leave_one_exact_dataset(src, tmp_path):
    """The race of the report: two `--overwrite` runs started together. Each either converts or
    is refused with the lock message (never a raw error), and the result verifies, with no shard
    file the manifest does not list."""
    dst = tmp_path / "dst"
    assert main(["convert", str(src), str(dst), *OPTS]) == 0
    argv = [sys.executable, "-m", "gdsload", "convert", str(src), str(dst), *OPTS, "--overwrite"]
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    results = [(p.wait(timeout=300), p.stderr.read().decode()) for p in procs]
    for p in procs:
        p.stdout.close()
        p.stderr.close()
    for rc, err in results:
        assert rc == 0 or (rc == 1 and "being written by another gdsload conversion" in err), err
    assert any(rc == 0 for rc, _ in results)
    assert main(["verify", str(dst)]) == 0
    with gdsload.open_dataset(dst) as ds:
        assert len(ds) == 200
        listed = {s["name"] for s in ds.shards}
    assert {p.name for p in dst.glob("*.tar")} == listed


def test_lock_is_exclusive_within_a_host_and_released(tmp_path):
    store = LocalStore(tmp_path / "d")
    with store.lock():
        assert (tmp_path / "d" / LOCK).read_text().startswith(f"pid {os.getpid()} on host ")
        with pytest.raises(DestinationError, match=f"pid {os.getpid()}"):
            with LocalStore(tmp_path / "d").lock():  # a second open file description: refused too
                pass
    assert not (tmp_path / "d" / LOCK).exists()
    with store.lock():  # and free again
        pass
