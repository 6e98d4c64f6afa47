"""Tests of `gdsload.doctor`: the host report behind ``gdsload doctor``."""

from __future__ import annotations

import ctypes
import importlib.abc
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gdsload import doctor

DOCTOR_PATH = Path(doctor.__file__)

MODULE_KEYS = ("kvikio", "cupy", "dali", "torch", "webdataset", "grpc")
EXPECTED_KEYS = {
    "python",
    "platform",
    "cuda",
    "cufile",
    *MODULE_KEYS,
    "gpu_available",
    "io_path",
    "decode_device",
    "native_output",
}


def _libcuda_loadable() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def _importable(name: str) -> bool:
    try:
        __import__(name)
    except Exception:
        return False
    return True


cpu_only = pytest.mark.skipif(
    _libcuda_loadable(), reason="libcuda.so.1 loads: not a CPU-only host"
)


@pytest.fixture(scope="module")
def report() -> dict:
    return doctor.collect()


def test_collect_has_expected_keys_and_shapes(report: dict) -> None:
    assert EXPECTED_KEYS <= set(report)
    assert report["python"]["version"] == "%d.%d.%d" % sys.version_info[:3]
    assert isinstance(report["platform"]["system"], str) and report["platform"]["system"]
    assert isinstance(report["cuda"]["driver_loaded"], bool)
    assert isinstance(report["cufile"]["loaded"], bool)
    assert set(report["cufile"]["kvikio"]) >= {
        "compat_mode",
        "compat_mode_preferred",
        "gds_available",
        "error",
    }
    for key in MODULE_KEYS:
        entry = report[key]
        assert set(entry) >= {"version", "error", "installed"}, key
        # Exactly one of: imported (error None) or failed (error is a message string).
        assert entry["error"] is None or (isinstance(entry["error"], str) and entry["error"])
    assert isinstance(report["gpu_available"], bool)
    assert report["io_path"] in doctor.IO_PATHS
    assert report["decode_device"] in doctor.DECODE_DEVICES


def test_collect_is_json_serialisable(report: dict) -> None:
    assert json.loads(json.dumps(report)) == report


def test_module_versions_match_what_is_importable(report: dict) -> None:
    # webdataset is a test dependency of the project, so it is present wherever the tests run.
    assert report["webdataset"]["error"] is None
    assert report["webdataset"]["installed"] is True
    assert report["webdataset"]["version"] == importlib.metadata.version("webdataset")
    if _importable("nvidia.dali"):
        import nvidia.dali

        assert report["dali"]["error"] is None
        assert report["dali"]["version"] == nvidia.dali.__version__
    else:
        assert report["dali"]["error"]
    if not _importable("grpc"):
        assert report["grpc"]["version"] is None
        assert "grpc" in report["grpc"]["error"]
        assert report["grpc"]["installed"] is False


@cpu_only
def test_cpu_only_host_report(report: dict) -> None:
    assert report["cuda"]["driver_loaded"] is False
    assert "libcuda.so.1" in report["cuda"]["error"]
    assert report["cuda"]["driver_version"] is None
    assert report["gpu_available"] is False
    assert report["io_path"] == "posix"
    expected_decode = "cpu" if _importable("nvidia.dali") else "unavailable"
    assert report["decode_device"] == expected_decode
    if report["cupy"]["error"] is None:  # CuPy imports on CPU-only hosts but cannot allocate
        assert report["cupy"]["can_allocate"] is False
        assert report["cupy"]["allocate_error"]


@cpu_only
def test_render_cpu_only(report: dict) -> None:
    text = doctor.render(report)
    lines = text.splitlines()
    assert "posix" in text
    assert doctor.CPU_ONLY_STATEMENT in lines
    assert lines[-2] == "I/O path: posix"
    assert lines[-1] == f"decode device: {report['decode_device']}"
    assert any(line.startswith("CUDA driver") and "not found" in line for line in lines)
    if _importable("nvidia.dali"):
        assert lines[-1] == "decode device: cpu"


def test_render_gpu_host_report() -> None:
    fake = {
        "python": {"version": "3.11.7", "implementation": "CPython"},
        "platform": {"platform": "Linux-x86_64"},
        "cuda": {
            "driver_loaded": True,
            "library": "libcuda.so.1",
            "driver_version": "12.8",
            "devices": [{"index": 0, "name": "NVIDIA H200", "memory_bytes": 141 * 2**30}],
            "device_count": 1,
        },
        "cufile": {
            "loaded": True,
            "library": "libcufile.so.0",
            "kvikio": {"compat_mode": "AUTO", "compat_mode_preferred": False, "gds_available": True},
        },
        "kvikio": {"installed": True, "version": "26.10.00", "package": "kvikio-cu12", "error": None},
        "cupy": {"installed": True, "version": "14.2.0", "error": None, "can_allocate": True},
        "dali": {"installed": True, "version": "2.4.0", "error": None},
        "torch": {"installed": False, "version": None, "error": "ModuleNotFoundError: torch"},
        "gpu_available": True,
        "io_path": "kvikio-gds",
        "decode_device": "mixed",
    }
    text = doctor.render(fake)
    lines = text.splitlines()
    assert doctor.CPU_ONLY_STATEMENT not in text
    assert "NVIDIA H200, 141 GiB" in text
    assert any(line.startswith("CUDA driver") and "12.8" in line for line in lines)
    assert any(line.strip().startswith("GDS usable") and line.endswith("yes") for line in lines)
    assert any(line.startswith("PyTorch") and line.endswith("not installed") for line in lines)
    assert lines[-2:] == ["I/O path: kvikio-gds", "decode device: mixed"]


def test_render_tolerates_an_empty_report() -> None:
    text = doctor.render({})
    assert text.splitlines()[-2:] == ["I/O path: posix", "decode device: unavailable"]
    assert doctor.CPU_ONLY_STATEMENT in text


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        (dict(kvikio_importable=True, cuda_driver=True, gpu_available=True,
              gds_available=True, compat_mode_preferred=False), "kvikio-gds"),
        (dict(kvikio_importable=True, cuda_driver=True, gpu_available=True,
              gds_available=True, compat_mode_preferred=True), "kvikio-compat"),
        (dict(kvikio_importable=True, cuda_driver=True, gpu_available=True,
              gds_available=False, compat_mode_preferred=False), "kvikio-compat"),
        (dict(kvikio_importable=True, cuda_driver=True, gpu_available=True,
              gds_available=None, compat_mode_preferred=None), "kvikio-compat"),
        (dict(kvikio_importable=True, cuda_driver=False, gpu_available=False,
              gds_available=False, compat_mode_preferred=True), "posix"),
        (dict(kvikio_importable=True, cuda_driver=True, gpu_available=False,
              gds_available=True, compat_mode_preferred=False), "posix"),
        (dict(kvikio_importable=False, cuda_driver=True, gpu_available=True,
              gds_available=None, compat_mode_preferred=None), "posix"),
    ],
)
def test_io_path_for(kwargs: dict, expected: str) -> None:
    assert doctor.io_path_for(**kwargs) == expected


def test_decode_device_for() -> None:
    assert doctor.decode_device_for(dali_importable=True, gpu_available=True) == "mixed"
    assert doctor.decode_device_for(dali_importable=True, gpu_available=False) == "cpu"
    assert doctor.decode_device_for(dali_importable=False, gpu_available=True) == "unavailable"
    assert doctor.decode_device_for(dali_importable=False, gpu_available=False) == "unavailable"


_EXPLODING_TORCH = r"""
import importlib.abc, importlib.util, json, sys

class Loader(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise RuntimeError("libtorch_cuda.so: undefined symbol: boom")

class Finder(importlib.abc.MetaPathFinder):  # finds `torch` (whatever is installed), makes importing it raise
    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, Loader()) if fullname == "torch" else None

sys.meta_path.insert(0, Finder())
from gdsload import doctor

report = doctor.collect()
line = next(ln for ln in doctor.render(report).splitlines() if ln.startswith("PyTorch"))
print(json.dumps({"torch": report["torch"], "line": line, "left": "torch" in sys.modules}))
"""


def test_module_that_raises_on_import_is_reported_not_raised() -> None:
    """In a fresh process: this one's torch stays as it is (taking torch out of `sys.modules` and
    back left its shared-memory storages to be freed at exit by a torch with its globals gone,
    which printed `Exception ignored in StorageWeakRef.__del__` after the test summary)."""
    import subprocess

    r = subprocess.run([sys.executable, "-c", _EXPLODING_TORCH], capture_output=True, text=True, check=True)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    torch_entry = out["torch"]
    assert torch_entry["error"] == "RuntimeError: libtorch_cuda.so: undefined symbol: boom"
    assert torch_entry["installed"] is True  # found, but broken: not the same as absent
    assert "cuda_available" not in torch_entry
    assert out["left"] is False  # the failed import left nothing half-initialised behind
    assert "import failed: RuntimeError: libtorch_cuda.so: undefined symbol: boom" in out["line"]


def test_absent_module_is_reported_as_not_installed(monkeypatch) -> None:
    monkeypatch.setitem(
        doctor.MODULES, "grpc", ("gdsload_no_such_module_xyz", ("gdsload-no-such-dist",), "gRPC")
    )
    report = doctor.collect()
    assert report["grpc"]["installed"] is False
    assert report["grpc"]["version"] is None
    assert report["grpc"]["error"].startswith("ModuleNotFoundError")
    line = next(ln for ln in doctor.render(report).splitlines() if ln.startswith("gRPC"))
    assert line.endswith("not installed")


def test_native_output_is_captured_not_printed(capfd) -> None:
    # cuFile prints "dlopen error libcuda.so.1 ..." with C stdio straight to fd 1; that must not
    # reach the real stdout (it would corrupt `gdsload doctor --json`).
    libc = ctypes.CDLL(None)
    sink: list[str] = []
    with doctor._captured_native_output(sink, "probe"):
        os.write(1, b"raw fd write\n")
        libc.printf(b"buffered C stdio write\n")
        os.write(2, b"to stderr\n")
    print("after")
    out, err = capfd.readouterr()
    assert out == "after\n"
    assert err == ""
    assert len(sink) == 1
    assert sink[0].startswith("[probe] ")
    for text in ("raw fd write", "buffered C stdio write", "to stderr"):
        assert text in sink[0]


def test_collect_prints_nothing(capfd) -> None:
    doctor.collect()
    out, err = capfd.readouterr()
    assert out == ""
    assert err == ""


def test_importing_doctor_needs_only_the_stdlib() -> None:
    # Load the file by path in a fresh interpreter (so gdsload/__init__ and its NumPy import stay
    # out of the picture) and list every module that import pulled in.
    script = textwrap.dedent(
        f"""
        import importlib.util, json, sys
        before = set(sys.modules)
        spec = importlib.util.spec_from_file_location("gdsload_doctor_alone", {str(DOCTOR_PATH)!r})
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        new = sorted(set(sys.modules) - before)
        print(json.dumps(new))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    new_modules = json.loads(result.stdout)
    top_level = {name.split(".")[0] for name in new_modules}
    non_stdlib = sorted(top_level - set(sys.stdlib_module_names) - {"gdsload_doctor_alone"})
    assert non_stdlib == []
    assert "ctypes" in top_level  # the module really was executed in the fresh interpreter
    for heavy in ("numpy", "nvidia", "kvikio", "cupy", "torch", "webdataset", "grpc"):
        assert heavy not in top_level
