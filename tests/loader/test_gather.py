"""Batch-at-a-time reads (`gdsload.loader.gather`): every batch is planned with array operations over
the shard indexes, never member by member, also where `.npy` headers are read (`verify="full"`)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from npykit import npy_bytes

from gdsload.errors import CorruptDataError, FormatError
from gdsload.format.index import ShardIndex
from gdsload.convert.shards import DatasetWriter
from gdsload.io import base as io_base
from gdsload.loader.dataloader import DataLoader, Dataset


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """3 shards (at least); per sample a (4, 1024) float32 .npy (16 KiB: aligned), a label and bytes of
    varied length."""
    root = tmp_path_factory.mktemp("br") / "ds"
    rng = np.random.default_rng(5)
    src = {}
    with DatasetWriter(root, shard_size=1_000_000) as w:
        for i in range(90):
            x = rng.standard_normal((4, 1024)).astype(np.float32)
            blob = rng.integers(0, 256, int(rng.integers(1, 9000)), dtype=np.uint8).tobytes()
            w.write(f"k{i:03d}", {"npy": npy_bytes(x), "cls": str(i % 7).encode(), "bin": blob})
            src[f"k{i:03d}"] = (x, i % 7, blob)
    assert len(Dataset(str(root)).shards.shards) >= 3
    return root, src


def _epoch(root, **kw):
    dl = DataLoader(root if isinstance(root, Dataset) else str(root), batch_size=16, shuffle=True, seed=3, device="cpu", output="numpy",
                    decode=False, copy=True, **kw)
    out = [b for b in dl]
    dl.close()
    return out


def test_planned_batches_equal_the_source_also_with_headers_read(mixed):
    root, src = mixed
    planned = _epoch(root)
    for b in planned:
        for k, key in enumerate(b["__key__"]):
            x, label, blob = src[key]
            np.testing.assert_array_equal(b["npy"][k], x)
            assert b["cls"][k] == label and b["bin"][k] == blob
    assert sum(len(b["__key__"]) for b in planned) == 90
    full = _epoch(Dataset(str(root), verify="full"))  # .npy headers staged, checked, CRC32s of the rows
    assert [b["__key__"] for b in planned] == [b["__key__"] for b in full]
    for a, b in zip(planned, full):
        np.testing.assert_array_equal(a["npy"], b["npy"])
        np.testing.assert_array_equal(a["cls"], b["cls"])
        assert a["bin"] == b["bin"]


def test_no_per_member_python_objects(mixed, monkeypatch):
    """The member path builds an `Extent` per member and asks the index per sample; the planned
    path does neither (its Python work per batch is per shard touched and per read)."""
    root, _ = mixed
    calls = {"Extent": 0, "members": 0, "key": 0}
    real_post_init = io_base.Extent.__post_init__

    def count(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapped

    dl = DataLoader(str(root), batch_size=90, device="cpu", output="numpy", decode=False)
    dl._setup()  # probing the first .npy header is set-up, not the hot path
    monkeypatch.setattr(io_base.Extent, "__post_init__", count("Extent", real_post_init))
    monkeypatch.setattr(ShardIndex, "members", count("members", ShardIndex.members))
    monkeypatch.setattr(ShardIndex, "key", count("key", ShardIndex.key))
    (batch,) = list(dl)
    dl.close()
    assert len(batch["__key__"]) == 90
    assert calls == {"Extent": 0, "members": 0, "key": 0}


def test_changed_member_is_caught_naming_shard_and_key(mixed, tmp_path):
    root, src = mixed
    import shutil

    copy = tmp_path / "ds"
    shutil.copytree(root, copy)
    ds = Dataset(str(copy)).shards
    idx = ds.index(1)
    j = 3
    row = int(idx.sample_start[j]) + idx.extensions.index("bin")
    off = int(idx.member_offset[row])
    with open(ds.shard_path(1), "r+b") as f:
        f.seek(off)
        first = f.read(1)
        f.seek(off)
        f.write(bytes([first[0] ^ 0xFF]))
    key = idx.key(j)
    with pytest.raises(CorruptDataError, match=rf"{ds.shards[1]['name']}:{key}: field 'bin' differs"):
        _epoch(copy)
    assert len(_epoch(copy, fields=["__key__", "npy"])) == 6  # the .npy rows are not CRC-checked by "fast"
    assert zlib.crc32(src[key][2]) == int(idx.member_crc[row])


def test_small_npy_payloads_are_planned_and_checked_by_full(tmp_path):
    """`.npy` payloads under 4 KiB (headers of varying length, read while planning) go the one
    planned path too: equal to the source, and under verify="full" a changed byte of one is a
    CorruptDataError naming it ("fast" does not check tensor payloads)."""
    root = tmp_path / "ds"
    rng = np.random.default_rng(2)
    src = {}
    with DatasetWriter(root, shard_size=1_000_000) as w:
        for i in range(20):
            x = rng.integers(0, 1000, (4,), dtype=np.int32)
            w.write(f"k{i:02d}", {"npy": npy_bytes(x), "cls": b"%d" % (i % 3)})
            src[f"k{i:02d}"] = x
    for verify in ("fast", "full"):
        got = {k: row for b in _epoch(Dataset(str(root), verify=verify)) for k, row in zip(b["__key__"], b["npy"])}
        assert sorted(got) == sorted(src)
        for key, x in src.items():
            np.testing.assert_array_equal(got[key], x)
    ds = Dataset(str(root)).shards
    idx, j = ds.index(0), 5
    row = int(idx.sample_start[j]) + idx.extensions.index("npy")
    off, n = int(idx.member_offset[row]), int(idx.member_size[row])
    assert n < 4096
    with open(ds.shard_path(0), "r+b") as f:
        f.seek(off + n - 1)
        last = f.read(1)
        f.seek(off + n - 1)
        f.write(bytes([last[0] ^ 1]))
    assert sum(len(b["__key__"]) for b in _epoch(root)) == 20
    with pytest.raises(CorruptDataError, match=rf"{ds.shards[0]['name']}:{idx.key(j)}: field 'npy' differs"):
        _epoch(Dataset(str(root), verify="full"))


def test_packed_members_are_checked_in_one_crc32_call(mixed, monkeypatch):
    """A loader that decodes nothing packs a batch's staged members back to back in a buffer of the
    batch's own and checks them with one `crc32` call (the members' CRCs combined): one call per
    member gave the GIL up and back once per member, which convoyed with the other readers. A
    changed byte still fails the run and is then named member by member."""
    import gdsload.dataset.verify as br
    import gdsload.format.crc as crcmod
    from gdsload.loader.gather import STAGE_ALIGN

    if crcmod.crc32_combine is None:
        pytest.skip("no isal: CRC32s are checked member by member")
    root, src = mixed
    dl = DataLoader(str(root), batch_size=16, device="cpu", output="numpy", decode=False, fields=["__key__", "bin"])
    dl._setup()
    assert dl._layout.own_staging
    planner = dl._layout.planner
    ids = np.arange(16)
    reads = planner.plan(ids, packed=True)
    pos, nb = reads.staged["bin"][:2]
    assert (pos[1:] == pos[:-1] + nb[:-1]).all()  # back to back
    staging = np.zeros(int(pos[-1] + nb[-1]), np.uint8)
    for i, key in enumerate(reads.keys):
        staging[pos[i] : pos[i] + nb[i]] = np.frombuffer(src[key][2], np.uint8)
    calls = []
    monkeypatch.setattr(crcmod, "crc32", lambda data, value=0: calls.append(len(data)) or zlib.crc32(data, value))
    br.check_crcs(reads, staging)
    assert len(calls) == 1 and calls[0] == staging.size
    staging[pos[5] + nb[5] // 2] ^= 0xFF
    with pytest.raises(CorruptDataError, match=rf":{reads.keys[5]}: field 'bin' differs .* \(1 such members"):
        br.check_crcs(reads, staging)
    aligned = planner.plan(ids)
    assert (aligned.staged["bin"][0] % STAGE_ALIGN == 0).all()
    dl.close()


def test_staging_buffers_are_reused_only_when_nothing_points_into_them(mixed):
    """The packed members of a batch that decodes nothing live in a pooled buffer the batch's
    BytesColumn owns. A column, or any view of its bytes, kept past the next batches keeps its
    buffer out of the pool (never overwritten); a dropped batch's buffer is taken again."""
    import gc

    from gdsload.ring.staging import StagingPool

    pool = StagingPool(keep=2)
    a = pool.take(1000)
    a[:] = 7
    view = a[10:20]
    addr = a.ctypes.data
    del a
    gc.collect()
    b = pool.take(1000)  # the first buffer is still seen by `view`: a new one
    assert b.ctypes.data != addr and (view == 7).all()
    b[:] = 9
    del view
    gc.collect()
    c = pool.take(900)  # now free again: reused
    assert c.ctypes.data == addr and len(c) == 900
    del b, c
    for _ in range(5):
        pool.take(10)
    assert len(pool._free) <= 2
    # free buffers of different sizes: the smallest one that fits is taken, the others stay
    big, small = pool.take(9 << 20), pool.take(5 << 20)
    big_at, small_at = big.ctypes.data, small.ctypes.data
    del big, small
    gc.collect()
    little = pool.take(1 << 20)  # both fit: the smaller (second in the free list)
    assert little.ctypes.data == small_at
    mid = pool.take(7 << 20)
    assert mid.ctypes.data == big_at

    root, src = mixed
    dl = DataLoader(str(root), batch_size=16, device="cpu", output="numpy", decode=False, shuffle=False)
    kept = []
    for batch in dl:  # keep every column: none of them may be overwritten by a later batch
        kept.append((list(batch["__key__"]), batch["bin"], batch["bin"].view(0)))
    dl.close()
    assert len(kept) > 3
    for keys, col, first in kept:
        assert col == [src[k][2] for k in keys]
        assert first.tobytes() == src[keys[0]][2]


def test_missing_field_names_sample(tmp_path):
    root = tmp_path / "ds"
    with DatasetWriter(root) as w:
        w.write("a", {"bin": b"x" * 10, "cls": b"1"})
        w.write("b", {"cls": b"2"})
    with pytest.raises(FormatError, match=r"sample 'b' in .* has no field 'bin'"):
        _epoch(root)


def _strip_manifest(root, tmp_path):
    """A copy of `root` whose manifest is as gdsload wrote it before shard entries had
    `max_nbytes`, `min_nbytes`, `member_crc` and `npy_c_order`."""
    import json
    import shutil

    old = tmp_path / "old"
    shutil.copytree(root, old)
    m = json.loads((old / "manifest.json").read_text())
    for e in m["shards"]:
        for k in ("max_nbytes", "min_nbytes", "member_crc", "npy_c_order"):
            del e[k]
    (old / "manifest.json").write_text(json.dumps(m))
    return old


def test_start_up_loads_only_the_indexes_it_reads(mixed, tmp_path, monkeypatch):
    """Buffers are sized from the manifest's per-field maxima: the first batch loads the index
    of the shard it reads (and the first one, for the .npy header probe), not all of them; an
    older manifest still loads (its indexes are read for the sizes) with the same layout."""
    root, _ = mixed
    loaded = []
    real = ShardIndex.from_bytes.__func__

    def counting(cls, data, *, name="<index>"):
        loaded.append(name)
        return real(cls, data, name=name)

    monkeypatch.setattr(ShardIndex, "from_bytes", classmethod(counting))
    n_shards = len(Dataset(str(root)).shards.shards)
    dl = DataLoader(str(root), batch_size=4, device="cpu", output="numpy", decode=False)
    first = next(iter(dl))
    assert len(set(loaded)) == 1 and first["__key__"] == ["k000", "k001", "k002", "k003"]
    staging = dl._resources.ring.spec.fields["__staging__"]
    dl.close()
    loaded.clear()
    old = _strip_manifest(root, tmp_path)
    dl = DataLoader(str(old), batch_size=4, device="cpu", output="numpy", decode=False)
    again = next(iter(dl))
    assert len(set(loaded)) == n_shards  # the old way: every index, for the sizes
    assert dl._resources.ring.spec.fields["__staging__"] == staging
    assert again["bin"] == first["bin"]
    dl.close()


def test_manifest_max_nbytes_is_checked(mixed, tmp_path):
    import json
    import shutil

    from gdsload.errors import FormatError

    root, _ = mixed
    bad = tmp_path / "bad"
    shutil.copytree(root, bad)
    m = json.loads((bad / "manifest.json").read_text())
    m["shards"][0]["max_nbytes"]["bin"] = 2**40
    (bad / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(FormatError, match="'max_nbytes' must map fields to byte counts within"):
        Dataset(str(bad))


def test_bytes_column_behaves_as_a_sequence_of_bytes():
    import pickle

    from gdsload.frontend.fields import BytesColumn

    members = [b"abc", b"", b"defgh", b"i"]
    data = np.frombuffer(b"..abc...defgh.i.", np.uint8)
    col = BytesColumn(data, np.array([2, 5, 8, 14]), np.array([3, 0, 5, 1]))
    assert len(col) == 4 and col.nbytes == 9 and col == members and members == col
    assert col[2] == b"defgh" and col[-1] == b"i" and list(col) == members
    assert col[1:3] == [b"", b"defgh"] and col.take([3, 0]) == [b"i", b"abc"]
    assert col.view(2).tobytes() == b"defgh" and col.view(2).base is not None  # no copy
    packed = col.copy()
    assert packed == members and packed.data.tobytes() == b"abcdefghi"
    assert pickle.loads(pickle.dumps(col)) == members
    assert col != [b"abc"] and col != members[::-1]


def test_distinct_lists_each_shard_of_a_batch_once_in_order():
    from gdsload.loader.gather import distinct

    assert distinct(np.array([3, 0, 3, 7, 0], np.int64)) == [0, 3, 7]
    assert distinct(np.zeros(0, np.int64)) == []
