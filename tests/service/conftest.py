"""Fixtures of the feed tests: small datasets and an in-process server on port 0 (helpers that
run the server as a subprocess are in feedkit.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("grpc_health")
pytest.importorskip("prometheus_client")

from gdsload.service.server import create_server

IMG_SAMPLES = 96
NPY_SAMPLES = 256


@pytest.fixture(scope="session")
def roots(tmp_path_factory) -> Path:
    """root/imgs: 96 small JPEGs in 4 classes over ~5 shards; root/feats: 256 float32 (32, 64)
    arrays with labels over ~8 shards."""
    pytest.importorskip("skimage")
    from gdsload.convert.engine import ConvertOptions, convert
    from gdsload.sampledata import make_image_folder, make_npy_folder

    base = tmp_path_factory.mktemp("feed")
    root = base / "root"
    make_image_folder(base / "src-img", num_images=IMG_SAMPLES, num_classes=4, mean_size=(160, 120), workers=1)
    convert(str(base / "src-img"), str(root / "imgs"), ConvertOptions(workers=1, progress=False, shard_size=300_000))
    make_npy_folder(base / "src-npy", num_samples=NPY_SAMPLES, shape=(32, 64), dtype="float32")
    convert(str(base / "src-npy"), str(root / "feats"), ConvertOptions(workers=1, progress=False, shard_size=300_000))
    return root


@pytest.fixture(scope="module")
def server(roots):
    """An in-process server (port 0) with a small message limit, so batches travel in chunks."""
    srv, port = create_server([str(roots)], max_message_bytes=64 * 1024)
    srv.start()
    yield srv, f"127.0.0.1:{port}"
    srv.shutdown(grace_s=2)


@pytest.fixture(scope="module")
def big_server(roots):
    """A server with the default message size: a batch is one message."""
    srv, port = create_server([str(roots)])
    srv.start()
    yield srv, f"127.0.0.1:{port}"
    srv.shutdown(grace_s=2)
