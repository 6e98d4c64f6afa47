"""`RemoteLoader.skip(n)` (issue 52 item 3), the twin of tests/loader/test_skip.py on a real
server (loopback, port 0), striped and not: during a pass the stream is cancelled and the servers
are asked again from the new position (the request's `start_position`), so no server is asked
for a skipped step; before `iter()` the first request starts after them. The server's
`stream_start` log events (their `start_position`) and its batch counter show what was asked."""

from __future__ import annotations

import logging
import urllib.request

import pytest

from gdsload.errors import ConfigError
from gdsload.service.client import RemoteLoader
from gdsload.service.server import create_server

B = 8  # 256 samples: 32 steps on one rank, 16 global steps of 16 on two


class Events(logging.Handler):
    """The server's log events, as (name, fields)."""

    def __init__(self):
        super().__init__()
        self.records: list[tuple[str, dict]] = []

    def emit(self, record):
        self.records.append((record.getMessage(), dict(getattr(record, "fields", {}))))

    def starts(self, since: int = 0) -> list[int]:
        """start_position of each stream started since record `since`."""
        return [f["start_position"] for name, f in self.records[since:] if name == "stream_start"]


@pytest.fixture(scope="module")
def feed(roots):
    events = Events()
    log = logging.getLogger("gdsload.service.test-skip")
    log.addHandler(events)
    log.setLevel(logging.INFO)
    log.propagate = False
    srv, port = create_server([str(roots)], max_message_bytes=64 * 1024, metrics_port=0,
                              metrics_address="127.0.0.1", logger=log)
    srv.start()
    yield srv, f"127.0.0.1:{port}", events
    srv.shutdown(grace_s=2)
    log.removeHandler(events)


def sent(srv) -> float:
    """The server's batches sent of 'feats' so far (its Prometheus counter)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=5).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith('gdsload_feed_batches_total{dataset="feats"'))


def remote(addrs, **kw):
    kw = {"dataset": "feats", "batch_size": B, "shuffle": True, "seed": 3, "output": "numpy", "device": "cpu",
          "stripe_batches": 2, **kw}
    return RemoteLoader(addrs, **kw)


def steps_of(addrs, epoch=0, **kw) -> list[list[str]]:
    lo = remote(addrs, **kw)
    lo.set_epoch(epoch)
    out = [list(b["__key__"]) for b in lo]
    lo.close()
    return out


def flat(steps):
    return [k for s in steps for k in s]


def addresses(feed, striped):
    _, addr, _ = feed
    return [addr, addr] if striped else addr


@pytest.mark.parametrize("striped", [False, True])
def test_remote_skip_before_iter_asks_from_after_the_skipped_steps(feed, striped):
    srv, _, events = feed
    addrs = addresses(feed, striped)
    ref = steps_of(addrs)
    lo = remote(addrs)
    lo.skip(5)
    st = lo.state_dict()
    assert (st["epoch"], st["position"], len(lo)) == (0, 5 * B, 32)
    since, before = len(events.records), sent(srv)
    assert [k for b in lo for k in b["__key__"]] == flat(ref[5:])
    starts = events.starts(since)
    assert starts and min(starts) == 5 * B  # no server was asked for a skipped step
    if not striped:  # one stream, and exactly the steps after the skipped ones sent
        assert starts == [5 * B] and sent(srv) - before == 32 - 5
    assert lo.epoch == 1 and lo.stats()["batches"] == 27
    lo.close()


@pytest.mark.parametrize("striped", [False, True])
def test_remote_skip_mid_pass_the_loop_goes_on(feed, striped):
    _, _, events = feed
    addrs = addresses(feed, striped)
    ref = steps_of(addrs)
    lo = remote(addrs)
    got, since = [], None
    for i, b in enumerate(lo):
        got.append(list(b["__key__"]))
        if i == 1:
            since = len(events.records)
            lo.skip(10)
            assert lo.state_dict()["position"] == 12 * B
        if i == 4:
            lo.skip(3)  # a second skip in the same pass
    assert got == ref[:2] + ref[12:15] + ref[18:]
    starts = events.starts(since)
    if not striped:  # the pass's first stream (from 0) had sent batches: its start was logged before
        assert starts == [12 * B, 18 * B]  # a stream from each new position, none from a skipped step
    else:  # a block asked before the skip may be logged after it: only the new receivers' are certain
        assert {12 * B, 18 * B} <= set(starts), starts
    assert lo.epoch == 1 and lo.state_dict()["position"] == 0
    lo.close()


@pytest.mark.parametrize("striped", [False, True])
def test_remote_skip_is_the_same_global_steps_on_every_rank(feed, striped):
    """Two ranks (global batch 16, 16 steps) skip 3 steps after their first batch: each gets its
    own batches minus the same steps, the two together the one-rank loader's global batches of the
    kept steps, and their equal states resume on one rank exactly."""
    addrs = addresses(feed, striped)
    one = steps_of(addrs, batch_size=2 * B)
    states, got = [], []
    for rank in range(2):
        ref = steps_of(addrs, rank=rank, world_size=2)
        lo = remote(addrs, rank=rank, world_size=2)
        it = iter(lo)
        mine = [list(next(it)["__key__"])]
        lo.skip(3)
        states.append(lo.state_dict())
        mine += [list(b["__key__"]) for b in it]
        assert mine == ref[:1] + ref[4:], rank
        got.append(mine)
        lo.close()
    assert states[0] == states[1] and states[0]["position"] == 4 * 2 * B
    for step, a, b in zip([0, *range(4, 16)], *got, strict=True):
        assert sorted(a + b) == sorted(one[step]), step
    resumed = remote(addrs, batch_size=2 * B)
    resumed.load_state_dict(states[0])
    assert [list(b["__key__"]) for b in resumed] == one[4:]
    resumed.close()


@pytest.mark.parametrize("striped", [False, True])
def test_remote_skip_to_exactly_the_end_completes_the_epoch(feed, striped):
    addrs = addresses(feed, striped)
    e0, e1 = steps_of(addrs, 0), steps_of(addrs, 1)
    lo = remote(addrs)
    it = iter(lo)
    assert [list(next(it)["__key__"]) for _ in range(20)] == e0[:20]
    lo.skip(12)
    st = lo.state_dict()
    assert (lo.epoch, st["epoch"], st["position"]) == (1, 1, 0)
    with pytest.raises(StopIteration):
        next(it)
    it = iter(lo)
    assert [list(next(it)["__key__"]) for _ in range(len(lo))] == e1  # len() batches, no StopIteration
    lo.skip(30)  # the pass handed out epoch 1's last batch: the skip is epoch 2's
    assert (lo.epoch, lo.state_dict()["position"]) == (2, 30 * B)
    with pytest.raises(StopIteration):
        next(it)
    assert [list(b["__key__"]) for b in lo] == steps_of(addrs, 2)[30:]
    lo.close()


def test_remote_skip_past_the_end_is_refused_naming_how_many_remain(feed):
    addrs = addresses(feed, False)
    ref = steps_of(addrs)
    lo = remote(addrs)
    with pytest.raises(ConfigError, match=r"skip\(33\) crosses the end of epoch 0: 32 of its 32 steps remain"):
        lo.skip(33)
    it = iter(lo)
    got = [list(next(it)["__key__"]) for _ in range(30)]
    with pytest.raises(ConfigError, match="2 of its 32 steps remain"):
        lo.skip(3)
    with pytest.raises(ConfigError, match="whole number of global steps"):
        lo.skip(-1)
    got += [list(b["__key__"]) for b in it]  # the pass went on untouched
    assert got == ref
    lo.close()


@pytest.mark.parametrize("striped", [False, True])
def test_remote_state_after_skip_resumes_exactly_remote_and_local(feed, roots, striped):
    """The state after a skip holds the advanced position; a new RemoteLoader and a local
    DataLoader over the same dataset resume it exactly."""
    from gdsload.loader.dataloader import DataLoader

    addrs = addresses(feed, striped)
    ref = steps_of(addrs)
    lo = remote(addrs)
    it = iter(lo)
    got = [list(next(it)["__key__"]) for _ in range(3)]
    lo.skip(7)
    state = lo.state_dict()
    got.append(list(next(it)["__key__"]))
    lo.close()
    assert got == ref[:3] + ref[10:11] and state["position"] == 10 * B
    resumed = remote(addrs)
    resumed.load_state_dict(state)
    assert [list(b["__key__"]) for b in resumed] == ref[10:]
    resumed.close()
    local = DataLoader(str(roots / "feats"), batch_size=B, shuffle=True, seed=3, output="numpy", device="cpu")
    local.load_state_dict(state)
    assert [list(b["__key__"]) for b in local] == ref[10:]
    local.close()
