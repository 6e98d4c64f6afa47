"""A storage fault under one of two data nodes: the server reports it as UNAVAILABLE (a shard that
cannot be opened) or DATA_LOSS (a corrupt copy), never INVALID_ARGUMENT, and a client with both
addresses fails over and finishes the epoch with every sample exactly once."""

from __future__ import annotations

import os
import shutil
from collections import Counter

import grpc
import pytest
from feedkit import local_batches

from gdsload.service.client import RemoteLoader
from gdsload.service.server import create_server
from gdsload.service.protocol.status import to_status
from gdsload.v1 import feed_pb2 as pb
from gdsload.v1 import feed_pb2_grpc as pb_grpc

BATCH = 8


def _break(shard, fault: str) -> None:
    """Delete the shard file, or replace it (a new file renamed over it) with its first half."""
    if fault == "delete":
        os.remove(shard)
        return
    half = shard.read_bytes()[: shard.stat().st_size // 2]
    tmp = shard.with_name(shard.name + ".new")
    tmp.write_bytes(half)
    os.replace(tmp, shard)


@pytest.fixture
def two_nodes(roots, tmp_path):
    """Two servers, each over its own copy of root/feats (two data nodes)."""
    servers, addresses, copies = [], [], []
    for node in ("a", "b"):
        copy = tmp_path / node / "feats"
        shutil.copytree(roots / "feats", copy)
        srv, port = create_server([str(copy.parent)], max_message_bytes=64 * 1024)
        srv.servicer.warm_loaders = 0  # a parked loader keeps its shards open: the fault would go unseen
        srv.start()
        servers.append(srv)
        addresses.append(f"127.0.0.1:{port}")
        copies.append(copy)
    yield addresses, copies
    for srv in servers:
        srv.shutdown(grace_s=1)


@pytest.mark.parametrize("stripe", [False, True])
@pytest.mark.parametrize("fault, code", [("delete", "UNAVAILABLE"), ("replace", "DATA_LOSS")])
def test_shard_broken_under_a_running_server_fails_over(two_nodes, fault, code, stripe):
    (first, second), (copy, _) = two_nodes
    expected = [k for b in local_batches(copy, batch_size=BATCH) for k in b["__key__"]]
    last_shard = copy / sorted(p.name for p in copy.glob("*.tar"))[-1]
    # Short streams, so that the broken shard is met by a stream opened after the fault (a server
    # reads a few batches ahead within a stream, and an open file outlives its deletion).
    loader = RemoteLoader([first, second], dataset="feats", batch_size=BATCH, rank=0, world_size=1,
                          batches_per_stream=4, prefetch=1, backoff_s=0.01, output="numpy", stripe=stripe,
                          stripe_batches=2, server_window=1)
    it = iter(loader)
    keys = list(next(it)["__key__"]) + list(next(it)["__key__"])
    assert loader.stats()["address"] == first
    _break(last_shard, fault)
    keys += [k for b in it for k in b["__key__"]]
    assert keys == expected  # the local plan's order, every sample once
    assert set(Counter(keys).values()) == {1}
    if stripe:  # the last blocks came from the intact copy; the broken one failed them
        servers = loader.stats()["servers"]
        assert servers[first]["failures"] >= 1 and servers[second]["batches"] >= 1
    else:
        assert loader.stats()["address"] == second and loader.stats()["reconnects"] >= 1
    loader.close()

    # what the first server answers a stream that reaches the broken shard
    position = len(expected) - len(expected) % BATCH - BATCH
    with grpc.insecure_channel(first) as channel:
        call = pb_grpc.FeedStub(channel).StreamBatches(
            pb.BatchRequest(dataset="feats", batch_size=BATCH, start_position=position), timeout=30)
        with pytest.raises(grpc.RpcError) as e:
            list(call)
    assert e.value.code().name == code and last_shard.name in e.value.details()


def test_storage_errors_map_to_unavailable_and_data_loss():
    from gdsload.errors import CorruptDataError, StorageError

    assert to_status(StorageError("cannot open /x/shard-000003.tar: No such file"))[0] == grpc.StatusCode.UNAVAILABLE
    assert to_status(CorruptDataError("short read from '/x/shard-000003.tar'"))[0] == grpc.StatusCode.DATA_LOSS


def test_corrupt_on_every_address_is_final(two_nodes):
    """DATA_LOSS is tried once on each address, then raised: no endless retrying of bad data."""
    from gdsload.service.protocol.status import RemoteError

    addresses, copies = two_nodes
    last = sorted(p.name for p in copies[0].glob("*.tar"))[-1]
    for copy in copies:
        _break(copy / last, "replace")
    loader = RemoteLoader(addresses, dataset="feats", batch_size=BATCH, rank=0, world_size=1,
                          backoff_s=0.01, output="numpy", stripe=False)
    with pytest.raises(RemoteError) as e:
        for _ in loader:
            pass
    # The truncated copy is caught by the size check of Dataset(verify="fast") when the stream
    # opens the shard, before any read comes up short.
    assert e.value.code == "DATA_LOSS" and last in str(e.value)
    assert "changed after conversion" in str(e.value)
    assert any("every address" in note for note in e.value.__notes__)
    assert loader.stats()["reconnects"] == 1  # moved to the other address once, not back again

    striped = RemoteLoader(addresses, dataset="feats", batch_size=BATCH, rank=0, world_size=1,
                           backoff_s=0.01, output="numpy", stripe_batches=2)
    with pytest.raises(RemoteError) as e:
        for _ in striped:
            pass
    assert e.value.code == "DATA_LOSS" and last in str(e.value)
    assert any("every address" in note for note in e.value.__notes__)
