"""`RemoteLoader.stats()["stages"]`: receive, map and wait, in the shape of the local loader's
`stats()["stages"]`, one server and striped over two (real servers on loopback)."""

from __future__ import annotations

import time

import pytest

from gdsload.loader.dataloader import DataLoader, Dataset
from gdsload.service.client import RemoteLoader
from gdsload.service.server import create_server

MAP_S = 0.004  # what the map costs per sample: 32 samples, ~0.13 s per batch


def _slow(sample):
    time.sleep(MAP_S)
    return sample


@pytest.fixture(scope="module")
def second(roots):
    srv, port = create_server([str(roots)], max_message_bytes=64 * 1024)
    srv.start()
    yield f"127.0.0.1:{port}"
    srv.shutdown(grace_s=2)


def _check(stages: dict, batches: int, *, mapped: bool) -> None:
    assert stages["batches"] == batches
    total, per = stages["total_s"], stages["per_batch_s"]
    assert set(total) == set(per) == {"receive", "map", "wait"}
    for k in total:
        assert per[k] == pytest.approx(total[k] / batches)
    assert total["receive"] > 0  # every batch is received
    if mapped:  # 8 batches x 32 samples x MAP_S, in the caller's thread
        assert total["map"] >= batches * 32 * MAP_S * 0.9, total
    else:
        assert total["map"] == 0.0


@pytest.mark.parametrize("striped", [False, True], ids=["one server", "striped"])
def test_stages_are_reported_like_the_local_loaders(server, second, roots, striped):
    _, address = server
    addresses = [address, second] if striped else address
    loader = RemoteLoader(addresses, dataset="feats", batch_size=32, output="numpy", decode=False,
                          map=_slow, stripe_batches=2)
    before = loader.stats()["stages"]
    assert before["batches"] == 0 and before["per_batch_s"] == {"receive": 0.0, "map": 0.0, "wait": 0.0}
    assert sum(len(b["__key__"]) for b in loader) == 256
    stats = loader.stats()
    _check(stats["stages"], 8, mapped=True)
    assert stats["stages"]["total_s"]["wait"] == pytest.approx(stats["wait_s"])
    # the shape of the local loader's
    local = DataLoader(Dataset(str(roots / "feats")), batch_size=32, output="numpy", device="cpu")
    list(local)
    ls = local.stats()["stages"]
    assert set(ls) == set(stats["stages"]) and set(ls["total_s"]) >= {"map", "wait"}
    local.close()
    # a second epoch adds to the same counters (since the loader was made, as its other counters)
    list(loader)
    _check(loader.stats()["stages"], 16, mapped=True)
    loader.close()


def test_stages_without_map(server):
    _, address = server
    loader = RemoteLoader(address, dataset="feats", batch_size=64, output="numpy", decode=False)
    assert len(list(loader)) == 4
    _check(loader.stats()["stages"], 4, mapped=False)
    loader.close()
