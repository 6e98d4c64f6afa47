"""The server's one loader reuse mechanism (`server.loaders.LoaderPool`): a parked loader keeps its
reservation until taken (by key, newest first) or closed (stale after `idle_s`, beyond `keep`,
the oldest first when the budget needs room, at once when the pool keeps none or the server
drains). On a real server: a share group's producer takes the loader a private stream of the same
request parked, and a private stream takes the one a share group's producer gave back (one pool,
whichever kind of stream parked it)."""

from __future__ import annotations

import time

import grpc

from gdsload.service.server import create_server
from gdsload.service.server.admission import Budget, stream_claim
from gdsload.service.server.loaders import LoaderPool
from gdsload.v1 import feed_pb2 as pb
from gdsload.v1 import feed_pb2_grpc as pb_grpc

CLAIM = stream_claim(3)


class Fake:
    """Stands for a `loaders.Loaded` (the pool only closes what it holds)."""

    def __init__(self, name: str):
        self.name = name
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_take_returns_the_newest_of_its_key_with_its_reservation():
    b = Budget(1000, max_streams=4)
    pool = LoaderPool(b)
    a1, a2, other = Fake("a1"), Fake("a2"), Fake("b")
    for key, item in (("a", a1), ("b", other), ("a", a2)):
        assert pool.park(key, item, b.reserve(100, CLAIM))
    assert b.reserved == 300 and pool.parked_nbytes() == 300 and len(pool) == 3
    item, res = pool.take("a")
    assert item is a2 and res.nbytes == 100 and res.held and pool.hits == 1
    assert b.reserved == 300 and pool.parked_nbytes() == 200  # the taker holds the reservation now
    assert pool.take("c") is None and pool.hits == 1
    res.release()
    pool.close()
    assert a1.closed and other.closed and not a2.closed and b.reserved == 0 and len(pool) == 0


def test_stale_and_surplus_loaders_are_closed():
    b = Budget(1000, max_streams=4)
    pool = LoaderPool(b, keep=2, idle_s=0.2)
    items = [Fake(str(i)) for i in range(3)]
    for item in items:
        pool.park("k", item, b.reserve(10, CLAIM))
    assert items[0].closed and len(pool) == 2 and b.reserved == 20  # beyond keep: the oldest went
    time.sleep(0.3)
    assert pool.take("k") is None  # stale ones are closed before anything is taken
    assert all(i.closed for i in items) and b.reserved == 0


def test_the_budget_evicts_parked_loaders_oldest_first_for_room():
    b = Budget(300, max_streams=4)
    pool = LoaderPool(b)
    b.on_short(pool.evict)
    old, new = Fake("old"), Fake("new")
    pool.park("a", old, b.reserve(100, CLAIM))
    pool.park("b", new, b.reserve(100, CLAIM))
    r = b.reserve(200, CLAIM)  # 200 + 200 > 300: the oldest parked loader makes room
    assert old.closed and not new.closed and b.reserved == 300
    r.release()
    pool.close()


def test_nothing_is_kept_when_the_pool_keeps_none_is_closed_or_the_server_drains():
    b = Budget(1000, max_streams=4)
    pool = LoaderPool(b, keep=0)
    item = Fake("x")
    assert not pool.park("k", item, b.reserve(10, CLAIM)) and item.closed and b.reserved == 0
    pool.keep = 8
    held = b.reserve(10, CLAIM)  # (reserved before the server began to drain)
    b.draining.set()
    item = Fake("y")
    assert not pool.park("k", item, held) and item.closed and b.reserved == 0
    b.draining.clear()
    pool.close()
    item = Fake("z")
    assert not pool.park("k", item, b.reserve(10, CLAIM)) and item.closed and b.reserved == 0


def _epoch(stub, **kw) -> int:
    req = pb.BatchRequest(dataset="feats", batch_size=32, shuffle=True, seed=3, world_size=1, **kw)
    return sum(1 for c in stub.StreamBatches(req, timeout=30) if c.HasField("header"))


def test_private_and_shared_streams_of_one_request_reuse_one_loader(roots):
    srv, port = create_server([str(roots)], max_message_bytes=64 * 1024, share_window=2)
    srv.start()
    try:
        sv = srv.servicer
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.FeedStub(ch)
            assert _epoch(stub) == 8 and len(sv.warm) == 1 and sv.warm_hits == 0
            assert _epoch(stub, share="g") == 8  # its producer took the private stream's loader
            assert sv.share.handoffs == 1 and sv.warm_hits == 1
            assert len(sv.warm) == 1  # ... and gave it back after its last step
            assert _epoch(stub, epoch=1) == 8  # the next private stream takes it again
            assert sv.warm_hits == 2 and len(sv.warm) == 1
        sv.share.evict_idle()  # the group's window, kept `linger_s` for late joiners
        info = sv.GetServerInfo(pb.GetServerInfoRequest(), None)
        assert info.memory_in_use_bytes == 0 and sv.budget.reserved == sv.warm.parked_nbytes() > 0
    finally:
        srv.shutdown(grace_s=1)
    assert len(sv.warm) == 0 and sv.budget.reserved == 0
