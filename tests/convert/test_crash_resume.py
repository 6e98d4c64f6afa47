"""A `gdsload convert` killed mid-run (SIGKILL), then resumed, restarted or refused.

One conversion is run in a subprocess and killed as soon as it has finished a shard; each test
works on its own copy of the killed destination, so the (slow) kill happens once per module.
The reference is a clean conversion of the same source with the same options.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from convertkit import convert_and_kill, shard_list

import gdsload
from gdsload.cli import main
from gdsload.errors import FormatError

OPTS = ["--shard-size", "64KB", "--workers", "1", "-q"]
STATE = ".gdsload-convert"


def snapshot(root: Path) -> dict[str, tuple]:
    """Every file's size, mtime and hash, except the writer lock (`.gdsload.lock`: a killed run
    leaves it, unlocked; the next run, refused or not, takes it and removes it when done)."""
    out = {}
    for dirpath, _, filenames in os.walk(root):
        for n in filenames:
            if n == ".gdsload.lock":
                continue
            p = Path(dirpath) / n
            st = p.stat()
            out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """src (image folder), killed (DST of a SIGKILLed conversion), clean (reference conversion)."""
    base = tmp_path_factory.mktemp("crash")
    src = base / "src"
    rng = np.random.default_rng(42)
    for c in range(4):
        (src / f"class{c}").mkdir(parents=True)
        for i in range(80):  # 320 random-bytes "JPEGs" of 20-50 KB: ~1 sample per 64 KB shard
            (src / f"class{c}" / f"img{i:04d}.jpg").write_bytes(rng.bytes(int(rng.integers(20_000, 50_000))))

    killed = base / "killed"
    def one_shard_finished() -> bool:  # its tar under the final name and its record in the state dir
        done = killed / STATE / "done"
        return done.is_dir() and any(done.glob("*.json")) and any(killed.glob("shard-*.tar"))

    convert_and_kill([str(src), str(killed), *OPTS], one_shard_finished, timeout=60, poll=0.002)

    clean = base / "clean"
    assert main(["convert", str(src), str(clean), *OPTS]) == 0
    return {"base": base, "src": src, "killed": killed, "clean": clean}


@pytest.fixture
def dst(world, tmp_path) -> Path:
    """A private copy of the killed conversion's destination (mtimes preserved)."""
    d = tmp_path / "dst"
    shutil.copytree(world["killed"], d, symlinks=True)
    return d


# -- the state a kill leaves ---------------------------------------------------------------------
def test_killed_run_leaves_no_manifest_and_resumable_state(world):
    killed = world["killed"]
    assert not (killed / "manifest.json").exists()
    assert (killed / STATE / "plan.json").is_file()
    finished = sorted(p.name for p in killed.glob("shard-*.tar"))
    records = sorted(p.name for p in (killed / STATE / "done").glob("*.json"))
    assert finished and records
    # every finished shard is complete: both indexes next to it
    for name in finished:
        stem = name[: -len(".tar")]
        assert (killed / f"{stem}.idx").is_file() and (killed / f"{stem}.dali.idx").is_file()
    # the kill happened mid-run: far fewer shards than the full conversion has
    assert len(finished) < len(shard_list(world["clean"])) // 2


def test_opening_or_verifying_a_killed_run_fails_and_mentions_resume(world, capsys):
    with pytest.raises(FormatError, match="--resume") as exc:
        gdsload.open_dataset(world["killed"])
    assert "manifest.json" in str(exc.value)
    assert main(["verify", str(world["killed"])]) == 1
    err = capsys.readouterr().err
    assert "--resume" in err and str(world["killed"]) in err


def test_plain_rerun_is_refused_and_touches_nothing(world, dst, capsys):
    before = snapshot(dst)
    assert main(["convert", str(world["src"]), str(dst), *OPTS]) == 1
    err = capsys.readouterr().err
    assert "interrupted conversion" in err and "--resume" in err and "--overwrite" in err
    assert snapshot(dst) == before


# -- --resume ------------------------------------------------------------------------------------
def test_resume_keeps_finished_shards_and_matches_a_clean_conversion(world, dst, capsys):
    finished = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in dst.glob("shard-*")}
    leftovers = [p.name for p in dst.iterdir() if ".tmp-" in p.name]

    assert main(["convert", str(world["src"]), str(dst), *OPTS, "--resume"]) == 0
    out = capsys.readouterr().out
    m = re.search(r"; (\d+) shards kept from the interrupted run", out)
    assert m, out
    records = len(list((world["killed"] / STATE / "done").glob("*.json")))
    assert int(m.group(1)) == records >= 1

    # the finished shards were kept as they were, not rewritten
    for name, (ino, mtime) in finished.items():
        if (world["killed"] / STATE / "done" / f"{name.split('.')[0]}.json").exists():
            st = (dst / name).stat()
            assert (st.st_ino, st.st_mtime_ns) == (ino, mtime), name
    # byte-identical to a clean conversion, and complete
    assert shard_list(dst) == shard_list(world["clean"])
    for name, _, _ in shard_list(dst):
        stem = name[: -len(".tar")]
        for f in (f"{stem}.idx", f"{stem}.dali.idx"):
            assert (dst / f).read_bytes() == (world["clean"] / f).read_bytes()
    with gdsload.open_dataset(dst) as ds:
        assert ds.verify() == {}
        assert len(ds) == 320
    # no trace of the interrupted run is left
    assert not (dst / STATE).exists()
    assert not any(".tmp-" in n for n in os.listdir(dst)), leftovers
    assert sorted(os.listdir(dst)) == sorted(os.listdir(world["clean"]))
    assert main(["verify", str(dst)]) == 0


def test_overwrite_restarts_a_killed_run_from_scratch(world, dst, capsys):
    assert main(["convert", str(world["src"]), str(dst), *OPTS, "--overwrite"]) == 0
    out = capsys.readouterr().out
    assert "kept" not in out and "converted 320 samples" in out
    assert shard_list(dst) == shard_list(world["clean"])
    assert not (dst / STATE).exists()
    assert sorted(os.listdir(dst)) == sorted(os.listdir(world["clean"]))
    with gdsload.open_dataset(dst) as ds:
        assert ds.verify() == {}


def test_resume_with_other_options_is_refused(world, dst, capsys):
    before = snapshot(dst)
    argv = ["convert", str(world["src"]), str(dst), "--shard-size", "128KB", "--workers", "1", "-q", "--resume"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "other inputs or options" in err and "--overwrite" in err
    assert snapshot(dst) == before


def test_resume_after_the_inputs_changed_is_refused(world, dst, capsys):
    src = world["src"]
    victim = src / "class2" / "img0007.jpg"
    st = victim.stat()
    data = victim.read_bytes()
    argv = ["convert", str(src), str(dst), *OPTS, "--resume"]
    before = snapshot(dst)
    try:
        # touched: same bytes, new mtime
        os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert "inputs" in err and "changed" in err and "--overwrite" in err and str(dst) in err
        assert snapshot(dst) == before
        # modified: other content and size
        victim.write_bytes(data + b"more")
        assert main(argv) == 1
        assert "changed" in capsys.readouterr().err
        # a file added
        extra = src / "class0" / "zzz_new.jpg"
        victim.write_bytes(data)
        os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
        extra.write_bytes(b"\xff\xd8new")
        try:
            assert main(argv) == 1
            assert "changed" in capsys.readouterr().err
        finally:
            extra.unlink()
        assert snapshot(dst) == before
    finally:
        victim.write_bytes(data)
        os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    # inputs restored exactly: the resume is accepted again
    assert main(argv) == 0
    assert shard_list(dst) == shard_list(world["clean"])


def test_resume_after_bytes_changed_with_the_same_size_and_mtime_is_refused(world, dst, capsys):
    """An input of a shard the killed run finished, rewritten with other bytes of the same size
    and its mtime put back: before, --resume kept the shard made from the old bytes; now it is
    refused naming the shard, and nothing is touched."""
    src = world["src"]
    done = sorted(p.name[: -len(".json")] for p in (dst / STATE / "done").glob("shard-*.json"))
    assert done and done[0] == "shard-000000"
    victim = src / "class0" / "img0000.jpg"  # the first sample of the plan: in shard-000000
    st = victim.stat()
    data = victim.read_bytes()
    before = snapshot(dst)
    try:
        victim.write_bytes(bytes([data[0] ^ 0xFF]) + data[1:])
        os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert main(["convert", str(src), str(dst), *OPTS, "--resume"]) == 1
        err = capsys.readouterr().err
        assert "inputs changed" in err and "shard-000000" in err and "img0000.jpg" in err, err
        assert snapshot(dst) == before
    finally:
        victim.write_bytes(data)
        os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
