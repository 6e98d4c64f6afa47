"""The remote benchmark runs as a tiny test so that it cannot rot (speed is never asserted)."""

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "remote_bench.py"


@pytest.mark.dali
def test_remote_bench_tiny(tmp_path):
    pytest.importorskip("skimage")
    spec = importlib.util.spec_from_file_location("remote_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    r = mod.main(["--tiny", "--workdir", str(tmp_path), "--out", str(tmp_path / "r.json")])
    assert r["dataset"]["images"] == 48
    assert {(row["payload"], row["consumers"]) for row in r["rows"]} == {
        ("raw", 1), ("raw", 4), ("decoded", 1), ("decoded", 4)}
    # CPU comes from /proc/PID/stat in 10 ms ticks: a tiny run's server may use none of them
    assert all(row["ratio"]["median"] > 0 and row["server_cpu_s_per_gb"] >= 0 for row in r["rows"])
    assert (tmp_path / "r.json").is_file()
