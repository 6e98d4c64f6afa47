"""A TokenLoader over a token dataset on a real feed server (loopback, port 0): the server's
documents view (`NAME#documents`), streamed as stored, packed on the client with the local code:
the same rows as the local TokenLoader, states interchangeable, exact resume."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

pytest.importorskip("grpc")
pytest.importorskip("grpc_health")
pytest.importorskip("prometheus_client")

import gdsload  # noqa: E402
from gdsload.errors import PassStopped  # noqa: E402

SEQ, B = 256, 4


@pytest.fixture(scope="module")
def served(corpus, tmp_path_factory):
    from gdsload.service.server import create_server

    root = tmp_path_factory.mktemp("tokfeed")
    shutil.copytree(corpus.tokens, root / "corpus")
    shutil.copytree(corpus.text, root / "text")
    srv, port = create_server([str(root)])
    srv.start()
    yield f"127.0.0.1:{port}", root / "corpus", srv
    srv.shutdown(grace_s=2)


def make(data, **kw):
    kw = {"shuffle": True, "seed": 5, "eos_token": "<eos>", "output": "numpy", "pack": "best_fit", **kw}
    return gdsload.TokenLoader(data, SEQ, B, **kw)


def ids(loader, n=None):
    out = []
    for b in loader:
        out.append(b["input_ids"])
        if n is not None and len(out) == n:
            break
    return out


@pytest.mark.parametrize("pack", ["concat", "best_fit"])
def test_remote_rows_equal_the_local_loader_and_resume_exactly(served, pack):
    address, path, srv = served
    stored = srv.metrics.registry.get_sample_value("gdsload_feed_stored_streams_total") or 0.0
    local = ids(make(str(path), pack=pack))
    remote = make(gdsload.ServedTokens(address, "corpus", documents_per_request=64), pack=pack)
    assert len(remote) == len(make(str(path), pack=pack))
    got = ids(remote)
    assert len(got) == len(local) and all(np.array_equal(a, b) for a, b in zip(got, local))
    # the documents went as stored (sendfile over the bulk connection, CRC32s checked here)
    assert (srv.metrics.registry.get_sample_value("gdsload_feed_stored_streams_total") or 0.0) > stored
    # a state saved by the local loader mid-epoch (best_fit: with a carry) resumes the remote one on
    # 2 ranks, and the remote state resumes the local loader
    lo = make(str(path), pack=pack)
    it = iter(lo)
    for _ in range(9):
        next(it)
    state = json.loads(json.dumps(lo.state_dict()))
    assert pack == "concat" or state["carry"]
    halves = [gdsload.TokenLoader(gdsload.ServedTokens(address, "corpus", documents_per_request=64), SEQ, B // 2,
                                  shuffle=True, seed=5, eos_token="<eos>", output="numpy", pack=pack, rank=r,
                                  world_size=2) for r in range(2)]
    for h in halves:
        h.load_state_dict(state)
    its = [iter(h) for h in halves]
    for k in range(4):
        a, b = (next(i)["input_ids"] for i in its)
        assert np.array_equal(np.stack([a[0], b[0], a[1], b[1]]), local[9 + k]), k
    back = make(str(path), pack=pack)
    back.load_state_dict(halves[0].state_dict())
    assert np.array_equal(next(iter(back))["input_ids"], local[13])


def test_remote_live_pass_rules_and_refusals(served):
    address = served[0]
    src = gdsload.ServedTokens(address, "corpus", documents_per_request=32)
    ld = make(src)
    it = iter(ld)
    first = [next(it)["input_ids"] for _ in range(3)]
    ld.load_state_dict(make(src).state_dict())  # back to the start, while the pass is live
    with pytest.raises(PassStopped):
        next(it)
    assert all(np.array_equal(a, b) for a, b in zip(ids(ld, 3), first))
    from gdsload.errors import ConfigError, GdsloadError

    with pytest.raises(GdsloadError, match="text#documents: .* is not a token dataset"):
        gdsload.ServedTokens(address, "text")
    with pytest.raises(GdsloadError, match="unknown dataset"):
        gdsload.ServedTokens(address, "nothing")
    with pytest.raises(ConfigError, match="set by the TokenLoader"):
        gdsload.ServedTokens(address, "corpus", batch_size=3)
    with pytest.raises(ConfigError, match="Mix of served"):
        gdsload.TokenLoader(gdsload.Mix([src, src], names=["a", "b"]), SEQ, B, output="numpy")
