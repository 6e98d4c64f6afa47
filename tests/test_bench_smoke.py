"""Benchmarks run as tiny tests so that they cannot rot (speed is never asserted)."""

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_convert_bench_tiny(tmp_path):
    pytest.importorskip("webdataset")
    r = _load("convert_bench").main(["--tiny", "--workdir", str(tmp_path), "--out", str(tmp_path / "r.json")])
    assert r["source"]["images"] == 40
    assert r["ratio_samples_per_s"]["median"] > 0
    assert (tmp_path / "r.json").is_file()
