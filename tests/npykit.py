"""Helpers shared by tests that use .npy data: `npy_bytes` is an array's .npy file,
`convert_folder` converts a folder with one worker, `npy_dataset` makes a small converted
dataset (`gdsload.sampledata.make_npy_folder`, then `convert_folder`), `keys` lists what a
loader delivers, `to_numpy` makes a batch value (a torch tensor or not) a NumPy array. Each
test file keeps its own arrays, sizes, seed and shard size (its data), only the steps are
shared."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np


def npy_bytes(a: np.ndarray, **kw) -> bytes:
    """`a` as `np.save(..., **kw)` writes it."""
    buf = io.BytesIO()
    np.save(buf, a, **kw)
    return buf.getvalue()


def npy_dataset(src: Path, dst: Path, *, num_samples: int, shape: tuple[int, ...], dtype: str, seed: int,
                shard_size: int | None = None) -> Path:
    """`num_samples` arrays of `shape` and `dtype` (with labels) written to `src` with `seed`, then
    converted into `dst` (`convert_folder`); returns `dst`."""
    from gdsload.sampledata import make_npy_folder

    make_npy_folder(src, num_samples=num_samples, shape=shape, dtype=dtype, seed=seed)
    return convert_folder(src, dst, shard_size=shard_size)


def convert_folder(src: Path, dst: Path, shard_size: int | None = None) -> Path:
    """`src` converted into `dst` with one worker, no progress, in shards of `shard_size` bytes
    (convert's default, 1 GiB, when None); returns `dst`."""
    from gdsload.convert.engine import ConvertOptions, convert

    opts = {} if shard_size is None else {"shard_size": shard_size}
    convert(str(src), dst, ConvertOptions(workers=1, progress=False, **opts))
    return dst


def keys(loader) -> list[str]:
    """Every key `loader` delivers in one pass, in order."""
    return [k for b in loader for k in b["__key__"]]


def to_numpy(x) -> np.ndarray:
    """A batch value as a NumPy array: a (CPU) torch tensor's own memory, anything else through
    `np.asarray`."""
    import torch

    return x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
