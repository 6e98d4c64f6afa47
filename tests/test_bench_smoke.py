"""Benchmarks run as tiny tests so that they cannot rot (speed is never asserted)."""

import importlib.util
import json
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


def test_writer_bench_tiny(tmp_path):
    pytest.importorskip("webdataset")
    pytest.importorskip("pyarrow")
    # litdata is not a test dependency (it pulls torchvision); the lead's runs include it
    r = _load("writer_bench").main(["--tiny", "--contestants", "gdsload,webdataset", "--workdir", str(tmp_path),
                                    "--out", str(tmp_path / "r.json")])
    assert r["source"]["rows"] == 200 and r["workers"] == 2
    assert r["ratio_vs_better_baseline"]["median"] > 0 and r["gdsload"]["cpu_s_per_gb"] > 0
    assert json.loads((tmp_path / "r.json").read_text())["bench"] == "writer"


@pytest.mark.dali
def test_loader_bench_tiny(tmp_path):
    pytest.importorskip("webdataset")
    pytest.importorskip("torch")
    r = _load("loader_bench").main(["--tiny", "--workdir", str(tmp_path), "--out", str(tmp_path / "r.json")])
    t = r["images"]["tiers"]["T"]
    assert {"gdsload", "torch", "dali", "read", "decode1"} <= set(t)
    assert t["torch"]["ratio_gdsload_over"]["median"] > 0 and t["gdsload"]["samples_per_s"] > 0
    assert r["tensors"]["tiers"]["R"]["read"]["ratio_bytes_gdsload_over"]["median"] > 0
    assert (tmp_path / "r.json").is_file()


def test_gdsload_bench_cli_refuses_unlabelled_data(tmp_path, capsys):
    from gdsload.cli import main
    from gdsload.convert.shards import DatasetWriter

    with DatasetWriter(tmp_path / "d") as w:
        w.write("a", {"bin": b"x"})
    assert main(["bench", str(tmp_path / "d"), "--rounds", "1"]) == 1
    assert "needs a 'cls' field" in capsys.readouterr().err


@pytest.mark.dali
def test_loader_bench_prefetch_sweep_tiny(tmp_path):
    """The auto-vs-fixed prefetch sweep runs end to end and reports auto's distance from the best."""
    pytest.importorskip("webdataset")
    pytest.importorskip("torch")
    mod = _load("loader_bench")
    jpg, _ = mod.ensure_data(tmp_path, images=48, tensors=48, tiny=True)
    r = mod.prefetch_sweep(jpg, [5.0], batch_size=16, rounds=1, log=lambda *_: None)["5.0"]
    assert set(r["wait_fraction"]) == {str(p) for p in mod.SWEEP}
    assert r["best_fixed"] != "auto" and r["auto_chose"][0] >= 2

def test_cache_bench_tiny_gdsload(tmp_path):
    """The object-store benchmark's gdsload contestants (cache cold and warm, ranges, local) over
    its latency- and bandwidth-capped local S3 server."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    import os

    before = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "S3_ENDPOINT_URL")}
    r = _load("cache_bench").main(["--tiny", "--contestants", "gdsload", "--workdir", str(tmp_path),
                                   "--out", str(tmp_path / "r.json")])
    # its store is gone: the session's S3 endpoint (tests/conftest.py::s3) must be back in place
    assert {k: os.environ.get(k) for k in before} == before
    t = r["tiers"]["R"]
    assert t["agree"] and {t[c]["samples"] for c in ("gdsload-cache", "gdsload-warm", "gdsload-ranges",
                                                      "gdsload-local")} == {48}
    fetched = t["gdsload-cache"]["runs"][0]["stats"]["cache"]["fetches"]
    assert fetched > 0  # the warm run's second epoch fetched nothing more:
    assert t["gdsload-warm"]["runs"][0]["stats"]["cache"]["fetches"] == fetched
    assert t["cache_over_ranges"]["median"] > 0 and (tmp_path / "r.json").is_file()


def test_map_bench_tiny(tmp_path):
    pytest.importorskip("webdataset")
    pytest.importorskip("torch")
    r = _load("map_bench").main(["--tiny", "--workdir", str(tmp_path), "--out", str(tmp_path / "r.json")])
    assert r["gdsload"]["samples_per_s"] > 0 and r["torch"]["samples_per_s"] > 0
    assert r["ratio_gdsload_over_torch"]["median"] > 0
    assert json.loads((tmp_path / "r.json").read_text())["args"]["samples"] == 64


def test_tree_compare_tiny(tmp_path):
    """The committed tree (HEAD) against this checkout, tier R on a few images."""
    import subprocess

    pytest.importorskip("torch")
    if subprocess.run(["git", "-C", str(BENCH.parent), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    r = _load("tree_compare").main(["--base", "HEAD", "--workdir", str(tmp_path), "--images", "24", "--rows", "8",
                                    "--tiers", "R,N", "--rounds", "1", "--out", str(tmp_path / "r.json")])
    assert r["tiers"]["R"]["samples"] == 24 and r["tiers"]["N"]["samples"] == 8
    assert r["tiers"]["R"]["head_over_base"]["median"] > 0
    assert (tmp_path / "r.json").is_file()


def test_first_epoch_tiny(tmp_path):
    """This checkout against itself on a few images, traced: every part timed, fills recorded."""
    pytest.importorskip("torch")
    from gdsload.convert.engine import ConvertOptions, convert
    from gdsload.sampledata import make_image_folder

    make_image_folder(tmp_path / "img", num_images=24, num_classes=3, seed=1)
    convert(str(tmp_path / "img"), tmp_path / "ds", ConvertOptions(workers=1, progress=False))
    ds = str(tmp_path / "ds")
    r = _load("first_epoch").main(["--base-tree", str(BENCH.parent), "--base-data", ds, "--head-data", ds,
                                   "--samples", "24", "--batch-size", "8", "--rounds", "1", "--trace",
                                   "--out", str(tmp_path / "r.json")])
    for row in r["trees"].values():
        assert 0 < row["first_s"] <= row["wall_s"] and len(row["reader_gap_ms"]) == 1
    runs = json.loads((tmp_path / "r.json").read_text())["runs"]
    assert sorted(seq for seq, *_ in runs["head"][0]["fills"]) == [0, 1, 2]
