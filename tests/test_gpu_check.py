"""bench/gpu_check.sh and its helpers, checked on the CPU so the one device run cannot fail on
something a CPU could have caught: shell syntax, the dry run, the carried wheel set against the
wheels' own requirements, the GPU test files it names, the report table, and gpu_bench's steps
end to end against the CUDA fakes (tests/gpu_fakes.py)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import gpu_fakes

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))

import gpu_table  # noqa: E402
import gpu_wheels  # noqa: E402

SCRIPT = BENCH / "gpu_check.sh"


def test_gpu_check_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_dry_run_lists_what_it_would_install_and_run(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PY": sys.executable}
    out = subprocess.run(["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True, env=env,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    spec = gpu_wheels.load_spec()
    for name in [*spec["carry"]["pins"], *spec["dali"]["pins"]]:
        assert name in text
    assert "rapids-logger" in text and "import kvikio, cupy, torch" in text
    for f in ("tests/test_gpu_path.py", "tests/test_ring.py", "tests/test_loader.py", "tests/io/test_conformance.py"):
        assert f in text and (ROOT / f).exists()
    assert "timeout -k 10" in text and "gpu or gds or dali_gpu" in text
    assert not (tmp_path / "out").exists()  # a dry run writes nothing


def test_carried_wheels_satisfy_their_own_requirements():
    spec = gpu_wheels.load_spec()
    assert gpu_wheels.closure_problems(spec) == []
    assert spec["carry"]["pins"]["rapids-logger"].startswith("0.3.")  # libkvikio-cu13 26.10.0 wants 0.3.*


def test_the_closure_check_can_fail():
    spec = copy.deepcopy(gpu_wheels.load_spec())
    del spec["carry"]["pins"]["rapids-logger"]  # the README's old wheel list
    assert any("rapids-logger==0.3.*" in p for p in gpu_wheels.closure_problems(spec))
    spec = copy.deepcopy(gpu_wheels.load_spec())
    del spec["dali"]["pins"]["nvidia-nvtiff-cu13"]  # needed only through nvimgcodec's [all] extra
    assert any("nvidia-nvtiff-cu13" in p for p in gpu_wheels.closure_problems(spec))


@pytest.mark.parametrize("group,folder", [("carry", ".whl"), ("dali", ".whl-dali")])
def test_recorded_requirements_match_the_wheels_metadata(group, folder):
    """Where the wheels were downloaded here (`bench/gpu_wheels.py download`), the JSON must say
    what their METADATA says."""
    wheels = sorted((ROOT / folder).glob("*.whl"))
    if not wheels:
        pytest.skip(f"no wheels in {folder}/ (python3 bench/gpu_wheels.py download)")
    spec = gpu_wheels.load_spec()[group]
    seen = {}
    for w in wheels:
        name, version, requires = gpu_wheels.wheel_metadata(w)
        seen[name] = version
        assert spec["requires"][name] == requires
    assert seen == spec["pins"]


def test_split_parts_fit_one_call_and_reassemble(tmp_path, monkeypatch):
    src = tmp_path / "repo" / ".whl-dali"
    src.mkdir(parents=True)
    rng = np.random.default_rng(0)
    (src / "a-1-py3-none-any.whl").write_bytes(rng.bytes(3000))
    (src / "b-1-py3-none-any.whl").write_bytes(rng.bytes(5000))
    monkeypatch.setattr(gpu_wheels, "ROOT", tmp_path / "repo")
    monkeypatch.setattr(gpu_wheels, "PART_BYTES", 4096)
    monkeypatch.setattr(gpu_wheels, "PARTS_DIR", tmp_path / "parts")
    monkeypatch.setattr(gpu_wheels, "DALI_WHEELS", tmp_path / "whl")
    gpu_wheels.cmd_split()
    parts = sorted((tmp_path / "repo").glob(".dali[0-9]*"))
    assert len(parts) >= 3 and all((p / f"part{i + 1:02d}").stat().st_size <= 4096 for i, p in enumerate(parts))
    for p in parts[:-1]:
        gpu_wheels.cmd_receive(str(p))
    with pytest.raises(SystemExit, match="parts missing"):
        gpu_wheels.cmd_assemble()
    gpu_wheels.cmd_receive(str(parts[-1]))
    gpu_wheels.cmd_assemble()
    for w in src.glob("*.whl"):
        assert (tmp_path / "whl" / w.name).read_bytes() == w.read_bytes()
    (tmp_path / "parts" / "part01").write_bytes(b"x" * 10)
    with pytest.raises(SystemExit, match="sha256"):
        gpu_wheels.cmd_assemble()


def test_dali_parts_are_ignored_by_git():
    out = subprocess.run(["git", "check-ignore", ".dali1/part01", ".whl-dali/x.whl", ".whl/x.whl"],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.stdout.split() == [".dali1/part01", ".whl-dali/x.whl", ".whl/x.whl"]


def test_report_is_written_after_every_step_and_fails_on_a_fail(tmp_path, capsys):
    r = gpu_table.Report(tmp_path)
    r.add("install", "PASS", "5 wheels", None, 1.04)
    assert json.loads((tmp_path / "gpu-check.json").read_text())["rows"][0]["step"] == "install"
    r.add("kvikio_rows", "INFO", "3.10 GB/s kvikio-gds", 1.234, 12.0, path_bytes={"kvikio-gds": 1})
    assert gpu_table.main(["print", str(tmp_path)]) == 0
    r.add("device_path", "FAIL", "io=posix ring=cpu", None, 3)
    assert gpu_table.main(["print", str(tmp_path)]) == 1
    text = capsys.readouterr().out
    table = text[text.rindex("step "):].splitlines()
    assert table[-1] == "FAILED: device_path" and len(table) == 6  # header, rule, 3 rows, verdict
    assert len({len(line) for line in table[:-1]}) == 1  # a fixed-width table
    with pytest.raises(ValueError):
        r.add("x", "OK")


def test_gpu_bench_steps_run_against_the_fakes(monkeypatch, tmp_path):
    """gpu_bench's steps end to end on the CUDA fakes (small sizes): the rows and their JSON, the
    path assertion, and the mixed-vs-CPU comparison; a real device shows the real numbers."""
    import gpu_bench

    gpu = gpu_fakes.install(monkeypatch, devices=1, torch_cuda=True, kvikio=dict(gds=True))
    gpu_fakes.dali_mixed_on_cpu(monkeypatch, gpu)
    out = tmp_path / "out"
    args = ["--out", str(out), "--workdir", str(tmp_path / "work"), "--samples", "64", "--images", "24",
            "--rounds", "1", "--batch-size", "16"]
    rc = gpu_bench.main([*args, "--steps", "data,device_path,kvikio_rows,mixed_vs_cpu"])
    rows = {r["step"]: r for r in json.loads((out / "gpu-check.json").read_text())["rows"]}
    assert rc == 0, rows
    assert [rows[s]["status"] for s in ("data", "device_path", "kvikio_rows", "mixed_vs_cpu")] == ["PASS"] * 4
    assert rows["device_path"]["figure"] == "io=kvikio-gds ring=cuda:0"  # 150 KB rows >= 16 KiB
    details = json.loads((out / "gpu-check.json").read_text())["details"]
    assert details["kvikio_rows"]["gds_threshold"] == 16 * 1024 and details["kvikio_rows"]["equal"]
    assert details["mixed_vs_cpu"]["compared"] == 24
    # the same run with KvikIO absent: the path assertion FAILs, and the exit status says so
    gpu_fakes.install(monkeypatch, devices=1, torch_cuda=True, kvikio=False)
    assert gpu_bench.main([*args, "--steps", "device_path"]) == 1
    rows = {r["step"]: r for r in json.loads((out / "gpu-check.json").read_text())["rows"]}
    assert rows["device_path"]["status"] == "FAIL" and "io=posix" in rows["device_path"]["figure"]


def test_the_gpu_test_files_collect_the_gpu_tests():
    """What gpu_check.sh's pytest step selects (by file and marker), collected here: the device
    run must not find 'no tests' or a collection error."""
    files = ["tests/test_gpu_path.py", "tests/test_ring.py", "tests/test_loader.py", "tests/io/test_conformance.py"]
    assert all(f in SCRIPT.read_text() for f in files)
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-m", "gpu or gds or dali_gpu", *files], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    ids = [line for line in out.stdout.splitlines() if "::" in line]
    for name in ("test_real_gpu_npy_loader_reads_through_kvikio_into_the_device_ring",
                 "test_real_mixed_decode_matches_the_cpu_decode", "test_cuda_npy_loader_returns_device_tensors",
                 "test_cuda_device_ring"):
        assert any(name in i for i in ids), name
    assert any("test_conformance.py" in i and "kvikio" in i for i in ids)
