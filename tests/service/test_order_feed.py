"""Order versions through the feed (issue 50): a request names its order in `dataset_id`
(`protocol.request.with_order` / `split_order`), a server plans the loader with it and lists what
it serves in `ServerInfo.orders`, and a server older than order versions (the real tree of commit
7cc061e, run as a subprocess) refuses a request for order 2 instead of serving order 1."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from feedkit import free_port, health_status, spawn_server

from gdsload.errors import BadRequest, DatasetChanged
from gdsload.loader.dataloader import DataLoader, Dataset
from gdsload.plan.plan import BlockSteps
from gdsload.service.protocol import request
from gdsload.service.server import create_server

grpc = pytest.importorskip("grpc")
from gdsload.v1 import feed_pb2 as pb  # noqa: E402
from gdsload.v1 import feed_pb2_grpc as pb_grpc  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
#: The last tree before order versions whose server the wire recording was made from
#: (tests/service/wire_records/README.md).
OLD_COMMIT = "7cc061e"
#: bench/tree_compare.py's USE_TREE: the editable install's import hook dropped, the tree first on
#: sys.path; then `python -m gdsload.service` of that tree (bench/remote_scale_bench.py's SERVE_TREE).
SERVE_TREE = r'''
import os, runpy, sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "").lower()
                    and "editable" not in repr(f).lower()]
sys.path.insert(0, sys.argv[1])
import gdsload
if not os.path.realpath(gdsload.__file__).startswith(os.path.realpath(sys.argv[1]) + os.sep):
    sys.exit(f"gdsload imported from {gdsload.__file__}, not from the tree {sys.argv[1]}")
sys.argv = ["gdsload.service", *sys.argv[2:]]
runpy.run_module("gdsload.service", run_name="__main__", alter_sys=True)
'''


def test_the_dataset_id_names_the_order():
    """Order 1 is the id alone (a request made before order versions, byte for byte); another
    order follows it as ';order=N'; a malformed tag is INVALID_ARGUMENT, an order this server does
    not serve FAILED_PRECONDITION naming the ones it serves."""
    assert request.with_order("0123456789abcdef", 1) == "0123456789abcdef"
    assert request.with_order("0123456789abcdef", 2) == "0123456789abcdef;order=2"
    assert request.split_order("0123456789abcdef;order=2") == ("0123456789abcdef", 2)
    assert request.split_order("0123456789abcdef") == ("0123456789abcdef", 1)
    assert request.split_order("") == ("", 1)
    assert request.split_order(";order=2") == ("", 2)
    assert request.split_order("mix-0123;order=1") == ("mix-0123", 1)
    for bad in ("abc;order=", "abc;order=two", "abc;order=-2", "abc;order=2 ", "abc;order=" + "9" * 20):
        with pytest.raises(BadRequest, match="an order is named as ';order='"):
            request.split_order(bad)
    with pytest.raises(DatasetChanged, match=r"asks for order 3; this server serves the orders 1, 2 \(ServerInfo"):
        request.split_order("abc;order=3")
    assert request.served_orders(pb.ServerInfo()) == (1,)
    assert request.served_orders(pb.ServerInfo(orders=[1, 2])) == (1, 2)


def _listed(first: int, num_steps: int, block: int, stride: int, limit: int = 0) -> list[int]:
    """The steps of a block_stride stream, listed one by one (the loop the server ran before)."""
    steps: list[int] = []
    b, step = first // block, first
    while step < num_steps and (not limit or len(steps) < limit):
        end = min((b + 1) * block, num_steps)
        steps.extend(range(step, end)[: (limit - len(steps)) if limit else None])
        b += stride
        step = b * block
    return steps


def test_block_steps_are_the_listed_steps():
    """`BlockSteps` (the server's steps of a striped stream, never listed) has the listed steps:
    every (first, epoch length, block, stride, limit) of a small table, with indexing, negative
    indices and slices; and at 10^8 steps its length and last step come at once."""
    for first in range(0, 23):
        for num_steps in range(0, 23):
            for block in range(1, 5):
                for stride in range(1, 4):
                    for limit in (0, 1, 3, 7):
                        want = _listed(first, num_steps, block, stride, limit)
                        got = BlockSteps(first, num_steps, block, stride, limit)
                        assert len(got) == len(want) and list(got) == want, (first, num_steps, block, stride, limit)
                        if want:
                            assert got[-1] == want[-1] and got[1:4] == want[1:4]
    with pytest.raises(IndexError):
        BlockSteps(0, 10, 2, 3)[4]
    assert list(BlockSteps(5, 10**6, 4, 3)) == _listed(5, 10**6, 4, 3)
    t0 = time.perf_counter()
    huge = BlockSteps(5, 10**8, 4, 3)  # steps 5..7 of block 1, then blocks 4, 7, ..., 24999997 (8333332 of them)
    assert len(huge) == 3 + 8_333_332 * 4 and huge[-1] == 24_999_997 * 4 + 3 and huge[3] == 16
    assert time.perf_counter() - t0 < 0.1


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """root/a: 72 float32[4, 8] with labels over 5 shards; root/b: 40 of them."""
    from gdsload.convert.engine import ConvertOptions, convert
    from gdsload.sampledata import make_npy_folder

    base = tmp_path_factory.mktemp("orderfeed")
    for name, n, seed in (("a", 72, 1), ("b", 40, 2)):
        make_npy_folder(base / f"src-{name}", num_samples=n, shape=(4, 8), dtype="float32", seed=seed)
        convert(str(base / f"src-{name}"), str(base / "root" / name),
                ConvertOptions(workers=1, progress=False, shard_size=20_000))
    return base / "root"


@pytest.fixture(scope="module")
def new_server(root):
    srv, port = create_server([str(root)])
    srv.start()
    yield f"127.0.0.1:{port}"
    srv.shutdown(grace_s=2)


def _keys(address: str, req: pb.BatchRequest) -> list[str]:
    with grpc.insecure_channel(address) as ch:
        return [k for c in pb_grpc.FeedStub(ch).StreamBatches(req, timeout=60) if c.chunk_index == 0
                for k in c.header.keys]


def _local_keys(path: Path, order: int, **kw) -> list[str]:
    dl = DataLoader(Dataset(str(path)), device="cpu", output="numpy", order=order, **kw)
    try:
        return [k for b in dl for k in b["__key__"]]
    finally:
        dl.close()


def _info(address: str) -> tuple[pb.ServerInfo, pb.DatasetInfo]:
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.FeedStub(ch)
        return (stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10),
                stub.ListDatasets(pb.ListDatasetsRequest(name="a"), timeout=10).datasets[0])


def test_the_server_plans_the_order_the_request_names(new_server, root):
    """A request with ';order=2' gets the local order 2's batches, one without the tag (as every
    request before order versions) order 1's; the two differ; ServerInfo.orders is [1, 2]."""
    server_info, info = _info(new_server)
    assert list(server_info.orders) == [1, 2]
    kw = dict(batch_size=8, shuffle=True, seed=5, rank=1, world_size=2)
    base = dict(dataset="a", batch_size=8, shuffle=True, seed=5, rank=1, world_size=2, shuffle_window=4)
    one = _keys(new_server, pb.BatchRequest(dataset_id=info.dataset_id, **base))
    two = _keys(new_server, pb.BatchRequest(dataset_id=info.dataset_id + ";order=2", **base))
    assert one == _local_keys(root / "a", 1, **kw)
    assert two == _local_keys(root / "a", 2, **kw)
    assert one != two
    assert _keys(new_server, pb.BatchRequest(dataset_id=";order=2", **base)) == two  # no id check, order 2
    with pytest.raises(grpc.RpcError) as err:
        _keys(new_server, pb.BatchRequest(dataset_id=info.dataset_id + ";order=3", **base))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "asks for order 3; this server serves the orders 1, 2" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        _keys(new_server, pb.BatchRequest(dataset_id="f" * 16 + ";order=2", **base))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "planned with ffff" in err.value.details()


def test_order_1_and_order_2_streams_share_no_loader(new_server, root):
    """The parked loader of an order-1 stream is not taken by an order-2 stream of the same request
    otherwise (the pool's key holds dataset_id with its tag), and vice versa."""
    _, info = _info(new_server)
    base = dict(dataset="a", batch_size=4, shuffle=True, seed=9, max_batches=2)
    first = [_keys(new_server, pb.BatchRequest(dataset_id=info.dataset_id + tag, **base)) for tag in ("", ";order=2")]
    again = [_keys(new_server, pb.BatchRequest(dataset_id=info.dataset_id + tag, **base)) for tag in ("", ";order=2")]
    assert first == again and first[0] != first[1]


@pytest.fixture(scope="module")
def old_tree(tmp_path_factory) -> Path:
    """The source tree of commit 7cc061e (`git archive`), or a skip where git cannot give it."""
    tree = tmp_path_factory.mktemp("old-tree")
    try:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", OLD_COMMIT], capture_output=True, timeout=60,
                                 check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"the tree of {OLD_COMMIT} is not available here ({exc})")
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True, timeout=60)
    return tree


@pytest.fixture(scope="module")
def old_server(old_tree, root, tmp_path_factory):
    """`python -m gdsload.service` of the 7cc061e tree over `root`, returned once SERVING."""
    from grpc_health.v1 import health_pb2

    port = free_port()
    log = tmp_path_factory.mktemp("old-log") / "server.log"
    env = {**os.environ, "PYTHONPATH": str(old_tree), "PYTHONUNBUFFERED": "1"}
    with open(log, "ab") as err:
        proc = subprocess.Popen([sys.executable, "-c", SERVE_TREE, str(old_tree), str(root), "--listen",
                                 f"127.0.0.1:{port}", "--grace", "2"], stdout=subprocess.DEVNULL, stderr=err, env=env)
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    try:
        while True:
            assert proc.poll() is None, f"the old server exited: {log.read_text()[-2000:]}"
            try:
                if health_status(address, timeout=0.5) == health_pb2.HealthCheckResponse.SERVING:
                    break
            except grpc.RpcError:
                pass
            assert time.monotonic() < deadline, f"the old server did not start: {log.read_text()[-2000:]}"
            time.sleep(0.1)
        yield address
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_an_old_server_refuses_order_2(old_server, root):
    """The server of 7cc061e (before order versions) lists no order, serves a request without the
    tag (order 1, as ever) and refuses one for order 2 with FAILED_PRECONDITION: plain, shared,
    striped (block_stride), from a mix, and with the tag alone; it never streams a batch of it."""
    server_info, info = _info(old_server)
    assert list(server_info.orders) == [] and request.served_orders(server_info) == (1,)
    base = dict(dataset="a", batch_size=8, shuffle=True, seed=5, shuffle_window=4)
    assert _keys(old_server, pb.BatchRequest(dataset_id=info.dataset_id, **base)) == _local_keys(
        root / "a", 1, batch_size=8, shuffle=True, seed=5)
    mix = pb.MixSpec(sources=[pb.MixSource(dataset="a", weight=1.0), pb.MixSource(dataset="b", weight=1.0)])
    with grpc.insecure_channel(old_server) as ch:  # a mix of order 1: served
        chunk = next(iter(pb_grpc.FeedStub(ch).StreamBatches(pb.BatchRequest(mix=mix, batch_size=8, max_batches=1),
                                                              timeout=30)))
    assert chunk.header.num_samples == 8
    requests = {
        "plain": pb.BatchRequest(dataset_id=info.dataset_id + ";order=2", **base),
        "shared": pb.BatchRequest(dataset_id=info.dataset_id + ";order=2", share="job", **base),
        "striped": pb.BatchRequest(dataset_id=info.dataset_id + ";order=2", block_batches=2, block_stride=2, **base),
        "tag alone": pb.BatchRequest(dataset_id=";order=2", **base),
        "mix": pb.BatchRequest(mix=mix, dataset_id="mix;order=2", batch_size=8, shuffle=True),
    }
    for name, req in requests.items():
        with grpc.insecure_channel(old_server) as ch:
            call = pb_grpc.FeedStub(ch).StreamBatches(req, timeout=30)
            with pytest.raises(grpc.RpcError) as err:
                for c in call:
                    raise AssertionError(f"{name}: the old server sent a batch of order 1 (step {c.step})")
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, (name, err.value.details())
        assert ";order=2" in err.value.details(), (name, err.value.details())


def test_remote_loader_refuses_to_plan_an_order_its_server_does_not_serve(old_server, new_server, root):
    """RemoteLoader(order=2) asks its server's ServerInfo.orders when it plans: against the old
    server it raises before any stream, naming the server, the orders and what to do; order=1
    reads the old server as ever (the local order 1's keys)."""
    from gdsload.service.client import RemoteLoader
    from gdsload.service.protocol.status import RemoteError

    loader = RemoteLoader(old_server, dataset="a", batch_size=8, shuffle=True, seed=3, order=2, output="numpy")
    with pytest.raises(RemoteError, match=rf"the server at {old_server} serves the orders 1 \(ServerInfo.orders; "
                                          r"none listed: a server older than order versions\) and this loader plans "
                                          r"order 2: upgrade the server, or pass RemoteLoader\(\.\.\., order=1\)"):
        iter(loader)
    old = RemoteLoader(old_server, dataset="a", batch_size=8, shuffle=True, seed=3, order=1, output="numpy")
    copy = pickle.loads(pickle.dumps(old))  # a worker's copy keeps order 1 (the default, 2, is refused here)
    want = _local_keys(root / "a", 1, batch_size=8, shuffle=True, seed=3)
    assert [k for b in old for k in b["__key__"]] == want
    assert [k for b in copy for k in b["__key__"]] == want
    with pytest.raises(Exception, match=r"order must be one of the order versions 1 or 2, got 3"):
        RemoteLoader(new_server, dataset="a", order=3)


def test_a_stripe_over_an_old_and_a_new_server_never_mixes_orders(old_server, new_server, root):
    """Striped over the new server (asked for the plan) and the old one, an order-2 loader gets
    every batch from the new server, the old one refusing each request (FAILED_PRECONDITION: left
    out for the epoch): the local order 2's batches, none of order 1."""
    from gdsload.service.client import RemoteLoader

    kw = dict(batch_size=4, shuffle=True, seed=7)
    loader = RemoteLoader([new_server, old_server], dataset="a", order=2, stripe_batches=1, output="numpy",
                          retry_timeout_s=20, **kw)
    got = [k for b in loader for k in b["__key__"]]
    assert got == _local_keys(root / "a", 2, **kw) and got != _local_keys(root / "a", 1, **kw)
    servers = loader.stats()["servers"]
    assert servers[old_server]["batches"] == 0 and servers[old_server]["state"] == "refused", servers


def _hwm_kb(pid: int) -> int:
    """VmHWM (peak resident set) of a process, in kB (Linux)."""
    status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines() if ":" in line)
    return int(status["VmHWM"].split()[0])


def test_a_striped_remote_loader_over_a_mix_of_10_10_samples(root, tmp_path):
    """Issue 50's target: a striped RemoteLoader over a mix of 10^10 samples per epoch (order 2)
    gets its first batch in under 2 s and each server's peak memory grows by less than 64 MB
    (each serves its blocks as one block_stride stream: steps never listed, batches computed as
    reached, the mix order's reservation O(shards)); the batches are the local loader's. The
    same request in order 1 is refused at once (RESOURCE_EXHAUSTED: 72 bytes per sample)."""
    if not os.path.exists("/proc/self/status"):
        pytest.skip("reads the servers' peak memory from /proc")
    from gdsload.dataset.mix import Mix
    from gdsload.service.client import RemoteLoader

    ports = [free_port(), free_port()]
    procs = [spawn_server(root, p, tmp_path / f"server{i}.log", "--max-memory", "512MB") for i, p in enumerate(ports)]
    try:
        addresses = [f"127.0.0.1:{p}" for p in ports]
        mix = dict(weights=[0.7, 0.3], samples_per_epoch=10**10)
        kw = dict(batch_size=64, shuffle=True, seed=1, rank=1, world_size=4, order=2)
        for a in addresses:  # warm: imports and a first loader on each server
            list(RemoteLoader(a, dataset=Mix(["a", "b"]), batch_size=8, output="numpy", order=2))
        peak0 = [_hwm_kb(p.pid) for p in procs]
        t0 = time.perf_counter()
        loader = RemoteLoader(addresses, dataset=Mix(["a", "b"], **mix), output="numpy", stripe_batches=2, **kw)
        it = iter(loader)
        first = next(it)
        first_s = time.perf_counter() - t0
        got = [first] + [next(it) for _ in range(11)]
        it.close()
        grown = [_hwm_kb(p.pid) - k for p, k in zip(procs, peak0)]
        print(f"10^10 mix, striped over 2 servers: first batch {first_s:.2f} s, servers' VmHWM +{grown} kB")
        assert len(loader) == 10**10 // (64 * 4)
        # a bound, not the figure (bench/ measures it): planning 10^10 samples per sample would take
        # minutes; 2 s on a quiet 2-core VM, 4.2 s once with the machine's cores shared four ways
        assert first_s < 10.0, first_s
        assert max(grown) < 64 * 1024, grown
        local = DataLoader(Mix([Dataset(str(root / "a")), Dataset(str(root / "b"))], **mix), device="cpu",
                           output="numpy", **kw)
        want = local.iter_batches(12)
        assert [b["__key__"] for b in got] == [b["__key__"] for b in want]
        local.close()
        spec = pb.MixSpec(sources=[pb.MixSource(dataset="a", weight=0.7), pb.MixSource(dataset="b", weight=0.3)],
                          samples_per_epoch=10**10)
        with pytest.raises(grpc.RpcError) as err:
            _keys(addresses[0], pb.BatchRequest(mix=spec, batch_size=64, world_size=4, shuffle=True, max_batches=1))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "72 per sample" in err.value.details()
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:  # (a server stuck in a stream: listing the epoch's steps)
                p.kill()
                p.wait()
