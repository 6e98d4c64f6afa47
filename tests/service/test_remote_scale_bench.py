"""The scale-out benchmark runs tiny so that it cannot rot (speed is never asserted; the churn
scenario's exactly-once check is), and so does its `--base` comparison of two source trees."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench" / "remote_scale_bench.py"
# The last commit before the feed split (issue 48): its gdsload.service is one flat folder, so a
# comparison against it crosses the restructure on both ends.
BASE = "7cc061e"


def _bench():
    spec = importlib.util.spec_from_file_location("remote_scale_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_remote_scale_bench_tiny(tmp_path):
    pytest.importorskip("skimage")
    mod = _bench()
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


def test_verdict_places_head_over_base_against_the_aa_range():
    v = _bench()._verdict
    aa = {"median": 1.0, "min": 0.95, "max": 1.04}
    assert v({"median": 0.97, "min": 0.9, "max": 1.1}, aa, higher_is_better=True) == "inside"
    assert v({"median": 0.94, "min": 0.9, "max": 1.1}, aa, higher_is_better=True) == "head worse"
    assert v({"median": 1.05, "min": 1.0, "max": 1.1}, aa, higher_is_better=True) == "head better"
    # CPU per GB: lower is better
    assert v({"median": 1.05, "min": 1.0, "max": 1.1}, aa, higher_is_better=False) == "head worse"
    assert v({"median": 0.94, "min": 0.9, "max": 1.1}, aa, higher_is_better=False) == "head better"
    assert v({"median": 1.04, "min": 1.04, "max": 1.04}, aa, higher_is_better=False) == "inside"  # the edge
    assert v(None, aa, higher_is_better=False) == "n/a"


def test_a_tree_server_refuses_another_trees_gdsload(tmp_path):
    """SERVE_TREE, what --base starts servers with, exits rather than serve with the gdsload an
    editable install or the working directory provides when the tree has none."""
    mod = _bench()
    r = subprocess.run([sys.executable, "-c", mod.SERVE_TREE, str(tmp_path), str(tmp_path), "--listen",
                        "127.0.0.1:1"], capture_output=True, text=True, cwd=REPO, env=mod._tree_env(str(tmp_path)),
                       timeout=60)
    assert r.returncode != 0
    assert f"not from the tree {tmp_path}" in r.stderr


@pytest.mark.slow
def test_remote_scale_bench_base_tiny_runs_three_arms_of_their_own_trees(tmp_path):
    """`--tiny --base 7cc061e` end to end (~40 s on 2 cores): base, head and base2 (A/A) of every
    case, each client and its servers from its own tree, head/base and base/base with verdicts."""
    pytest.importorskip("skimage")
    if shutil.which("git") is None or subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{BASE}^{{commit}}"],
                                                     capture_output=True).returncode != 0:
        pytest.skip(f"needs git and commit {BASE} in this checkout")
    cpus = os.sched_getaffinity(0)
    r = _bench().main(["--tiny", "--base", BASE, "--throttle", "sigstop", "--workdir", str(tmp_path),
                       "--out", str(tmp_path / "r.json")])
    assert json.loads((tmp_path / "r.json").read_text())["rows"] == r["rows"]
    rows = {(x["scenario"], x["payload"], str(x["servers"])): x for x in r["rows"]}
    assert set(rows) == {("scale", "raw", "1"), ("scale", "raw", "2"), ("wire", "raw", "tcp"), ("wire", "raw", "unix")}
    for row in rows.values():
        t = row["throughput"]
        assert set(t) == {"base", "head", "base2"} and all(t[arm]["median"] > 0 for arm in t)
        # one round: each ratio is that round's pair of runs
        assert row["head_over_base"]["median"] == pytest.approx(t["head"]["median"] / t["base"]["median"])
        assert row["base_over_base"]["median"] == pytest.approx(t["base2"]["median"] / t["base"]["median"])
        aa = row["base_over_base"]
        inside = aa["min"] <= row["head_over_base"]["median"] <= aa["max"]
        assert (row["verdict"] == "inside") == inside and row["verdict"] in ("inside", "head better", "head worse")
        assert set(row["cpu_s_per_gb"]) == {"base", "head", "base2"}
        assert row["cpu_verdict"] in ("inside", "head better", "head worse", "n/a")
    # every arm ran its own tree's gdsload (the client checked here; servers by SERVE_TREE's guard),
    # and the base is the flat feed of before the split, the head the packages of after it
    ran = {(run["arm"], run["gdsload_file"]) for run in r["runs"]}
    assert ran == {("base", str(tmp_path / f"base-{BASE}" / "gdsload" / "__init__.py")),
                   ("base2", str(tmp_path / f"base2-{BASE}" / "gdsload" / "__init__.py")),
                   ("head", str(REPO / "gdsload" / "__init__.py"))}
    assert (tmp_path / f"base-{BASE}" / "gdsload" / "service" / "client.py").is_file()
    assert (REPO / "gdsload" / "service" / "client" / "__init__.py").is_file()
    # interleaved: 3 arms per case, in an order that rotates from case to case
    orders = {}
    for run in r["runs"]:
        orders.setdefault(tuple(run["case"]), []).append(run["arm"])
    assert all(sorted(o) == ["base", "base2", "head"] for o in orders.values())
    assert len({tuple(o) for o in orders.values()}) == 3
    assert os.sched_getaffinity(0) == cpus
