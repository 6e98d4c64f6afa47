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


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


CAPABILITIES = {
    "gpu": (lambda: _has_cuda_device(), "needs a CUDA device"),
    "gds": (lambda: _has_cuda_device() and _has("kvikio"), "needs KvikIO and a CUDA device"),
    "dali": (lambda: _has("nvidia.dali"), "needs NVIDIA DALI (pip install 'gdsload[cpu]')"),
    "dali_gpu": (lambda: _has("nvidia.dali") and _has_cuda_device(), "needs DALI and a CUDA device"),
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        for name, (check, why) in CAPABILITIES.items():
            if item.get_closest_marker(name) and not check():
                item.add_marker(pytest.mark.skip(reason=why))
