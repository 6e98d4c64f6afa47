"""A filled slot as the batch the training loop gets (`BatchAssembler.make`).

Batch tensors are views of the slot in the output type on the loader's device (zero copy), or
owned copies with `copy=True` and for rows compacted after corrupt images were skipped; bytes
fields are the `BytesColumn` the batch owns, list fields (text, json, ragged tensors) lists;
`"__key__"` (and a mix's `"__source__"`) per sample. `host=True` gives host copies with plain
Python values, what `map`/`collate_fn` take (`gdsload.frontend.usercode`); the reader that ran
the user code stores its output in the slot's `BatchInfo.mapped`, which `make` then returns.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gdsload.frontend import fields as _fieldkinds
from gdsload.frontend.output import Batch, as_output
from gdsload.frontend.usercode import host_copy


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()


@dataclass(slots=True)
class BatchInfo:
    """What the reader knows of the batch in a slot, for the consumer (`slot.meta["batch"]`)."""

    keys: Sequence[str]  # per sample, in batch order
    n: int  # samples read (rows filled, before corrupt images are dropped)
    nbytes: int  # bytes read
    extra: dict[str, Any] = field(default_factory=dict)  # list-like fields: bytes, text, json, ragged
    sources: list[str] | None = None  # a Mix: the dataset of each sample
    keep: list[int] | None = None  # rows kept when corrupt images were skipped (None: all)
    skipped: int = 0  # samples skipped (corrupt or over the pixel limit)
    ready: Any = None  # device ring: the event after which the batch's copies are done
    mapped: Any = UNSET  # the output of `map` / `collate_fn`, when the loader has them


class BatchAssembler:
    def __init__(self, fields: Sequence[Any], *, output: str, device: str, copy: bool,
                 tuple_fields: list[str] | None, times: Any = None, resources: Any = None):
        self.fields = list(fields)  # FieldPlans
        self.output = output
        self.device = device  # "cpu" or "cuda:N"
        self.copy = copy
        self.tuple_fields = tuple_fields
        self.times = times
        self.resources = resources  # its `streams` (a device ring): the consumer's gathers run there

    def convert(self, arr: Any, *, copy: bool) -> Any:
        """A slot view as the output type, on the loader's device (zero copy where it is there)."""
        if not copy or self.times is None:
            return as_output(arr, self.output, self.device, copy=copy)
        t0 = time.perf_counter()
        out = as_output(arr, self.output, self.device, copy=copy)
        self.times.add("copy", time.perf_counter() - t0)
        return out

    def make(self, slot: Any, *, host: bool = False) -> Any:
        info: BatchInfo = slot.meta["batch"]
        if info.mapped is not UNSET:
            return info.mapped
        n = info.n
        keep = info.keep
        out: dict[str, Any] = Batch()  # a missing field's KeyError names the fields there are
        for fp in self.fields:
            if fp.kind == "bytes":  # a BytesColumn owning its buffer (never a view of the ring)
                col = info.extra[fp.name]
                col = col.take(keep) if keep is not None else col
                out[fp.name] = col.tolist() if host else col  # `map`/`collate_fn` get bytes per sample
                continue
            if fp.kind in _fieldkinds.LIST_KINDS:
                vals = info.extra[fp.name]
                vals = [vals[k] for k in keep] if keep is not None else vals
                out[fp.name] = [self.convert(v, copy=False) for v in vals] if fp.kind == "ragged" and not host else vals
                continue
            for name in (fp.name, fp.aux) if fp.aux is not None else (fp.name,):  # "<video>.frames", "<audio>.length"
                arr = slot.buffers[name]
                if keep is not None and fp.kind != "image":
                    streams = getattr(self.resources, "streams", None)
                    if not hasattr(arr, "__cuda_array_interface__"):
                        view = arr[np.asarray(keep, dtype=np.intp)]
                    elif host or streams is None:  # the producer: under CopyStreams.producing()
                        view = arr[keep]
                    else:  # a CuPy gather: on the consumer's stream, which waited for the batch (C4)
                        with streams.consuming():  # the loader's device too (audit 4 R9)
                            view = arr[keep]
                else:
                    view = arr[: len(keep) if keep is not None else n]
                # rows gathered by `keep` are fresh memory already: no second copy
                out[name] = host_copy(view) if host else self.convert(view, copy=self.copy)
        keys = info.keys
        out["__key__"] = [keys[k] for k in keep] if keep is not None else list(keys)
        if info.sources is not None:
            sources = info.sources
            out["__source__"] = [sources[k] for k in keep] if keep is not None else sources
        if self.tuple_fields is not None and not host:
            return tuple(out[f] for f in self.tuple_fields)
        return out
