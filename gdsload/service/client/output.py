"""`OutputConverter`: a received batch (NumPy columns) as the training loop gets it from a
`RemoteLoader`, the same as from the local `DataLoader`: text, json and ragged `.npy` fields parsed
(`fields.parse_columns`), a `Batch` dict (or a tuple when `fields` was given), arrays as torch
tensors on `device` when the output is torch, and `map` / `collate_fn` run in the caller's thread
(`gdsload.frontend.usercode`, timed as the "map" stage).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from gdsload.frontend.fields import parse_columns
from gdsload.frontend.output import Batch, as_output
from gdsload.service.protocol import wire


class OutputConverter:
    """`convert(batch, stages)`: the batch as handed out; `stages` gets the "map" time."""

    def __init__(self, *, decode: bool, output: str, device: str, tuple_fields: list[str] | None, stage: Any):
        self.decode = decode
        self.output = output
        self.device = device
        self.tuple_fields = tuple_fields
        self.stage = stage  # the MapStage of map / collate_fn, or None

    def convert(self, batch: dict[str, Any], stages: Any) -> Any:
        batch = Batch(parse_columns(batch, decode=self.decode))  # text, json, ragged .npy: as locally
        if self.stage is not None:
            names = [f"{k}" for k in batch[wire.KEY]]
            t0 = time.perf_counter()
            try:
                return self.stage.start(0).run(batch, names, self.to_output)
            finally:
                stages.add("map", time.perf_counter() - t0)
        if self.output == "torch":
            for k, v in batch.items():
                if isinstance(v, np.ndarray):
                    batch[k] = self.to_output(v)
                elif isinstance(v, list) and v and isinstance(v[0], np.ndarray):  # a ragged .npy field
                    batch[k] = [self.to_output(a) for a in v]
        if self.tuple_fields is not None:
            return tuple(batch[f] for f in self.tuple_fields)
        return batch

    def to_output(self, arr: np.ndarray) -> Any:
        return as_output(arr, self.output, self.device)  # NumPy output: `arr` itself (device is "cpu")
