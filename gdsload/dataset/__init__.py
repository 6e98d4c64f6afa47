"""What a loader reads: `Dataset`, `Mix` (one `Source` interface), the sharded reader beneath them."""

from __future__ import annotations

__all__ = ["Dataset", "Mix", "ShardedDataset", "open_dataset"]

_WHERE = {"Dataset": "gdsload.dataset.dataset", "Mix": "gdsload.dataset.mix",
          "ShardedDataset": "gdsload.dataset.sharded", "open_dataset": "gdsload.dataset.sharded"}


def __getattr__(name: str):
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'gdsload.dataset' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(mod), name)
