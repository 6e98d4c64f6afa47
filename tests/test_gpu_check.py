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
import time
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


def test_dry_run_prints_a_plan_that_fits_the_device_budget(tmp_path):
    """Each call, what it sends and its time; part 1 (no DALI) one call; both parts <= 7 min with a
    machine start, <= 12 together, every call <= 64 MiB; only DALI's JPEG wheels sent."""
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PY": sys.executable}
    out = subprocess.run(["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True, env=env,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    spec = gpu_wheels.load_spec()
    for name in [*spec["carry"]["pins"], *spec["dali"]["pins"]]:
        assert name in text
    assert set(spec["dali"]["lazy"]) == {"nvidia-libnvcomp-cu13", "nvidia-nvjpeg2k-cu13", "nvidia-nvtiff-cu13"}
    sent = text.split("DALI wheels sent (JPEG decoding):")[1].split("\n")[0]
    assert "nvjpeg," in sent + "," and not any(n in sent for n in spec["dali"]["lazy"])
    import gpu_plan

    calls = gpu_plan.plan(spec)
    part1 = [c for c in calls if c["part"] == 1]
    assert len(part1) == 1 and part1[0]["carry"] == [".whl"] and "--part 1" in part1[0]["command"]
    assert {".whl", ".media"} <= set(calls[-1]["carry"]) and "--part 2" in calls[-1]["command"]
    assert all(c["mib"] <= 64 for c in calls) and gpu_plan.check(calls) == []
    for part in (1, 2):
        assert sum(p[2] for c in calls if c["part"] == part for p in c["phases"]) <= 7 * 60
    assert sum(p[1] for c in calls for p in c["phases"]) <= 12 * 60
    assert "PART 1" in text and "PART 2" in text and "TOTAL:" in text and "MiB" in text
    assert not (tmp_path / "out").exists()  # a dry run writes nothing


def test_the_plan_check_can_fail(monkeypatch):
    import gpu_plan

    spec = copy.deepcopy(gpu_wheels.load_spec())
    spec["dali"]["lazy"] = {}  # nvCOMP, nvjpeg2k and nvtiff sent too: one more part
    monkeypatch.setattr(gpu_plan, "SEND_MIB_PER_S", 1.0)
    assert any("part 2" in p for p in gpu_plan.check(gpu_plan.plan(spec)))


def test_carried_wheels_satisfy_their_own_requirements():
    spec = gpu_wheels.load_spec()
    assert gpu_wheels.closure_problems(spec) == []
    assert spec["carry"]["pins"]["rapids-logger"].startswith("0.3.")  # libkvikio-cu13 26.10.0 wants 0.3.*


def test_the_closure_check_can_fail():
    spec = copy.deepcopy(gpu_wheels.load_spec())
    del spec["carry"]["pins"]["rapids-logger"]  # the README's old wheel list
    assert any("rapids-logger==0.3.*" in p for p in gpu_wheels.closure_problems(spec))
    spec = copy.deepcopy(gpu_wheels.load_spec())
    del spec["dali"]["pins"]["gast"]  # DALI imports it
    assert any("gast" in p for p in gpu_wheels.closure_problems(spec))
    spec = copy.deepcopy(gpu_wheels.load_spec())
    del spec["dali"]["lazy"]["nvidia-nvtiff-cu13"]  # not sent, and not declared lazy
    del spec["dali"]["pins"]["nvidia-nvtiff-cu13"]
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
    paths = [".dali1/part01", ".whl-dali/x.whl", ".whl/x.whl", ".dali-parts/part01"]
    out = subprocess.run(["git", "check-ignore", *paths], cwd=ROOT, capture_output=True, text=True)
    assert out.stdout.split() == paths
    assert gpu_wheels.PARTS_DIR == ROOT / ".dali-parts"  # in the tree: kept between warm calls


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
    monkeypatch.setattr(gpu_bench._Burner, "_run", _cpu_burner)
    steps = ("data", "device_path", "kvikio_rows", "ring_safety", "mixed_vs_cpu", "mixed_busy")
    rc = gpu_bench.main([*args, "--steps", ",".join(steps)])
    rows = {r["step"]: r for r in json.loads((out / "gpu-check.json").read_text())["rows"]}
    assert rc == 0, rows
    assert [rows[s]["status"] for s in steps] == ["PASS"] * len(steps), rows
    # 150 KB rows >= 16 KiB; no cuFile config file (as on the H200): KvikIO's synchronous fallback
    assert rows["device_path"]["figure"] == "io=kvikio-gds ring=cuda:0 kvikio-gds/sync-fallback=64"
    details = json.loads((out / "gpu-check.json").read_text())["details"]
    assert details["kvikio_rows"]["gds_threshold"] == 16 * 1024 and details["kvikio_rows"]["equal"]
    assert details["kvikio_rows"]["read_modes"] == {"kvikio-gds/sync-fallback": 64 * 2}  # warm-up + 1 round
    assert details["mixed_vs_cpu"]["compared"] == 24
    assert rows["mixed_busy"]["figure"].startswith("24/24 bit-equal to idle")
    assert details["ring_safety"]["burner_products"] > 0
    # a burner that dies (an OOM in its thread) is not a busy run: FAIL, not PASS
    monkeypatch.setattr(gpu_bench._Burner, "_run", lambda self: setattr(self, "error", "OutOfMemoryError: fake"))
    assert gpu_bench.main([*args, "--steps", "ring_safety,mixed_busy"]) == 1
    rows = {r["step"]: r for r in json.loads((out / "gpu-check.json").read_text())["rows"]}
    assert rows["ring_safety"]["status"] == rows["mixed_busy"]["status"] == "FAIL"
    # the same run with KvikIO absent: the path assertion FAILs, and the exit status says so
    gpu_fakes.install(monkeypatch, devices=1, torch_cuda=True, kvikio=False)
    assert gpu_bench.main([*args, "--steps", "device_path"]) == 1
    rows = {r["step"]: r for r in json.loads((out / "gpu-check.json").read_text())["rows"]}
    assert rows["device_path"]["status"] == "FAIL" and "io=posix" in rows["device_path"]["figure"]


def test_resnet50_step_runs_its_loop_against_the_fakes(monkeypatch, tmp_path):
    """The training-step loop and its stall figure, with a tiny model on the CPU (the device run
    uses ResNet-50 and the torch DataLoader baseline)."""
    import torch

    import gpu_bench

    gpu = gpu_fakes.install(monkeypatch, devices=1, torch_cuda=True, kvikio=False)
    gpu_fakes.dali_mixed_on_cpu(monkeypatch, gpu)
    monkeypatch.setattr(torch.nn.Module, "cuda", lambda self, device=None: self)
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, device=None, non_blocking=False: self)
    monkeypatch.setattr(torch, "autocast", lambda *a, **k: __import__("contextlib").nullcontext())  # bf16 on CUDA
    monkeypatch.setitem(sys.modules, "nvidia.dali", __import__("nvidia.dali").dali)
    out = tmp_path / "out"
    args = ["--out", str(out), "--workdir", str(tmp_path / "w"), "--samples", "8", "--images", "8",
            "--model", "tiny", "--train-steps", "2", "--train-batch", "4", "--image-size", "32",
            "--baseline", "none", "--steps", "data,resnet50"]
    assert gpu_bench.main(args) == 0
    rows = {r["step"]: r for r in json.loads((out / "gpu-check.json").read_text())["rows"]}
    detail = json.loads((out / "gpu-check.json").read_text())["details"]["resnet50"]
    assert rows["resnet50"]["status"] == "INFO" and rows["resnet50"]["figure"].startswith("stall ")
    assert detail["gdsload"]["steps"] == 2 and 0 <= detail["gdsload"]["stall"] <= 1


def _cpu_burner(self):
    """gpu_bench's burner on the CPU (the fakes have no CUDA matrix products): it counts."""
    while not self.stop.is_set():
        time.sleep(0.001)
        self.products += 8


def test_dali_steps_skip_only_when_dali_was_not_carried(monkeypatch, tmp_path):
    """E2: a DALI that was carried but does not import (a missing gast, say) SKIPped, and the run
    ended green with the riskiest GPU code never run. Now: FAIL when carried, SKIP otherwise."""
    import gpu_bench

    monkeypatch.setitem(sys.modules, "nvidia.dali", None)  # `import nvidia.dali` raises ImportError
    args = ["--out", str(tmp_path / "out"), "--workdir", str(tmp_path / "w"), "--steps", "mixed_vs_cpu,mixed_busy,resnet50"]
    monkeypatch.delenv("GDSLOAD_DALI_CARRIED", raising=False)
    assert gpu_bench.main(args) == 0
    rows = json.loads((tmp_path / "out" / "gpu-check.json").read_text())["rows"]
    assert {r["status"] for r in rows} == {"SKIP"} and "DALI NOT EXERCISED" in rows[0]["figure"]
    monkeypatch.setenv("GDSLOAD_DALI_CARRIED", "1")
    assert gpu_bench.main(args) == 1
    rows = json.loads((tmp_path / "out" / "gpu-check.json").read_text())["rows"]
    assert {r["status"] for r in rows} == {"FAIL"} and "carried but does not import" in rows[0]["figure"]


def _part2_env(tmp_path, bench_body: str, site_files: dict[str, str]) -> dict:
    """gpu_check.sh --part 2 set up on the CPU: dummy wheels already installed (markers), a fake
    gpu_bench, modules in the site folder."""
    whl, dali, site = tmp_path / "whl", tmp_path / "dali", tmp_path / "site"
    for d in (whl, dali, site):
        d.mkdir()
    spec = gpu_wheels.load_spec()
    for name in spec["carry"]["pins"]:
        (whl / f"{name.replace('-', '_')}-1-py3-none-any.whl").write_bytes(b"")
    (dali / "nvidia_dali-1-py3-none-any.whl").write_bytes(b"")
    for step, folder in (("install", whl), ("dali_install", dali)):
        names = "\n".join(sorted(p.name for p in folder.glob("*.whl"))) + "\n"
        digest = subprocess.run(["sha256sum"], input=names, capture_output=True, text=True).stdout[:16]
        (site / f".gdsload-installed-{step}").write_text(digest + "\n")
    for rel, text in site_files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
    bench = tmp_path / "fake_bench.py"
    bench.write_text(f"import os, sys\nsys.path.insert(0, {str(BENCH)!r})\nfrom gpu_table import Report\n"
                     f"out = sys.argv[sys.argv.index('--out') + 1]\n{bench_body}\n")
    return {**os.environ, "OUT": str(tmp_path / "out"), "PY": sys.executable, "SITE": str(site),
            "GDSLOAD_WHL_DIR": str(whl), "GDSLOAD_DALI_WHEELS": str(dali), "GPU_BENCH": str(bench),
            "PYTHONPATH": str(ROOT)}


def test_a_bench_that_crashes_after_one_row_fails_the_check(tmp_path):
    """E1: a native crash of gpu_bench (SIGABRT here) after one PASS row added no FAIL row, and
    the earlier PASS rows gave exit 0 with the other steps never listed."""
    env = _part2_env(tmp_path, "Report(out).add('data', 'PASS', 'made')\nos.abort()", {})
    r = subprocess.run(["bash", str(SCRIPT), "--part", "2"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode != 0, r.stdout
    rows = {x["step"]: x for x in json.loads((tmp_path / "out" / "gpu-check.json").read_text())["rows"]}
    assert rows["data"]["status"] == "PASS" and rows["dali_import"]["status"] == "PASS"
    assert rows["bench"]["status"] == "FAIL" and "SIGABRT (rc=134)" in rows["bench"]["figure"]
    for step in ("mixed_vs_cpu", "mixed_busy", "resnet50"):
        assert rows[step]["status"] == "FAIL" and "NOT EXERCISED" in rows[step]["figure"]
    assert "FAILED:" in r.stdout


def test_a_carried_dali_that_does_not_import_fails_the_check(tmp_path):
    """E2 at the script level: DALI's wheels were carried and installed, `import nvidia.dali`
    fails (here: its gast dependency missing), and the verdict is FAIL even when every bench row
    passed."""
    rows_ok = "\n".join(f"Report(out).add({s!r}, 'PASS', 'ok')" for s in ("data", "mixed_vs_cpu", "mixed_busy", "resnet50"))
    env = _part2_env(tmp_path, rows_ok, {"nvidia/__init__.py": "",
                                                "nvidia/dali/__init__.py": "import gast_missing_here\n"})
    r = subprocess.run(["bash", str(SCRIPT), "--part", "2"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1, r.stdout
    rows = {x["step"]: x for x in json.loads((tmp_path / "out" / "gpu-check.json").read_text())["rows"]}
    assert rows["dali_import"]["status"] == "FAIL" and "does not import" in rows["dali_import"]["figure"]
    assert rows["install"]["figure"].startswith("already installed")  # no reinstall on a rerun


def test_the_media_step_skips_when_not_carried_and_fails_when_it_crashes(tmp_path):
    """Part 2's video/audio step: no `.media/` carried gives SKIP rows naming it; a check that
    crashes before printing a row (here: a `ref.npz` that is not a NumPy file) leaves every media
    step NOT EXERCISED and the verdict FAIL, even with every bench row passing."""
    rows_ok = "\n".join(f"Report(out).add({s!r}, 'PASS', 'ok')" for s in ("data", "mixed_vs_cpu", "mixed_busy", "resnet50"))
    dali = {"nvidia/__init__.py": "", "nvidia/dali/__init__.py": "__version__ = '0'\n"}
    env = _part2_env(tmp_path, rows_ok, dali)
    env["GDSLOAD_MEDIA_DIR"] = str(tmp_path / "absent")
    r = subprocess.run(["bash", str(SCRIPT), "--part", "2"], capture_output=True, text=True, env=env, timeout=120)
    rows = {x["step"]: x for x in json.loads((tmp_path / "out" / "gpu-check.json").read_text())["rows"]}
    assert r.returncode == 0, r.stdout
    assert rows["video_h264"]["status"] == "SKIP" and "not carried" in rows["video_h264"]["figure"]
    media = tmp_path / "media"
    media.mkdir()
    (media / "ref.npz").write_bytes(b"not a numpy file")
    env["GDSLOAD_MEDIA_DIR"] = str(media)
    r = subprocess.run(["bash", str(SCRIPT), "--part", "2"], capture_output=True, text=True, env=env, timeout=120)
    rows = {x["step"]: x for x in json.loads((tmp_path / "out" / "gpu-check.json").read_text())["rows"]}
    assert r.returncode == 1, r.stdout
    for step in ("video_h264", "video_hevc", "video_vp9", "audio_flac", "audio_wav"):
        assert rows[step]["status"] == "FAIL" and "NOT EXERCISED" in rows[step]["figure"], rows[step]


def test_the_gpu_test_files_collect_the_gpu_tests():
    """What gpu_check.sh's pytest step selects (by file and marker), collected here: the device
    run must not find 'no tests' or a collection error."""
    files = ["tests/test_gpu_path.py", "tests/ring/test_ring.py", "tests/loader/test_dataloader.py", "tests/io/test_conformance.py"]
    assert all(f in SCRIPT.read_text() for f in files)
    assert '-m "gpu or gds"' in SCRIPT.read_text()
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-m", "gpu or gds", *files], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    ids = [line for line in out.stdout.splitlines() if "::" in line]
    for name in ("test_real_gpu_npy_loader_reads_through_kvikio_into_the_device_ring",
                 "test_cuda_npy_loader_returns_device_tensors",
                 "test_cuda_device_ring"):
        assert any(name in i for i in ids), name
    assert any("test_conformance.py" in i and "kvikio" in i for i in ids)
