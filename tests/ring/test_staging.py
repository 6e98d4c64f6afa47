"""The staging pool (`gdsload.ring.staging`): batch-owned buffers that cost no lasting objects."""

from __future__ import annotations

import gc

import numpy as np

from gdsload.ring.staging import StagingPool


def _array_types() -> int:
    return sum(type(o).__name__ == "PyCArrayType" for o in gc.get_objects())


def test_batches_of_many_sizes_leave_no_ctypes_type_each():
    """ctypes keeps every array type it makes for the life of the process: an owner typed by the
    batch's size (`c_char * nbytes`) left ~10 GC-tracked objects behind per batch, for good (each
    full collection then scanned them all). Owners are typed by the pool buffer's size now."""
    pool = StagingPool(keep=2)
    pool.take(1000)  # the pool's first buffer (4 MiB) and its owner type
    before = _array_types()
    for k in range(200):
        a = pool.take(1000 + 37 * k)  # 200 different batch sizes, all fitting the one buffer
        assert len(a) == 1000 + 37 * k and a.dtype == np.uint8
        a[:] = k % 256
        del a
    assert _array_types() - before <= 1
