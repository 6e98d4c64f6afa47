"""Batch layout: what each field of a loader becomes, and the ring slot that holds one batch.

`plan_fields` decides, once per loader, each field's kind (image, tensor, ragged, label, bytes,
text, json: the table is `gdsload.frontend.fields`), the largest member it may stage (from the manifest,
else the index) and, for a `.npy` field, its dtype and shape (probed on the first sample that has
it; every dataset of a `Mix` must agree). `slot_fields` turns those into the ring's `SlotSpec`
fields: batch tensors (`.npy` rows, decoded images, labels) where the batch is consumed, and in
host memory the staging area for encoded bytes plus, on a GPU, host copies ("__h_<name>") of the
fields that are parsed or read on the host first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gdsload.frontend import fields as _fieldkinds
from gdsload.loader.gather import STAGE_ALIGN, needs_headers, round_up
from gdsload.decode.raw import TensorField
from gdsload.errors import FormatError
from gdsload.format.tar import ALIGN


@dataclass
class FieldPlan:
    name: str
    kind: str  # image | tensor | ragged | label | bytes | text | json
    tensor: TensorField | None = None  # a .npy field's dtype, shape and header size
    max_nbytes: int = 0  # the field's largest member: staging room per sample
    media: Any = None  # video/audio: its VideoTransform / AudioTransform
    aux: str | None = None  # video/audio: "<name>.frames" / "<name>.length", a batch tensor beside it
    media_hw: tuple[int, int] | None = None  # video with size=None: the dataset's one frame size


def _probe(ds: Any, name: str) -> TensorField:
    """The `.npy` layout of field `name`, from the first sample of `ds` that has it."""
    s0, j0 = next((s, j) for s in range(len(ds.shards)) for j in range(ds.index(s).num_samples)
                  if any(e == name for e, _, _ in ds.index(s).members(j)))
    o, n = next((o, n) for e, o, n in ds.index(s0).members(j0) if e == name)
    return TensorField.probe(name, ds.read_extent(s0, o, min(n, 2 * ALIGN)),
                             where=f"{ds.shards[s0]['name']}:{ds.index(s0).key(j0)}")


def _max_nbytes(ds: Any, name: str) -> int:
    """The largest member of field `name` in any shard: the manifest's figure, else the index's."""
    most = 0
    for s in range(len(ds.shards)):
        known = ds.shards[s].get("max_nbytes")  # in the manifest: no index to load
        if known is not None:
            most = max(most, known.get(name, 0))
            continue
        idx = ds.index(s)
        if name in idx.extensions:
            sizes = idx.member_size[idx.member_ext == idx.extensions.index(name)]
            if len(sizes):
                most = max(most, int(sizes.max()))
    return most


def _frame_size(ds: Any, name: str) -> tuple[int, int]:
    """The one (height, width) of video field `name` (VideoTransform(size=None)), from the index."""
    sizes = set()
    for s in range(len(ds.shards)):
        got = ds.index(s).media.get(name)
        if got is None:
            raise FormatError(f"field {name!r} of {ds.shards[s]['name']} has no probed frame sizes (converted "
                              f"before media were probed): set VideoTransform(size=...)")
        desc, table = got
        hw = table[:, [desc["columns"].index("height"), desc["columns"].index("width")]]
        sizes |= {tuple(int(v) for v in r) for r in hw[~np.isnan(hw[:, 0])].tolist()}
    if len(sizes) != 1:
        raise FormatError(f"video field {name!r} has frames of {len(sizes)} sizes ({sorted(sizes)[:4]}...): "
                          f"VideoTransform(size=None) needs one; set size=")
    return sizes.pop()


def plan_fields(dataset: Any, *, decode: bool, media: Any = None) -> list[FieldPlan]:
    """The fields a loader over `dataset` (a `gdsload.dataset.source.Source`) reads; `media(name,
    kind)`: the field's video/audio transform or None (`LoaderOptions.media_for`)."""
    from gdsload.format.manifest import field_kind

    ds = dataset.shards
    plans = []
    for name in dataset.fields:
        kind = _fieldkinds.loader_kind(name, decode=decode)
        if kind == "tensor" and _fieldkinds.is_ragged(ds, name):
            kind = "ragged"  # shapes vary: a list of tensors, parsed per sample
        fp = FieldPlan(name, kind, max_nbytes=_max_nbytes(ds, name))
        mk = field_kind(name)
        t = media(name, mk) if decode and media is not None and mk in ("video", "audio") else None
        if t is not None:
            fp.kind, fp.media = mk, t
            fp.aux = f"{name}.frames" if mk == "video" else f"{name}.length"
            if mk == "video" and t.size is None:
                fp.media_hw = _frame_size(ds, name)
        if kind == "tensor":
            fp.tensor = _probe(ds, name)
        plans.append(fp)
    if len(dataset.parts) > 1:  # a mix: one batch tensor per field across its datasets
        _check_part_tensors(dataset, plans)
    return plans


def _check_part_tensors(mix: Any, plans: list[FieldPlan]) -> None:
    """A tensor field of a mix has one dtype and shape in every dataset (one batch tensor); the
    layout is probed on each dataset's first sample of the field, as for one dataset."""
    for fp in plans:
        if fp.kind != "tensor":
            continue
        for name, d in zip(mix.names, mix.parts):
            t = _probe(d.shards, fp.name)
            if (t.dtype, t.shape) != (fp.tensor.dtype, fp.tensor.shape):
                raise FormatError(
                    f"field {fp.name!r} is {t.dtype}{list(t.shape)} in dataset {name!r} of the mix and "
                    f"{fp.tensor.dtype}{list(fp.tensor.shape)} in {mix.names[0]!r}; a batch needs one "
                    f"shape per field (choose fields=[...] without it)"
                )


def tensor_headers_needed(ds: Any, shard_verify: Sequence[str | None]) -> bool:
    """Whether `.npy` headers must be read (into staging) and checked in some shard
    (`gdsload.loader.gather.needs_headers`): staging room for them in every slot."""
    return any(needs_headers(ds, s, mode) for s, mode in enumerate(shard_verify))


Spec = dict[str, tuple[tuple[int, ...], str]]


def slot_fields(plans: Sequence[FieldPlan], rows: int, transform: Any, *, on_device: bool,
                direct: bool, tensor_headers: bool) -> tuple[Spec, Spec]:
    """(batch fields, host fields) of a ring slot of `rows` samples, as `SlotSpec` fields.

    `on_device`: batch tensors on the GPU; then labels are parsed into "__h_<name>" host fields
    and copied, and so are `.npy` rows unless the backend reads into device memory (`direct`).
    Host fields always end with "__staging__": room for every staged member of a batch (encoded
    bytes, text, label text and, with `tensor_headers`, `.npy` headers), each on a cache line."""
    spec: Spec = {}
    host: Spec = {}
    staging = 0
    for fp in plans:
        if fp.kind == "tensor":
            spec[fp.name] = ((rows, *fp.tensor.shape), fp.tensor.dtype.str)
            if on_device and not direct:
                host["__h_" + fp.name] = spec[fp.name]
        elif fp.kind == "image":
            spec[fp.name] = ((rows, *transform.output_shape()), transform.dtype)
        elif fp.kind in ("video", "audio"):  # decoded on the host, copied to a device ring
            t = fp.media
            aux = (t.frames_shape() if fp.kind == "video" else ())
            spec[fp.name] = ((rows, *t.output_shape(fp.media_hw)), t.dtype)
            spec[fp.aux] = ((rows, *aux), "int64")
            if on_device:
                host["__h_" + fp.name] = spec[fp.name]
                host["__h_" + fp.aux] = spec[fp.aux]
        elif fp.kind == "label":
            (spec if on_device else host)[fp.name] = ((rows,), "int64")
            if on_device:
                host["__h_" + fp.name] = ((rows,), "int64")
        if fp.kind != "tensor":
            staging += rows * round_up(fp.max_nbytes)
        elif tensor_headers:
            staging += rows * round_up(max(ALIGN, fp.tensor.header_nbytes))
    host["__staging__"] = ((max(staging, STAGE_ALIGN),), "uint8")
    return spec, host


@dataclass
class BatchLayout:
    """Everything fixed about one loader's batches, decided once before its first batch: the
    fields (`FieldPlan`s), rows per slot, what is verified per shard, whether `.npy` headers are
    read, the batch planner, and the ring slot (`slot_fields`) that holds a batch.

    `own_staging`: nothing is decoded and batches stay in host memory, so a planned batch's
    staged members (bytes, text, json, label text) go into a buffer the batch owns (its
    `BytesColumn`s keep it) instead of the ring slot's staging area."""

    fields: list[FieldPlan]
    rows: int
    shard_verify: list[Any]  # per global shard: its dataset's `verify` mode
    verify_note: str
    tensor_headers: bool
    planner: Any  # gdsload.loader.gather.BatchPlanner: every batch's reads and checks
    own_staging: bool
    transform: Any

    @classmethod
    def build(cls, source: Any, *, batch_size: int, samples_per_rank: int, decode: bool, transform: Any,
              on_device: bool, media: Any = None) -> "BatchLayout":
        from gdsload.dataset.verify import check_dataset
        from gdsload.loader.gather import BatchPlanner

        parts = source.parts  # what is verified is each dataset's own setting, also in a Mix
        notes = [check_dataset(d.shards, d.verify) for d in parts]
        note = notes[0] if len(set(notes)) == 1 else "; ".join(
            f"{name}: {n}" for name, n in zip(source.names, notes))
        shard_verify = [d.verify for d in parts for _ in d.shards.shards]
        ds = source.shards
        headers = tensor_headers_needed(ds, shard_verify)
        fplans = plan_fields(source, decode=decode, media=media)
        planner = BatchPlanner(ds, [(fp.name, fp.kind, fp.tensor) for fp in fplans], shard_verify=shard_verify)
        # rows per slot: a batch never holds more than one rank's samples of an epoch
        rows = max(1, min(batch_size, samples_per_rank))
        own = not on_device and not any(fp.kind == "image" for fp in fplans)
        return cls(fields=fplans, rows=rows, shard_verify=shard_verify, verify_note=note,
                   tensor_headers=headers, planner=planner, own_staging=own, transform=transform)

    @property
    def media_fields(self) -> list[FieldPlan]:
        """Video and audio fields decoded by their transforms."""
        return [fp for fp in self.fields if fp.media is not None]

    @property
    def n_images(self) -> int:
        """Image fields: decode turns per batch."""
        return sum(fp.kind == "image" for fp in self.fields)

    def slot_fields(self, *, on_device: bool, direct: bool) -> tuple[Spec, Spec]:
        """(batch fields, host fields) of one ring slot; see `slot_fields`."""
        return slot_fields(self.fields, self.rows, self.transform, on_device=on_device, direct=direct,
                           tensor_headers=self.tensor_headers)

    def slot_nbytes(self, *, on_device: bool = False, direct: bool = False) -> tuple[int, int]:
        """(device bytes, host bytes) of one slot; on the host only: (0, all of it). The one slot
        size computation: the loader's memory check, autotune's growth and the feed server's
        memory estimate use it."""
        from gdsload.ring.ring import SlotSpec

        spec, host = self.slot_fields(on_device=on_device, direct=direct)
        if on_device and spec:
            return SlotSpec(fields=spec).nbytes, SlotSpec(fields=host).nbytes
        return 0, SlotSpec(fields={**spec, **host}).nbytes
