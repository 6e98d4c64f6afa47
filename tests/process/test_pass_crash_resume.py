"""A pass SIGKILLed at 5 seeded points, then resumed: the same output keys and bytes as an
uninterrupted pass, `fn` run again on at most one output shard's windows plus one batch; the
resume record refuses another fn, other options or another source version, naming it.

The killed pass is the CLI (`python -m gdsload process`, fn `passfns:frame_stats` imported from
this folder), killed by `GDSLOAD_PROCESS_KILL=POINT:N` (`gdsload.preprocess.unit`); N is drawn
from a seeded generator within the counts of the reference pass, so the kill always fires. The
resume runs here, with the same `module:qualname`.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import passfns
import pytest
from mediakit import assert_same_output, cli_env

import gdsload
from gdsload.errors import DestinationError
from gdsload.preprocess.unit import KILL_ENV

HERE = Path(__file__).parent
ARGS = ["--frames", "5:2", "--size", "45", "--batch-size", "3", "--shard-size", "16KiB", "-q"]
KW = dict(frames=(5.0, 2), size=45, batch_size=3, shard_size="16KiB")


@pytest.fixture(scope="module")
def reference(media_src: Path, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("ref") / "out"
    r = gdsload.process(media_src, out, passfns.frame_stats, **KW)
    return out, r


def _kill_pass(src: Path, dst: Path, point: str, n: int, log: Path) -> None:
    env = cli_env(**{KILL_ENV: f"{point}:{n}", "PASS_LOG": str(log)})
    p = subprocess.run([sys.executable, "-m", "gdsload", "process", str(src), str(dst), "--fn",
                        "passfns:frame_stats", *ARGS], cwd=HERE, env=env, capture_output=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, f"not killed at {point}:{n} (rc {p.returncode}): {p.stderr.decode()[-2000:]}"


def _counts(r: dict) -> dict[str, int]:
    return {"decode": r["windows"], "fn": r["batches"], "write": r["outputs"], "publish": r["shards"], "manifest": 1}


@pytest.mark.parametrize("point", ["decode", "fn", "write", "publish", "manifest"])
def test_sigkill_then_resume_is_exact(point: str, media_src: Path, reference, tmp_path: Path, monkeypatch) -> None:
    ref, r = reference
    n = random.Random(f"54-{point}").randint(1, _counts(r)[point])
    log = tmp_path / "fn.log"
    _kill_pass(media_src, tmp_path / "out", point, n, log)
    assert not (tmp_path / "out" / "manifest.json").exists()
    monkeypatch.setenv("PASS_LOG", str(log))
    got = gdsload.process(media_src, tmp_path / "out", passfns.frame_stats, resume=True, **KW)
    assert_same_output(tmp_path / "out", ref)
    assert gdsload.open_dataset(tmp_path / "out").keys() == gdsload.open_dataset(ref).keys()
    assert got["windows"] == r["windows"] and got["outputs"] == r["outputs"]
    # fn ran on every window at least once, and again on at most one shard's windows + one batch
    seen = Counter(log.read_text().splitlines())
    assert len(seen) == r["windows"]
    per_shard = max(s["samples"] for s in json.loads((ref / "manifest.json").read_text())["shards"])
    assert sum(seen.values()) - r["windows"] <= per_shard + KW["batch_size"], (point, n)


def test_resume_record_refuses_what_differs(media_src: Path, tmp_path: Path) -> None:
    """An interrupted pass resumed with another fn, other options or another version of the
    source is refused, naming what differs; the same pass resumed again is 'complete'."""
    out = tmp_path / "out"
    _kill_pass(media_src, out, "publish", 2, tmp_path / "log")
    with pytest.raises(DestinationError, match=r"fn passfns:frame_stats \(this one: passfns:speech_stats\)"):
        gdsload.process(media_src, out, passfns.speech_stats, resume=True, **KW)
    with pytest.raises(DestinationError, match=r"option batch_size=3 \(this one: 4\)"):
        gdsload.process(media_src, out, passfns.frame_stats, resume=True, **{**KW, "batch_size": 4})
    with pytest.raises(DestinationError, match=r"holds an interrupted pass; pass resume=True"):
        gdsload.process(media_src, out, passfns.frame_stats, **KW)
    src = tmp_path / "src"
    shutil.copytree(media_src, src)
    import mediakit as mk

    with gdsload.ShardWriter(src, append=True) as w:
        w.write({"__key__": "v9", "mp4": mk.video(1.0), "flac": mk.flac(0.5)})
    with pytest.raises(DestinationError, match=r"source dataset id \w+ version 1 \(this one: id \w+ version 2\)"):
        gdsload.process(src, out, passfns.frame_stats, resume=True, **KW)
    gdsload.process(media_src, out, passfns.frame_stats, resume=True, **KW)
    again = gdsload.process(media_src, out, passfns.frame_stats, resume=True, **KW)
    assert again["complete"] is True


def test_cli_summary_json_and_usage(media_src: Path, tmp_path: Path) -> None:
    env = cli_env()
    p = subprocess.run([sys.executable, "-m", "gdsload", "process", str(media_src), str(tmp_path / "o"), "--fn",
                        "passfns:speech_stats", "--speech", "1.5", "--fields", "flac", "--json",
                        str(tmp_path / "s.json")], cwd=HERE, env=env, capture_output=True, timeout=120)
    assert p.returncode == 0, p.stderr.decode()
    out = p.stdout.decode()
    assert "media hours" in out and "stages (s): read" in out and "decode" in out and "write" in out
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["members"] == 6 and s["windows"] == sum(-(-x // 1.5) for x in (2.0, 1.0, 2.5, 1.2, 0.5, 3.0))
    assert "media hours" in p.stderr.decode()  # the progress line
    p = subprocess.run([sys.executable, "-m", "gdsload", "process", str(media_src), str(tmp_path / "u"), "--fn",
                        "passfns:speech_stats", "--speech", "1", "--frames", "1:2"], cwd=HERE, env=env,
                       capture_output=True, timeout=120)
    assert p.returncode == 2 and "not allowed with argument" in p.stderr.decode()
    p = subprocess.run([sys.executable, "-m", "gdsload", "process", str(media_src), str(tmp_path / "g"), "--fn",
                        "passfns:speech_stats", "--frames", "1:2", "--device", "cuda"], cwd=HERE, env=env,
                       capture_output=True, timeout=120)  # (no GPU here: --device reaches process() and is refused)
    assert p.returncode != 0 and "no usable CUDA device" in p.stderr.decode(), p.stderr.decode()
    assert not (tmp_path / "g" / "manifest.json").exists()


def test_sigterm_stops_the_cli_and_resume_finishes(media_src: Path, reference, tmp_path: Path) -> None:
    """SIGTERM mid-pass: exit status 143, no manifest, no half-written shard left under its name;
    --resume then writes the uninterrupted pass's bytes."""
    import time

    log = tmp_path / "fn.log"
    env = cli_env(PASS_LOG=str(log), PASS_SLOW="0.1")
    p = subprocess.Popen([sys.executable, "-m", "gdsload", "process", str(media_src), str(tmp_path / "out"), "--fn",
                          "passfns:frame_stats", *ARGS], cwd=HERE, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not log.exists() or log.read_text().count("\n") < 10):
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 143, err.decode()[-2000:]
    assert "interrupted" in err.decode() and not (tmp_path / "out" / "manifest.json").exists()
    gdsload.process(media_src, tmp_path / "out", passfns.frame_stats, resume=True, **KW)
    assert_same_output(tmp_path / "out", reference[0])
