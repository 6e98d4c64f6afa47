"""Skip tests by detected capability: `gpu`, `gds`, `dali_gpu` need a CUDA device (and KvikIO
with a working driver for `gds`); `dali` needs NVIDIA DALI importable."""

from __future__ import annotations

import ctypes
import functools
import importlib.util

import pytest


@functools.cache
def _has_cuda_driver() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


@functools.cache
def _has_cuda_device() -> bool:
    if not _has_cuda_driver():
        return False
    try:
        import cupy

        cupy.zeros(1)
        return True
    except Exception:
        return False


@functools.cache
def _kvikio_imports() -> bool:
    """KvikIO really imports (find_spec alone says yes for a wheel that cannot load, e.g. without
    rapids-logger; bench/gpu_check.sh stops before the tests in that case)."""
    try:
        import kvikio  # noqa: F401
    except Exception:
        return False
    return True


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


CAPABILITIES = {
    "gpu": (lambda: _has_cuda_device(), "needs a CUDA device"),
    "gds": (lambda: _has_cuda_device() and _kvikio_imports(), "needs KvikIO and a CUDA device"),
    "dali": (lambda: _has("nvidia.dali"), "needs NVIDIA DALI (pip install 'gdsload[cpu]')"),
    "dali_gpu": (lambda: _has("nvidia.dali") and _has_cuda_device(), "needs DALI and a CUDA device"),
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        for name, (check, why) in CAPABILITIES.items():
            if item.get_closest_marker(name) and not check():
                item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture(scope="session")
def s3():
    """A local S3 endpoint (moto's server on loopback, port 0) for the whole session; yields an
    s3fs filesystem. The endpoint and dummy credentials are put in the environment, which is how
    fsspec in this process, in worker processes and in Ray workers started afterwards finds them."""
    pytest.importorskip("s3fs")
    server_mod = pytest.importorskip("moto.server")
    import logging
    import os

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env["AWS_ENDPOINT_URL"] = f"http://{host}:{port}"
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        import fsspec

        yield fsspec.filesystem("s3", skip_instance_cache=True)
    finally:
        server.stop()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
