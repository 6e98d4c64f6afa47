"""Kept batches are never written over (issue 46 row 5): with the default `copy=False`, a batch
the training loop still references (a list of `batch["cls"]` for a metric, whole batches, torch
tensors made with `from_numpy` or DLPack) keeps its values for good, because the ring gives the
slot fresh memory instead of refilling it; with nothing kept, no slot is replaced and the same
memory comes back every cycle (zero copies)."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

import gpu_fakes
from npykit import npy_dataset, to_numpy
from gdsload.convert.engine import ConvertOptions, convert
from gdsload.loader.dataloader import DataLoader
from gdsload.sampledata import make_image_folder


EVAL_U8 = dict(train=False, size=32, resize=36, mean=None, std=None, dtype="uint8", layout="NHWC")


@pytest.fixture(scope="module")
def npy(tmp_path_factory):
    root = tmp_path_factory.mktemp("kept_npy")
    # 4 KiB rows: page-aligned data, no npy header parsed by the readers (see tests/test_gpu_path.py)
    return npy_dataset(root / "src", root / "ds", num_samples=52, shape=(4, 32, 32), dtype="uint8", seed=3,
                       shard_size=40_000)


@pytest.fixture(scope="module")
def npy_big(tmp_path_factory):
    """16 KiB rows: KvikIO reads them with cuFile (its default gds_threshold)."""
    root = tmp_path_factory.mktemp("kept_npy_big")
    return npy_dataset(root / "src", root / "ds", num_samples=24, shape=(4, 64, 64), dtype="uint8", seed=12,
                       shard_size=120_000)


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory):
    root = tmp_path_factory.mktemp("kept_jpegs")
    make_image_folder(root / "src", num_images=24, num_classes=3, seed=4, mean_size=(48, 40), workers=1)
    convert(str(root / "src"), root / "ds", ConvertOptions(workers=1, progress=False, shard_size=30_000))
    return root / "ds"


def _reference(ds, fields, **kw) -> list[dict]:
    """Every batch of one epoch as owned copies (`copy=True`): what kept batches must still say."""
    loader = DataLoader(str(ds), copy=True, **kw)
    out = [{f: to_numpy(b[f]).copy() for f in fields} | {"__key__": list(b["__key__"])} for b in loader]
    loader.close()
    return out


def _same(kept: list[dict], ref: list[dict], fields) -> int:
    """How many kept batches differ from the reference (0 expected), after checking the keys."""
    assert [k["__key__"] for k in kept] == [r["__key__"] for r in ref]
    return sum(any(not np.array_equal(to_numpy(k[f]), r[f]) for f in fields) for k, r in zip(kept, ref))


@pytest.mark.parametrize("output", ["numpy", "torch"])
@pytest.mark.parametrize("fields", [("cls",), ("npy",), ("cls", "npy")])
def test_kept_batches_keep_their_values(npy, output, fields):
    """The issue's loop: `preds.append(batch["cls"])` over an epoch (and whole batches). Before:
    10-11 of 13 kept batches overwritten by later ones."""
    kw = dict(batch_size=4, num_workers=2, prefetch_factor=2, seed=5, output=output)
    ref = _reference(npy, fields, **kw)
    loader = DataLoader(str(npy), **kw)
    kept = [{f: b[f] for f in fields} | {"__key__": list(b["__key__"])} for b in loader]
    assert len(kept) == 13
    assert _same(kept, ref, fields) == 0
    s = loader.stats()
    assert s["ring_replaced"] >= 13 - s["ring_slots"]  # each kept slot got fresh memory
    loader.close()
    assert _same(kept, ref, fields) == 0  # and closing the loader frees nothing the user holds


@pytest.mark.parametrize("make", ["from_numpy", "from_dlpack"])
def test_tensors_made_from_numpy_batches_are_kept_too(npy, make):
    """Only the tensor is kept (the NumPy array it was made from is dropped): torch holds the
    array (`from_numpy`) or its DLPack capsule, and so the slot memory."""
    kw = dict(batch_size=4, num_workers=2, seed=6, output="numpy")
    ref = _reference(npy, ("cls", "npy"), **kw)
    loader = DataLoader(str(npy), **kw)
    conv = getattr(torch, make)
    kept = [{"cls": conv(b["cls"]), "npy": conv(b["npy"]), "__key__": list(b["__key__"])} for b in loader]
    gc.collect()
    assert _same(kept, ref, ("cls", "npy")) == 0


@pytest.mark.parametrize("output", ["numpy", "torch"])
def test_nothing_kept_nothing_replaced_and_the_memory_is_reused(npy, output):
    """A plain loop that drops each batch when it takes the next: no slot is ever replaced, and
    the arrays handed out live in the same few addresses (the ring's slots) epoch after epoch."""
    loader = DataLoader(str(npy), batch_size=4, num_workers=2, prefetch_factor=2, seed=7, output=output)
    addresses = set()
    for epoch in range(3):
        loader.set_epoch(epoch)
        for batch in loader:
            addresses.add(to_numpy(batch["npy"]).__array_interface__["data"][0])
            assert to_numpy(batch["cls"]).shape == (4,)
    s = loader.stats()
    assert s["ring_replaced"] == 0
    assert len(addresses) <= s["ring_slots"]
    loader.close()


def test_a_batch_kept_for_a_while_then_dropped(npy):
    """Batches kept for a few steps (a window for a running metric) stay right; once dropped, the
    ring takes its memory back: in the next epoch nothing is replaced."""
    kw = dict(batch_size=4, num_workers=2, seed=8, output="torch")
    ref = _reference(npy, ("cls", "npy"), **kw)
    loader = DataLoader(str(npy), **kw)
    window, bad = [], 0
    for i, b in enumerate(loader):
        window.append((i, b))
        if len(window) > 3:
            j, old = window.pop(0)
            bad += not (np.array_equal(old["cls"].numpy(), ref[j]["cls"])
                        and np.array_equal(old["npy"].numpy(), ref[j]["npy"]))
    assert bad == 0
    replaced = loader.stats()["ring_replaced"]
    assert replaced > 0
    del window, old, b
    gc.collect()
    for b in loader:
        pass
    assert loader.stats()["ring_replaced"] == replaced
    loader.close()


def test_a_kept_label_keeps_its_own_memory_not_the_slot(npy):
    """Labels are written through the slot's buffers, so a kept label moves alone: 4 KiB per
    slot beyond the arena, not a whole slot of `.npy` rows."""
    loader = DataLoader(str(npy), batch_size=8, num_workers=2, seed=10, output="torch")
    kept = [b["cls"] for b in loader]
    s = loader.stats()
    assert s["ring_replaced"] > 0 and 0 < s["ring_fresh_nbytes"] <= s["ring_slots"] * 4096
    assert loader._resources.ring.nbytes_per_slot > 8 * 4096  # a slot of 8 rows of 4 KiB
    assert len(kept) == 7


@pytest.mark.dali
@pytest.mark.parametrize("fields", [("cls",), ("cls", "jpg")])
def test_kept_decoded_batches_keep_their_values(jpegs, fields):
    from gdsload.decode.image import ImageTransform

    kw = dict(batch_size=4, num_workers=2, seed=9, output="torch", transform=ImageTransform(**EVAL_U8))
    ref = _reference(jpegs, fields, **kw)
    loader = DataLoader(str(jpegs), **kw)
    kept = [{f: b[f] for f in fields} | {"__key__": list(b["__key__"])} for b in loader]
    assert _same(kept, ref, fields) == 0
    assert loader.stats()["ring_replaced"] > 0
    loader.close()
    assert _same(kept, ref, fields) == 0


@pytest.mark.dali
def test_decoded_batches_nothing_kept_nothing_replaced(jpegs):
    """DALI keeps the encoded bytes it was fed for two runs (in the slot's staging area): that is
    not a kept batch."""
    from gdsload.decode.image import ImageTransform

    loader = DataLoader(str(jpegs), batch_size=4, num_workers=2, seed=9, output="torch",
                        transform=ImageTransform(**EVAL_U8))
    addresses = set()
    for epoch in range(2):
        for b in loader:
            addresses.add((b["jpg"].data_ptr(), b["cls"].data_ptr()))
    s = loader.stats()
    assert s["ring_replaced"] == 0 and s["ring_fresh_nbytes"] == 0
    assert len(addresses) <= s["ring_slots"]
    loader.close()


def test_kept_device_batches_keep_their_values(monkeypatch, npy_big):
    """A device ring (CuPy and KvikIO's CPU stand-ins): `.npy` rows read by KvikIO straight into
    the slot move to the arena's spare block (registered with it), then to fresh device memory;
    labels move alone. Nothing kept: nothing replaced."""
    npy = npy_big
    ref = _reference(npy, ("cls", "npy"), batch_size=4, num_workers=2, seed=11, output="numpy")
    # a cuFile config: reads are cuFileReadAsync, which says whether they hit registered memory
    gpu = gpu_fakes.install(monkeypatch, devices=1, kvikio=dict(gds=True, config_file=True))
    loader = DataLoader(str(npy), batch_size=4, num_workers=2, seed=11, device="cuda", output="numpy")
    kept = [{"cls": b["cls"], "npy": b["npy"], "__key__": list(b["__key__"])} for b in loader]
    gpu.synchronize_all()
    assert all(hasattr(k["npy"], "__cuda_array_interface__") for k in kept)
    assert _same([{f: (v.get() if f != "__key__" else v) for f, v in k.items()} for k in kept],
                 ref, ("cls", "npy")) == 0
    ring = loader._resources.ring
    s = loader.stats()
    assert ring.spares == 1 and ring.arena.nbytes == (ring.num_slots + 1) * ring.nbytes_per_slot
    base, nbytes, _ = gpu.allocation_of(ring.arena.data.ptr)  # the spare is in the registered allocation
    assert gpu.kvikio.registered == [(base, nbytes)] and nbytes >= ring.arena.nbytes
    assert s["ring_replaced"] >= 6 - s["ring_slots"] and s["ring_fresh_nbytes"] > 0
    hows = [e[3] for e in gpu.log_calls("kvikio_read_how")]
    assert any(hows) and not all(hows)  # reads into the arena (and its spare) registered, fresh blocks not
    del kept
    gc.collect()
    before = loader.stats()["ring_replaced"]
    for b in loader:
        pass
    gpu.synchronize_all()
    assert loader.stats()["ring_replaced"] == before
    loader.close()


@pytest.mark.parametrize("fields", [("npy",), ("cls",)])
def test_kept_device_batches_copied_from_the_host_keep_their_values(monkeypatch, npy, fields):
    """Without KvikIO, `.npy` rows are read on the host and copied into the device slot through its
    buffers, so a kept `.npy` field moves alone, like a label, and the copy lands there."""
    ref = _reference(npy, fields, batch_size=4, num_workers=2, seed=13, output="numpy")
    gpu = gpu_fakes.install(monkeypatch, devices=1, kvikio=False)
    loader = DataLoader(str(npy), batch_size=4, num_workers=2, seed=13, device="cuda", output="numpy")
    kept = [{f: b[f] for f in fields} | {"__key__": list(b["__key__"])} for b in loader]
    gpu.synchronize_all()
    assert _same([{f: (v.get() if f != "__key__" else v) for f, v in k.items()} for k in kept], ref, fields) == 0
    assert loader._resources.ring.spares == 0 and loader.stats()["ring_replaced"] >= 13 - loader.stats()["ring_slots"]
    loader.close()


def test_device_batches_kept_then_dropped_are_fenced(monkeypatch, npy_big):
    """Labels kept over an epoch on the GPU, a metric queued on them, then dropped: the ring records
    a fence on the consumer's stream when they go, and the next epoch's producers wait for it
    before writing that memory (the release fences alone predate the metric)."""
    gpu = gpu_fakes.install(monkeypatch, devices=1, kvikio=dict(gds=True, config_file=True))
    loader = DataLoader(str(npy_big), batch_size=4, num_workers=2, seed=11, device="cuda", output="numpy")
    kept = [b["cls"] for b in loader]
    before = len(gpu.log_calls("record"))
    del kept
    gc.collect()
    drops = {e[1] for e in gpu.log_calls("record")[before:]}
    assert drops  # recorded when the labels went
    for b in loader:
        pass
    waited = {e[1] for e in gpu.log_calls("event_sync")}
    assert drops & waited  # the memory written again waited for them
    assert loader.stats()["ring_replaced"] > 0
    loader.close()
