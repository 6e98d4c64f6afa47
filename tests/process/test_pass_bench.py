"""bench/pass_bench.py --tiny runs (speed is never asserted): the pass and the PyAV pool write the
same number of outputs from a generated corpus; the peak-RSS mode reports both passes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "pass_bench.py"


def _load():
    spec = importlib.util.spec_from_file_location("pass_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["pass_bench"] = mod  # its process pools pickle its functions by module name
    spec.loader.exec_module(mod)
    return mod


def test_pass_bench_tiny(tmp_path: Path) -> None:
    bench = _load()
    common = ["--tiny", "--cache", str(tmp_path / "cache"), "--workdir", str(tmp_path / "work")]
    for mode in ("frames", "speech"):
        r = bench.main([*common, "--mode", mode, "--contestants", "gdsload,pyav_pool,ray_data",
                        "--out", str(tmp_path / f"{mode}.json")])
        c = r["contestants"]
        assert c["gdsload"]["outputs"] == c["pyav_pool"]["outputs"] > 0, mode
        assert r["ratio_gdsload_over"]["pyav_pool"] > 0 and (tmp_path / f"{mode}.json").is_file()
        assert "ray_data" in c or "ray[data]" in r["skipped"]["ray_data"]
    r = bench.main([*common, "--rss", "--out", str(tmp_path / "rss.json")])
    assert r["rss"]["long"]["vm_hwm_mb"] > 0 and r["rss"]["ratio_long_over_short"] > 0
