"""The rank and world size a `torch.distributed` process group gives, for loaders that default to it.

Only a process that has imported torch can have initialised a process group, so torch is looked up
in `sys.modules` and never imported here: a loader with NumPy output does not pay torch's import
(about 1.4 s on 2 cores) to learn that no group exists.
"""

from __future__ import annotations

import sys


def dist_rank_world() -> tuple[int, int] | None:
    """(rank, world_size) of the initialised default process group, else None."""
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None) if torch is not None else None
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None
