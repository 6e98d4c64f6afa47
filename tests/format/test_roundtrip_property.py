"""Property: whatever samples go into `DatasetWriter`, `open_dataset` gives the same bytes back,
with every payload of 4 KiB or more 4096-aligned and `verify()` clean."""

from __future__ import annotations

import io
import tempfile
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gdsload.errors import DestinationError, FormatError
from gdsload.format import npy
from gdsload.dataset.sharded import open_dataset
from gdsload.format.tar import ALIGN
from gdsload.convert.shards import DatasetWriter

KEY_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-"
EXTS = ["jpg", "cls", "bin", "json", "npy"]
DTYPES = ["<f4", "<f8", "<f2", "<i8", "<u1", "<i2", ">i4", "?", "<c8"]


@st.composite
def npy_payloads(draw) -> bytes:
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    ndim = draw(st.integers(0, 3))
    # up to ~2600 elements: many arrays are >= 4096 bytes, many are below
    shape = tuple(draw(st.lists(st.integers(0, 14 if ndim > 1 else 2600), min_size=ndim, max_size=ndim)))
    seed = draw(st.integers(0, 2**32 - 1))
    raw = np.random.default_rng(seed).integers(0, 256, size=int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    arr = raw.view(dtype).reshape(shape) if raw.size else np.zeros(shape, dtype)
    if draw(st.booleans()) and ndim > 1:
        arr = np.asfortranarray(arr)
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


@st.composite
def fields(draw) -> dict[str, bytes]:
    exts = draw(st.lists(st.sampled_from(EXTS), min_size=1, max_size=4, unique=True))
    out = {}
    for ext in exts:
        if ext == "npy":
            out[ext] = draw(npy_payloads())
        elif ext == "cls":  # a label: a decimal integer (the writer refuses anything else)
            out[ext] = b"%d" % draw(st.integers(-(1 << 63), (1 << 63) - 1))
        else:
            size = draw(st.one_of(st.integers(0, 20000), st.sampled_from([0, 1, 511, 512, 4095, 4096, 4097])))
            out[ext] = draw(st.binary(min_size=size, max_size=size)) if size < 64 else np.random.default_rng(
                draw(st.integers(0, 2**32 - 1))
            ).bytes(size)
    return out


samples_strategy = st.lists(
    st.tuples(st.text(KEY_ALPHABET, min_size=1, max_size=24), fields()),
    min_size=1,
    max_size=12,
    unique_by=lambda kv: kv[0],
)


def _same_npy(got: bytes, want: bytes) -> None:
    a = np.load(io.BytesIO(want), allow_pickle=False)
    b = np.load(io.BytesIO(got), allow_pickle=False)
    assert a.dtype == b.dtype and a.shape == b.shape
    assert b.flags.c_contiguous  # stored in C order, whatever the input's order
    assert a.tobytes(order="C") == b.tobytes(order="C")  # bitwise: NaNs compare equal too


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(samples=samples_strategy, shard_size=st.integers(1, 120_000))
def test_write_read_round_trip(samples, shard_size) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        with DatasetWriter(tmp, shard_size=shard_size) as w:
            for key, f in samples:
                w.write(key, f)
        with open_dataset(tmp) as ds:
            assert len(ds) == len(samples)
            assert ds.keys() == [k for k, _ in samples]
            assert ds.verify() == {}
            assert sum(s["samples"] for s in ds.shards) == len(samples)
            labels = {k: int(f["cls"]) for k, f in samples if "cls" in f}
            assert sum(ds.class_histogram().values()) == len(labels)
            for s in range(len(ds.shards)):  # the label column holds the parsed .cls values
                idx = ds.index(s)
                for j, key in enumerate(idx.keys()):
                    if key in labels:
                        assert int(idx.labels["cls"][j]) == labels[key]
            big = sum(1 for _, f in samples for p in f.values() if len(p) >= ALIGN)
            al = ds.alignment()
            assert al["aligned"] == al["payloads_4k_or_more"]
            # realignment can only grow an npy payload past 4 KiB, never shrink one below it
            assert al["payloads_4k_or_more"] >= big

            event(f"{len(ds.shards)} shard(s)" if len(ds.shards) < 3 else "3+ shards")
            streamed = list(ds.iter_samples())
            for i, (key, f) in enumerate(samples):
                got = ds.sample(i)
                assert got == streamed[i]
                assert got["__key__"] == key
                assert set(got) - {"__key__", "__shard__"} == set(f)
                s, j = ds.locate(i)
                members = {e: (o, n) for e, o, n in ds.index(s).members(j)}
                assert list(members) == list(f)  # tar order is field order
                crcs = dict(zip(members, ds.index(s).crcs(j)))  # the CRC32 of each stored payload
                assert crcs == {e: zlib.crc32(got[e]) for e in members}
                for ext, want in f.items():
                    off, n = members[ext]
                    assert n == len(got[ext])
                    if n >= ALIGN:
                        assert off % ALIGN == 0, (key, ext, off)
                    if ext == "npy":
                        _same_npy(got[ext], want)
                        if len(want) >= ALIGN:
                            data_off = npy.parse_header(got[ext])[3]
                            assert data_off == ALIGN
                            assert (off + data_off) % ALIGN == 0  # array data aligned in the file
                            event("npy payload >= 4 KiB")
                        elif not npy.parse_header(want)[2]:
                            assert got[ext] == want  # small C-ordered npy payloads are stored as given
                    else:
                        assert got[ext] == want


# -- writer input checks (plain examples next to the property) -----------------------------------
def test_writer_refuses_bad_input(tmp_path) -> None:
    with DatasetWriter(tmp_path / "ds") as w:
        w.write("ok", {"bin": b"1"})
        for key in ("a.b", "a b", "", "/abs", "x/../y"):
            with pytest.raises(FormatError):
                w.write(key, {"bin": b"1"})
        with pytest.raises(FormatError, match="duplicate"):
            w.write("ok", {"bin": b"2"})
        with pytest.raises(FormatError, match="no fields"):
            w.write("empty", {})
        for ext in ("", " jpg", "a/b", "j pg", "jpg\n"):
            with pytest.raises(FormatError, match="field name"):
                w.write("badext", {ext: b"1"})
        with pytest.raises(FormatError):  # >= 4 KiB and not an npy file
            w.write("badnpy", {"npy": b"\0" * 5000})
        w.write("ok2", {"bin": b"2"})
    with open_dataset(tmp_path / "ds") as ds:
        assert ds.keys() == ["ok", "ok2"]
        assert ds.verify() == {}
    with pytest.raises(DestinationError):
        DatasetWriter(tmp_path / "ds")


def test_writer_exception_leaves_no_dataset(tmp_path) -> None:
    with pytest.raises(RuntimeError):
        with DatasetWriter(tmp_path / "ds", shard_size=1) as w:
            w.write("a", {"bin": b"1" * 5000})
            w.write("b", {"bin": b"2"})
            raise RuntimeError("boom")
    names = sorted(p.name for p in (tmp_path / "ds").iterdir())
    assert "manifest.json" not in names
    assert not [n for n in names if ".tmp-" in n]


def test_writer_refuses_control_characters_in_field_names(tmp_path) -> None:
    with DatasetWriter(tmp_path / "ds") as w, pytest.raises(FormatError):
        w.write("k", {"a\x00b": b"1"})


def test_writer_refuses_duplicate_keys_across_shards(tmp_path) -> None:
    with DatasetWriter(tmp_path / "ds", shard_size=1) as w:
        w.write("k", {"bin": b"1"})
        with pytest.raises(FormatError, match="duplicate"):
            w.write("k", {"bin": b"2"})


def test_writer_to_an_fsspec_url_matches_a_local_folder(tmp_path) -> None:
    """The same samples written to memory:// and to a local folder give the same files, and an
    aborted shard leaves nothing under its name at the URL."""
    import uuid

    import fsspec

    fs = fsspec.filesystem("memory")
    url = f"memory://gdsload-writer-{uuid.uuid4().hex}"
    rng = np.random.default_rng(3)
    samples = []
    for i in range(20):
        buf = io.BytesIO()
        np.save(buf, rng.standard_normal((i + 1, 300)))
        samples.append((f"k{i:03d}", {"npy": buf.getvalue(), "cls": b"%d" % (i % 3)}))
    try:
        for root in (tmp_path / "ds", url):
            with DatasetWriter(root, shard_size=40_000) as w:
                for key, fields in samples:
                    w.write(key, fields)
        local = {p.name: p.read_bytes() for p in (tmp_path / "ds").iterdir()}
        remote = {p.rsplit("/", 1)[-1]: fs.cat_file(p) for p in fs.find(url)}
        assert sorted(remote) == sorted(local) and len([n for n in local if n.endswith(".tar")]) > 1
        for name in local:
            if name != "manifest.json":
                assert remote[name] == local[name], name
        assert open_dataset(url).verify() == {}

        with pytest.raises(RuntimeError), DatasetWriter(f"{url}-aborted") as w:
            w.write("a", {"bin": b"x" * 5000})
            raise RuntimeError("stop")
        assert fs.find(f"{url}-aborted") == []
    finally:
        for p in (url, f"{url}-aborted"):
            if fs.exists(p):
                fs.rm(p, recursive=True)
