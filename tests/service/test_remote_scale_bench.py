"""The scale-out benchmark runs tiny so that it cannot rot (speed is never asserted; the churn
scenario's exactly-once check is)."""

import importlib.util
import os
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "remote_scale_bench.py"


@pytest.mark.slow
def test_remote_scale_bench_tiny(tmp_path):
    pytest.importorskip("skimage")
    spec = importlib.util.spec_from_file_location("remote_scale_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cpus = os.sched_getaffinity(0)
    r = mod.main(["--tiny", "--scenarios", "churn,wire", "--throttle", "sigstop",
                  "--workdir", str(tmp_path), "--out", str(tmp_path / "r.json")])
    assert r["settings"]["throttle"] == "sigstop"
    assert r["churn"][0]["exactly_once_in_plan_order"] is True
    assert {w["transport"] for w in r["wire"]} == {"tcp", "unix"}
    assert all(w["socket_gb_per_s"]["median"] > 0 for w in r["wire"])
    assert (tmp_path / "r.json").is_file()
    # main() pins itself to the client's core while it runs; the rest of the suite gets them all back
    assert os.sched_getaffinity(0) == cpus
