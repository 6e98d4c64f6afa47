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

__all__ = [
    "DestinationError",
    "FormatError",
    "GdsloadError",
    "InputError",
    "MissingDependencyError",
    "ShardedDataset",
    "open_dataset",
    "__version__",
]
