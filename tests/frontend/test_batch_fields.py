"""Issue 46 row 14: a batch's missing field names the fields there are.

A HuggingFace `Image` column converted becomes the field named by its images' type (`png`), so
`batch["jpg"]` was a bare `KeyError: 'jpg'`. Batches of both loaders are `Batch` dicts whose
`KeyError` lists the batch's fields; they stay dicts (pickle, torch's `default_collate`)."""

from __future__ import annotations

import io
import pickle

import numpy as np
import pytest

import gdsload
from gdsload.frontend.output import Batch, MissingFieldError

MESSAGE = r"'jpg' is not a field of this batch; its fields are 'cls', 'png', '__key__'; did you mean 'png'\?"


def png(i: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((8, 8, 3), i, np.uint8)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """root/pngs: 8 samples with fields `png` and `cls` (what an HF Image column of PNGs becomes)."""
    base = tmp_path_factory.mktemp("batchfields")
    with gdsload.ShardWriter(base / "pngs") as w:
        for i in range(8):
            w.write({"__key__": f"k{i}", "png": png(i), "cls": i % 2})
    return base


def check(batch) -> None:
    assert isinstance(batch, Batch) and isinstance(batch, dict)
    with pytest.raises(KeyError, match=MESSAGE) as info:
        batch["jpg"]
    assert isinstance(info.value, MissingFieldError)
    assert batch.get("jpg") is None and "jpg" not in batch and batch["__key__"]  # a dict otherwise
    again = pickle.loads(pickle.dumps(batch))
    assert type(again) is Batch and list(again) == list(batch)


def test_local_loader_batches_name_their_fields(root):
    loader = gdsload.DataLoader(str(root / "pngs"), batch_size=4, decode=False, output="numpy", device="cpu")
    batches = list(loader)
    assert len(batches) == 2
    for b in batches:
        check(b)


def test_remote_loader_batches_name_their_fields(root):
    pytest.importorskip("grpc")
    pytest.importorskip("grpc_health")
    pytest.importorskip("prometheus_client")
    from gdsload.service.client import RemoteLoader
    from gdsload.service.server import create_server

    srv, port = create_server([str(root)])
    srv.start()
    try:
        batches = list(RemoteLoader(f"127.0.0.1:{port}", dataset="pngs", batch_size=4, decode=False, output="numpy"))
    finally:
        srv.shutdown(grace_s=2)
    assert len(batches) == 2
    for b in batches:
        check(b)


def test_a_batch_stays_a_dict_for_torch_collation():
    torch = pytest.importorskip("torch")
    from torch.utils.data import default_collate

    got = default_collate([Batch(x=torch.zeros(2)), Batch(x=torch.ones(2))])
    assert type(got) is Batch and got["x"].shape == (2, 2)
    with pytest.raises(KeyError, match=r"'y' is not a field of this batch; its fields are 'x'$"):
        got["y"]
