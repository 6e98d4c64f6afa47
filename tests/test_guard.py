"""bench/guard.py (issue 55): the verdict rule, and a tiny run of the whole guard (A/B and A/A of
tier R on a few images, HEAD against this checkout) that writes its JSON with a verdict per figure.
Its figures mean nothing; the test checks the shape only."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _load(name):
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_verdict_is_the_a_a_range():
    v = _load("guard").verdict
    assert v(1.00, 0.97, 1.03) == "inside the A/A spread"
    assert v(0.97, 0.97, 1.03) == "inside the A/A spread"  # the range's ends are inside
    assert "SLOWER" in v(0.90, 0.97, 1.03) and "faster" in v(1.10, 0.97, 1.03)
    # first batch: a time, lower is better
    assert "faster" in v(0.80, 0.97, 1.03, higher_is_better=False)
    assert "SLOWER" in v(1.20, 0.97, 1.03, higher_is_better=False)


def test_the_guard_runs_and_writes_a_verdict_per_figure(tmp_path):
    pytest.importorskip("torch")
    if subprocess.run(["git", "-C", str(BENCH.parent), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    out = tmp_path / "guard.json"
    r = _load("guard").main(["--base", "HEAD", "--rounds", "1", "--images", "24", "--tiers", "R",
                             "--workdir", str(tmp_path / "w"), "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["verdicts"] == r["verdicts"]
    assert set(r["verdicts"]) == {"tier R samples/s, head/base", "tier R first batch s, head/base"}
    for v in r["verdicts"].values():
        assert v["verdict"].startswith(("inside", "outside")) and v["aa"]["min"] <= v["aa"]["max"]
    assert r["ab"]["tiers"]["R"]["samples"] == 24 and r["aa"]["base"] == "HEAD"
