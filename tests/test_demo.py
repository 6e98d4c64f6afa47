"""`gdsload demo --tiny` end to end, its failure paths, and the examples with `--tiny`.

The demo and the examples run as subprocesses: the demo forks PyTorch DataLoader workers, which
must not happen in a process that has run gRPC servers (as this test process may have).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NEEDS = ("torch", "webdataset", "grpc", "skimage", "nvidia.dali")


def _need_all() -> None:
    for module in NEEDS:
        pytest.importorskip(module)


def _run(args: list[str], cwd: Path, timeout: int = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, check=False,
                          timeout=timeout)


@pytest.mark.dali
def test_demo_tiny(tmp_path):
    _need_all()
    out = _run(["-m", "gdsload", "demo", "--tiny", "--workdir", str(tmp_path / "d"), "--json",
                str(tmp_path / "r.json")], tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    r = json.loads((tmp_path / "r.json").read_text())
    n = r["config"]["num_images"]
    assert r["convert"]["samples"] == n and r["convert"]["rejected"] == 0
    assert r["alignment"]["aligned"] == r["alignment"]["payloads_4k_or_more"] > 0
    steps, batch = r["config"]["steps"], r["config"]["batch_size"]
    for name in ("local", "remote", "torch"):
        assert r[name]["steps"] == steps and r[name]["samples"] == steps * batch, name
        assert r[name]["samples_per_s"] > 0 and 0 <= r[name]["stall_fraction"] <= 1, name
    for name in ("local", "remote"):  # checkpoint mid-epoch 0, and the resumed run went past epoch 0
        assert 0 < r[name]["checkpoint_step"] < r[name]["batches_per_epoch"] < steps
    assert r["local"]["stats"]["io_path"] == "posix" and r["local"]["stats"]["decode_device"] == "cpu"
    assert [row["loader"] for row in r["report"]] == [
        "gdsload.DataLoader", "gdsload.RemoteLoader (loopback)", "torch DataLoader (2 workers)"]
    text = out.stdout
    assert text.count("resume ok:") == 2 and "epoch 0 order equals the local loader's" in text
    assert "samples/s" in text and "data stall" in text and "demo finished" in text
    assert (tmp_path / "d" / "shards" / "train" / "manifest.json").exists()


@pytest.mark.dali
def test_demo_refuses_a_foreign_images_folder(tmp_path, capsys):
    _need_all()
    from gdsload.cli import main

    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "mine.txt").write_text("not the demo's")
    assert main(["demo", "--tiny", "--workdir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "mine.txt" in err and "--workdir" in err and "Traceback" not in err
    assert (tmp_path / "images" / "mine.txt").exists()


def test_resume_check_names_the_difference():
    from gdsload.demo import _check_resume
    from gdsload.errors import GdsloadError

    ref = [f"k{i}" for i in range(8)]
    _check_resume("x", ref[:3], ref[3:], ref)
    with pytest.raises(GdsloadError, match=r"missing \['k5'\]"):
        _check_resume("x", ref[:3], ref[3:5] + ref[6:], ref)
    with pytest.raises(GdsloadError, match="unexpected"):
        _check_resume("x", ref[:3], ref[2:], ref)  # one repeated
    with pytest.raises(GdsloadError, match="first 3 keys"):
        _check_resume("x", ref[1:4], ref[4:], ref)


def test_demo_cli_options():
    from gdsload.cli import build_parser

    a = build_parser().parse_args(["demo", "--tiny", "--steps", "9", "--json", "r.json"])
    assert a.tiny and a.steps == 9 and a.json == "r.json" and a.images is None


@pytest.mark.dali
@pytest.mark.slow
def test_example_imagefolder_torchrun_then_resume_on_one_process(tmp_path):
    """Two CPU ranks (gloo) train 3 steps of global batch 8 and checkpoint; one process resumes
    the same epoch with batch 8 (same global batch, other world size) and finishes 6 steps."""
    _need_all()
    paths = ["--tiny", "--src", str(tmp_path / "images"), "--shards", str(tmp_path / "shards"),
             "--checkpoint", str(tmp_path / "ck.pt")]
    script = str(ROOT / "examples" / "train_imagefolder.py")
    two = _run(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", script, *paths,
                "--max-steps", "3", "--batch-size", "4"], tmp_path)
    assert two.returncode == 0, two.stdout + two.stderr
    assert "epoch 0 step 3 " in two.stdout
    one = _run([script, *paths, "--resume"], tmp_path)
    assert one.returncode == 0, one.stdout + one.stderr
    assert "resumed at epoch 0, step 3" in one.stdout and "epoch 0 step 6 " in one.stdout


@pytest.mark.dali
@pytest.mark.slow
def test_example_remote(tmp_path):
    _need_all()
    out = _run([str(ROOT / "examples" / "train_remote.py"), "--tiny", "--checkpoint", str(tmp_path / "ck.pt")],
               tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "epoch 0 step 6 " in out.stdout and "0 reconnects" in out.stdout
    assert (tmp_path / "ck.pt").exists()
