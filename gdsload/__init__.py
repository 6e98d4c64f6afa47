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
from gdsload.dataset.sharded import ShardedDataset, open_dataset

from gdsload._version import __version__

_LAZY = {
    "DataLoader": "gdsload.loader.dataloader",
    "Dataset": "gdsload.dataset.dataset",
    "ImageTransform": "gdsload.decode.image",
    "Mix": "gdsload.dataset.mix",
    "RemoteLoader": "gdsload.service.client.loader",
    "ShardWriter": "gdsload.convert.writer",
    "TokenLoader": "gdsload.frontend.tokens",
    "ServedTokens": "gdsload.service.client.tokens",
    "write": "gdsload.convert.writer",
    "process": "gdsload.cli.process",  # the pass (gdsload.preprocess.run) and an address as its feed
    "VideoTransform": "gdsload.decode.video",
    "AudioTransform": "gdsload.decode.audio",
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
    "VideoTransform",
    "AudioTransform",
    "Mix",
    "RemoteLoader",
    "ShardWriter",
    "TokenLoader",
    "ServedTokens",
    "write",
    "process",
    "DestinationError",
    "FormatError",
    "GdsloadError",
    "InputError",
    "MissingDependencyError",
    "ShardedDataset",
    "open_dataset",
    "__version__",
]
