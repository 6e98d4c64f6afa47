"""One stream per server of a striped epoch (`BatchRequest.block_stride`, issue 28): a server
serves every `block_stride`-th block of `block_batches` steps on one call, the values are the local
loader's for those steps, a striping client asks each such server once per epoch (not once per
block), and a server that does not announce `ServerInfo.serves_block_stride` (an older one) is
asked one block at a time as before."""

from __future__ import annotations

import grpc
import pytest
from feedkit import assert_same_batches, local_batches

from gdsload.errors import ConfigError
from gdsload.service.protocol import wire
from gdsload.service.client import RemoteLoader
from gdsload.service.server import create_server
from gdsload.service.server.loaders import Loaders, stride_steps
from gdsload.service.server.servicer import FeedServicer
from gdsload.v1 import feed_pb2 as pb
from gdsload.v1 import feed_pb2_grpc as pb_grpc

BATCH = 4  # 64 steps of the 256 samples of root/feats
SEED = 5


def test_stride_steps_take_every_strideth_block_from_the_first_step():
    assert stride_steps(0, 10, 2, 3) == [0, 1, 6, 7]
    assert stride_steps(3, 20, 2, 2) == [3, 6, 7, 10, 11, 14, 15, 18, 19]
    assert stride_steps(3, 20, 2, 2, limit=4) == [3, 6, 7, 10]
    assert stride_steps(9, 10, 4, 2) == [9]  # the rest of its block; the next one is past the end
    assert stride_steps(10, 10, 4, 2) == []


def test_iter_batches_over_steps_equals_those_batches_and_checks_them(roots):
    from gdsload.loader.dataloader import DataLoader, Dataset

    dl = DataLoader(Dataset(str(roots / "feats")), batch_size=BATCH, shuffle=True, seed=SEED, output="numpy", copy=True)
    every = list(dl)
    dl.load_state_dict(dl.plan.state(0, 0))
    steps = [1, 2, 9, 10, 63]
    assert_same_batches(list(dl.iter_batches(steps=steps)), [every[s] for s in steps])
    assert dl.state_dict()["epoch"] == 1  # step 63 was the epoch's last
    for bad in ([], [3, 3], [5, 4], [64], [-1]):
        with pytest.raises(ConfigError, match="steps must be increasing"):
            dl.iter_batches(steps=bad)
    dl.close()


def _stream(address: str, **kw) -> list[tuple[int, dict]]:
    stub = pb_grpc.FeedStub(grpc.insecure_channel(address))
    asm, out = wire.BatchAssembler(), []
    req = pb.BatchRequest(dataset="feats", batch_size=BATCH, shuffle=True, seed=SEED, rank=0, world_size=1, **kw)
    for chunk in stub.StreamBatches(req, timeout=60):
        batch = asm.add(chunk)
        if batch is not None:
            out.append((chunk.position // BATCH - 1, batch))
    return out


def test_a_strided_request_streams_its_blocks_with_their_positions(server, roots):
    _, address = server
    local = local_batches(roots / "feats", batch_size=BATCH, shuffle=True, seed=SEED, order=1)  # (_stream: no ';order=')
    got = _stream(address, start_position=3 * BATCH, block_batches=4, block_stride=3)
    steps = [s for s, _ in got]
    assert steps == [3, 12, 13, 14, 15, 24, 25, 26, 27, 36, 37, 38, 39, 48, 49, 50, 51, 60, 61, 62, 63]
    for s, batch in got:
        assert list(batch["__key__"]) == list(local[s]["__key__"])
        assert (batch["npy"] == local[s]["npy"]).all()
    limited = _stream(address, start_position=0, block_batches=2, block_stride=4, max_batches=3)
    assert [s for s, _ in limited] == [0, 1, 8]
    stub = pb_grpc.FeedStub(grpc.insecure_channel(address))
    for bad in ({"block_stride": 2}, {"block_stride": 2, "block_batches": 2, "share": "g"}):
        with pytest.raises(grpc.RpcError) as e:
            list(stub.StreamBatches(pb.BatchRequest(dataset="feats", batch_size=BATCH, **bad), timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "block_stride" in e.value.details()
    info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert info.serves_block_stride


def _streams_started(srv) -> float:
    reg = srv.servicer.metrics.registry
    return reg.get_sample_value("gdsload_feed_streams_total", {"dataset": "feats"}) or 0.0


@pytest.mark.parametrize("old", [False, True], ids=["strided", "older-servers"])
def test_a_striping_client_asks_each_server_once_per_epoch(roots, monkeypatch, old):
    if old:  # servers that do not announce the field (older ones ignore it): one request per block
        info = FeedServicer.GetServerInfo

        def without(self, request, context):
            reply = info(self, request, context)
            reply.ClearField("serves_block_stride")
            return reply

        monkeypatch.setattr(FeedServicer, "GetServerInfo", without)
    strides: list[tuple[int, int]] = []  # (server port, block_stride) of every request
    open_loader = Loaders.open
    bulk_port: dict[int, int] = {}  # id of a server's Loaders -> its bulk port

    def recording(self, req, opts=None):
        strides.append((bulk_port[id(self)], req.block_stride))
        return open_loader(self, req, opts)

    monkeypatch.setattr(Loaders, "open", recording)
    pairs = [create_server([str(roots)], max_message_bytes=64 * 1024) for _ in range(2)]
    for srv, _ in pairs:
        bulk_port[id(srv.servicer.loaders)] = srv.servicer.bulk.port if srv.servicer.bulk else 0
    try:
        for srv, _ in pairs:
            srv.start()
        loader = RemoteLoader([f"127.0.0.1:{p}" for _, p in pairs], dataset="feats", batch_size=BATCH, shuffle=True,
                              seed=SEED, rank=0, world_size=1, output="numpy", stripe_batches=2, server_window=2)
        local = local_batches(roots / "feats", batch_size=BATCH, shuffle=True, seed=SEED)
        assert_same_batches(list(loader), local)
        servers = loader.stats()["servers"]
        assert all(s["batches"] > 0 for s in servers.values())
        loader.close()
        calls = sum(_streams_started(srv) for srv, _ in pairs)
        # a stream the client cancels while its server opens it (a block stolen or hedged meanwhile)
        # was opened but never started: seen once in 17 on a loaded machine
        assert 0 <= len(strides) - calls <= 2, (calls, strides)
        if old:
            assert calls >= 64 // 2 and {k for _, k in strides} == {0}  # a call per block of 2 of the 64 steps
        else:
            # a stream of every other block on each server, plus a few calls of one block (those
            # asked before the second server answered its probe, a block stolen or hedged)
            assert {p for p, k in strides if k == 2} == {srv.servicer.bulk.port for srv, _ in pairs}
            assert calls < 64 // 2, calls
    finally:
        for srv, _ in pairs:
            srv.shutdown(grace_s=1)
