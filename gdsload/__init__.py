"""gdsload: a GPU-direct data pipeline for deep-learning training.

`import gdsload` needs NumPy only; DALI, KvikIO, CuPy, torch and grpc are imported where they are
used, with an install hint when missing.
"""

from __future__ import annotations

from gdsload.errors import (
    DestinationError,
    FormatError,
    GdsloadError,
    InputError,
    MissingDependencyError,
)
from gdsload.format.reader import ShardedDataset, open_dataset

__version__ = "0.1.0"

_LAZY = {
    "DataLoader": "gdsload.loader",
    "Dataset": "gdsload.dataset",
    "ImageTransform": "gdsload.decode.image",
    "Mix": "gdsload.mix",
    "RemoteLoader": "gdsload.service.client",
}


def __getattr__(name: str):
    """`gdsload.DataLoader` and friends, imported on first use."""
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'gdsload' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(mod), name)

__all__ = [
    "DataLoader",
    "Dataset",
    "ImageTransform",
    "Mix",
    "RemoteLoader",
    "DestinationError",
    "FormatError",
    "GdsloadError",
    "InputError",
    "MissingDependencyError",
    "ShardedDataset",
    "open_dataset",
    "__version__",
]
