"""`gdsload convert --engine ray` against a local Ray cluster started by this module.

Covers `gdsload/convert/ray_engine.py` and the `runner` hook of `engine.convert`: the output is
byte-identical to the local engine's (manifest apart from timing); a task whose worker dies
mid-shard is retried with the output still exact and no temporary left; one lost for good fails
the run with a `--resume` hint; `--resume` finishes a conversion whose driver was SIGKILLed mid-run;
without Ray, `--engine ray` says how to install it; `bench/ray_convert_bench.py --tiny` runs.
Tests needing Ray skip when it is not importable; one cluster (2 CPUs) serves the whole module.
Faults are injected through the `GDSLOAD_RAY_FAULTS` marker folder, set before the cluster
starts so that every worker inherits it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import pytest
from convertkit import convert_and_kill

from gdsload.cli import main
from gdsload.convert.ray_engine import FAULTS_ENV

OPTS = ["--shard-size", "32KB", "--validate", "-q"]
STATE = ".gdsload-convert"
TIMING = ("at", "seconds")
S3_IGNORE = (*TIMING, "fingerprint")  # the run's fingerprint hashes input paths and mtimes


def files(root: Path) -> dict[str, bytes]:
    """Every file under root (hidden ones and the state folder included), by relative path."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def assert_same_files(got: dict[str, bytes], want: dict[str, bytes], ignore: tuple[str, ...] = TIMING) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        if name != "manifest.json":
            assert got[name] == want[name], f"{name} differs"
    gm, wm = json.loads(got["manifest.json"]), json.loads(want["manifest.json"])
    for m in (gm, wm):
        for k in ignore:
            m["created"].pop(k)
    assert gm == wm


def assert_same_output(got: Path, want: Path) -> None:
    assert_same_files(files(got), files(want))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, request):
    """A 2-CPU local Ray cluster; yields `{"address", "faults", "s3"}`. The local S3 server (the
    session fixture `s3`, None without moto) starts first, so that the workers inherit its
    endpoint."""
    ray = pytest.importorskip("ray")
    try:
        s3 = request.getfixturevalue("s3")
    except pytest.skip.Exception:
        s3 = None
    faults = tmp_path_factory.mktemp("faults")
    old = os.environ.get(FAULTS_ENV)
    os.environ[FAULTS_ENV] = str(faults)  # inherited by the raylet, so by every worker
    try:
        ctx = ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
        yield {"address": ctx.address_info["gcs_address"], "faults": faults, "s3": s3}
    finally:
        ray.shutdown()
        if old is None:
            os.environ.pop(FAULTS_ENV, None)
        else:
            os.environ[FAULTS_ENV] = old


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """`base/src`: 120 small JPEGs in 3 classes, one corrupt and one empty file; `base/ref`: the
    local engine's conversion, run with relative paths from `base` (as the Ray runs are)."""
    from gdsload.sampledata import make_image_folder

    base = tmp_path_factory.mktemp("ray")
    make_image_folder(base / "src", num_images=120, num_classes=3, mean_size=(64, 48), workers=1)
    (base / "src" / "class_001" / "broken.jpg").write_bytes(os.urandom(3000))  # rejected by --validate
    (base / "src" / "class_002" / "empty.jpg").write_bytes(b"")  # rejected when listed
    cwd = os.getcwd()
    os.chdir(base)
    try:
        assert main(["convert", "src", "ref", "--workers", "2", *OPTS]) == 0
    finally:
        os.chdir(cwd)
    assert (base / "ref" / "rejected.jsonl").read_text().count("\n") == 2
    assert len(list((base / "ref").glob("*.tar"))) >= 8
    return base


def test_ray_output_equals_local_engine(cluster, world, monkeypatch):
    monkeypatch.chdir(world)  # relative paths: the workers' own cwd is elsewhere
    assert main(["convert", "src", "out-equal", "--engine", "ray", *OPTS]) == 0
    assert_same_output(world / "out-equal", world / "ref")


def test_task_killed_mid_shard_is_retried_and_output_is_exact(cluster, world, monkeypatch):
    monkeypatch.chdir(world)
    marker = cluster["faults"] / "shard-000003.exit"
    marker.touch()
    assert main(["convert", "src", "out-retry", "--engine", "ray", *OPTS]) == 0
    assert not marker.exists() and marker.with_name(marker.name + "-fired").exists()  # it did fire
    assert_same_output(world / "out-retry", world / "ref")  # no temporary left behind either


def test_task_lost_for_good_fails_the_run_and_resume_finishes_it(cluster, world, monkeypatch, capsys):
    from gdsload.convert import ray_engine

    monkeypatch.chdir(world)
    monkeypatch.setattr(ray_engine, "MAX_RETRIES", 0)
    (cluster["faults"] / "shard-000002.exit").touch()
    assert main(["convert", "src", "out-lost", "--engine", "ray", *OPTS]) == 1
    err = capsys.readouterr().err
    assert "shard shard-000002: its Ray task was lost 1 time(s)" in err and "--resume" in err
    assert not (world / "out-lost" / "manifest.json").exists()
    # the tasks the failure cancelled have ended and left nothing half written (the resume below
    # once raced one of them, which wrote a shard's temporaries after the resume had cleaned up)
    assert not [p.name for p in (world / "out-lost").rglob(".*tmp-*")]
    monkeypatch.setattr(ray_engine, "MAX_RETRIES", 3)
    assert main(["convert", "src", "out-lost", "--engine", "ray", "--resume", *OPTS]) == 0
    assert_same_output(world / "out-lost", world / "ref")


def test_resume_after_the_driver_is_killed(cluster, world, monkeypatch):
    """Driver SIGKILLed while shard 5 hangs in its task: no manifest, only complete shards under
    final names; `--resume` (Ray engine) keeps them and produces the exact output."""
    monkeypatch.chdir(world)
    hang = cluster["faults"] / "shard-000005.hang"
    hang.touch()
    dst = world / "out-killed"
    total = len(list((world / "ref").glob("*.tar")))
    def all_but_the_hung_shard_finished() -> bool:
        done = list((dst / STATE / "done").glob("*.json")) if (dst / STATE / "done").is_dir() else []
        return not hang.exists() and len(done) >= total - 1

    convert_and_kill(["src", str(dst), "--engine", "ray", "--ray-address", cluster["address"], *OPTS],
                     all_but_the_hung_shard_finished, timeout=40, poll=0.05)

    assert not (dst / "manifest.json").exists()
    assert not (dst / "shard-000005.tar").exists()
    ref = files(world / "ref")
    for p in dst.glob("shard-*"):  # whatever is under a final name is complete and exact
        assert p.read_bytes() == ref[p.name], p.name

    assert main(["convert", "src", str(dst), "--engine", "ray", "--resume", *OPTS]) == 0
    assert_same_output(dst, world / "ref")


@pytest.fixture(scope="module")
def s3_world(cluster, world):
    """The source of `world` uploaded to s3://gdsload-ray/src; yields the s3fs filesystem."""
    fs = cluster["s3"]
    if fs is None:
        pytest.skip("needs moto and s3fs for a local S3 server")
    fs.mkdir("gdsload-ray")
    fs.put(str(world / "src"), "gdsload-ray/src", recursive=True)
    fs.pipe_file("gdsload-ray/src/class_002/empty.jpg", b"")
    return fs


def s3_output(fs, root: str, src: str, local_src: str) -> dict[str, bytes]:
    """The files under root, rejected.jsonl's and the manifest's source rewritten to the local
    source's, so that the result compares with `files(world / "ref")`."""
    fs.invalidate_cache()
    out = {p[len(root) + 1:]: fs.cat_file(p) for p in sorted(fs.find(root))}
    out["rejected.jsonl"] = out["rejected.jsonl"].replace(src.encode(), local_src.encode())
    m = json.loads(out["manifest.json"])
    m["created"]["source"] = local_src
    out["manifest.json"] = json.dumps(m).encode()
    return out


def test_s3_input_and_output_through_ray_tasks(cluster, world, s3_world, capsys):
    """Source and destination on the local S3 server: every worker reads and writes s3:// itself;
    the bytes equal the local engine's from the local copy of the source."""
    assert main(["convert", "s3://gdsload-ray/src", "s3://gdsload-ray/out", "--engine", "ray", *OPTS]) == 0
    got = s3_output(s3_world, "gdsload-ray/out", "s3://gdsload-ray/src", "src")
    assert_same_files(got, files(world / "ref"), ignore=S3_IGNORE)
    assert main(["verify", "s3://gdsload-ray/out"]) == 0


def test_s3_task_killed_mid_upload_is_retried_and_no_partial_object_is_left(cluster, world, s3_world):
    """The worker writing shard 4 dies mid-shard, with its upload unfinished: the retry writes the
    shard, and nothing but complete objects is ever listed under the destination."""
    marker = cluster["faults"] / "shard-000004.exit"
    marker.touch()
    assert main(["convert", "s3://gdsload-ray/src", "s3://gdsload-ray/out-retry", "--engine", "ray", *OPTS]) == 0
    assert marker.with_name(marker.name + "-fired").exists()
    got = s3_output(s3_world, "gdsload-ray/out-retry", "s3://gdsload-ray/src", "src")
    assert_same_files(got, files(world / "ref"), ignore=S3_IGNORE)


def test_missing_ray_says_how_to_install(world, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    assert main(["convert", str(world / "src"), str(world / "out-noray"), "--engine", "ray", "-q"]) == 1
    err = capsys.readouterr().err
    assert "pip install 'gdsload[ray]'" in err and "--engine ray" in err
    assert not (world / "out-noray").exists()  # refused before any work


def test_ray_address_needs_the_ray_engine(world, capsys):
    assert main(["convert", str(world / "src"), str(world / "out-addr"), "--ray-address", "127.0.0.1:6379", "-q"]) == 1
    assert "--engine ray" in capsys.readouterr().err


def test_ray_convert_bench_tiny(cluster, tmp_path):
    """The benchmark runs as a tiny test so it cannot rot (speed is never asserted)."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "bench" / "ray_convert_bench.py"
    spec = importlib.util.spec_from_file_location("ray_convert_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    r = bench.main(["--tiny", "--contestants", "local,ray-joined", "--ray-address", cluster["address"],
                    "--workdir", str(tmp_path), "--out", str(tmp_path / "r.json")])
    assert r["contestants"]["ray-joined"]["ratio_over_local"]["median"] > 0
    assert json.loads((tmp_path / "r.json").read_text())["source"]["images"] == 40
