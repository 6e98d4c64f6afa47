"""TokenLoader's GPU path (`gdsload.frontend.tokens_gpu`) on the CPU, against the fakes of
tests/gpu_fakes.py: KvikIO reads into a device ring slot, the batch assembled with CuPy, handed out
with the image ring's streams, fences and kept-batch rule. The fake CuPy has no `arange` or
`searchsorted`; `_kernels` adds them as the fake's arithmetic is (eager NumPy on device arrays)."""

from __future__ import annotations

import itertools
import sys

import numpy as np
import pytest

import gdsload
import gpu_fakes
from gdsload.frontend import tokendocs

FIELDS = ("input_ids", "labels", "position_ids", "attention_mask", "cu_seqlens")


def _kernels(monkeypatch, gpu) -> None:
    cupy = sys.modules["cupy"]

    def on_device(a):
        out = np.asarray(a).view(gpu_fakes.FakeArray)
        out._device_id = gpu.current()
        gpu.keepalive.append(out)
        gpu.allocations.append((out.__array_interface__["data"][0], out.nbytes, out._device_id))
        return out

    monkeypatch.setattr(cupy, "arange", lambda *a, dtype=None: on_device(np.arange(*a, dtype=dtype)), raising=False)
    monkeypatch.setattr(cupy, "searchsorted", lambda a, v, side="left": on_device(
        np.searchsorted(np.asarray(a), np.asarray(v), side=side)), raising=False)


def _install(monkeypatch, **kw):
    gpu = gpu_fakes.install(monkeypatch, **kw)
    _kernels(monkeypatch, gpu)
    return gpu


def _host(corpus, steps, **kw):
    ld = gdsload.TokenLoader(str(corpus.tokens), output="numpy", eos_token="<eos>", **kw)
    return [dict(b) for b in itertools.islice(ld, steps)]


def _no_host_reads(monkeypatch):
    def refuse(self, ids):
        raise AssertionError("the GPU path read token bytes on the host")

    monkeypatch.setattr(tokendocs.Documents, "read", refuse)


def _equal(got, want):
    for f in FIELDS:
        np.testing.assert_array_equal(got[f], want[f], err_msg=f)
        assert got[f].dtype == want[f].dtype, f


@pytest.mark.parametrize("pack,prefetch,config_file,shuffle", [
    ("concat", 2, False, False), ("best_fit", 0, True, True), ("concat", 1, True, True)])
def test_device_batches_equal_host_batches_read_by_kvikio_into_device_memory(
        monkeypatch, corpus, pack, prefetch, config_file, shuffle):
    """Batches equal the host path's exactly; the token bytes go from KvikIO into device memory on the
    loader's GPU (cuda:1 while the caller's current device is 0: every fresh thread binds it, or the
    fake's reads fail without a context / with the peer-access error), never through the host."""
    kw = dict(seq_len=96, batch_size=3, pack=pack, shuffle=shuffle, seed=3, prefetch=prefetch)
    want = _host(corpus, 7, **kw)
    gpu = _install(monkeypatch, devices=2, kvikio=dict(config_file=config_file))
    _no_host_reads(monkeypatch)
    ld = gdsload.TokenLoader(str(corpus.tokens), output="numpy", device="cuda:1", eos_token="<eos>", **kw)
    assert ld._gpu is not None
    got = []
    for b in itertools.islice(ld, 7):
        assert all(b[f]._device_id == 1 for f in FIELDS)
        got.append({f: b[f].get() for f in FIELDS})
    for g, w in zip(got, want, strict=True):
        _equal(g, w)
    reads = gpu.log_calls("kvikio_read_async") if config_file else [
        e for e in gpu.log_calls("kvikio_pread")]
    assert reads and not gpu.log_calls("kvikio_pread" if config_file else "kvikio_read_async")
    if config_file:
        assert all(e[4] == 1 for e in reads)  # into device 1's memory
    else:
        assert all(e[3] == 1 and e[5] for e in reads)  # on_device, device 1
    read_bytes = sum(e[2] for e in reads)
    staged = [e[1] for e in gpu.log_calls("h2d_staged")]  # only the piece tables (6 int64 rows)
    assert staged and all(n % 48 == 0 for n in staged) and sum(staged) < read_bytes
    assert ld.state_dict()["step"] == 7


def test_torch_output_comes_by_dlpack_on_the_consumer_stream(monkeypatch, corpus):
    import torch

    kw = dict(seq_len=64, batch_size=2, prefetch=1)
    want = _host(corpus, 4, **kw)
    gpu = _install(monkeypatch, devices=1, torch_cuda=True)
    ld = gdsload.TokenLoader(str(corpus.tokens), output="torch", device="cuda", eos_token="<eos>", **kw)
    got = []
    for b in itertools.islice(ld, 4):
        assert isinstance(b["input_ids"], torch.Tensor) and b["input_ids"].is_cuda
        torch.cuda.current_stream().synchronize()  # the consumer's stream waited for the batch
        got.append({f: b[f].numpy().copy() for f in FIELDS})
    for g, w in zip(got, want, strict=True):
        _equal(g, w)
    assert gpu.log_calls("torch_to_cuda") == []  # no host batch copied up
    waits = {e[1] for e in gpu.log_calls("wait_event")}
    assert 0 in waits  # torch's current (legacy) stream waited for the batch's ready event


def test_a_kept_batch_is_not_overwritten(monkeypatch, corpus):
    """Batches kept by the caller (not copied) still hold their values after the ring went round
    several times: their slots got other memory."""
    kw = dict(seq_len=64, batch_size=2, prefetch=1)
    want = _host(corpus, 10, **kw)
    gpu = _install(monkeypatch, devices=1)
    ld = gdsload.TokenLoader(str(corpus.tokens), output="numpy", device="cuda", eos_token="<eos>", **kw)
    kept = [b for b in itertools.islice(ld, 10)]  # 10 batches through a ring of 3 slots
    gpu.synchronize_all()
    for g, w in zip(kept, want, strict=True):
        _equal({f: g[f].get() for f in FIELDS}, w)
    assert ld._gpu.ring.stats()["replaced"] > 0


def test_a_new_pass_and_a_resume_on_the_device_path(monkeypatch, corpus):
    """iter() again continues from the state (the ring reset, the producer woken and joined);
    a state loaded mid-epoch resumes with the host path's batches."""
    kw = dict(seq_len=80, batch_size=2, prefetch=2, shuffle=True)
    want = _host(corpus, 6, **kw)
    _install(monkeypatch, devices=1)
    ld = gdsload.TokenLoader(str(corpus.tokens), output="numpy", device="cuda", eos_token="<eos>", **kw)
    got = [{f: b[f].get() for f in FIELDS} for b in itertools.islice(iter(ld), 2)]
    got += [{f: b[f].get() for f in FIELDS} for b in itertools.islice(iter(ld), 2)]
    st = ld.state_dict()
    other = gdsload.TokenLoader(str(corpus.tokens), output="numpy", device="cuda", eos_token="<eos>", **kw)
    other.load_state_dict(st)
    got += [{f: b[f].get() for f in FIELDS} for b in itertools.islice(iter(other), 2)]
    for g, w in zip(got, want, strict=True):
        _equal(g, w)


@pytest.mark.parametrize("why", ["no kvikio", "verify full"])
def test_without_kvikio_or_with_verify_full_the_host_path_is_kept(monkeypatch, corpus, why):
    kw = dict(seq_len=64, batch_size=2, prefetch=1)
    want = _host(corpus, 3, **kw)
    gpu = _install(monkeypatch, devices=1, kvikio=why != "no kvikio")
    data = gdsload.Dataset(str(corpus.tokens), verify="full") if why == "verify full" else str(corpus.tokens)
    ld = gdsload.TokenLoader(data, output="numpy", device="cuda", eos_token="<eos>", **kw)
    assert ld._gpu is None
    got = [{f: b[f].get() for f in FIELDS} for b in itertools.islice(ld, 3)]
    for g, w in zip(got, want, strict=True):
        _equal(g, w)
    assert not gpu.log_calls("kvikio_pread") and not gpu.log_calls("kvikio_read_async")


def test_a_slot_is_not_rewritten_under_a_consumer_kernel_on_a_side_stream(monkeypatch, corpus):
    """The consumer's kernels reading batch k are only queued when it asks for batch k+1: the
    release fence recorded on its stream is waited for before the slot is written again (without
    it, the queued kernel read a later batch's rows)."""
    import ctypes
    import time

    kw = dict(seq_len=64, batch_size=2, prefetch=1)
    want = _host(corpus, 8, **kw)
    gpu = _install(monkeypatch, devices=1)
    cupy = sys.modules["cupy"]
    ld = gdsload.TokenLoader(str(corpus.tokens), output="numpy", device="cuda", eos_token="<eos>", **kw)
    side = cupy.cuda.Stream(non_blocking=True)
    snaps: list[np.ndarray] = []

    def read(ptr, shape):  # what a kernel holds: an address, not the array (which would keep the batch)
        buf = (ctypes.c_char * (int(np.prod(shape)) * 8)).from_address(ptr)
        return np.frombuffer(buf, np.int64).reshape(shape).copy()

    with side:  # the consumer's current stream, as under `torch.cuda.stream(s)`
        for b in itertools.islice(ld, 8):
            x = b["input_ids"]
            at = (x.__cuda_array_interface__["data"][0], x.shape)
            del x, b
            side.enqueue(lambda at=at: snaps.append(read(*at)), "consumer kernel")
            time.sleep(0.02)  # the producer gets every chance to run ahead
        side.synchronize()
    assert len(snaps) == 8
    for g, w in zip(snaps, want, strict=True):
        np.testing.assert_array_equal(g, w["input_ids"])
    assert ld._gpu.ring.stats()["replaced"] == 0  # nothing kept: the same memory, fenced


def test_a_whole_epoch_with_its_padded_last_step_equals_the_host_path(monkeypatch, corpus):
    """Every step of an epoch, the padded last one included (rows, or parts of rows, of padding),
    then the end of the epoch and the next epoch's first step."""
    kw = dict(seq_len=4096, batch_size=8, pack="best_fit", shuffle=True, prefetch=2)
    host = gdsload.TokenLoader(str(corpus.tokens), output="numpy", eos_token="<eos>", **kw)
    want = [dict(b) for b in host]
    _install(monkeypatch, devices=1)
    ld = gdsload.TokenLoader(str(corpus.tokens), output="numpy", device="cuda", eos_token="<eos>", **kw)
    got = [{f: b[f].get() for f in FIELDS} for b in ld]
    assert len(got) == len(want) > 1
    assert (want[-1]["attention_mask"] == 0).any()  # the last step is padded
    for g, w in zip(got, want, strict=True):
        _equal(g, w)
    assert ld.epoch == 1
    _equal({f: v.get() for f, v in next(iter(ld)).items()}, next(iter(host)))


@pytest.fixture(scope="module")
def two_parts(corpus, tmp_path_factory):
    """Two token datasets of one tokenizer: short documents stored as uint16, long ones as uint32
    (`token_dtype` forced while converting it: a vocabulary over 65,536 would take minutes to train),
    so the device path assembles ids from 2- and 4-byte tokens in one batch."""
    import json

    from gdsload.convert.tokens import convert_corpus
    from gdsload.format import tokens as tf

    root = tmp_path_factory.mktemp("tokgpu_mix")
    out = []
    real = tf.token_dtype
    for name, keep, dtype in (("short", lambda d: len(d) < 1500, None), ("long", lambda d: len(d) >= 1500, "<u4")):
        src = root / f"{name}.jsonl"
        src.write_text("".join(json.dumps({"text": d}) + "\n" for d in corpus.docs[:300] if keep(d)))
        tf.token_dtype = (lambda v, dtype=dtype: np.dtype(dtype)) if dtype else real
        try:
            convert_corpus(str(src), str(root / name), tokenizer=str(corpus.tokenizer_json), workers=1,
                           shard_size=256 << 10, chunk_tokens=32 << 10)
        finally:
            tf.token_dtype = real
        out.append(str(root / name))
    return out


def test_a_mix_on_the_device_path_and_state_dict_while_the_producer_waits_for_a_slot(monkeypatch, two_parts):
    """A mix's batches (2- and 4-byte tokens) equal the host path's; `state_dict()` (which takes
    the loader's lock) after each batch, kept, while the prefetch thread waits for the slot
    released last (its batch still referenced: it waits for the consumer's next release): the
    thread waits outside that lock (before: it held it in `Ring.acquire`, and `state_dict()`
    never returned)."""
    import threading
    import time

    kw = dict(seq_len=128, batch_size=2, prefetch=1, shuffle=True, seed=5, eos_token="<eos>", output="numpy")
    host = gdsload.TokenLoader(gdsload.Mix(two_parts, weights=[1, 2]), **kw)
    want = [dict(b) for b in itertools.islice(host, 5)]
    _install(monkeypatch, devices=1)
    ld = gdsload.TokenLoader(gdsload.Mix(two_parts, weights=[1, 2]), device="cuda", **kw)
    assert ld._gpu is not None and [d.itemsize for d in ld.docs.dtypes] == [2, 4]
    got, states = [], []

    def consume():  # keeps every batch: the producer waits for the slot released last, not referenced
        for b in itertools.islice(ld, 5):
            got.append(b)
            time.sleep(0.1)  # the producer runs ahead until it waits for a slot
            states.append(ld.state_dict())

    t = threading.Thread(target=consume, daemon=True)
    t.start()
    t.join(timeout=30)
    assert not t.is_alive(), "state_dict() waited for the prefetch thread, which waited for a slot"
    assert [s["step"] for s in states] == [1, 2, 3, 4, 5]
    for g, w in zip(got, want, strict=True):
        _equal({f: g[f].get() for f in FIELDS}, w)


def test_prefetch_0_keeping_every_batch_does_not_wait_for_itself(monkeypatch, corpus):
    """prefetch=0 makes each step on the caller's thread: the slot it writes must not be the one
    the caller released last (the ring would wait for the caller to let that batch go, or to
    release another one: the same thread, waiting). Kept batches keep their values."""
    import threading

    kw = dict(seq_len=64, batch_size=2, prefetch=0)
    want = _host(corpus, 6, **kw)
    _install(monkeypatch, devices=1)
    ld = gdsload.TokenLoader(str(corpus.tokens), output="numpy", device="cuda", eos_token="<eos>", **kw)
    kept: list = []
    t = threading.Thread(target=lambda: kept.extend(itertools.islice(ld, 6)), daemon=True)
    t.start()
    t.join(timeout=30)
    assert not t.is_alive(), "the step waited for a batch the same thread keeps"
    for g, w in zip(kept, want, strict=True):
        _equal({f: g[f].get() for f in FIELDS}, w)


@pytest.mark.gds
def test_real_gpu_batches_equal_host_batches(corpus):
    """On a GPU host with KvikIO (skipped elsewhere; in bench/gpu_check.sh's part 1 selection,
    bench/gpu_plan.py SELECTION): real CuPy kernels and KvikIO reads into the device ring give the
    host path's batches, torch output on the GPU."""
    import torch

    kw = dict(seq_len=256, batch_size=4, pack="best_fit", shuffle=True, prefetch=2)
    want = _host(corpus, 5, **kw)
    ld = gdsload.TokenLoader(str(corpus.tokens), output="torch", device="cuda", eos_token="<eos>", **kw)
    assert ld._gpu is not None
    got = [{f: b[f].cpu().numpy() for f in FIELDS} for b in itertools.islice(ld, 5)]
    torch.cuda.synchronize()
    for g, w in zip(got, want, strict=True):
        _equal(g, w)
