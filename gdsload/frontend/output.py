"""What both loaders (`gdsload.DataLoader`, `gdsload.RemoteLoader`) hand the training loop.

`output="torch"` (the default when torch imports) gives torch tensors, `"numpy"` NumPy arrays (CuPy
arrays for a loader whose batches are on a GPU). Torch is looked up, never imported at
`import gdsload` time, so a NumPy-output loader never loads it.
"""

from __future__ import annotations

from typing import Any


def torch_or_none() -> Any:
    """The torch module, or None where it is not installed."""
    try:
        import torch

        return torch
    except ImportError:
        return None


def default_output(output: str | None) -> str:
    """`output` as given, else "torch" where torch imports and "numpy" otherwise."""
    return output or ("torch" if torch_or_none() is not None else "numpy")


def as_output(arr: Any, output: str, device: str = "cpu", *, copy: bool = False) -> Any:
    """`arr` (a NumPy array, or a CuPy array on a GPU) as the output type on `device` ("cpu",
    "cuda" or "cuda:N"): zero copy where it already is there, an owned copy with `copy`."""
    on_device = hasattr(arr, "__cuda_array_interface__")
    if output == "torch":
        torch = torch_or_none()
        t = torch.from_dlpack(arr) if on_device else torch.from_numpy(arr)
        if device != "cpu" and not on_device:  # host rows to the GPU (the remote feed's batches)
            return t.to(device, non_blocking=True)
        return t.clone() if copy else t
    if device != "cpu" and not on_device:
        import cupy

        with cupy.cuda.Device(int(device.partition(":")[2] or 0)):
            return cupy.asarray(arr)
    return arr.copy() if copy else arr
