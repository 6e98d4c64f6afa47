"""Field kinds (text, json, ragged and fixed `.npy`, labels, several images, other bytes), `map=`
and `collate_fn=` in thread mode, and the same through `RemoteLoader`, on one small converted
dataset (`tests/fieldsample.py`). Values are checked against the source files by key, and map /
collate results against a plain-Python reference over the plan's order."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import fieldsample as fs
from gdsload.decode.image import ImageTransform
from gdsload.errors import GdsloadError
from gdsload.dataset.sharded import ShardedDataset
from gdsload.loader.dataloader import DataLoader
from gdsload.frontend.usercode import default_collate
from gdsload.plan.plan import DEFAULT_ORDER, epoch_order

pytestmark = pytest.mark.dali


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    root = tmp_path_factory.mktemp("fields")
    ref = fs.make_source(root / "src")
    result = fs.convert_source(root / "src", root / "ds")
    assert result["shards"] >= 3
    return root / "ds", ref


def loader(path, **kw) -> DataLoader:
    kw.setdefault("batch_size", 5)
    kw.setdefault("num_workers", 2)
    kw.setdefault("device", "cpu")
    kw.setdefault("transform", ImageTransform(**fs.EVAL))
    return DataLoader(str(path), **kw)


def plan_keys(path, *, seed: int, shuffle: bool, epoch: int = 0) -> list[str]:
    sd = ShardedDataset(path)
    sizes = [s["samples"] for s in sd.shards]
    keys = sd.keys()
    return [keys[i] for i in epoch_order(sizes, seed=seed, epoch=epoch, shuffle=shuffle, window=4,
                                         order=DEFAULT_ORDER)]  # the loader's default order


def no_new_threads(before: set, timeout_s: float = 10.0) -> list[str]:
    import gc
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        gc.collect()
        alive = [t for t in threading.enumerate() if t not in before and t.is_alive()]
        if not alive or time.monotonic() > deadline:
            return [t.name for t in alive]
        time.sleep(0.05)


def ref_sample(ref: dict, key: str) -> dict:
    """A sample as `map` is documented to receive it, from the source files."""
    r = ref[key]
    return {"__key__": key, "txt": r["txt"], "json": r["json"], "cls": np.int64(r["cls"]),
            "tokens.npy": r["tokens.npy"], "emb.npy": r["emb.npy"], "bin": r["bin"]}


def test_every_field_kind_round_trips(ds):
    path, ref = ds
    seen = set()
    for b in loader(path):
        n = len(b["__key__"])
        assert b["jpg"].shape == (n, 40, 40, 3) and b["depth.png"].shape == (n, 40, 40, 3)
        assert b["cls"].dtype == torch.int64 and b["emb.npy"].shape == (n, 4)
        for i, k in enumerate(b["__key__"]):
            r = ref[k]
            seen.add(k)
            jpg = b["jpg"][i].numpy().astype(int)
            assert np.abs(jpg - r["jpg"][:, 4:44].astype(int)).mean() < 3  # JPEG, center crop
            depth = b["depth.png"][i].numpy()  # PNG is lossless; grey comes back as RGB
            assert all(np.array_equal(depth[..., c], r["depth.png"][:, 4:44]) for c in range(3))
            assert b["txt"][i] == r["txt"] and isinstance(b["txt"][i], str)
            assert b["json"][i] == r["json"]
            assert int(b["cls"][i]) == r["cls"]
            tok = b["tokens.npy"][i]
            assert isinstance(tok, torch.Tensor) and tok.dtype == torch.int32
            assert np.array_equal(tok.numpy(), r["tokens.npy"])
            assert np.array_equal(b["emb.npy"][i].numpy(), r["emb.npy"])
            assert b["bin"][i] == r["bin"]
    assert seen == set(ref)


def test_decode_false_keeps_text_json_and_images_as_bytes(ds):
    path, ref = ds
    b = next(iter(loader(path, decode=False, fields=("txt", "json", "jpg", "tokens.npy", "__key__"))))
    txt, js, jpg, tok, keys = b
    assert txt == [ref[k]["txt"].encode() for k in keys]
    assert [__import__("json").loads(j) for j in js] == [ref[k]["json"] for k in keys]
    assert all(isinstance(j, bytes) and j[:2] == b"\xff\xd8" for j in jpg)
    assert [t.numpy().tolist() for t in tok] == [ref[k]["tokens.npy"].tolist() for k in keys]


def test_map_result_equals_python_reference_in_plan_order(ds):
    path, ref = ds
    got = list(loader(path, shuffle=True, seed=3, map=fs.caption_map))
    order = plan_keys(path, seed=3, shuffle=True)
    assert [k for b in got for k in b["__key__"]] == order
    for j, b in enumerate(got):
        want = default_collate([fs.caption_map(ref_sample(ref, k)) for k in order[j * 5 : (j + 1) * 5]])
        assert b["__key__"] == want["__key__"]
        for name in ("ids", "score", "tok_sum", "cls"):
            assert isinstance(b[name], torch.Tensor)
            assert np.array_equal(b[name].numpy(), want[name]), name


def test_collate_fn_replaces_stacking_and_pads_ragged_tokens(ds):
    path, ref = ds
    got = list(loader(path, shuffle=True, seed=5, collate_fn=fs.pad_collate))
    order = plan_keys(path, seed=5, shuffle=True)
    for j, b in enumerate(got):
        want = fs.pad_collate([ref_sample(ref, k) for k in order[j * 5 : (j + 1) * 5]])
        assert b["keys"] == want["keys"] and b["lengths"] == want["lengths"]
        assert isinstance(b["tokens"], np.ndarray)  # a collate_fn's batch comes back as it made it
        assert np.array_equal(b["tokens"], want["tokens"])


def test_fields_with_a_map_select_what_is_read_and_the_batch_stays_a_dict(ds):
    path, ref = ds
    for txt, cls, keys in loader(path, fields=("txt", "cls", "__key__")):  # without a map: tuples
        assert txt == [ref[k]["txt"] for k in keys]
    lo = loader(path, fields=("txt", "cls", "__key__"), map=lambda s: {**s, "upper": s["txt"].upper()})
    for b in lo:
        assert sorted(b) == ["__key__", "cls", "txt", "upper"]
        assert b["upper"] == [ref[k]["txt"].upper() for k in b["__key__"]]
        assert b["cls"].tolist() == [ref[k]["cls"] for k in b["__key__"]]


def test_exception_in_map_names_shard_and_key_and_threads_stop(ds):
    path, _ = ds
    before = set(threading.enumerate())
    lo = loader(path, map=fs.failing_map, num_workers=3)
    with pytest.raises(fs.MapBoom) as info:
        for _ in lo:
            pass
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert ":s010" in notes and ".tar" in notes
    del lo, info
    assert no_new_threads(before) == []


def test_threads_stop_after_break_with_a_map(ds):
    path, _ = ds
    before = set(threading.enumerate())
    lo = loader(path, map=fs.slow_map, num_workers=2)
    for _ in lo:
        break
    del lo
    assert no_new_threads(before) == []


def test_bad_options_are_refused_with_a_clear_message(ds):
    path, _ = ds
    with pytest.raises(GdsloadError, match="picklable"):
        loader(path, map=lambda s: s, worker_mode="process")
    with pytest.raises(GdsloadError, match="worker_mode must be"):
        loader(path, map=fs.caption_map, worker_mode="fork")
    with pytest.raises(GdsloadError, match="give map= or collate_fn="):
        loader(path, worker_mode="process")
    with pytest.raises(GdsloadError, match="callable"):
        loader(path, map="caption_map")


def test_default_collate_stacks_same_shapes_and_lists_the_rest():
    out = default_collate([{"a": np.zeros(2), "r": np.zeros(i + 1), "s": "x", "n": i} for i in range(3)])
    assert out["a"].shape == (3, 2) and isinstance(out["r"], list) and len(out["r"]) == 3
    assert out["s"] == ["x"] * 3 and out["n"].tolist() == [0, 1, 2]
    t = default_collate([torch.ones(2), torch.ones(2)])
    assert isinstance(t, torch.Tensor) and t.shape == (2, 2)


def test_remote_loader_carries_every_field_kind_and_maps_on_the_client(ds):
    pytest.importorskip("grpc")
    from gdsload.service.client import RemoteLoader
    from gdsload.service.server import create_server

    path, ref = ds
    srv, port = create_server([str(path.parent)])
    srv.start()
    try:
        addr = f"127.0.0.1:{port}"
        T = ImageTransform(**fs.EVAL)
        fields = ("txt", "json", "tokens.npy", "emb.npy", "cls", "bin", "__key__")
        local = list(loader(path, shuffle=True, seed=2, fields=fields, copy=True))
        remote = list(RemoteLoader(addr, dataset="ds", batch_size=5, shuffle=True, seed=2, transform=T,
                                   fields=fields, device="cpu"))
        assert len(local) == len(remote) == 5
        for lb, rb in zip(local, remote):
            assert lb[0] == rb[0] and lb[1] == rb[1] and lb[5] == rb[5] and lb[6] == rb[6]
            assert [t.tolist() for t in lb[2]] == [t.tolist() for t in rb[2]]
            assert all(isinstance(t, torch.Tensor) for t in rb[2])
            assert torch.equal(lb[3], rb[3]) and torch.equal(lb[4], rb[4])
        # the server decodes one image field per request: name the fields
        mapped = list(RemoteLoader(addr, dataset="ds", batch_size=5, shuffle=True, seed=2, transform=T,
                                   device="cpu", map=fs.caption_map,
                                   fields=("jpg", "txt", "json", "tokens.npy", "cls", "__key__")))
        order = plan_keys(path, seed=2, shuffle=True)
        assert [k for b in mapped for k in b["__key__"]] == order
        for j, b in enumerate(mapped):
            want = default_collate([fs.caption_map(ref_sample(ref, k)) for k in order[j * 5 : (j + 1) * 5]])
            assert np.array_equal(b["ids"].numpy(), want["ids"]) and np.array_equal(b["tok_sum"].numpy(), want["tok_sum"])
    finally:
        srv.shutdown(grace_s=2)


@pytest.fixture(scope="module")
def two_images(tmp_path_factory):
    root = tmp_path_factory.mktemp("two_images")
    ref = fs.make_two_image_source(root / "src", bad_jpg="s002", bad_png="s005")
    fs.convert_source(root / "src", root / "ds")
    return root / "ds", ref


@pytest.mark.parametrize("worker_mode", ["thread", "process"])
def test_several_image_fields_skip_a_sample_bad_in_either(two_images, worker_mode):
    path, ref = two_images
    kw = dict(map=fs.identity, worker_mode=worker_mode) if worker_mode == "process" else {}
    got = []
    lo = loader(path, batch_size=4, on_error="skip", **kw)
    for b in lo:
        for i, k in enumerate(b["__key__"]):
            got.append(k)
            jpg = b["jpg"][i].numpy().astype(int)
            assert np.abs(jpg - ref[k]["jpg"][:, 4:44].astype(int)).mean() < 3, k
            assert np.array_equal(b["depth.png"][i].numpy()[..., 0], ref[k]["depth.png"][:, 4:44]), k
            assert int(b["cls"][i]) == int(k[1:])
    assert got == [k for k in sorted(ref) if k not in ("s002", "s005")]
    assert lo.stats()["skipped"] == 2 and lo.stats()["samples"] == 6


def test_several_image_fields_raise_naming_the_bad_one(two_images):
    from gdsload.decode.image import DecodeError

    path, _ = two_images
    with pytest.raises(DecodeError, match=r"\.tar:s002"):
        list(loader(path, batch_size=4))


def test_map_on_a_device_ring_sees_the_finished_copies(monkeypatch, tmp_path):
    """CUDA fakes (tests/gpu_fakes.py: stream work is deferred until synchronized): rows and
    labels reach the device ring on the loader's private stream; `map` gets host copies made
    after those copies completed, not the slot's stale memory."""
    import gpu_fakes
    from gdsload.sampledata import make_npy_folder

    make_npy_folder(tmp_path / "src", num_samples=12, shape=(4, 32, 32), dtype="uint8", seed=5)
    fs.convert_source(tmp_path / "src", tmp_path / "ds")
    arrays = {p.stem: np.load(p) for p in (tmp_path / "src").glob("*.npy")}
    gpu_fakes.install(monkeypatch, devices=1, kvikio=False)
    lo = DataLoader(str(tmp_path / "ds"), batch_size=4, device="cuda", output="numpy", num_workers=2,
                    map=fs.identity, collate_fn=fs.keep_list)
    n = 0
    for samples in lo:
        for s in samples:
            assert isinstance(s["npy"], np.ndarray) and not hasattr(s["npy"], "__cuda_array_interface__")
            np.testing.assert_array_equal(s["npy"], arrays[s["__key__"]], err_msg=s["__key__"])
            n += 1
    assert n == 12
