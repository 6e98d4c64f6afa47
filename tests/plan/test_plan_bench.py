"""bench/plan_bench.py runs as a tiny test so that it cannot rot (speed is never asserted)."""

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "plan_bench.py"


def test_plan_bench_tiny(tmp_path):
    spec = importlib.util.spec_from_file_location("plan_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    r = mod.main(["--tiny", "--sizes", "1e4", "--workdir", str(tmp_path), "--out", str(tmp_path / "r.json")])
    rows = {(row["n"], row["order"]): row for row in r["rows"]}
    assert set(rows) == {(10_000, 1), (10_000, 2)}
    for row in rows.values():
        assert row["first_batch_s_median"] > 0 and row["hwm_growth_mb_median"] >= 0 and row["elastic_equal"]
    assert json.loads((tmp_path / "r.json").read_text())["bench"] == "plan_bench"
