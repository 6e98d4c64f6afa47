"""A `gdsload.Mix` through the feed: `RemoteLoader` over `gdsload serve` gives the local mix's
batches (order, values, "__source__"), shares its state format, and the server checks the mix."""

from __future__ import annotations

import signal

import numpy as np
import pytest
from feedkit import assert_same_batches, free_port, spawn_server

from gdsload.loader.dataloader import DataLoader, Dataset
from gdsload.dataset.mix import Mix
from gdsload.plan.plan import StateError
from gdsload.service.client import RemoteLoader
from gdsload.service.server import create_server
from gdsload.service.protocol.status import RemoteError
from gdsload.v1 import feed_pb2 as pb
from gdsload.v1 import feed_pb2_grpc as pb_grpc

grpc = pytest.importorskip("grpc")


@pytest.fixture(scope="module")
def mixroot(tmp_path_factory):
    """root/a: 40 float32[4, 8] with labels; root/b: 24 of them; root/c: 16 without labels."""
    from gdsload.convert.engine import ConvertOptions, convert
    from gdsload.sampledata import make_npy_folder

    base = tmp_path_factory.mktemp("mixfeed")
    for name, n, seed, labels in (("a", 40, 1, True), ("b", 24, 2, True), ("c", 16, 3, False)):
        make_npy_folder(base / f"src-{name}", num_samples=n, shape=(4, 8), dtype="float32", seed=seed,
                        labels=labels)
        convert(str(base / f"src-{name}"), str(base / "root" / name),
                ConvertOptions(workers=1, progress=False, shard_size=30_000))
    return base / "root"


@pytest.fixture(scope="module")
def mixserver(mixroot):
    srv, port = create_server([str(mixroot)], max_message_bytes=64 * 1024)
    srv.start()
    yield f"127.0.0.1:{port}"
    srv.shutdown(grace_s=2)


MIX_KW = ("weights", "samples_per_epoch", "repeat", "samples", "mix_by")


def local(root, names, **kw):
    mix = Mix([Dataset(str(root / n)) for n in names], **{k: kw.pop(k) for k in MIX_KW if k in kw})
    dl = DataLoader(mix, device="cpu", output="numpy", copy=True, **kw)
    try:
        return list(dl)
    finally:
        dl.close()


def remote(address, names, **kw):
    mix = Mix(list(names), **{k: kw.pop(k) for k in MIX_KW if k in kw})
    return RemoteLoader(address, dataset=mix, output="numpy", **kw)


CASES = [
    dict(weights=[0.7, 0.3], batch_size=8, shuffle=True, seed=3, rank=1, world_size=2),
    dict(weights=[1, 1], samples_per_epoch=50, batch_size=5, shuffle=False, rank=0, world_size=3, drop_last=True),
    dict(weights=[None, 2.0], repeat=[1.5, None], batch_size=4, shuffle=True, seed=1, mix_by="batch"),
    dict(batch_size=6, shuffle=True, seed=8, shuffle_window=2, fields=["__source__", "npy", "__key__"]),
]


@pytest.mark.parametrize("kw", CASES, ids=["weights-rank1of2", "ordered-droplast", "repeat-by-batch", "tuples"])
def test_remote_mix_equals_local(mixserver, mixroot, kw):
    got = list(remote(mixserver, ["a", "b"], **dict(kw)))
    want = local(mixroot, ["a", "b"], **dict(kw))
    assert_same_batches(got, want)
    first = got[0] if isinstance(got[0], dict) else dict(zip(kw["fields"], got[0]))
    assert set(first["__source__"]) <= {"a", "b"}
    assert sum(len(b["__key__"] if isinstance(b, dict) else b[2]) for b in got) > 0


def test_remote_mix_common_fields(mixserver, mixroot):
    got = list(remote(mixserver, ["a", "c"], batch_size=8, shuffle=True, seed=2))
    assert set(got[0]) == {"npy", "__key__", "__source__"}  # c has no labels
    assert_same_batches(got, local(mixroot, ["a", "c"], batch_size=8, shuffle=True, seed=2))
    with pytest.raises(Exception, match=r"fields \['cls'\] are not in dataset 'c'"):
        remote(mixserver, ["a", "c"], batch_size=8, fields=["npy", "cls"]).plan


def test_mix_state_moves_between_local_and_remote(mixserver, mixroot):
    kw = dict(weights=[0.6, 0.4], batch_size=4, shuffle=True, seed=11, drop_last=True)
    full = local(mixroot, ["a", "b"], **dict(kw))
    mix = Mix([Dataset(str(mixroot / n)) for n in ("a", "b")], weights=kw["weights"])
    dl = DataLoader(mix, device="cpu", output="numpy", copy=True,
                    **{k: v for k, v in kw.items() if k != "weights"})
    it = iter(dl)
    head = [next(it) for _ in range(3)]
    state = dl.state_dict()
    dl.close()
    r = remote(mixserver, ["a", "b"], **dict(kw))
    r.load_state_dict(state)
    assert_same_batches(head + list(r), full)
    other = remote(mixserver, ["a", "b"], **{**kw, "weights": [0.5, 0.5]})
    with pytest.raises(StateError, match=r"dataset 0 \('a'\) differs in 'weight'"):
        other.load_state_dict(state)


def _stream(address, req):
    with grpc.insecure_channel(address) as ch:
        return list(pb_grpc.FeedStub(ch).StreamBatches(req, timeout=30))


def test_server_checks_the_mix(mixserver):
    src = [pb.MixSource(dataset="a", weight=1.0), pb.MixSource(dataset="b", weight=1.0)]
    ok = pb.BatchRequest(mix=pb.MixSpec(sources=src), batch_size=4, max_batches=1)
    chunks = _stream(mixserver, ok)
    assert chunks[0].header.num_samples == 4 and set(chunks[0].header.sources) <= {"a", "b"}
    cases = [
        (pb.BatchRequest(dataset="a", mix=pb.MixSpec(sources=src), batch_size=4), "INVALID_ARGUMENT", "both dataset"),
        (pb.BatchRequest(mix=pb.MixSpec(sources=[pb.MixSource(dataset="a", weight=1, dataset_id="0" * 16)]),
                         batch_size=4), "FAILED_PRECONDITION", "mix source 0"),
        (pb.BatchRequest(mix=pb.MixSpec(sources=[pb.MixSource(dataset="nope", weight=1)]), batch_size=4),
         "NOT_FOUND", "unknown dataset 'nope'"),
        (pb.BatchRequest(mix=pb.MixSpec(sources=[pb.MixSource(dataset="a", weight=1, repeat=2)]), batch_size=4),
         "INVALID_ARGUMENT", "dataset 0 has a weight"),
        (pb.BatchRequest(mix=pb.MixSpec(sources=src), batch_size=4, dataset_id="mix-0000000000000000"),
         "FAILED_PRECONDITION", "planned with mix-0000"),
    ]
    for req, code, message in cases:
        with pytest.raises(grpc.RpcError) as info:
            _stream(mixserver, req)
        assert info.value.code().name == code, (code, info.value.details())
        assert message in info.value.details()


def test_unknown_mix_dataset_is_a_clear_client_error(mixserver):
    with pytest.raises(RemoteError, match="nope"):
        remote(mixserver, ["a", "nope"], batch_size=4).plan


def test_mix_through_gdsload_serve_subprocess(mixroot, tmp_path):
    """The same through `python -m gdsload.service` (what `gdsload serve` runs) on loopback."""
    port = free_port()
    proc = spawn_server(mixroot, port, tmp_path / "server.log")
    try:
        kw = dict(weights=[0.3, 0.7], samples_per_epoch=48, batch_size=8, shuffle=True, seed=5, world_size=2, rank=0)
        got = list(remote(f"127.0.0.1:{port}", ["a", "b"], **dict(kw)))
        assert_same_batches(got, local(mixroot, ["a", "b"], **dict(kw)))
        sources = [s for b in got for s in b["__source__"]]
        assert len(sources) == 24 and 0 < sources.count("a") < sources.count("b")
        assert np.all(np.isfinite(got[0]["npy"]))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def test_remote_mix_of_opened_datasets_is_refused(mixserver, mixroot):
    from gdsload.errors import GdsloadError

    mix = Mix([Dataset(str(mixroot / "a")), Dataset(str(mixroot / "b"))])
    with pytest.raises(GdsloadError, match="names served datasets by their names"):
        RemoteLoader(mixserver, dataset=mix, output="numpy").plan


def _rss_kb(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of a process, in kB (Linux)."""
    status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines() if ":" in line)
    return int(status["VmRSS"].split()[0]), int(status["VmHWM"].split()[0])


@pytest.mark.parametrize("spec", [
    pb.MixSpec(sources=[pb.MixSource(dataset="a", weight=1.0), pb.MixSource(dataset="b", weight=1.0)],
               samples_per_epoch=30_000_000),
    pb.MixSpec(sources=[pb.MixSource(dataset="a", repeat=750_000.0), pb.MixSource(dataset="b", samples=5)]),
    pb.MixSpec(sources=[pb.MixSource(dataset="a", samples=10**12)]),
], ids=["samples_per_epoch", "repeat", "samples"])
def test_a_huge_mix_epoch_is_refused_within_the_memory_budget(mixroot, tmp_path, spec):
    """Before: the server built a 3e7-sample mix order in memory outside --max-memory (236 MB ->
    3.65 GB for 3 requests, 73 s of CPU each; 1e12 gave INTERNAL). Now the order's memory counts
    against the budget: refused at once with RESOURCE_EXHAUSTED naming the limit, the server's
    peak RSS growing by less than 100 MB."""
    pytest.importorskip("grpc")
    if not __import__("os").path.exists("/proc/self/status"):
        pytest.skip("reads the server's RSS from /proc")
    import time

    port = free_port()
    proc = spawn_server(mixroot, port, tmp_path / "server.log", "--max-memory", "512MB")
    try:
        address = f"127.0.0.1:{port}"
        _stream(address, pb.BatchRequest(mix=pb.MixSpec(sources=[pb.MixSource(dataset="a", weight=1.0)]),
                                         batch_size=4, max_batches=1))  # warm: imports, first stream
        _, peak0 = _rss_kb(proc.pid)
        for _ in range(2):
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as info:
                _stream(address, pb.BatchRequest(mix=spec, batch_size=4, max_batches=1))
            assert time.monotonic() - t0 < 2.0
            assert info.value.code().name == "RESOURCE_EXHAUSTED", info.value.details()
            details = info.value.details()
            assert "mix" in details and "512000000 bytes" in details and "--max-memory" in details, details
        _, peak1 = _rss_kb(proc.pid)
        assert peak1 - peak0 < 100_000, (peak0, peak1)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def test_striped_mix_equals_local(mixserver, mixroot):
    """A mix striped over two servers (the same one twice under two names is not two servers, so a
    second server here) gives the local mix's batches."""
    srv, port = create_server([str(mixroot)], max_message_bytes=64 * 1024)
    srv.start()
    try:
        kw = dict(weights=[0.7, 0.3], batch_size=4, shuffle=True, seed=3)
        loader = remote([mixserver, f"127.0.0.1:{port}"], ["a", "b"], stripe_batches=1, **dict(kw))
        assert_same_batches(list(loader), local(mixroot, ["a", "b"], **dict(kw)))
        assert all(s["batches"] > 0 for s in loader.stats()["servers"].values())
    finally:
        srv.shutdown(grace_s=2)
