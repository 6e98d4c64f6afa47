"""`gdsload convert --resume` on a dataset that is already finished.

Same inputs and options: nothing to do, exit 0, the dataset left exactly as it was. Anything
else: a refusal (exit 1) that says what differs, and the dataset left as it was.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from gdsload.cli import main

OPTS = ["--shard-size", "64KB", "--workers", "1", "-q"]


def snapshot(root: Path) -> dict[str, tuple]:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(root.iterdir()) if p.is_file()}


@pytest.fixture
def done(tmp_path):
    """`src` (an image folder) and `dst`, its finished conversion."""
    src = tmp_path / "src"
    rng = np.random.default_rng(5)
    for c in range(2):
        (src / f"c{c}").mkdir(parents=True)
        for i in range(6):
            (src / f"c{c}" / f"im{i}.jpg").write_bytes(rng.bytes(int(rng.integers(20_000, 40_000))))
    dst = tmp_path / "dst"
    assert main(["convert", str(src), str(dst), *OPTS]) == 0
    return src, dst


def test_same_inputs_and_options_is_complete_and_exits_0(done, capsys):
    src, dst = done
    capsys.readouterr()
    before = snapshot(dst)
    assert main(["convert", str(src), str(dst), *OPTS, "--resume"]) == 0
    out = capsys.readouterr().out
    assert "already complete" in out and "12 samples" in out and "nothing to resume" in out, out
    assert snapshot(dst) == before
    # the worker count is not an output option: still the same conversion
    assert main(["convert", str(src), str(dst), "--shard-size", "64KB", "--workers", "2", "-q", "--resume"]) == 0
    assert snapshot(dst) == before


@pytest.mark.parametrize("extra, says", [
    (["--shard-size", "128KB"], "--shard-size was 64000, now 128000"),
    (["--shuffle"], "--shuffle was False, now True"),
    (["--prefix", "train"], "--prefix was 'shard', now 'train'"),
])
def test_other_options_are_refused_naming_the_option(done, capsys, extra, says):
    src, dst = done
    before = snapshot(dst)
    assert main(["convert", str(src), str(dst), *OPTS, *extra, "--resume"]) == 1  # the last --shard-size wins
    err = capsys.readouterr().err
    assert says in err and "--overwrite" in err and str(dst) in err, err
    assert snapshot(dst) == before


def test_changed_inputs_are_refused(done, capsys):
    src, dst = done
    before = snapshot(dst)
    victim = src / "c1" / "im3.jpg"
    victim.write_bytes(victim.read_bytes() + b"x")
    assert main(["convert", str(src), str(dst), *OPTS, "--resume"]) == 1
    err = capsys.readouterr().err
    assert "inputs changed" in err and "--overwrite" in err, err
    assert snapshot(dst) == before


def test_another_source_is_refused(done, tmp_path, capsys):
    src, dst = done
    other = tmp_path / "other"
    shutil.copytree(src, other)
    before = snapshot(dst)
    assert main(["convert", str(other), str(dst), *OPTS, "--resume"]) == 1
    err = capsys.readouterr().err
    assert f"it was made from {src}, not {other}" in err, err
    assert snapshot(dst) == before


def test_a_finished_dataset_with_a_missing_shard_is_refused(done, capsys):
    src, dst = done
    (dst / "shard-000001.tar").unlink()
    assert main(["convert", str(src), str(dst), *OPTS, "--resume"]) == 1
    err = capsys.readouterr().err
    assert "shard-000001.tar is missing" in err and "--overwrite" in err, err


def test_a_manifest_without_fingerprint_is_refused(done, capsys):
    """A dataset made by an older gdsload cannot be matched to this run: refused, not guessed."""
    src, dst = done
    m = json.loads((dst / "manifest.json").read_text())
    del m["created"]["fingerprint"]
    (dst / "manifest.json").write_text(json.dumps(m))
    assert main(["convert", str(src), str(dst), *OPTS, "--resume"]) == 1
    assert "records no input fingerprint" in capsys.readouterr().err


def test_overwrite_with_resume_still_reconverts(done, capsys):
    src, dst = done
    before = snapshot(dst)
    assert main(["convert", str(src), str(dst), *OPTS, "--resume", "--overwrite"]) == 0
    assert "converted 12 samples" in capsys.readouterr().out
    after = snapshot(dst)
    assert after.keys() == before.keys()
    assert after["shard-000000.tar"][1] != before["shard-000000.tar"][1]  # rewritten
    assert os.listdir(dst).count("manifest.json") == 1


def test_changed_bytes_with_the_same_size_and_mtime_are_refused(done, capsys):
    """Before: one input rewritten with other bytes of the same size, its mtime put back, and
    `--resume` said "already complete" (exit 0) and kept the old bytes. Now the SHA-256 of each
    shard's inputs, recorded when it was written, is compared with the inputs read again."""
    src, dst = done
    before = snapshot(dst)
    victim = src / "c1" / "im3.jpg"
    st = victim.stat()
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert victim.stat().st_size == st.st_size and victim.stat().st_mtime_ns == st.st_mtime_ns
    assert main(["convert", str(src), str(dst), *OPTS, "--resume"]) == 1
    err = capsys.readouterr().err
    assert "inputs changed" in err and "same sizes and mtimes" in err and "im3.jpg" in err, err
    assert "--overwrite" in err
    assert snapshot(dst) == before
