"""Backend choice and the registry: URLs go to fsspec, device buffers to KvikIO only where it can
work, POSIX otherwise; missing dependencies are named with an install hint."""

from __future__ import annotations

import subprocess
import sys

import pytest

import gdsload.io as gio
from gdsload.errors import GdsloadError, MissingDependencyError


@pytest.mark.parametrize(
    "url",
    ["s3://bucket/train-000000.tar", "gs://b/x.tar", "http://host/x.tar", "https://host:8443/x.tar",
     "memory://x.tar"],
)
@pytest.mark.parametrize("device", [False, True])
def test_urls_go_to_fsspec(url, device):
    assert gio.choose_backend(url, device=device) == "fsspec"


@pytest.mark.parametrize("path", ["/data/shards/train-000000.tar", "shards/x.tar", "C:x.tar", "file:///data/x.tar"])
def test_local_paths_go_to_posix_for_host_buffers(path):
    assert gio.choose_backend(path, device=False) == "posix"


@pytest.mark.skipif(gio.kvikio_usable(), reason="this host has KvikIO and a CUDA device")
def test_device_buffers_fall_back_to_posix_without_a_usable_kvikio():
    assert gio.choose_backend("/data/x.tar", device=True) == "posix"
    assert "kvikio" not in gio.available_backends()
    with gio.open_backend(path="/data/x.tar", device=True) as b:
        assert b.name == "posix"


def test_kvikio_usable_needs_a_cuda_driver(monkeypatch):
    monkeypatch.setattr(gio, "cuda_device_count", lambda: 0)
    gio.kvikio_usable.cache_clear()
    try:
        assert gio.kvikio_usable() is False
        assert gio.choose_backend("/x.tar", device=True) == "posix"
    finally:
        gio.kvikio_usable.cache_clear()


def test_missing_kvikio_is_a_missing_dependency_error_with_an_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "kvikio", None)  # makes `import kvikio` fail, also on GPU hosts
    with pytest.raises(MissingDependencyError) as info:
        gio.open_backend("kvikio")
    message = str(info.value)
    assert "'kvikio'" in message and "pip install 'gdsload[cuda12]'" in message
    assert isinstance(info.value, ImportError)  # callers may catch it as an ImportError too


def test_unknown_backend_names_the_valid_ones():
    with pytest.raises(GdsloadError, match="unknown I/O backend 'nfs'.*posix, posix-odirect, fsspec, kvikio"):
        gio.open_backend("nfs")


def test_open_backend_builds_registered_backends():
    with gio.open_backend("posix", threads=2) as b:
        assert (b.name, b.threads, b.device_capable) == ("posix", 2, False)
    with gio.open_backend("posix-odirect") as b:
        assert b.o_direct_requested and b.name in ("posix-odirect", "posix")
    with gio.open_backend(path="s3://bucket/x.tar", retries=1) as b:
        assert (b.name, b.retries) == ("fsspec", 1)
    for name in gio.available_backends():
        assert name in gio.REGISTRY
    assert {"posix", "fsspec"} <= set(gio.available_backends())


def test_import_gdsload_io_needs_stdlib_and_numpy_only():
    code = (
        "import sys\n"
        "import gdsload\n"
        "before = set(sys.modules)\n"
        "import gdsload.io\n"
        "new = {m.split('.')[0] for m in set(sys.modules) - before}\n"
        "print(sorted(new - set(sys.stdlib_module_names) - {'numpy', 'gdsload'}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("path, remote", [
    ("s3://bucket/ds", True), ("gs://b/x.tar", True), ("https://host:8443/x", True), ("memory://x", True),
    ("file:///data/ds", False), ("/data/ds", False), ("ds/x.tar", False), ("C:x.tar", False),
])
def test_where_is_this_has_one_answer(path, remote):
    """`is_remote` is the storage layer's one "where is this?": a `file://` URL is a local path."""
    assert gio.is_remote(path) is remote
    if not remote:
        assert str(gio.local_path(path)) == path.removeprefix("file://")


def test_no_other_module_decides_where_a_path_is():
    """No `"://" in path` or `.startswith("s3://")` of its own anywhere in gdsload/: every
    module asks `gdsload.io.is_remote`."""
    import ast
    from pathlib import Path

    root = Path(gio.__file__).parents[1]
    found = []
    for py in root.rglob("*.py"):
        if py == Path(gio.__file__):
            continue
        for node in ast.walk(ast.parse(py.read_text(), str(py))):
            consts = []
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
                consts = [node.left]
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr in ("startswith", "removeprefix", "partition", "split")):
                consts = node.args[:1]
            if any(isinstance(c, ast.Constant) and isinstance(c.value, str) and "://" in c.value for c in consts):
                found.append(f"{py.relative_to(root)}:{node.lineno}")
    assert found == []
