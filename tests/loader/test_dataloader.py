"""`gdsload.DataLoader` end to end on small converted datasets (CPU path; one `gpu` test).

Datasets are built once per module: 60 JPEGs (about 14 KB each) in 3 classes cut into 6 shards,
50 ``uint8[3, 32, 32]`` and 30 ``float16[3, 32, 32]`` `.npy` samples with labels in several shards
each, and 16 JPEGs of which two are corrupt (converted without ``--validate``).

What is checked: values against the source files (by key), every sample once per epoch, order and
resumption (also elastic, across world sizes), state refusal, tuple output, thread shutdown,
slot lifetime (``copy``), errors naming shard and key, and `stats()`.
"""

from __future__ import annotations

import collections
import csv
import gc
import json
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from npykit import to_numpy
from PIL import Image

from gdsload.convert.engine import ConvertOptions, convert
from gdsload.errors import FormatError
from gdsload.dataset.sharded import ShardedDataset
from gdsload.loader.dataloader import DataLoader
from gdsload.plan.plan import DEFAULT_ORDER, StateError, epoch_order
from gdsload.sampledata import make_image_folder, make_npy_folder

EVAL_U8 = dict(train=False, size=64, resize=72, mean=None, std=None, dtype="uint8", layout="NHWC")


# -- datasets ------------------------------------------------------------------------------------
class Source:
    """A converted dataset and the source it came from."""

    def __init__(self, src: Path, dst: Path, result: dict):
        self.src, self.dst, self.result = src, dst, result
        self.shards = result["shards"]
        self.storage_keys = ShardedDataset(dst).keys()  # keys in sample-id order


def _convert(src: Path, dst: Path, shard_size: int) -> Source:
    result = convert(str(src), dst, ConvertOptions(workers=1, progress=False, shard_size=shard_size))
    return Source(src, dst, result)


class NpySource(Source):
    def __init__(self, src: Path, dst: Path, result: dict):
        super().__init__(src, dst, result)
        self.arrays = {p.stem: np.load(p) for p in sorted(src.glob("*.npy"))}
        with open(src / "labels.csv") as f:
            self.labels = {row["key"]: int(row["label"]) for row in csv.DictReader(f)}


@pytest.fixture(scope="module")
def npy_u8(tmp_path_factory) -> NpySource:
    root = tmp_path_factory.mktemp("npy_u8")
    make_npy_folder(root / "src", num_samples=50, shape=(3, 32, 32), dtype="uint8", seed=1)
    s = _convert(root / "src", root / "ds", shard_size=60_000)
    s = NpySource(s.src, s.dst, s.result)
    assert s.shards >= 5 and len(s.arrays) == 50
    return s


@pytest.fixture(scope="module")
def npy_f16(tmp_path_factory) -> NpySource:
    root = tmp_path_factory.mktemp("npy_f16")
    make_npy_folder(root / "src", num_samples=30, shape=(3, 32, 32), dtype="float16", seed=2)
    s = _convert(root / "src", root / "ds", shard_size=60_000)
    s = NpySource(s.src, s.dst, s.result)
    assert s.shards >= 3
    return s


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Source:
    root = tmp_path_factory.mktemp("images")
    make_image_folder(root / "src", num_images=60, num_classes=3, seed=0, mean_size=(160, 120), workers=1)
    s = _convert(root / "src", root / "ds", shard_size=200_000)
    assert s.shards >= 3 and s.result["samples"] == 60
    return s


CORRUPT = {"class_001/img_000003": "garbage", "class_000/img_000010": "truncated"}


@pytest.fixture(scope="module")
def corrupt_images(tmp_path_factory) -> Source:
    """16 JPEGs in 2 classes; two are corrupt, and conversion (no --validate) keeps them."""
    root = tmp_path_factory.mktemp("corrupt")
    make_image_folder(root / "src", num_images=16, num_classes=2, seed=5, mean_size=(96, 72), workers=1)
    for key, how in CORRUPT.items():
        path = root / "src" / f"{key}.jpg"
        good = path.read_bytes()
        if how == "garbage":
            path.write_bytes(np.random.default_rng(0).integers(0, 256, 3000, dtype=np.uint8).tobytes())
        else:
            path.write_bytes(good[: len(good) // 2])
    s = _convert(root / "src", root / "ds", shard_size=40_000)
    assert s.result["rejected"] == 0 and s.result["samples"] == 16 and s.shards >= 2
    return s


# -- helpers -------------------------------------------------------------------------------------
def npy_loader(src: NpySource, **kw) -> DataLoader:
    kw.setdefault("batch_size", 8)
    kw.setdefault("num_workers", 2)
    kw.setdefault("device", "cpu")
    return DataLoader(str(src.dst), **kw)


def keys_of(loader) -> list[list[str]]:
    return [list(b["__key__"]) for b in loader]


def flat(batches) -> list[str]:
    return [k for b in batches for k in b]


def plan_keys(src: Source, *, seed: int, epoch: int, shuffle: bool = True, window: int = 4) -> list[str]:
    sizes = [s["samples"] for s in src.result["manifest"]["shards"]]
    return [src.storage_keys[i] for i in epoch_order(sizes, seed=seed, epoch=epoch, shuffle=shuffle, window=window,
                                                     order=DEFAULT_ORDER)]  # the loader's default order


def new_threads_finish(before: set[threading.Thread], timeout: float = 10.0) -> list[str]:
    """Join the threads started since `before`; returns the names of those still alive."""
    deadline = time.monotonic() + timeout
    while True:
        gc.collect()
        alive = [t for t in threading.enumerate() if t not in before and t.is_alive()]
        for t in alive:
            t.join(max(0.0, min(0.2, deadline - time.monotonic())))
        alive = [t for t in alive if t.is_alive()]
        if not alive or time.monotonic() >= deadline:
            return [t.name for t in alive]


def pil_reference(path: Path, resize: int = 72, size: int = 64) -> np.ndarray:
    """Resize the shorter side to `resize` (bilinear, which Pillow antialiases when shrinking) and
    center-crop `size`, rounding halves up as DALI does for the output size and crop start."""
    im = Image.open(path).convert("RGB")
    w, h = im.size
    if w <= h:
        nw, nh = resize, int(h * resize / w + 0.5)
    else:
        nw, nh = int(w * resize / h + 0.5), resize
    im = im.resize((nw, nh), Image.BILINEAR)
    x, y = int((nw - size) / 2 + 0.5), int((nh - size) / 2 + 0.5)
    return np.asarray(im.crop((x, y, x + size, y + size)))


# -- .npy values, labels, coverage ---------------------------------------------------------------
@pytest.mark.parametrize("output", ["torch", "numpy"])
@pytest.mark.parametrize("which", ["u8", "f16"])
def test_npy_values_labels_and_coverage(which, output, npy_u8, npy_f16):
    src = npy_u8 if which == "u8" else npy_f16
    loader = npy_loader(src, batch_size=8, shuffle=True, seed=4, output=output)
    n = len(src.arrays)
    assert len(loader) == -(-n // 8)
    seen = []
    batches = 0
    for batch in loader:
        batches += 1
        keys = batch["__key__"]
        assert isinstance(keys, list) and 1 <= len(keys) <= 8
        kind = torch.Tensor if output == "torch" else np.ndarray
        assert isinstance(batch["npy"], kind) and isinstance(batch["cls"], kind)
        arr, cls = to_numpy(batch["npy"]), to_numpy(batch["cls"])
        assert arr.shape == (len(keys), 3, 32, 32) and arr.dtype == src.arrays[keys[0]].dtype
        assert cls.shape == (len(keys),) and cls.dtype == np.int64
        for i, key in enumerate(keys):
            np.testing.assert_array_equal(arr[i], src.arrays[key], err_msg=key)
            assert cls[i] == src.labels[key], key
        seen += keys
    assert batches == len(loader)
    assert sorted(seen) == sorted(src.arrays)  # every sample exactly once (N % G padding: none here)
    assert len(seen) == len(set(seen))


def test_every_sample_once_per_epoch_with_ragged_last_batch(npy_u8):
    loader = npy_loader(npy_u8, batch_size=7, shuffle=True, seed=9, num_workers=3, prefetch_factor=1)
    for epoch in range(2):
        batches = keys_of(loader)
        assert len(batches) == len(loader) == 8
        assert [len(b) for b in batches] == [7] * 7 + [1]
        assert collections.Counter(flat(batches)) == collections.Counter(list(npy_u8.arrays))
        assert loader.epoch == epoch + 1


# -- decoded images ------------------------------------------------------------------------------
@pytest.mark.dali
def test_decoded_images_close_to_pillow(images):
    """DALI's decode + resize-shorter + center crop against Pillow's. Both decoders are libjpeg
    (IDCT and chroma upsampling may differ by a level or two) and both resamplers are antialiased
    bilinear filters whose kernels differ slightly; measured mean absolute differences are 0.2-4
    levels per image (mean about 1.2). A crop off by one pixel on these noisy, sharpened images
    gives 15-30, so a bound of 8 per image and 3 over the set catches geometry errors."""
    from gdsload.decode.image import ImageTransform

    loader = DataLoader(str(images.dst), batch_size=16, device="cpu", num_workers=2,
                        transform=ImageTransform(**EVAL_U8))
    diffs, labels, n = {}, {}, 0
    classes = images.result["manifest"]["classes"]
    for batch in loader:
        img, cls = batch["jpg"], batch["cls"]
        assert img.dtype == torch.uint8 and tuple(img.shape[1:]) == (64, 64, 3)
        for i, key in enumerate(batch["__key__"]):
            ref = pil_reference(images.src / f"{key}.jpg")
            diffs[key] = float(np.abs(img[i].numpy().astype(np.int16) - ref).mean())
            labels[key] = int(cls[i])
            n += 1
    assert n == 60 and len(diffs) == 60
    worst = max(diffs, key=diffs.get)
    assert diffs[worst] < 8, (worst, diffs[worst])
    assert np.mean(list(diffs.values())) < 3
    for key, label in labels.items():
        assert classes[label] == key.split("/")[0]


@pytest.mark.dali
def test_nchw_float_normalized_matches_uint8(images):
    from gdsload.decode.image import IMAGENET_MEAN, IMAGENET_STD, ImageTransform

    u8 = DataLoader(str(images.dst), batch_size=16, device="cpu", transform=ImageTransform(**EVAL_U8))
    f32 = DataLoader(str(images.dst), batch_size=16, device="cpu",
                     transform=ImageTransform(train=False, size=64, resize=72))  # NCHW float32, ImageNet norm
    mean = np.array(IMAGENET_MEAN, np.float32)[:, None, None] * 255
    std = np.array(IMAGENET_STD, np.float32)[:, None, None] * 255
    for a, b in zip(u8, f32, strict=True):
        assert a["__key__"] == b["__key__"]
        x = b["jpg"]
        assert x.dtype == torch.float32 and tuple(x.shape) == (len(b["__key__"]), 3, 64, 64)
        assert x.is_contiguous()
        restored = x.numpy() * std + mean  # back to 0..255 levels, NCHW
        expected = a["jpg"].numpy().transpose(0, 3, 1, 2).astype(np.float32)
        assert np.abs(restored - expected).max() <= 1.0
        assert -3 < float(x.min()) and float(x.max()) < 3  # normalized, not 0..255


@pytest.mark.dali
def test_default_training_transform_shape(images):
    loader = DataLoader(str(images.dst), batch_size=32, device="cpu", shuffle=True)
    batch = next(iter(loader))
    assert tuple(batch["jpg"].shape) == (32, 3, 224, 224) and batch["jpg"].dtype == torch.float32
    loader.close()


# -- order ---------------------------------------------------------------------------------------
def test_order_is_deterministic_and_follows_the_plan(npy_u8):
    a = flat(keys_of(npy_loader(npy_u8, shuffle=True, seed=3, num_workers=3)))
    b = flat(keys_of(npy_loader(npy_u8, shuffle=True, seed=3, num_workers=1, batch_size=5)))
    assert a == b == plan_keys(npy_u8, seed=3, epoch=0)
    c = npy_loader(npy_u8, shuffle=True, seed=3)
    c.set_epoch(1)
    other = flat(keys_of(c))
    assert other != a and sorted(other) == sorted(a)
    assert other == plan_keys(npy_u8, seed=3, epoch=1)
    assert flat(keys_of(npy_loader(npy_u8, shuffle=True, seed=4))) != a


def test_unshuffled_is_storage_order(npy_u8, images):
    assert flat(keys_of(npy_loader(npy_u8, shuffle=False))) == npy_u8.storage_keys
    assert npy_u8.storage_keys == sorted(npy_u8.arrays)
    loader = DataLoader(str(images.dst), batch_size=16, device="cpu", decode=False)
    batches = list(loader)
    assert flat(b["__key__"] for b in batches) == images.storage_keys
    first = images.storage_keys[0]
    assert batches[0]["jpg"][0] == (images.src / f"{first}.jpg").read_bytes()  # decode=False: bytes


def test_epoch_advances_after_a_full_pass(npy_u8):
    loader = npy_loader(npy_u8, shuffle=True, seed=2)
    assert loader.epoch == 0 and loader.state_dict()["epoch"] == 0
    first = flat(keys_of(loader))
    assert loader.epoch == 1
    state = loader.state_dict()
    assert state["epoch"] == 1 and state["position"] == 0
    second = flat(keys_of(loader))
    assert loader.state_dict()["epoch"] == 2
    assert first == plan_keys(npy_u8, seed=2, epoch=0)
    assert second == plan_keys(npy_u8, seed=2, epoch=1)
    loader.set_epoch(0)
    assert flat(keys_of(loader)) == first


# -- resumption ----------------------------------------------------------------------------------
@pytest.mark.parametrize("drop_last", [False, True])
def test_resume_from_state_dict(npy_u8, drop_last):
    kw = dict(batch_size=4, shuffle=True, seed=11, drop_last=drop_last)
    full = keys_of(npy_loader(npy_u8, **kw))
    n = len(full)
    assert n == (12 if drop_last else 13)
    for stop in (-1, 0, 1, n // 2, n - 1):  # -1: saved before the first batch
        loader = npy_loader(npy_u8, **kw)
        if stop >= 0:
            for i, batch in enumerate(loader):
                assert list(batch["__key__"]) == full[i]
                if i == stop:
                    break
        state = json.loads(json.dumps(loader.state_dict()))  # JSON-serialisable
        loader.close()
        if stop == n - 1:  # the epoch's last batch completes it: the state is the next epoch's start
            assert (state["epoch"], state["position"]) == (1, 0)
            continue
        assert state["epoch"] == 0 and state["position"] == (stop + 1) * 4

        resumed = npy_loader(npy_u8, **kw, num_workers=1)
        resumed.load_state_dict(state)
        rest = []
        for batch in resumed:
            rest.append(list(batch["__key__"]))
            for k, key in enumerate(batch["__key__"]):
                np.testing.assert_array_equal(to_numpy(batch["npy"])[k], npy_u8.arrays[key])
        assert rest == full[stop + 1 :], stop
        assert resumed.epoch == 1  # the remainder completes the epoch


def _run_ranks(src, world: int, batch: int, steps: int | None, state=None, **kw):
    """Keys each rank reads (up to `steps` batches), and the state of rank 0 after them."""
    keys, state0 = [], None
    for rank in range(world):
        loader = npy_loader(src, batch_size=batch, world_size=world, rank=rank, **kw)
        if state is not None:
            loader.load_state_dict(state)
        mine = []
        for i, b in enumerate(loader):
            mine += b["__key__"]
            if steps is not None and i + 1 == steps:
                break
        if rank == 0:
            state0 = loader.state_dict()
        loader.close()
        keys.append(mine)
    return keys, state0


@pytest.mark.parametrize("steps", [1, 2])
@pytest.mark.parametrize("new_world,new_batch", [(2, 8), (8, 2)])
def test_elastic_resume_reads_every_sample_once(npy_u8, steps, new_world, new_batch):
    kw = dict(shuffle=True, seed=5, drop_last=True)
    before, state = _run_ranks(npy_u8, 4, 4, steps, **kw)
    assert state["position"] == steps * 16 and state["global_batch"] == 16
    assert all(len(k) == 4 * steps for k in before)
    after, _ = _run_ranks(npy_u8, new_world, new_batch, None, state=state, **kw)
    assert len({len(k) for k in after}) == 1  # every rank reads the same number of samples
    union = collections.Counter(flat(before) + flat(after))
    assert max(union.values()) == 1
    expected = plan_keys(npy_u8, seed=5, epoch=0)[: (50 // 16) * 16]  # drop_last: 48 of 50
    assert set(union) == set(expected)


def test_state_from_other_dataset_seed_or_shuffle_is_refused(npy_u8, npy_f16):
    state = npy_loader(npy_u8, batch_size=4, shuffle=True, seed=1).state_dict()
    with pytest.raises(StateError, match="'dataset'"):
        npy_loader(npy_f16, batch_size=4, shuffle=True, seed=1).load_state_dict(state)
    with pytest.raises(StateError, match="'seed'"):
        npy_loader(npy_u8, batch_size=4, shuffle=True, seed=2).load_state_dict(state)
    with pytest.raises(StateError, match="'shuffle'"):
        npy_loader(npy_u8, batch_size=4, shuffle=False, seed=1).load_state_dict(state)
    with pytest.raises(StateError, match="'global_batch'"):
        npy_loader(npy_u8, batch_size=8, shuffle=True, seed=1).load_state_dict(state)
    ok = npy_loader(npy_u8, batch_size=2, world_size=2, rank=1, shuffle=True, seed=1)
    ok.load_state_dict(state)  # same global batch on another world size: accepted


# -- tuples --------------------------------------------------------------------------------------
def test_fields_give_tuples_in_order(npy_u8):
    loader = npy_loader(npy_u8, batch_size=8, fields=("npy", "cls", "__key__"))
    n = 0
    for batch in loader:
        assert isinstance(batch, tuple) and len(batch) == 3
        arr, cls, keys = batch
        assert isinstance(arr, torch.Tensor) and arr.shape[1:] == (3, 32, 32)
        assert isinstance(keys, list) and len(keys) == arr.shape[0] == cls.shape[0]
        for i, key in enumerate(keys):
            np.testing.assert_array_equal(arr[i].numpy(), npy_u8.arrays[key])
            assert int(cls[i]) == npy_u8.labels[key]
        n += len(keys)
    assert n == 50
    cls, key = next(iter(npy_loader(npy_u8, batch_size=4, fields=("cls", "__key__"))))
    assert [int(c) for c in cls] == [npy_u8.labels[k] for k in key]


# -- shutdown ------------------------------------------------------------------------------------
def test_threads_stop_after_break_and_close(npy_u8):
    before = set(threading.enumerate())
    loader = npy_loader(npy_u8, batch_size=4, num_workers=3)
    for _ in loader:
        break
    loader.close()
    assert new_threads_finish(before) == []
    assert threading.active_count() <= len(before)


def test_threads_stop_after_break_and_del(npy_u8):
    before = set(threading.enumerate())
    loader = npy_loader(npy_u8, batch_size=4, num_workers=3)
    for _ in loader:
        assert any(t not in before for t in threading.enumerate())  # producers are running
        break
    del loader, _
    assert new_threads_finish(before) == []
    assert threading.active_count() <= len(before)


def test_threads_stop_when_the_consumer_raises(npy_u8):
    before = set(threading.enumerate())
    loader = npy_loader(npy_u8, batch_size=4, num_workers=2)
    with pytest.raises(ZeroDivisionError):
        for _ in loader:
            1 / 0
    del loader
    assert new_threads_finish(before) == []
    assert threading.active_count() <= len(before)


@pytest.mark.dali
def test_image_loader_threads_stop_after_break(images):
    from gdsload.decode.image import ImageTransform

    before = set(threading.enumerate())
    loader = DataLoader(str(images.dst), batch_size=8, device="cpu", transform=ImageTransform(**EVAL_U8))
    for _ in loader:
        break
    del loader, _
    assert new_threads_finish(before) == []


def test_iterating_again_after_early_break(npy_u8):
    """A new `iter()` continues from the loader's position (what `state_dict()` records): the
    rest of the interrupted epoch, then whole epochs again."""
    loader = npy_loader(npy_u8, batch_size=4, shuffle=True, seed=8)
    head = []
    for b in loader:
        head.append(list(b["__key__"]))
        break
    rest = keys_of(loader)
    assert flat(head + rest) == plan_keys(npy_u8, seed=8, epoch=0)
    assert loader.epoch == 1
    assert flat(keys_of(loader)) == plan_keys(npy_u8, seed=8, epoch=1)
    loader.close()


def test_a_replaced_iterator_stops_and_takes_nothing_from_the_new_one(npy_u8):
    """A new `iter()` closes the previous iterator: that one then ends (StopIteration) and must
    neither take the new iterator's batches nor move the loader's position or epoch."""
    expected = plan_keys(npy_u8, seed=8, epoch=0)
    loader = npy_loader(npy_u8, batch_size=4, shuffle=True, seed=8)
    it1 = iter(loader)
    assert next(it1)["__key__"] == expected[:4]
    it2 = iter(loader)  # continues at position 4
    assert next(it2)["__key__"] == expected[4:8]
    with pytest.raises(StopIteration):
        next(it1)
    rest = flat(list(b["__key__"]) for b in it2)
    assert rest == expected[8:]
    assert loader.epoch == 1 and loader.state_dict()["position"] == 0
    with pytest.raises(StopIteration):  # an exhausted iterator stays exhausted
        next(it2)
    assert loader.epoch == 1
    loader.close()


# -- slot lifetime -------------------------------------------------------------------------------
def test_copy_true_batches_survive(npy_u8):
    loader = npy_loader(npy_u8, batch_size=4, num_workers=1, prefetch_factor=1, copy=True)
    kept = [(b["__key__"], b["npy"], b["cls"]) for b in loader]
    assert len(kept) == 13
    assert len({t.data_ptr() for _, t, _ in kept}) == len(kept)
    for keys, arr, cls in kept:
        for i, key in enumerate(keys):
            np.testing.assert_array_equal(arr[i].numpy(), npy_u8.arrays[key])
            assert int(cls[i]) == npy_u8.labels[key]


def test_copy_false_held_batch_is_not_written_over(npy_u8):
    """Documented slot lifetime (issue 46 row 5): a batch still referenced is never written over.
    With prefetch_factor=1 the ring has 2 slots, so batch 2 goes to batch 0's slot, which gets
    other memory because batch 0 is held (tests/loader/test_kept_batches.py has the rest)."""
    loader = npy_loader(npy_u8, batch_size=4, num_workers=1, prefetch_factor=1, copy=False)
    it = iter(loader)
    b0 = next(it)
    held, snapshot = b0["npy"], b0["npy"].clone()
    np.testing.assert_array_equal(held[0].numpy(), npy_u8.arrays[b0["__key__"][0]])
    next(it)
    b2 = next(it)
    assert b2["npy"].data_ptr() != held.data_ptr()  # not the held batch's memory
    assert torch.equal(held, snapshot)  # the held view did not change
    for i, key in enumerate(b2["__key__"]):
        np.testing.assert_array_equal(b2["npy"][i].numpy(), npy_u8.arrays[key])
    assert loader.stats()["ring_replaced"] == 1
    loader.close()


# -- errors --------------------------------------------------------------------------------------
def test_truncated_shard_raises_format_error_naming_it(npy_u8, tmp_path):
    copy = tmp_path / "ds"
    shutil.copytree(npy_u8.dst, copy)
    name = npy_u8.result["manifest"]["shards"][2]["name"]
    path = copy / name
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)
    before = set(threading.enumerate())
    loader = DataLoader(str(copy), batch_size=4, device="cpu", shuffle=False)
    got = []
    with pytest.raises(FormatError, match=name.replace(".", r"\.")):
        for b in loader:
            got += b["__key__"]
    assert got == npy_u8.storage_keys[: len(got)]  # the samples before the bad extent came through
    assert loader.state_dict()["position"] == len(got)  # the failed batch is not consumed
    loader.close()
    assert new_threads_finish(before) == []


@pytest.mark.dali
def test_corrupt_jpeg_raises_decode_error_naming_shard_and_key(corrupt_images):
    from gdsload.decode.image import DecodeError, ImageTransform

    loader = DataLoader(str(corrupt_images.dst), batch_size=4, device="cpu",
                        transform=ImageTransform(**EVAL_U8))
    with pytest.raises(DecodeError) as info:
        for _ in loader:
            pass
    msg = str(info.value)
    bad = [k for k in CORRUPT if k in msg]
    assert len(bad) == 1, msg
    ds = ShardedDataset(corrupt_images.dst)
    shard = ds.shards[ds.locate(corrupt_images.storage_keys.index(bad[0]))[0]]["name"]
    assert shard in msg


@pytest.mark.dali
@pytest.mark.parametrize("run_size", [64, 3])  # 3: each batch of 4 decoded in DALI runs of 3 and 1
def test_corrupt_jpeg_skip_yields_the_others(corrupt_images, run_size, monkeypatch):
    from gdsload.decode import image
    from gdsload.decode.image import ImageTransform

    monkeypatch.setattr(image, "RUN_SIZE", run_size)
    loader = DataLoader(str(corrupt_images.dst), batch_size=4, device="cpu", on_error="skip",
                        transform=ImageTransform(**EVAL_U8))
    classes = corrupt_images.result["manifest"]["classes"]
    seen = []
    for batch in loader:
        keys = batch["__key__"]
        assert batch["jpg"].shape[0] == batch["cls"].shape[0] == len(keys)
        for i, key in enumerate(keys):
            assert classes[int(batch["cls"][i])] == key.split("/")[0]
            ref = pil_reference(corrupt_images.src / f"{key}.jpg")
            assert np.abs(batch["jpg"][i].numpy().astype(np.int16) - ref).mean() < 8, key
        seen += keys
    assert sorted(seen) == sorted(set(corrupt_images.storage_keys) - set(CORRUPT))
    stats = loader.stats()
    assert stats["skipped"] == len(CORRUPT)
    assert stats["samples"] == 16 - len(CORRUPT)


@pytest.mark.dali
def test_batch_of_only_corrupt_images_is_empty_under_skip(corrupt_images):
    """batch_size=1: a batch whose every image is corrupt comes back empty (0 rows), so every
    rank still takes len(loader) steps."""
    from gdsload.decode.image import ImageTransform

    loader = DataLoader(str(corrupt_images.dst), batch_size=1, device="cpu", on_error="skip",
                        fields=("jpg", "cls", "__key__"), transform=ImageTransform(**EVAL_U8))
    sizes, seen = [], []
    for img, cls, keys in loader:
        assert img.shape[0] == cls.shape[0] == len(keys)
        assert tuple(img.shape[1:]) == (64, 64, 3)
        sizes.append(len(keys))
        seen += keys
    assert len(sizes) == len(loader) == 16
    assert sizes.count(0) == len(CORRUPT)
    assert sorted(seen) == sorted(set(corrupt_images.storage_keys) - set(CORRUPT))
    assert loader.stats()["skipped"] == len(CORRUPT)


# -- stats ---------------------------------------------------------------------------------------
@pytest.mark.dali
def test_stats_image_dataset(images):
    from gdsload.decode.image import ImageTransform

    loader = DataLoader(str(images.dst), batch_size=16, device="cpu", transform=ImageTransform(**EVAL_U8))
    assert loader.stats() == {}
    n = sum(len(b["__key__"]) for b in loader)
    s = loader.stats()
    for key in ("samples_per_s", "bytes_per_s", "wait_s", "wait_fraction", "ring_occupancy",
                "io_path", "decode_device"):
        assert key in s, key
    assert s["io_path"] == "posix" and s["decode_device"] == "cpu"
    assert s["samples"] == n == 60 and s["samples_per_s"] > 0
    assert s["bytes_per_s"] > 0 and s["wait_s"] >= 0 and 0 <= s["wait_fraction"] <= 1.0
    assert 0 <= s["ring_occupancy"] <= loader.prefetch_factor + 1


def test_stats_npy_dataset(npy_u8):
    loader = npy_loader(npy_u8, batch_size=8)
    for _ in loader:
        pass
    s = loader.stats()
    assert s["io_path"] == "posix" and s["decode_device"] is None
    assert s["samples"] == 50 and s["skipped"] == 0
    # array data is 3 KiB per sample, plus the label bytes
    assert s["bytes_per_s"] * s["elapsed_s"] >= 50 * 3 * 32 * 32 * (1 - 1e-9)  # (bytes / el) * el rounds


# -- GPU -----------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_cuda_npy_loader_returns_device_tensors(npy_u8):
    loader = DataLoader(str(npy_u8.dst), batch_size=8, device="cuda", shuffle=True)
    n = 0
    for batch in loader:
        assert batch["npy"].is_cuda
        host = batch["npy"].cpu().numpy()
        for i, key in enumerate(batch["__key__"]):
            np.testing.assert_array_equal(host[i], npy_u8.arrays[key])
            assert int(batch["cls"][i]) == npy_u8.labels[key]
        n += len(batch["__key__"])
    assert n == 50
    s = loader.stats()  # the device path itself, not the POSIX + host ring fallback (audit 1 #14)
    assert s["io_path"].startswith("kvikio") and s["ring_device"].startswith("cuda")


def test_default_prefetch_is_one_batch_ahead_when_decoding_images(images, npy_u8):
    def slots(src, **kw):
        loader = DataLoader(str(src.dst), batch_size=4, device="cpu", output="numpy", **kw)
        next(iter(loader))
        n = (loader.prefetch_factor, loader.stats()["ring_slots"])
        loader.close()
        return n

    assert slots(images) == (1, 2)  # decoded by the one DALI pipeline: no second batch ahead
    assert slots(images, decode=False) == (2, 3)  # encoded bytes only
    assert slots(npy_u8) == (2, 3)
    assert slots(images, prefetch_factor=2) == (2, 3)  # what was asked
