"""`gdsload convert` on a full disk: an error naming DST, no temporary files left, `--resume`
finishes once there is space again, with the same bytes as a clean conversion.

Two ways of filling the disk: a real one (an 8 MiB tmpfs mounted in a private mount namespace,
`unshare -m`, or `unshare -rm` without root; skipped only where neither can mount), and an
injected one that always runs: the store's files are opened through a raw file that raises
ENOSPC once a byte budget is spent, below Python's buffering, as a full disk does (so `flush()`
and `close()` fail too).
"""

from __future__ import annotations

import errno
import io
import multiprocessing
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from convertkit import shard_list

import gdsload
from gdsload.cli import main
from gdsload.io import store as store_mod

OPTS = ["--shard-size", "64KB", "-q"]


def make_src(root: Path, n: int, seed: int = 7) -> Path:
    rng = np.random.default_rng(seed)
    for c in range(2):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(n // 2):
            (root / f"c{c}" / f"im{i:04d}.jpg").write_bytes(rng.bytes(int(rng.integers(15_000, 40_000))))
    return root


def temporaries(dst: Path) -> list[str]:
    return [str(p.relative_to(dst)) for p in dst.rglob("*") if ".tmp-" in p.name]


# -- a real full disk ----------------------------------------------------------------------------
def _unshare(target: Path) -> list[str] | None:
    """The `unshare` prefix that can mount a tmpfs on `target` here, or None."""
    exe = shutil.which("unshare")
    if exe is None or not sys.platform.startswith("linux"):
        return None
    for flags in (["-m"], ["-r", "-m"]):  # as root; else in a user namespace
        probe = subprocess.run([exe, *flags, "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {target}"],
                               capture_output=True, timeout=30)
        if probe.returncode == 0:
            return [exe, *flags]
    return None


def test_real_enospc_on_tmpfs_names_dst_cleans_up_and_resumes(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    prefix = _unshare(mnt)
    if prefix is None:
        pytest.skip("cannot mount a tmpfs here (no unshare, or no mount namespace without privileges)")
    src = make_src(tmp_path / "src", 120)  # ~3.3 MB of payloads, 4 MB of shards
    clean = tmp_path / "clean"
    assert main(["convert", str(src), str(clean), *OPTS, "--workers", "2"]) == 0
    out = tmp_path / "out"
    out.mkdir()
    py = sys.executable
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    # inside one private mount namespace: an 8 MiB tmpfs with 6 MiB taken by a filler file
    script = textwrap.dedent(f"""
        set -u
        mount -t tmpfs -o size=8m tmpfs {mnt}
        head -c 6291456 /dev/zero > {mnt}/filler
        {py} -m gdsload convert {src} {mnt}/ds {' '.join(OPTS)} --workers 2 2> {out}/err1
        echo $? > {out}/rc1
        (cd {mnt}/ds && find . -name '*.tmp-*') > {out}/tmp1
        {py} -m gdsload convert {src} {mnt}/ds {' '.join(OPTS)} --workers 2 --resume 2> {out}/err2
        echo $? > {out}/rc2
        rm {mnt}/filler
        {py} -m gdsload convert {src} {mnt}/ds {' '.join(OPTS)} --workers 2 --resume 2> {out}/err3
        echo $? > {out}/rc3
        cp -a {mnt}/ds {out}/ds
    """)
    proc = subprocess.run([*prefix, "sh", "-c", script], capture_output=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    read = lambda name: (out / name).read_text()  # noqa: E731

    # the full disk: exit 1, one line naming DST and the way on, no temporary file left behind
    assert read("rc1").strip() == "1", read("err1")
    err = read("err1")
    assert f"{mnt}/ds" in err and "No space left on device" in err and "--resume" in err, err
    assert "Traceback" not in err
    assert read("tmp1").strip() == "", read("tmp1")
    # still full: --resume fails the same clear way
    assert read("rc2").strip() == "1" and "No space left on device" in read("err2"), read("err2")
    # space back: --resume finishes, and the result is the clean conversion's bytes
    assert read("rc3").strip() == "0", read("err3")
    ds = out / "ds"
    assert shard_list(ds) == shard_list(clean)
    assert temporaries(ds) == [] and not (ds / ".gdsload-convert").exists()
    assert sorted(os.listdir(ds)) == sorted(os.listdir(clean))
    with gdsload.open_dataset(ds) as d:
        assert d.verify() == {} and len(d) == 120


# -- an injected full disk (always runs) ---------------------------------------------------------
class _FullDisk(io.RawIOBase):
    """A raw file on a disk with `free.value` bytes free (shared memory: forked workers write to
    the same disk): writes beyond it fail with ENOSPC, after a short write of what still fits, as
    write(2) does."""

    def __init__(self, raw: io.FileIO, free):
        self._raw, self._free = raw, free

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        with self._free.get_lock():
            n = min(len(b), self._free.value)
            if n == 0 and len(b):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self._free.value -= n
        return self._raw.write(memoryview(b)[:n])

    def fileno(self) -> int:
        return self._raw.fileno()

    def close(self) -> None:
        self._raw.close()
        super().close()


def full_disk(monkeypatch, free_nbytes: int, root: Path):
    """Every file the store writes under `root` from now on (in this process and forked workers)
    goes to a disk with `free_nbytes` free; returns the shared counter of free bytes. Both ways the
    store writes are covered: Python file objects (`open`, small files) and `os.write` on a file
    descriptor (shards, written with O_DIRECT), the latter told apart by the descriptor's path."""
    free = multiprocessing.get_context("fork").Value("q", free_nbytes)

    def open_on_full_disk(path, mode="r", *args, **kwargs):
        if "w" not in mode:
            return open(path, mode, *args, **kwargs)
        return io.BufferedWriter(_FullDisk(io.FileIO(path, "w"), free))

    real_write = os.write

    def write_on_full_disk(fd, data):
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            path = ""
        if not path.startswith(str(root)):
            return real_write(fd, data)
        want = memoryview(data).nbytes
        with free.get_lock():
            n = min(want, free.value)
            if n == 0 and want:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            free.value -= n
        return real_write(fd, memoryview(data).cast("B")[:n])

    monkeypatch.setattr(store_mod, "open", open_on_full_disk, raising=False)
    monkeypatch.setattr(os, "write", write_on_full_disk)
    return free


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    base = tmp_path_factory.mktemp("full")
    src = make_src(base / "src", 40)
    clean = base / "clean"
    assert main(["convert", str(src), str(clean), *OPTS, "--workers", "1"]) == 0
    total = sum(p.stat().st_size for p in clean.iterdir())
    return {"src": src, "clean": clean, "total": total}


@pytest.mark.parametrize("workers", ["1", "2"])
@pytest.mark.parametrize("where", [0.0, 0.01, 0.4, 0.97])
def test_injected_enospc_names_dst_cleans_up_and_resumes(small, tmp_path, monkeypatch, capsys, where, workers):
    """`where`: the fraction of the output that fits (0: not even the plan; 0.97: all shards but
    not the manifest, for one writer)."""
    dst = tmp_path / "dst"
    argv = ["convert", str(small["src"]), str(dst), *OPTS, "--workers", workers]
    free = full_disk(monkeypatch, int(where * small["total"]), dst)
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert str(dst) in err and "No space left on device" in err and "--resume" in err, err
    assert not (dst / "manifest.json").exists()
    assert temporaries(dst) == []
    # Still full: a new counter holding what is left (read without its lock). When one worker
    # hits ENOSPC the driver stops the other with SIGTERM; a worker that dies holding the
    # counter's lock never releases it, and the next run's workers would wait on it for ever.
    # CI timed out once in this resume run (300 s, workers=2) with one shared counter.
    full_disk(monkeypatch, free.get_obj().value, dst)
    assert main([*argv, "--resume"]) == 1
    assert "No space left on device" in capsys.readouterr().err
    assert temporaries(dst) == []

    monkeypatch.undo()  # space is back
    assert main([*argv, "--resume"]) == 0, capsys.readouterr().err
    assert shard_list(dst) == shard_list(small["clean"])
    assert sorted(os.listdir(dst)) == sorted(os.listdir(small["clean"]))
    with gdsload.open_dataset(dst) as d:
        assert d.verify() == {}


def test_write_errors_name_the_file(tmp_path, monkeypatch):
    """An ENOSPC from write() carries no file name; the store's error does."""
    full_disk(monkeypatch, 100, tmp_path)
    store = store_mod.open_store(tmp_path)
    with pytest.raises(OSError) as exc:
        store.write("a.bin", b"x" * 10_000)
    assert exc.value.errno == errno.ENOSPC and exc.value.filename == str(tmp_path / f".a.bin.tmp-{os.getpid()}")
    pending = store.create("b.tar")
    pending.write(b"y" * 100)
    with pytest.raises(OSError) as exc:
        pending.write(b"y" * 10_000)
        pending.commit()
    assert exc.value.errno == errno.ENOSPC and "b.tar" in exc.value.filename
    pending.abort()  # its close() fails to flush again; the temporary goes anyway
    assert os.listdir(tmp_path) == []
