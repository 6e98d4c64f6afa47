"""bench/gpu_check.sh and its helpers, checked on the CPU so the one device run cannot fail on
something a CPU could have caught: shell syntax, the dry run, the carried wheel set against the
wheels' own requirements, the GPU test files it names, the report table, and gpu_bench's steps
end to end against the CUDA fakes (tests/gpu_fakes.py)."""

from __future__ import annotations

import copy
import json
import os
import re
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


def _dry_run(env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PY": sys.executable, **(env_extra or {})}
    return subprocess.run(["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True, env=env, timeout=60)


def test_dry_run_prints_a_plan_that_fits_the_device_budget(tmp_path):
    """Audit 4 R1/R5/R13: at most 5 device calls, each <= 62 MiB as measured here and with the tree,
    .whl and .media at their budgets; <= 10.5 min typical with the start and every turnaround;
    the slack covers a warm rerun of the last call; each command's caps fit its timeout_s and
    the tool's 600 s; only DALI's JPEG wheels sent; and bench/README.md quotes the plan's figures
    (so growth or drift fails here, not on the device)."""
    import gpu_plan

    out = _dry_run({"OUT": str(tmp_path / "out")})
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    spec = gpu_wheels.load_spec()
    for name in [*spec["carry"]["pins"], *spec["dali"]["pins"]]:
        assert name in text
    assert set(spec["dali"]["lazy"]) == {"nvidia-libnvcomp-cu13", "nvidia-nvjpeg2k-cu13", "nvidia-nvtiff-cu13"}
    sent = text.split("DALI wheels sent (JPEG decoding):")[1].split("\n")[0]
    assert "nvjpeg," in sent + "," and not any(n in sent for n in spec["dali"]["lazy"])
    sz = gpu_plan.sizes(spec)
    for s in (sz, gpu_plan.at_budgets(sz)):
        calls = gpu_plan.plan(spec, s)
        t = gpu_plan.totals(calls, s)
        assert gpu_plan.check(calls, s) == []
        assert len(calls) <= 5 and all(c["mib"] <= 62 for c in calls) and all(m <= 62 for m in t["mib_budget"])
        assert t["typical_s"] <= 10.5 * 60 and t["slack_s"] >= t["rerun_s"] and t["slack_s"] >= 4 * 60
        assert all(sum(p[2] for p in c["phases"]) + 30 <= c["timeout_s"] <= 600 for c in calls)
        # call 1 is part 1 with .whl and DALI's first part; the last is part 2 with .media; none in between runs a part
        assert calls[0]["carry"] == [".whl", ".dali1"] and "--part 1 --receive .dali1" in calls[0]["command"]
        assert calls[-1]["carry"][-1] == ".media" and "--part 2 --receive" in calls[-1]["command"]
        assert ".whl" not in calls[-1]["carry"]  # useless there: a cold machine has lost .dali1.. too
        assert all("gpu_wheels.py receive" in c["command"] for c in calls[1:-1])
    assert sz["tree"] <= gpu_plan.TREE_BUDGET_MIB and sz["tree_measured"]
    assert "RERUN of the last call" in text and "run(command='bash bench/gpu_check.sh --part 2', carry=[]" in text
    readme = (BENCH / "README.md").read_text()
    lines = [ln for ln in text.splitlines() if ln.startswith(("PLAN at the size budgets:", "SIZES at the budgets"))]
    assert len(lines) == 2 and all(ln in readme for ln in lines), lines  # the README quotes the plan
    b = gpu_plan.at_budgets(sz)
    tb = gpu_plan.totals(gpu_plan.plan(spec, b), b)
    assert f"{tb['calls']} device calls, {tb['typical_s'] / 60:.1f} min typical of a session's 15" in \
        (ROOT / "README.md").read_text().replace("\n", " ")  # and so does the README's Status
    assert not (tmp_path / "out").exists()  # a dry run writes nothing


def test_dry_run_ready_names_what_is_not_made_yet(tmp_path):
    """R1: the plan is measured, not assumed: `--dry-run --ready` (before the first call) refuses
    while .whl/, the DALI parts or .media are missing here (this checkout has none of them)."""
    import gpu_plan

    sz = gpu_plan.sizes(gpu_wheels.load_spec())
    if sz["whl_measured"] and sz["parts_measured"] and sz["media_measured"]:
        pytest.skip("this checkout has the wheels, the parts and .media")
    out = _dry_run({"OUT": str(tmp_path / "out")} | {})
    ready = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--ready"], capture_output=True, text=True,
                           env={**os.environ, "PY": sys.executable}, timeout=60)
    assert out.returncode == 0 and ready.returncode == 1
    assert "not made yet:" in ready.stdout and (".media/ref.npz" in ready.stdout or ".whl/" in ready.stdout)


def test_the_plan_check_can_fail(monkeypatch):
    """Each budget is enforced: a tree over its budget, a slower start, more tests, clips NVDEC
    refuses, a lost lazy list (more parts: more calls)."""
    import gpu_plan

    spec = gpu_wheels.load_spec()
    sz = gpu_plan.sizes(spec)
    assert gpu_plan.check(gpu_plan.plan(spec, sz), sz) == []
    big = {**sz, "tree": gpu_plan.TREE_BUDGET_MIB + 0.1}
    assert any("the tree is" in p for p in gpu_plan.check(gpu_plan.plan(spec, big), big))
    monkeypatch.setattr(gpu_plan, "START_S", (240, 300))
    assert any("min typical > 10.5" in p for p in gpu_plan.check(gpu_plan.plan(spec, sz), sz))
    monkeypatch.undo()
    monkeypatch.setitem(gpu_plan.SELECTION[1], "tests", 400)  # caps derived from the selection
    assert any("command limit" in p for p in gpu_plan.check(gpu_plan.plan(spec, sz), sz))
    monkeypatch.undo()
    monkeypatch.setattr(gpu_plan, "clip_size", lambda: (160, 96))  # audit 4 R2: the old clips
    assert any("NVDEC needs >= 144" in p for p in gpu_plan.check(gpu_plan.plan(spec, sz), sz))
    monkeypatch.undo()
    fat = copy.deepcopy(spec)
    fat["dali"]["lazy"] = {}  # nvCOMP, nvjpeg2k and nvtiff sent too
    fsz = gpu_plan.sizes(fat)
    calls = gpu_plan.plan(fat, fsz)
    assert len(calls) == 5 and any("min typical > 10.5" in p for p in gpu_plan.check(calls, fsz))
    six = sz | {"parts": [40.0] * 6}
    assert any("6 device calls > 5" in p for p in gpu_plan.check(gpu_plan.plan(spec, six), six))


def test_the_pytest_selection_is_what_the_plan_counts():
    """The pytest steps' caps come from `SELECTION` (files, marker, number of tests): collected
    here, so a new GPU test changes the plan in CI, and neither part finds 'no tests'."""
    import gpu_plan

    for part, sel in gpu_plan.SELECTION.items():
        out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                              "-m", sel["marker"], *sel["files"]], cwd=ROOT, capture_output=True, text=True,
                             timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        ids = [line for line in out.stdout.splitlines() if "::" in line]
        assert len(ids) == sel["tests"], (part, ids)
        if part == 1:
            for name in ("test_real_gpu_npy_loader_reads_through_kvikio_into_the_device_ring",
                         "test_cuda_npy_loader_returns_device_tensors", "test_cuda_device_ring"):
                assert any(name in i for i in ids), name
            assert any("test_conformance.py" in i and "kvikio" in i for i in ids)
        else:
            assert any("test_real_mixed_decode_matches_the_cpu_decode" in i for i in ids)  # audit 4 R7


def test_the_script_takes_every_cap_from_the_plan():
    """R13: no number of the plan is spelled again in the script: its timeouts are the plan's
    `--caps` (evaluated), and the caps are the plan's phases."""
    import gpu_plan

    text = SCRIPT.read_text()
    assert "bench/gpu_plan.py --caps" in text
    for line in text.splitlines():
        if "timeout -k" in line:
            assert re.search(r'timeout -k \d+ "\$(\w+|\{?\w+\}?)"', line) or 'timeout -k 5 "$cap"' in line, line
    for part in (1, 2):
        out = subprocess.run([sys.executable, str(BENCH / "gpu_plan.py"), "--caps", str(part)], capture_output=True,
                             text=True, check=True, timeout=60).stdout
        caps = dict(line.split("=", 1) for line in out.splitlines())
        assert int(caps["PYTEST_CAP_S"]) == gpu_plan._pytest_phase(part)[2]
        assert caps["BENCH_STEPS"] == ",".join(gpu_plan.PART_STEPS[part])
        used = set(re.findall(r"\$\{?([A-Z_]+_CAP_S)", text))
        assert {k for k in caps if k.endswith("_CAP_S")} <= used | {"RECEIVE_CAP_S"}


def test_media_clips_are_large_enough_for_nvdec_and_small_enough_to_carry(tmp_path):
    """R2: 160x96 clips were under NVDEC's minimum for HEVC (144x144) and VP9 (128x128), so two
    healthy video rows would FAIL. The clips PyAV makes now are >= 144 px a side in every codec,
    and `.media` stays within the plan's budget (ref.npz keeps only the compared frames)."""
    import gpu_plan

    r = subprocess.run([sys.executable, str(BENCH / "media_gpu_check.py"), "make", str(tmp_path / "m")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    from gdsload.decode import media

    for f in sorted((tmp_path / "m").glob("*.*")):
        if f.suffix in (".mp4", ".webm"):
            meta = media.probe(f.read_bytes(), "video")
            assert min(meta["width"], meta["height"]) >= gpu_plan.MIN_CLIP_SIDE, (f.name, meta)
    assert gpu_plan.clip_size() == (192, 160)
    assert gpu_plan.folder_bytes(tmp_path / "m") / 2**20 <= gpu_plan.MEDIA_BUDGET_MIB


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
    monkeypatch.setattr(gpu_wheels, "PART_BYTES", (2048, 4096))  # the first part rides with .whl
    monkeypatch.setattr(gpu_wheels, "PARTS_DIR", tmp_path / "parts")
    monkeypatch.setattr(gpu_wheels, "DALI_WHEELS", tmp_path / "whl")
    gpu_wheels.cmd_split()
    parts = sorted((tmp_path / "repo").glob(".dali[0-9]*"))
    sizes = [(p / f"part{i + 1:02d}").stat().st_size for i, p in enumerate(parts)]
    assert len(parts) >= 3 and sizes[0] == 2048 and all(n <= 4096 for n in sizes[1:])
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
    r.add("kvikio_rows", "INFO", "3.10 GB/s kvikio-gds", 1.234, 12.0, on="gpu", expect="gpu", path_bytes={"x": 1})
    assert gpu_table.main(["print", str(tmp_path)]) == 0
    r.add("device_path", "FAIL", "io=posix ring=cpu", None, 3)
    assert gpu_table.main(["print", str(tmp_path)]) == 1
    text = capsys.readouterr().out
    table = text[text.rindex("step "):].splitlines()
    assert table[-1] == "FAILED: device_path" and len(table) == 6  # header, rule, 3 rows, verdict
    assert len({len(line) for line in table[:-1]}) == 1  # a fixed-width table
    with pytest.raises(ValueError):
        r.add("x", "OK")
    with pytest.raises(ValueError):
        r.add("x", "PASS", on="tpu")


def test_the_verdict_passes_only_when_every_step_ran_where_it_should(tmp_path, capsys):
    """Audit 4 R4/R6/R7: the verdict FAILs a step with no row, an expected step that SKIPped, a row
    measured on the CPU where the GPU was expected (a CPU fallback reported as a GPU figure), and
    a missing result file; with all of them right it passes."""
    (tmp_path / "pytest.xml").write_text("<testsuites/>")
    r = gpu_table.Report(tmp_path, echo=False)
    r.add("raw_tier", "INFO", "9 GB/s", on="gpu", expect="gpu")
    r.add("video_av1", "INFO", "cpu fallback (no AV1 on Hopper)", on="cpu", expect="cpu")
    assert gpu_table.verdict(tmp_path, ["raw_tier", "video_av1"], ["pytest.xml"]) == 0
    cases = [  # (what is wrong, the FAIL it gives)
        (lambda: None, ["raw_tier", "video_av1", "never_ran"], [], "never_ran", "NOT EXERCISED"),
        (lambda: r.add("video_h264", "SKIP", "not carried"), ["video_h264"], [], "video_h264", "NOT RUN"),
        (lambda: r.add("mixed", "PASS", "900 img/s", on="cpu", expect="gpu"), [], [], "mixed",
         "measured on cpu, expected on gpu"),
        (lambda: None, [], ["doctor.json"], "file:doctor.json", "MISSING FILE"),
    ]
    for setup, expect, files, step, why in cases:
        setup()
        assert gpu_table.verdict(tmp_path, expect, files) == 1, step
        row = {x["step"]: x for x in gpu_table.Report(tmp_path, echo=False).data["rows"]}[step]
        assert row["status"] == "FAIL" and why in row["figure"], row
    assert "FAILED:" in capsys.readouterr().out


def _junit(path, tests: int, skipped: int = 0, failures: int = 0) -> None:
    cases = "".join(f'<testcase name="t{i}">' + ('<skipped message="needs a CUDA device"/>' if i < skipped else "")
                    + "</testcase>" for i in range(tests))
    path.write_text(f'<testsuites><testsuite name="pytest" tests="{tests}" skipped="{skipped}" '
                    f'failures="{failures}" errors="0">{cases}</testsuite></testsuites>')


def test_pytest_passes_only_when_every_selected_test_ran(tmp_path):
    """R7: conftest skips the GPU tests when its capability probe fails; pytest then exits 0 with
    everything skipped, and the old check said PASS."""
    f = tmp_path / "pytest.xml"
    _junit(f, 27)
    assert gpu_table.junit(f, 27) == (True, "27 passed, 0 failed, 0 errors, 0 skipped of 27 (plan: 27)")
    _junit(f, 27, skipped=27)
    ok, figure = gpu_table.junit(f, 27)
    assert not ok and "0 passed" in figure and "needs a CUDA device" in figure
    _junit(f, 27, skipped=1)
    assert not gpu_table.junit(f, 27)[0]
    _junit(f, 26)
    assert not gpu_table.junit(f, 27)[0]  # the selection is not what the plan counted
    assert not gpu_table.junit(tmp_path / "absent.xml", 27)[0]


def test_gpu_bench_steps_run_against_the_fakes(monkeypatch, tmp_path):
    """gpu_bench's steps end to end on the CUDA fakes (small sizes): the rows and their JSON, the
    path assertion, the mixed-vs-CPU comparison, DALI's own pipeline (on the CPU here, and labelled
    so) and the NVDEC probe's answer on a host without a driver; a real device shows the numbers."""
    import gpu_bench

    gpu = gpu_fakes.install(monkeypatch, devices=1, torch_cuda=True, kvikio=dict(gds=True))
    gpu_fakes.dali_mixed_on_cpu(monkeypatch, gpu)
    out = tmp_path / "out"
    args = ["--out", str(out), "--workdir", str(tmp_path / "work"), "--samples", "64", "--images", "24",
            "--rounds", "1", "--batch-size", "16", "--dali-device", "cpu"]
    monkeypatch.setattr(gpu_bench._Burner, "_run", _cpu_burner)
    steps = ("data_npy", "data_jpg", "device_path", "kvikio_rows", "ring_safety", "dali_import", "mixed_vs_cpu",
             "mixed_busy", "dali_pipeline")
    rc = gpu_bench.main([*args, "--steps", ",".join(steps)])
    rows = {r["step"]: r for r in json.loads((out / "gpu-check.json").read_text())["rows"]}
    assert rc == 0, rows
    assert [rows[s]["status"] for s in steps] == ["PASS"] * (len(steps) - 1) + ["INFO"], rows
    # where each figure was measured: the fakes' device ring and "mixed" decoder say GPU; DALI's own
    # pipelines ran on the CPU here, and say so (the device run's verdict would FAIL them)
    assert {s: rows[s]["on"] for s in steps if rows[s]["expect"]} == {
        "device_path": "gpu", "kvikio_rows": "gpu", "ring_safety": "gpu", "dali_import": "cpu",
        "mixed_vs_cpu": "gpu", "mixed_busy": "gpu", "dali_pipeline": "cpu"}
    # 150 KB rows >= 16 KiB; no cuFile config file (as on the H200): KvikIO's pread (audit 4 R10b)
    assert rows["device_path"]["figure"] == "io=kvikio-gds ring=cuda:0 kvikio-gds/pread=64"
    details = json.loads((out / "gpu-check.json").read_text())["details"]
    assert details["kvikio_rows"]["gds_threshold"] == 16 * 1024 and details["kvikio_rows"]["equal"]
    assert details["kvikio_rows"]["read_modes"] == {"kvikio-gds/pread": 64 * 2}  # warm-up + 1 round
    assert details["mixed_vs_cpu"]["compared"] == 24
    assert rows["mixed_busy"]["figure"].startswith("24/24 bit-equal to idle")
    assert details["ring_safety"]["burner_products"] > 0
    assert set(details["dali_pipeline"]["images_per_s"]) == {"gdsload", "dali"} and rows["dali_pipeline"]["ratio"]
    # the NVDEC probe on a host without a driver: an answer (INFO, on cpu), and every clip routed to the CPU
    gpu_fakes.install_nvdec(monkeypatch, table=None)
    assert gpu_bench.main([*args, "--steps", "nvdec"]) == 0
    rows = {r["step"]: r for r in json.loads((out / "gpu-check.json").read_text())["rows"]}
    details = json.loads((out / "gpu-check.json").read_text())["details"]
    assert rows["nvdec"]["status"] == "INFO" and rows["nvdec"]["figure"].startswith("no NVDEC: OSError")
    assert all(why.startswith("no NVDEC here") for why in details["nvdec"]["media_routes"].values())
    gpu_fakes.install_nvdec(monkeypatch)  # Hopper: the 192x160 clips all go to NVDEC
    assert gpu_bench.main([*args, "--steps", "nvdec"]) == 0
    details = json.loads((out / "gpu-check.json").read_text())["details"]
    assert details["nvdec"]["media_routes"] == {"h264": "nvdec", "hevc": "nvdec", "vp9": "nvdec"}
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
            "--baseline", "none", "--steps", "data_jpg,resnet50"]
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


def _fake_bench(tmp_path, rows: dict[str, tuple] | None = None, abort_after: str | None = None) -> Path:
    """A gpu_bench stand-in: for each step of `--steps`, the row `rows[step]` ((status, on, expect),
    default PASS measured on the GPU), or a SIGABRT after the row of `abort_after`."""
    bench = tmp_path / "fake_bench.py"
    bench.write_text(f"import os, sys\nsys.path.insert(0, {str(BENCH)!r})\nfrom gpu_table import Report\n"
                     f"out = sys.argv[sys.argv.index('--out') + 1]\nrows = {rows or {}!r}\n"
                     f"for step in sys.argv[sys.argv.index('--steps') + 1].split(','):\n"
                     f"    status, on, expect = rows.get(step, ('PASS', 'gpu', 'gpu'))\n"
                     f"    Report(out).add(step, status, 'fake ' + step, on=on, expect=expect)\n"
                     f"    if step == {abort_after!r}:\n        os.abort()\n"
                     f"sys.exit(1 if any(r[0] == 'FAIL' for r in rows.values()) else 0)\n")
    return bench


def _fake_pytest(tmp_path, tests: int, skipped: int = 0, crash: bool = False) -> str:
    """A `pytest` stand-in that writes the JUnit XML of `tests` tests (`skipped` of them skipped),
    or crashes before writing anything."""
    script = tmp_path / "fake_pytest.py"
    cases = "".join(f'<testcase name="t{i}">' + ('<skipped message="needs a CUDA device"/>' if i < skipped else "")
                    + "</testcase>" for i in range(tests))
    xml = (f'<testsuites><testsuite name="pytest" tests="{tests}" skipped="{skipped}" failures="0" errors="0">'
           f"{cases}</testsuite></testsuites>")
    script.write_text("import os, sys\n" + ("os.abort()\n" if crash else "")
                      + "path = next(a.split('=', 1)[1] for a in sys.argv if a.startswith('--junitxml='))\n"
                      + f"open(path, 'w').write({xml!r})\nprint('{tests - skipped} passed, {skipped} skipped')\n")
    return f"{sys.executable} {script}"


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("media") / ".media"
    r = subprocess.run([sys.executable, str(BENCH / "media_gpu_check.py"), "make", str(d)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return d


def _part_env(tmp_path, *, media: Path | None = None, site_files: dict[str, str] | None = None,
              bench: Path | None = None, pytest_cmd: str | None = None) -> dict:
    """gpu_check.sh set up on the CPU: dummy wheels already installed (markers) and assembled, a fake
    gpu_bench and pytest, modules in the site folder, the media folder (absent by default)."""
    whl, dali, site = tmp_path / "whl", tmp_path / "dali", tmp_path / "site"
    for d in (whl, dali, site):
        d.mkdir(exist_ok=True)
    spec = gpu_wheels.load_spec()
    for name in spec["carry"]["pins"]:
        (whl / f"{name.replace('-', '_')}-1-py3-none-any.whl").write_bytes(b"")
    (dali / "nvidia_dali-1-py3-none-any.whl").write_bytes(b"")
    for step, folder in (("install", whl), ("dali_install", dali)):
        names = "\n".join(sorted(p.name for p in folder.glob("*.whl"))) + "\n"
        digest = subprocess.run(["sha256sum"], input=names, capture_output=True, text=True).stdout[:16]
        (site / f".gdsload-installed-{step}").write_text(digest + "\n")
    for rel, text in (site_files or {}).items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
    return {**os.environ, "OUT": str(tmp_path / "out"), "PY": sys.executable, "SITE": str(site),
            "GDSLOAD_WHL_DIR": str(whl), "GDSLOAD_DALI_WHEELS": str(dali),
            "GPU_BENCH": str(bench or _fake_bench(tmp_path)), "GPU_PYTEST": pytest_cmd or _fake_pytest(tmp_path, 1),
            "GDSLOAD_MEDIA_DIR": str(media or tmp_path / "absent"), "GDSLOAD_DALI_PARTS": str(tmp_path / "parts"),
            "PYTHONPATH": str(ROOT)}


def _run_part(part: int, env: dict, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    r = subprocess.run(["bash", str(SCRIPT), "--part", str(part), *args], capture_output=True, text=True, env=env,
                       timeout=300)
    rows = {x["step"]: x for x in json.loads((Path(env["OUT"]) / "gpu-check.json").read_text())["rows"]}
    return r, rows


def test_part2_passes_when_every_step_ran_and_routes_videos_as_the_probe_says(tmp_path, media_dir):
    """A whole part 2 on the CPU with stand-ins for gpu_bench and pytest and the real media check:
    every expected step has a PASS/INFO row, so it passes. This host has no NVDEC, so the probe
    routes every clip to the CPU path and the rows say so (on=cpu, expected cpu): labelled, not
    reported as GPU figures. The log ends with the verdict (the tee is awaited, audit 4 R7), and
    $OUT holds 3 files (the tool returns 8)."""
    env = _part_env(tmp_path, media=media_dir)
    r, rows = _run_part(2, env)
    assert r.returncode == 0, r.stdout[-4000:]
    for step in ("install", "assemble", "dali_install", "dali_import", "pytest", "data_jpg", "mixed_vs_cpu",
                 "mixed_busy", "dali_pipeline", "resnet50", "video_h264", "video_hevc", "video_vp9", "audio_flac",
                 "audio_wav"):
        assert rows[step]["status"] in ("PASS", "INFO"), rows[step]
    for codec in ("h264", "hevc", "vp9"):
        row = rows[f"video_{codec}"]
        assert (row["on"], row["expect"]) == ("cpu", "cpu") and "cpu fallback (no NVDEC here" in row["figure"], row
        assert "clips/s" in row["figure"] and "PSNR min" in row["figure"]
    assert rows["pytest"]["figure"] == "1 passed, 0 failed, 0 errors, 0 skipped of 1 (plan: 1)"
    log = (tmp_path / "out" / "gpu-check.log").read_text()
    assert log.rstrip().endswith("exit 0") and "FAILED" not in log
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["gpu-check.json", "gpu-check.log", "pytest.xml"]


@pytest.mark.parametrize("case", ["all-skipped", "cpu-figure", "pytest-crash", "bench-crash", "no-media"])
def test_part2_verdict_fails(tmp_path, case):
    """Each way the first run could end green without having run: the GPU tests all skipped (R7);
    a decoded-tier figure measured on the CPU (R6); pytest crashing before its result file; a native
    crash of gpu_bench after one row (E1); `.media` not carried (R4: was SKIP and exit 0)."""
    kw: dict = {}
    if case == "all-skipped":
        kw["pytest_cmd"] = _fake_pytest(tmp_path, 1, skipped=1)
    elif case == "cpu-figure":
        kw["bench"] = _fake_bench(tmp_path, {"mixed_vs_cpu": ("PASS", "cpu", "gpu")})
    elif case == "pytest-crash":
        kw["pytest_cmd"] = _fake_pytest(tmp_path, 1, crash=True)
    elif case == "bench-crash":
        kw["bench"] = _fake_bench(tmp_path, abort_after="data_jpg")
    r, rows = _run_part(2, _part_env(tmp_path, **kw))
    assert r.returncode == 1, r.stdout[-3000:]
    assert "FAILED:" in r.stdout
    if case == "all-skipped":
        assert rows["pytest"]["status"] == "FAIL" and "0 passed" in rows["pytest"]["figure"]
    elif case == "cpu-figure":
        assert rows["mixed_vs_cpu"]["status"] == "FAIL" and "measured on cpu, expected on gpu" in rows["mixed_vs_cpu"]["figure"]
    elif case == "pytest-crash":
        assert rows["pytest"]["status"] == "FAIL" and rows["file:pytest.xml"]["status"] == "FAIL"
    elif case == "bench-crash":
        assert rows["data_jpg"]["status"] == "PASS" and "SIGABRT (rc=134)" in rows["bench"]["figure"]
        for step in ("mixed_vs_cpu", "mixed_busy", "dali_pipeline", "resnet50"):
            assert rows[step]["status"] == "FAIL" and "NOT EXERCISED" in rows[step]["figure"]
    if case == "no-media":
        assert "ref.npz is missing" in rows["media"]["figure"]
    for step in ("video_h264", "video_hevc", "video_vp9", "audio_flac", "audio_wav"):  # no .media in these runs
        assert rows[step]["status"] == "FAIL" and "NOT EXERCISED" in rows[step]["figure"], rows[step]


def test_a_media_check_that_crashes_leaves_its_steps_not_exercised(tmp_path):
    """A check that crashes before its first row (here: a `ref.npz` that is not a NumPy file)."""
    media = tmp_path / "media"
    media.mkdir()
    (media / "ref.npz").write_bytes(b"not a numpy file")
    r, rows = _run_part(2, _part_env(tmp_path, media=media))
    assert r.returncode == 1, r.stdout[-3000:]
    assert rows["media"]["status"] == "FAIL" and rows["pytest"]["status"] == "PASS"
    for step in ("video_h264", "video_hevc", "video_vp9", "audio_flac", "audio_wav"):
        assert rows[step]["status"] == "FAIL" and "NOT EXERCISED" in rows[step]["figure"], rows[step]


def test_part1_receives_dali_part_one_and_stops_when_torch_has_no_cuda(tmp_path):
    """Part 1 keeps DALI's first part (call 1 carries it) and asserts torch.cuda.is_available():
    here KvikIO and CuPy import (stand-ins) but torch has no CUDA, so import FAILs and the steps
    after it are NOT EXERCISED (before, the import row printed `cuda False` and PASSed)."""
    part = tmp_path / ".dali1"
    part.mkdir()
    (part / "part01").write_bytes(b"x" * 100)
    (part / "MANIFEST").write_text(json.dumps({"parts": 4, "sha256": "0", "part": 1}))
    env = _part_env(tmp_path, site_files={"kvikio/__init__.py": "__version__ = '26.10.0'\n",
                                          "cupy/__init__.py": "__version__ = '14.2.0'\n"})
    r, rows = _run_part(1, env, "--receive", str(part))
    assert r.returncode == 1, r.stdout[-3000:]
    assert rows["receive"]["status"] == "PASS" and (tmp_path / "parts" / "part01").read_bytes() == b"x" * 100
    assert rows["install"]["status"] == "PASS"
    assert rows["import"]["status"] == "FAIL" and "torch.cuda.is_available() is False" in rows["import"]["figure"]
    for step in ("nvdec", "doctor", "pytest", "data_npy", "device_path", "kvikio_rows", "raw_tier", "ring_safety"):
        assert "NOT EXERCISED" in rows[step]["figure"], rows[step]
    assert rows["file:doctor.json"]["status"] == rows["file:pytest.xml"]["status"] == "FAIL"


def test_gdsload_bench_measures_gdsload_on_the_cpu_like_its_baselines(monkeypatch, tmp_path):
    """R6: `gdsload bench` on a GPU host ran gdsload on the default device ("cuda": device ring,
    mixed decode) while torch, DALI and SPDL decode on the CPU: the ratios set GPU against CPU.
    Here a GPU is visible (the fakes) and the gdsload contestant still runs the CPU path."""
    from gdsload.bench import runners
    from gdsload.convert.engine import ConvertOptions, convert
    from gdsload.sampledata import make_npy_folder

    make_npy_folder(tmp_path / "src", num_samples=8, shape=(4, 8), dtype="uint8")
    convert(str(tmp_path / "src"), tmp_path / "ds", ConvertOptions(workers=1, progress=False))
    gpu_fakes.install(monkeypatch, devices=1, torch_cuda=True, kvikio=False)
    r = runners.run_gdsload({"kind": "tensor", "tier": "R", "dataset": str(tmp_path / "ds"), "batch_size": 4,
                             "workers": 1, "contestant": "gdsload", "step_ms": 0})
    assert r["samples"] == 8 and r["stats"]["ring_device"] == "cpu"


def test_examples_set_the_ranks_gpu_before_the_process_group():
    """R13: the examples called init_process_group before torch.cuda.set_device(LOCAL_RANK), so NCCL's
    set-up (and anything CUDA before it) ran on GPU 0 in every rank."""
    for name in ("train_imagefolder.py", "train_remote.py"):
        text = (ROOT / "examples" / name).read_text()
        assert text.index("torch.cuda.set_device(") < text.index("dist.init_process_group("), name


def test_the_plan_has_the_pass_nvdec_step_and_the_token_device_ring_test():
    """Issue 54 item 4 and issue 51 item 5: part 2's media check expects a pass_nvdec row, capped at
    60 s at most, and part 1's pytest selection holds the token test that reads token shards by
    KvikIO into the device ring against the host path (its corpus fixture counted in the caps)."""
    import gpu_plan

    assert "pass_nvdec" in gpu_plan.media_steps() and "pass_nvdec" in gpu_plan.caps(2)["MEDIA_STEPS"].split(",")
    assert gpu_plan.PASS_NVDEC_S[1] <= 60
    assert "tests/tokens/test_token_gpu.py" in gpu_plan.SELECTION[1]["files"]
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                                "-m", "gpu or gds", "tests/tokens/test_token_gpu.py"], cwd=ROOT, capture_output=True,
                               text=True, timeout=120).stdout
    assert "test_token_gpu.py::test_real_gpu_batches_equal_host_batches" in collected, collected[-2000:]
    name, typ, cap = gpu_plan._pytest_phase(1)
    n = gpu_plan.SELECTION[1]["tests"]
    assert cap >= gpu_plan.PYTEST_START_S[1] + n * gpu_plan.PER_TEST_S[1] + gpu_plan.FIXTURE_S[1][1] - 1
    assert gpu_plan.caps(1)["BENCH_ARGS"] == "--samples 1024"
