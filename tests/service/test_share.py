"""Share groups (`RemoteLoader(share=...)`, gdsload.service.server.share): jobs that ask one server for
the same batches are fed by one producer, and each still gets exactly its own epoch, in the local
loader's order. Checked with real loopback servers: 2 and 4 sharing jobs (each batch produced
once, sent to each); decoded training batches (the same crops for every job); rank r with rank r;
a Mix; a job paused mid-epoch while the others finish (it is detached, then served from its own
cursor) with the window's bytes within its reservation and the server's budget; a job that starts
behind the window; another seed or epoch, or another token, never shares; no share name is the
private path; bad names are refused; a share group striped over two server processes, one
SIGKILLed mid-epoch."""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import threading
import time

import grpc
import pytest
from feedkit import assert_same_batches, free_port, local_batches, spawn_server

from gdsload.errors import ConfigError
from gdsload.service.client import RemoteLoader
from gdsload.service.server import create_server
from gdsload.v1 import feed_pb2 as pb
from gdsload.v1 import feed_pb2_grpc as pb_grpc

BATCH = 4  # 64 steps of the 256 samples of root/feats
SEED = 5


@contextlib.contextmanager
def _serve(roots, **kw):
    kw = {"max_message_bytes": 64 * 1024, **kw}
    srv, port = create_server([str(roots)], **kw)
    srv.start()
    try:
        yield srv, f"127.0.0.1:{port}"
    finally:
        srv.shutdown(grace_s=2)


def _loader(address, share: str | None = "grid", *, dataset="feats", seed=SEED, **kw) -> RemoteLoader:
    kw = {"prefetch": 1, "backoff_s": 0.02, "max_backoff_s": 0.2, "retry_timeout_s": 30, "rank": 0,
          "world_size": 1, **kw}
    return RemoteLoader(address, dataset=dataset, batch_size=BATCH, shuffle=True, seed=seed, output="numpy",
                        share=share, **kw)


def _run(loaders, *, on_batch=None, timeout_s: float = 60.0) -> list[list[dict]]:
    """Iterate one epoch of each loader, all in threads started together; `on_batch(i, n)` after
    the n-th batch of loader i (in its thread)."""
    out: list = [None] * len(loaders)
    errors: list[BaseException] = []
    for ld in loaders:
        len(ld)  # the plan (ListDatasets) before the start
    barrier = threading.Barrier(len(loaders))

    def job(i: int) -> None:
        try:
            barrier.wait(timeout=30)
            got = []
            for b in loaders[i]:
                got.append(b)
                if on_batch is not None:
                    on_batch(i, len(got))
            out[i] = got
        except BaseException as exc:  # noqa: BLE001 (raised below, in the test's thread)
            errors.append(exc)

    threads = [threading.Thread(target=job, args=(i,), daemon=True) for i in range(len(loaders))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a job did not finish its epoch in time"
    if errors:
        raise errors[0]
    return out


def _counts(srv, dataset: str = "feats") -> dict[str, float]:
    reg = srv.metrics.registry

    def v(name: str, **labels) -> float:
        return reg.get_sample_value(name, labels) or 0.0

    return {
        "produced": v("gdsload_feed_share_produced_total", dataset=dataset),
        "sent": v("gdsload_feed_share_sent_total", dataset=dataset),
        "behind": v("gdsload_feed_share_fallbacks_total", dataset=dataset, reason="behind"),
        "detached": v("gdsload_feed_share_fallbacks_total", dataset=dataset, reason="detached"),
        "subscriptions": v("gdsload_feed_share_subscriptions_total", dataset=dataset),
    }


def _delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in before}


def _local_epoch(path, *, seed: int, epoch: int) -> list[dict]:
    from gdsload.loader.dataloader import DataLoader, Dataset

    dl = DataLoader(Dataset(str(path)), batch_size=BATCH, shuffle=True, seed=seed, device="cpu", output="numpy",
                    copy=True)
    dl.set_epoch(epoch)
    try:
        return list(dl)
    finally:
        dl.close()


def _wait_no_producers(srv, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while srv.servicer.share.producers() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not srv.servicer.share.producers(), "idle producers were not closed after linger_s"


@pytest.mark.parametrize("jobs", [2, 4])
def test_sharing_jobs_each_get_the_local_order_from_one_producer(roots, jobs):
    local = local_batches(roots / "feats", batch_size=BATCH, shuffle=True, seed=SEED)
    steps = len(local)
    # a window as long as the epoch: whenever a job's first request arrives, step 0 is still there
    with _serve(roots, share_window=steps, share_hold_s=10.0) as (srv, address):
        c0 = _counts(srv)
        loaders = [_loader(address, share=f"sweep-{jobs}") for _ in range(jobs)]
        results = _run(loaders)
        for got in results:
            assert_same_batches(got, local)  # every key once, in the local loader's order, same bytes
        d = _delta(c0, _counts(srv))
        assert d["produced"] == steps  # read, decoded and serialized once ...
        assert d["sent"] == jobs * steps  # ... and sent to every job
        assert d["subscriptions"] == jobs and d["behind"] == d["detached"] == 0
        copies = [ld.stats()["shared_batches"] for ld in loaders]
        assert sum(copies) == (jobs - 1) * steps  # each batch's first copy is one job's, the rest copies
        assert all(ld.stats()["batches"] == steps for ld in loaders)
        for ld in loaders:
            ld.close()
        _wait_no_producers(srv)
        text = srv.metrics.text()
        assert "gdsload_feed_share_window_bytes 0.0" in text
        assert "gdsload_feed_share_producers 0.0" in text


@pytest.mark.parametrize("decode_pool", [0, 1])
def test_decoded_train_batches_are_the_same_crops_for_every_job(roots, decode_pool):
    """Decoded tier, training transform: the jobs of a group get the very same pixels (one decode),
    in the local loader's key order; with a pipeline per stream or the server's decode pool."""
    pytest.importorskip("nvidia.dali")
    from gdsload.decode.image import ImageTransform

    tf = ImageTransform(size=32, train=True)
    local = local_batches(roots / "imgs", batch_size=BATCH, shuffle=True, seed=SEED, decode=True, transform=tf)
    with _serve(roots, share_window=64, share_hold_s=10.0, decode_pool=decode_pool) as (srv, address):
        c0 = _counts(srv, "imgs")
        loaders = [_loader(address, share="crops", dataset="imgs", decode=True, transform=tf) for _ in range(2)]
        a, b = _run(loaders)
        assert [x["__key__"] for x in a] == [x["__key__"] for x in local]
        assert_same_batches(a, b)  # same crops and flips, byte for byte
        d = _delta(c0, _counts(srv, "imgs"))
        assert d["produced"] == len(local) and d["sent"] == 2 * len(local)
        for ld in loaders:
            ld.close()


def test_paused_job_falls_out_and_still_gets_its_epoch_while_the_others_go_on(tmp_path_factory):
    """Batches of 1 MB, so a paused client's transport fills and its server stream blocks: after
    `share_hold_s` it is detached, the others finish without it, and when it resumes it is served
    from its own cursor (exactly its epoch, in order). Meanwhile the window never holds more than
    it reserved, nor the server more than its budget. The epoch (64 MB) is larger than what the
    paused client's transport can take in: loopback TCP's receive buffer grows up to
    `net.ipv4.tcp_rmem`'s maximum (32 MB on the CI machines), and with 16 MB the whole rest of the
    epoch once fitted there, so nothing blocked and nothing was detached (a clean-clone `.ci/run`)."""
    pytest.importorskip("skimage")
    from gdsload.convert.engine import ConvertOptions, convert
    from gdsload.sampledata import make_npy_folder

    base = tmp_path_factory.mktemp("share-big")
    make_npy_folder(base / "src", num_samples=256, shape=(64, 1024), dtype="float32")
    convert(str(base / "src"), str(base / "root" / "big"), ConvertOptions(workers=1, progress=False,
                                                                           shard_size=4_000_000))
    local = local_batches(base / "root" / "big", batch_size=BATCH, shuffle=True, seed=SEED)
    expected = [k for b in local for k in b["__key__"]]
    budget = 256 << 20
    from gdsload.service.protocol.config import Limits

    with _serve(base / "root", share_window=2, share_hold_s=0.3,
                limits=Limits(max_message_bytes=64 * 1024, max_memory_bytes=budget)) as (srv, address):
        c0 = _counts(srv, "big")
        hub = srv.servicer.share
        peaks = {"window": 0, "over": 0, "reserved": 0}  # per producer, and the server's reservations
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                for p in hub.producers():
                    peaks["window"] = max(peaks["window"], p.window_nbytes)
                    peaks["over"] = max(peaks["over"], p.window_nbytes - p.window_memory)
                peaks["reserved"] = max(peaks["reserved"], srv.servicer.budget.reserved)
                time.sleep(0.002)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        others_done = threading.Event()
        finished: list[int] = []
        paused_for = []

        def on_batch(i: int, n: int) -> None:
            if i == 2 and n == 4:  # job 2 stops reading mid-epoch until the other two are done
                t0 = time.monotonic()
                assert others_done.wait(30), "the other jobs waited for the paused one"
                paused_for.append(time.monotonic() - t0)
            if i != 2 and n == len(local):
                finished.append(i)
                if len(finished) == 2:
                    others_done.set()

        loaders = [_loader(address, share="pause", dataset="big") for _ in range(3)]
        results = _run(loaders, on_batch=on_batch)
        stop.set()
        sampler.join(5)
        for got in results:
            assert [k for b in got for k in b["__key__"]] == expected
        assert_same_batches(results[2], local)
        d = _delta(c0, _counts(srv, "big"))
        assert d["detached"] >= 1, d  # the paused job fell out instead of holding the others
        assert loaders[0].stats()["shared_batches"] + loaders[1].stats()["shared_batches"] > 0
        # window memory: never over what it reserved (2 batches' bound), nor the server over budget
        assert peaks["over"] <= 0 and 0 < peaks["window"]
        assert peaks["reserved"] <= budget
        two_batches = 2 * (BATCH * (64 * 1024 * 4 + 8 + 256) + 4096)  # bodies, keys, chunk framing, loosely
        assert peaks["window"] <= two_batches
        for ld in loaders:
            ld.close()
        _wait_no_producers(srv)
        assert hub.window_bytes() == (0, 0)


def test_rank_r_shares_with_rank_r_of_the_other_job(roots):
    with _serve(roots, share_window=64, share_hold_s=10.0) as (srv, address):
        c0 = _counts(srv)
        loaders = [_loader(address, share="ranks", rank=r, world_size=2) for _job in range(2) for r in range(2)]
        results = _run(loaders)
        locals_ = [local_batches(roots / "feats", batch_size=BATCH, shuffle=True, seed=SEED, rank=r, world_size=2)
                   for r in range(2)]
        for i, got in enumerate(results):
            assert_same_batches(got, locals_[i % 2])
        steps = len(locals_[0])
        d = _delta(c0, _counts(srv))
        assert d["produced"] == 2 * steps and d["sent"] == 4 * steps  # one producer per rank
        assert sum(ld.stats()["shared_batches"] for ld in loaders) == 2 * steps
        for ld in loaders:
            ld.close()


def test_a_mix_shares_like_a_dataset(tmp_path_factory):
    from gdsload.convert.engine import ConvertOptions, convert
    from gdsload.dataset.mix import Mix
    from gdsload.loader.dataloader import DataLoader, Dataset
    from gdsload.sampledata import make_npy_folder

    base = tmp_path_factory.mktemp("share-mix")
    for name, n, seed in (("a", 40, 1), ("b", 24, 2)):
        make_npy_folder(base / f"src-{name}", num_samples=n, shape=(4, 8), dtype="float32", seed=seed)
        convert(str(base / f"src-{name}"), str(base / "root" / name),
                ConvertOptions(workers=1, progress=False, shard_size=30_000))
    dl = DataLoader(Mix([Dataset(str(base / "root" / n)) for n in "ab"], weights=[1, 1]), batch_size=BATCH,
                    shuffle=True, seed=SEED, device="cpu", output="numpy", copy=True)
    local = list(dl)
    dl.close()
    with _serve(base / "root", share_window=64, share_hold_s=10.0) as (_srv, address):
        loaders = [_loader(address, share="mix", dataset=Mix(["a", "b"], weights=[1, 1])) for _ in range(2)]
        for got in _run(loaders):
            assert_same_batches(got, local)  # "__source__" included
        assert sum(ld.stats()["shared_batches"] for ld in loaders) == len(local)
        for ld in loaders:
            ld.close()


def test_another_seed_or_epoch_does_not_share(roots):
    with _serve(roots, share_window=64, share_hold_s=10.0) as (srv, address):
        c0 = _counts(srv)
        a = _loader(address, share="same")
        b = _loader(address, share="same", seed=SEED + 1)
        c = _loader(address, share="same")
        c.set_epoch(1)
        results = _run([a, b, c])
        for got, seed, epoch in zip(results, (SEED, SEED + 1, SEED), (0, 0, 1)):
            assert_same_batches(got, _local_epoch(roots / "feats", seed=seed, epoch=epoch))
        d = _delta(c0, _counts(srv))
        assert d["produced"] == d["sent"] == 3 * len(results[0])  # nothing sent twice
        assert [ld.stats()["shared_batches"] for ld in (a, b, c)] == [0, 0, 0]
        for ld in (a, b, c):
            ld.close()


def test_different_tokens_never_share(roots):
    """The server takes any caller here (no --token), but the group is scoped to the token each
    call carries: the two "alice" jobs share, "bob" does not share with them."""
    local = local_batches(roots / "feats", batch_size=BATCH, shuffle=True, seed=SEED)
    steps = len(local)
    with _serve(roots, share_window=64, share_hold_s=10.0) as (srv, address):
        c0 = _counts(srv)
        alice1, alice2, bob = (_loader(address, share="team", token=t) for t in ("alice", "alice", "bob"))
        results = _run([alice1, alice2, bob])
        for got in results:
            assert_same_batches(got, local)
        d = _delta(c0, _counts(srv))
        assert d["produced"] == 2 * steps and d["sent"] == 3 * steps
        assert alice1.stats()["shared_batches"] + alice2.stats()["shared_batches"] == steps
        assert bob.stats()["shared_batches"] == 0
        for ld in (alice1, alice2, bob):
            ld.close()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_different_tls_client_certificates_never_share(roots, tmp_path):
    """Mutual TLS: two jobs with client certificate A share; one with certificate B (same CA, same
    alternative names) does not."""
    from gdsload.service.protocol.config import TlsConfig

    def openssl(*args):
        subprocess.run(["openssl", *args], cwd=tmp_path, check=True, capture_output=True)

    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=share CA")
    (tmp_path / "san.cnf").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for name, cn in (("server", "localhost"), ("a", "trainer"), ("b", "trainer")):
        openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={cn}")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.pem", "-days", "2", "-extfile", "san.cnf")
    tls = TlsConfig.from_files(tmp_path / "server.pem", tmp_path / "server.key", client_ca=tmp_path / "ca.pem")
    local = local_batches(roots / "feats", batch_size=BATCH, shuffle=True, seed=SEED)
    with _serve(roots, tls=tls, share_window=64, share_hold_s=10.0) as (srv, address):
        c0 = _counts(srv)
        loaders = [_loader(address, share="tenant", tls_ca=tmp_path / "ca.pem", tls_cert=tmp_path / f"{c}.pem",
                           tls_key=tmp_path / f"{c}.key") for c in ("a", "a", "b")]
        for got in _run(loaders):
            assert_same_batches(got, local)
        d = _delta(c0, _counts(srv))
        assert d["produced"] == 2 * len(local) and d["sent"] == 3 * len(local)
        assert loaders[2].stats()["shared_batches"] == 0
        for ld in loaders:
            ld.close()


def test_no_share_name_is_the_private_path(roots):
    with _serve(roots) as (srv, address):
        c0 = _counts(srv)
        loaders = [_loader(address, share=None) for _ in range(2)]
        results = _run(loaders)
        local = local_batches(roots / "feats", batch_size=BATCH, shuffle=True, seed=SEED)
        for got in results:
            assert_same_batches(got, local)
        assert _delta(c0, _counts(srv)) == {k: 0 for k in c0}
        assert not srv.servicer.share.producers()
        for ld in loaders:
            ld.close()


def test_late_job_behind_the_window_gets_its_own_producer(roots):
    """A job that starts when the group's producer is past its window is served from its own
    cursor (a `behind` fallback), still with exactly its epoch."""
    local = local_batches(roots / "feats", batch_size=BATCH, shuffle=True, seed=SEED)
    with _serve(roots, share_window=2, share_hold_s=10.0) as (srv, address):
        c0 = _counts(srv)
        early, late = _loader(address, share="late"), _loader(address, share="late")
        it = iter(early)
        got_early = [next(it) for _ in range(20)]  # the producer is at step ~20, its window 2 deep
        got_late = list(late)
        got_early += list(it)
        assert_same_batches(got_early, local)
        assert_same_batches(got_late, local)
        assert _delta(c0, _counts(srv))["behind"] == 1
        early.close()
        late.close()


def _steps(stub, **kw) -> list[tuple[int, list[str], bool]]:
    """(step, keys, BatchHeader.shared) of each batch of one StreamBatches call of group "mv"."""
    from gdsload.service.protocol import wire

    req = pb.BatchRequest(dataset="feats", seed=SEED, shuffle=True, batch_size=BATCH, world_size=1,
                          payload=pb.PAYLOAD_RAW, share="mv", **kw)
    asm, out, shared = wire.BatchAssembler(), [], False
    for chunk in stub.StreamBatches(req, timeout=30):
        if chunk.chunk_index == 0:
            shared = chunk.header.shared
        batch = asm.add(chunk)
        if batch is not None:
            out.append((chunk.step, batch["__key__"], shared))
    return out


def test_a_new_block_takes_the_idle_producers_loader_and_its_window_stays(roots):
    """Block requests as a striping client sends them: a block past an idle producer takes that
    producer's loader (no new loader), the idle one keeps its window; a request that starts in
    that window is served from it (as copies), then moves on to a producer for the rest."""
    keys = [b["__key__"] for b in local_batches(roots / "feats", batch_size=BATCH, shuffle=True, seed=SEED,
                                                 order=1)]  # (_steps: no ';order=')
    with _serve(roots, share_window=2, share_hold_s=10.0) as (srv, address), grpc.insecure_channel(address) as ch:
        stub, hub = pb_grpc.FeedStub(ch), srv.servicer.share
        assert [s for s, _, _ in _steps(stub, start_position=0, max_batches=4)] == [0, 1, 2, 3]
        second = _steps(stub, start_position=8 * BATCH, max_batches=2)
        assert [(s, k) for s, k, _ in second] == [(8, keys[8]), (9, keys[9])]
        assert hub.handoffs == 1  # the block of steps 8-9 took the idle producer's loader
        late = _steps(stub, start_position=2 * BATCH)
        assert [s for s, _, _ in late] == list(range(2, len(keys)))
        assert [k for _, k, _ in late] == keys[2:]
        assert [sh for _, _, sh in late[:2]] == [True, True]  # steps 2, 3: the old window's copies
        assert not any(sh for _, _, sh in late[2:])  # then made for it
        assert hub.handoffs == 2  # ... by the loader of the idle 8-9 producer


def test_the_next_epoch_takes_the_last_epochs_loader(roots):
    with _serve(roots, share_window=64, share_hold_s=10.0) as (srv, address):
        loaders = [_loader(address, share="epochs") for _ in range(2)]
        for epoch in (0, 1):
            ref = _local_epoch(roots / "feats", seed=SEED, epoch=epoch)
            for got in _run(loaders):
                assert_same_batches(got, ref)
        assert srv.servicer.share.handoffs == 1  # epoch 1's producer took epoch 0's idle loader
        assert sum(ld.stats()["shared_batches"] for ld in loaders) == 2 * len(ref)
        for ld in loaders:
            ld.close()


def test_the_next_epoch_takes_the_loader_while_a_slower_job_reads_the_last_window(roots):
    """A job that reaches the next epoch while another still reads the last one's window takes
    the producer's loader (it has made its last step): no second loader at the epoch boundary,
    and the slower job still gets exactly its epoch from the window. The slow job's server side
    is held after its first batch (a gate in the hub) until the fast job is into epoch 1."""
    with _serve(roots, share_window=64, share_hold_s=10.0) as (srv, address):
        hub = srv.servicer.share
        gate, first = threading.Event(), []
        take = hub._next

        def gated(sub, context):
            if not first:
                first.append(sub)  # the slow job's stream subscribes first
            if sub is first[0] and sub.next >= 1:
                gate.wait(30)
            return take(sub, context)

        hub._next = gated
        slow, fast = _loader(address, share="boundary"), _loader(address, share="boundary")
        len(slow), len(fast)
        it_slow = iter(slow)
        got_slow = [next(it_slow)]
        got_fast0 = list(fast)  # the producer makes every step of epoch 0: all in its window
        assert [len(p.subs) for p in hub.producers()] == [1]  # the slow job is still on it
        got_fast1 = list(fast)  # epoch 1, while the slow job still reads epoch 0
        assert hub.handoffs == 1  # epoch 1 took epoch 0's loader: no second one built
        gate.set()
        got_slow += list(it_slow)
        ref0 = _local_epoch(roots / "feats", seed=SEED, epoch=0)
        assert_same_batches(got_slow, ref0)
        assert_same_batches(got_fast0, ref0)
        assert_same_batches(got_fast1, _local_epoch(roots / "feats", seed=SEED, epoch=1))
        assert _counts(srv)["behind"] == _counts(srv)["detached"] == 0
        fast.close()
        slow.close()


def test_a_window_over_the_memory_budget_is_refused_naming_it(roots):
    from gdsload.service.protocol.config import Limits
    from gdsload.service.protocol.status import RemoteError

    limits = Limits(max_message_bytes=64 * 1024, max_memory_bytes=64 << 20)
    with _serve(roots, limits=limits, share_window=10_000) as (srv, address):
        ld = _loader(address, share="huge", max_retries=0)
        with pytest.raises(RemoteError) as err:
            next(iter(ld))
        assert err.value.code == "RESOURCE_EXHAUSTED" and "--share-window" in str(err.value)
        assert srv.servicer.budget.reserved == 0 and not srv.servicer.share.producers()
        ld.close()


def test_share_name_is_checked():
    with pytest.raises(ConfigError, match="share"):
        RemoteLoader("127.0.0.1:1", dataset="feats", share="")
    with pytest.raises(ConfigError, match="at most 128"):
        RemoteLoader("127.0.0.1:1", dataset="feats", share="x" * 129)


def test_server_refuses_a_bad_share_name(roots):
    with _serve(roots) as (_srv, address), grpc.insecure_channel(address) as ch:
        stub = pb_grpc.FeedStub(ch)
        req = pb.BatchRequest(dataset="feats", batch_size=4, world_size=1, share="x" * 200)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.StreamBatches(req, timeout=10))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "share" in err.value.details()


def test_share_group_striped_over_two_servers_one_killed_mid_epoch(roots, tmp_path):
    """Two jobs stripe over two server processes under one share name; one server is SIGKILLed
    mid-epoch. Both still get every key once, in plan order; the surviving server shared."""
    local = local_batches(roots / "feats", batch_size=BATCH, shuffle=True, seed=SEED)
    expected = [k for b in local for k in b["__key__"]]
    ports = [free_port(), free_port()]
    procs = [spawn_server(roots, p, tmp_path / "servers.log", "--grace", "1", "--max-message-bytes", "65536",
                          "--share-window", "16") for p in ports]
    addresses = [f"127.0.0.1:{p}" for p in ports]
    try:
        loaders = [_loader(addresses, share="striped", stripe_batches=2, server_window=1, stall_timeout_s=2.0)
                   for _ in range(2)]

        def on_batch(i: int, n: int) -> None:
            if i == 0 and n == 16:
                procs[0].send_signal(signal.SIGKILL)

        results = _run(loaders, on_batch=on_batch, timeout_s=90)
        for got in results:
            assert [k for b in got for k in b["__key__"]] == expected
        assert procs[0].wait(timeout=10) == -signal.SIGKILL
        assert sum(ld.stats()["shared_batches"] for ld in loaders) > 0
        for ld in loaders:
            ld.close()
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)
