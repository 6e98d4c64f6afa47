"""Skip tests by detected capability: `gpu`, `gds`, `dali_gpu` need a CUDA device (and KvikIO
with a working driver for `gds`); `dali` needs NVIDIA DALI importable."""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import sys

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


# Tests that use gRPC in a child forked from the test process. gRPC core does not promise that a
# forked child can use it when the parent holds gRPC state (threads, pollers, servers: see grpc's
# doc/fork_support.md); a training script that builds a RemoteLoader and then forks workers holds
# little of it, but a test process that has run every in-process server of the suite holds a lot,
# and a child forked from it was once seen to hang. They run first, from a process that has
# started no gRPC server yet, as a training script would be.
FORK_WITH_GRPC = ("tests/service/test_fork.py", "tests/service/test_multiprocess_remote.py")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: not item.nodeid.startswith(FORK_WITH_GRPC))  # stable: order kept otherwise
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


# -- a guard on the test process itself ----------------------------------------------------------
# A CI run once went wrong part-way (the rest of the run failed or hung until the job's limit) in a
# way no other run reproduced: imports of modules not yet loaded stopped working and subprocesses
# failed, which is what a damaged installation, working directory or import path looks like. The
# guard stats a few installed files after every test (microseconds) and, the moment one goes
# missing, stops the whole run naming the test that was running, instead of letting hundreds of
# tests fail for a reason that is not theirs.
_CANARY_MODULES = ("webdataset", "nvidia.dali", "numpy.testing", "json.tool", "hypothesis", "pytest")


def _canaries() -> dict[str, str]:
    """Canary module name -> the file it is found in (those installed here)."""
    found = {"": sys.executable}
    for name in _CANARY_MODULES:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is not None and spec.origin and os.path.isfile(spec.origin):
            found[name] = spec.origin
    return found


def _damage(canaries: dict[str, str], path: list[str], finders: list) -> str | None:
    missing = [f for f in canaries.values() if not os.access(f, os.R_OK)]
    if missing:
        return f"installed files no longer readable: {missing}"
    for name in canaries:  # a module not imported yet must still be found (the import system works)
        if name and name not in sys.modules:
            try:
                if importlib.util.find_spec(name) is None:
                    return f"the installed module {name!r} can no longer be found"
            except Exception as exc:  # noqa: BLE001 (reported, with what it was)
                return f"looking for the installed module {name!r} raised {exc!r}"
    try:
        os.getcwd()
    except OSError as exc:
        return f"the working directory is gone: {exc}"
    lost = [p for p in path if p not in sys.path]
    if lost:
        return f"sys.path lost {lost}"
    gone = [f for f in finders if f not in sys.meta_path]
    if gone:
        return f"sys.meta_path lost {gone}"
    return None


def pytest_sessionstart(session):
    session.config._gdsload_guard = (_canaries(), list(sys.path), list(sys.meta_path))


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    why = _damage(*item.config._gdsload_guard)
    if why is not None:
        pytest.exit(f"the test process was damaged during {item.nodeid}: {why}", returncode=3)
