"""Package-level contracts: import cost, the CLI entry points, the README commands."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("nvidia.dali", "torch", "grpc", "cupy", "kvikio", "PIL", "fsspec", "tqdm", "webdataset", "skimage")


def test_import_needs_numpy_only():
    # A meta-path finder makes every heavy module unimportable; `import gdsload` must still work.
    code = (
        "import sys\n"
        f"HEAVY = {HEAVY!r}\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in {h.split('.')[0] for h in HEAVY}:\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import gdsload, gdsload.cli, gdsload.sampledata, gdsload.doctor\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in {h.split('.')[0] for h in HEAVY}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_cli_help_and_usage_errors():
    ok = subprocess.run([sys.executable, "-m", "gdsload", "--help"], capture_output=True, text=True)
    assert ok.returncode == 0
    for cmd in ("convert", "inspect", "verify", "doctor", "demo"):
        assert cmd in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "gdsload", "convert"], capture_output=True, text=True)
    assert bad.returncode == 2 and "src" in bad.stderr


def test_inspect_missing_dataset_is_a_clear_error(tmp_path, capsys):
    from gdsload.cli import main

    assert main(["inspect", str(tmp_path / "nope")]) == 1
    err = capsys.readouterr().err
    assert "nope" in err and "does not exist" in err and "Traceback" not in err


def test_readme_commands_are_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    for tag in ("demo", "test"):
        m = re.search(rf"<!-- ci:{tag} -->\n```bash\n(.+?)\n```", readme, re.S)
        assert m, f"README lacks the {tag} command block"
        assert "pip install" in m.group(1)
    assert "for name in test demo" in ci
    assert "torch" not in re.search(r"<!-- ci:test -->\n```bash\n(.+?)\n```", readme, re.S).group(1).replace(
        "torch==2.13.0", ""
    ), "CI must never pull an unpinned (CUDA) torch"



def test_test_extra_installs_what_the_suite_needs():
    """Skips by capability are for GPUs only: the test extra must bring every library the CPU
    suite imports (a lost line here once made CI skip the whole gRPC suite silently)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {re.split(r"[<>=!\[ ]", d, maxsplit=1)[0].lower() for d in extras["test"]}
    assert {"grpcio", "grpcio-health-checking", "grpcio-tools", "protobuf", "prometheus-client",
            "webdataset", "hypothesis", "aiohttp", "scikit-image", "ray", "moto", "s3fs"} <= names


def test_a_numpy_output_loader_does_not_import_torch(tmp_path):
    """Only a process that imported torch can have a torch.distributed group, so the loader does not
    import torch (over a second) to look for one (`gdsload.host.dist`)."""
    from gdsload.cli import main
    from gdsload.sampledata import make_npy_folder

    make_npy_folder(tmp_path / "src", num_samples=8, shape=(4,), dtype="uint8", seed=1)
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "ds"), "-q"]) == 0
    code = ("import sys, gdsload\n"
            f"dl = gdsload.DataLoader(gdsload.Dataset({str(tmp_path / 'ds')!r}), batch_size=4, device='cpu', "
            "output='numpy')\n"
            "print(sum(len(b['cls']) for b in dl), 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["8", "False"]
