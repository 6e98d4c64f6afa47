"""The share benchmark runs tiny so that it cannot rot (speed is never asserted; the paused job's
exactly-once check and that the shared jobs got copies are)."""

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "share_bench.py"


@pytest.mark.slow
def test_share_bench_tiny(tmp_path):
    pytest.importorskip("skimage")
    pytest.importorskip("nvidia.dali")
    spec = importlib.util.spec_from_file_location("share_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    r = mod.main(["--tiny", "--cases", "solo,shared,pause", "--workdir", str(tmp_path), "--out",
                  str(tmp_path / "r.json")])
    assert r["pause_exact_epoch_in_order"] == [True]
    assert r["shared_copies_per_round"][0] > 0
    assert r["figures"]["shared_cpu_ratio"]["median"] > 0
    assert (tmp_path / "r.json").is_file()
