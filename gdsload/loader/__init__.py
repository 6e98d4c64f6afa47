"""The local pipeline: `gdsload.DataLoader`, one stage per module (reading order in `dataloader`)."""

from __future__ import annotations

__all__ = ["DataLoader"]


def __getattr__(name: str):
    if name == "DataLoader":
        from gdsload.loader.dataloader import DataLoader

        return DataLoader
    raise AttributeError(f"module 'gdsload.loader' has no attribute {name!r}")
