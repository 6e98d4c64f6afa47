"""The CUDA driver as seen through ctypes (`libcuda.so.1`), with no CUDA library imported: how
many devices it sees. A host fact every layer may ask (the loaders' default device, the I/O
backend's choice) without importing `gdsload.io` or CuPy."""

from __future__ import annotations

import ctypes


def cuda_device_count() -> int:
    """CUDA devices visible through the driver API (libcuda.so.1), 0 without a driver."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value
