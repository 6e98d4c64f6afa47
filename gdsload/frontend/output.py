"""What both loaders (`gdsload.DataLoader`, `gdsload.RemoteLoader`) hand the training loop.

`output="torch"` (the default when torch imports) gives torch tensors, `"numpy"` NumPy arrays (CuPy
arrays for a loader whose batches are on a GPU). Torch is looked up, never imported at
`import gdsload` time, so a NumPy-output loader never loads it.

A batch is a `Batch`: a dict (torch's `default_collate` and `pin_memory` keep its type, and it
pickles as a dict does) whose missing field is a `MissingFieldError`, a `KeyError` naming the fields
the batch has (a converted HuggingFace `Image` column is named by its images' type, `png` say,
where a user may look for `jpg`).
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


def _from_dlpack(torch: Any, arr: Any) -> Any:
    """`torch.from_dlpack` of a CuPy array with the array's device current and torch's current
    stream on it as CuPy's current stream. CuPy's `__dlpack__` records an event on the *calling
    thread's* current device and CuPy stream and makes the consumer's stream wait for it
    (cupy/_core/core.pyx): without this, a consumer on a side stream waited for the legacy stream
    (all the default-stream work, a burner's included) every batch, and under torchrun without
    `torch.cuda.set_device` every rank recorded that event on GPU 0, making a context there (audit
    4 R8). With both on the array's device and the same stream, there is nothing to wait for."""
    import cupy

    dev = arr.device.id
    with cupy.cuda.Device(dev), cupy.cuda.ExternalStream(torch.cuda.current_stream(dev).cuda_stream, dev):
        return torch.from_dlpack(arr)


def as_output(arr: Any, output: str, device: str = "cpu", *, copy: bool = False) -> Any:
    """`arr` (a NumPy array, or a CuPy array on a GPU) as the output type on `device` ("cpu",
    "cuda" or "cuda:N"): zero copy where it already is there, an owned copy with `copy`."""
    on_device = hasattr(arr, "__cuda_array_interface__")
    if output == "torch":
        torch = torch_or_none()
        t = _from_dlpack(torch, arr) if on_device else torch.from_numpy(arr)
        if device != "cpu" and not on_device:  # host rows to the GPU (the remote feed's batches)
            return t.to(device, non_blocking=True)
        return t.clone() if copy else t
    if device != "cpu" and not on_device:
        import cupy

        with cupy.cuda.Device(int(device.partition(":")[2] or 0)):
            return cupy.asarray(arr)
    return arr.copy() if copy else arr


class MissingFieldError(KeyError):
    """A `KeyError` for a field a batch does not have; its message names the fields there are."""

    def __str__(self) -> str:  # the message as it is, not KeyError's repr of it
        return str(self.args[0]) if self.args else ""


class Batch(dict):
    """What a loader hands out (without `fields=` tuples or a `collate_fn`): field -> column, plus
    `"__key__"`. A plain dict but for a missing field, whose `KeyError` lists the fields there are."""

    def __missing__(self, key: Any) -> Any:
        from gdsload.format.manifest import field_kind

        alike = [k for k in self if isinstance(key, str) and isinstance(k, str) and not k.startswith("__")
                 and field_kind(k) == field_kind(key) != "bytes"]
        raise MissingFieldError(
            f"{key!r} is not a field of this batch; its fields are {', '.join(map(repr, self)) or 'none'}"
            + (f"; did you mean {alike[0]!r}? (a converted image column is named by its images' type)"
               if alike else ""))
