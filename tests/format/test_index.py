"""Per-shard indexes: `ShardIndex` (`NAME.idx`), DALI's `NAME.dali.idx`, and key rules."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from gdsload.errors import FormatError
from gdsload.format.index import (
    DALI_INDEX_VERSION,
    INDEX_VERSION,
    ShardIndex,
    check_key,
    parse_dali_index,
    split_name,
)

SAMPLES = [
    ("a", [("jpg", 1536, 5000), ("cls", 7168, 1)]),
    ("dir/b", [("jpg", 8192, 4096), ("cls", 12800, 2), ("json", 13824, 17)]),
    ("ключ_ü", [("npy", 16384, 4224)]),
    ("d", [("cls", 21504, 0), ("jpg", 24576, 70000)]),
]


@pytest.fixture
def index() -> ShardIndex:
    return ShardIndex.build(SAMPLES)


def test_build_accessors(index: ShardIndex) -> None:
    assert index.num_samples == 4
    assert index.num_members == 8
    assert index.extensions == ("jpg", "cls", "json", "npy")
    assert index.keys() == [k for k, _ in SAMPLES]
    for i, (k, members) in enumerate(SAMPLES):
        assert index.key(i) == k
        assert index.members(i) == members
    assert index.sample_start.tolist() == [0, 2, 5, 6, 8]


def test_bytes_round_trip(index: ShardIndex) -> None:
    data = index.to_bytes()
    again = ShardIndex.from_bytes(data, name="x.idx")
    assert again.extensions == index.extensions
    assert again.keys() == index.keys()
    for i in range(index.num_samples):
        assert again.members(i) == index.members(i)
    for f in ("key_blob", "key_offsets", "sample_start", "member_ext", "member_offset", "member_size"):
        a, b = getattr(index, f), getattr(again, f)
        assert a.dtype == b.dtype, f
        np.testing.assert_array_equal(a, b)
    assert again.to_bytes() == data  # deterministic
    assert again.to_dali() == index.to_dali()


def test_load_from_path(tmp_path, index: ShardIndex) -> None:
    p = tmp_path / "s.idx"
    p.write_bytes(index.to_bytes())
    assert ShardIndex.load(p).keys() == index.keys()


def test_empty_index_round_trip() -> None:
    idx = ShardIndex.build([])
    again = ShardIndex.from_bytes(idx.to_bytes())
    assert again.num_samples == 0 and again.num_members == 0 and again.keys() == []
    assert again.to_dali() == f"{DALI_INDEX_VERSION} 0\n"


def test_million_member_index_loads() -> None:
    n = 500_000  # samples; two members each -> 1,000,000 members
    keys = np.char.mod("%07d", np.arange(n)).astype("S7")
    key_blob = np.frombuffer(keys.tobytes(), np.uint8)
    key_offsets = np.arange(n + 1, dtype=np.int64) * 7
    sample_start = np.arange(n + 1, dtype=np.int64) * 2
    member_ext = np.tile(np.array([0, 1], np.uint16), n)
    sizes = np.where(member_ext == 0, 5000, 1).astype(np.uint64)
    offsets = (np.arange(2 * n, dtype=np.uint64) * 12288) + np.uint64(4096)
    idx = ShardIndex(("jpg", "cls"), key_blob, key_offsets, sample_start, member_ext, offsets, sizes)
    data = idx.to_bytes()
    again = ShardIndex.from_bytes(data, name="big.idx")
    assert again.num_samples == n
    assert again.num_members == 1_000_000
    assert again.key(0) == "0000000"
    assert again.key(n - 1) == f"{n - 1:07d}"
    assert again.key(123_456) == "0123456"
    assert again.members(123_456) == [
        ("jpg", 4096 + 2 * 123_456 * 12288, 5000),
        ("cls", 4096 + (2 * 123_456 + 1) * 12288, 1),
    ]
    assert again.members(n - 1)[1] == ("cls", 4096 + (2 * n - 1) * 12288, 1)
    np.testing.assert_array_equal(again.member_offset, offsets)


def test_truncated_index(index: ShardIndex) -> None:
    data = index.to_bytes()
    for cut in (0, 10, len(data) // 2, len(data) - 1):
        with pytest.raises(FormatError, match="shard-000007.idx"):
            ShardIndex.from_bytes(data[:cut], name="shard-000007.idx")


def test_garbage_index() -> None:
    with pytest.raises(FormatError, match="bad.idx"):
        ShardIndex.from_bytes(b"this is not an npz file" * 10, name="bad.idx")


def test_corrupted_index_bytes(index: ShardIndex) -> None:
    data = bytearray(index.to_bytes())
    # flip a byte inside the stored key_blob array: the zip CRC no longer matches
    pos = bytes(data).find("ключ".encode())
    assert pos > 0
    data[pos] ^= 0xFF
    with pytest.raises(FormatError, match="flipped.idx"):
        ShardIndex.from_bytes(bytes(data), name="flipped.idx")


def _npz(meta: dict, index: ShardIndex, **override) -> bytes:
    arrays = {
        f: getattr(index, f)
        for f in ("key_blob", "key_offsets", "sample_start", "member_ext", "member_offset", "member_size")
    }
    arrays.update(override)
    buf = io.BytesIO()
    np.savez(buf, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)
    return buf.getvalue()


def test_wrong_version(index: ShardIndex) -> None:
    meta = {"format": "gdsload-index", "version": INDEX_VERSION + 1, "extensions": list(index.extensions)}
    with pytest.raises(FormatError, match=rf"v2\.idx.*version {INDEX_VERSION + 1}"):
        ShardIndex.from_bytes(_npz(meta, index), name="v2.idx")


def test_wrong_format_tag(index: ShardIndex) -> None:
    meta = {"format": "something-else", "version": INDEX_VERSION, "extensions": list(index.extensions)}
    with pytest.raises(FormatError, match="other.idx.*not a gdsload index"):
        ShardIndex.from_bytes(_npz(meta, index), name="other.idx")


def test_missing_array(index: ShardIndex) -> None:
    buf = io.BytesIO()
    meta = {"format": "gdsload-index", "version": INDEX_VERSION, "extensions": list(index.extensions)}
    np.savez(buf, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), key_blob=index.key_blob)
    with pytest.raises(FormatError, match="partial.idx"):
        ShardIndex.from_bytes(buf.getvalue(), name="partial.idx")


@pytest.mark.parametrize(
    "override",
    [
        {"sample_start": np.array([0, 2, 5, 6, 9], np.int64)},  # past the member arrays
        {"sample_start": np.array([0, 2, 2, 6, 8], np.int64)},  # an empty sample
        {"key_offsets": np.array([0, 1], np.int64)},  # wrong length
        {"member_ext": np.array([0, 1, 0, 1, 2, 9, 0, 1], np.uint16)},  # extension out of range
        {"member_size": np.zeros(3, np.uint64)},  # wrong length
    ],
)
def test_inconsistent_arrays(index: ShardIndex, override) -> None:
    meta = {"format": "gdsload-index", "version": INDEX_VERSION, "extensions": list(index.extensions)}
    with pytest.raises(FormatError, match="inc.idx.*inconsistent"):
        ShardIndex.from_bytes(_npz(meta, index, **override), name="inc.idx")


def test_index_with_pickled_object_refused(index: ShardIndex) -> None:
    meta = {"format": "gdsload-index", "version": INDEX_VERSION, "extensions": list(index.extensions)}
    data = _npz(meta, index, key_blob=np.array([b"a", None], dtype=object))
    with pytest.raises(FormatError, match="pickle.idx"):
        ShardIndex.from_bytes(data, name="pickle.idx")


# -- DALI's index ------------------------------------------------------------------------------
def test_dali_index_text(index: ShardIndex) -> None:
    text = index.to_dali()
    lines = text.splitlines()
    assert lines[0] == f"{DALI_INDEX_VERSION} 4"
    assert lines[1] == "jpg 1536 5000 a.jpg cls 7168 1 a.cls"
    parsed = parse_dali_index(text, name="x.dali.idx")
    assert len(parsed) == 4
    for (key, members), row in zip(SAMPLES, parsed):
        assert row == [(e, o, s, f"{key}.{e}") for e, o, s in members]


@pytest.mark.parametrize(
    "text, match",
    [
        ("", "not a v1.2"),
        ("v1.1 1\njpg 0 1 a.jpg\n", "not a v1.2"),
        ("v1.2 2\njpg 0 1 a.jpg\n", "header says 2"),
        ("v1.2 1\njpg 0 1\n", "malformed line"),
        ("v1.2 1\njpg 0 1 a.jpg cls 2\n", "malformed line"),
    ],
)
def test_dali_index_errors(text: str, match: str) -> None:
    with pytest.raises(FormatError, match=f"d.dali.idx.*{match}"):
        parse_dali_index(text, name="d.dali.idx")


# -- keys ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("key", ["a", "0001", "n01440764/n01440764_10026", "ключ", "a-b_c", "dir.v2/file"])
def test_check_key_accepts(key: str) -> None:
    assert check_key(key) == key


@pytest.mark.parametrize(
    "key, match",
    [
        ("", "empty"),
        ("a.b", "dot"),
        ("dir/a.jpg", "dot"),
        ("..", "dot"),
        ("a b", "whitespace"),
        ("a\tb", "whitespace"),
        ("a\nb", "whitespace"),
        ("a\x00b", "control"),
        ("a\u3000b", "whitespace"),
        ("/abs/key", "absolute"),
        ("a/../b", "'..'"),
        ("a/./b", "'.'"),
        ("a//b", "empty"),
        ("a/", "empty"),
    ],
)
def test_check_key_rejects(key: str, match: str) -> None:
    with pytest.raises(FormatError, match=match):
        check_key(key)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("a.jpg", ("a", "jpg")),
        ("a.seg.png", ("a", "seg.png")),
        ("d.v2/k.cls", ("d.v2/k", "cls")),
        ("noext", ("noext", "")),
    ],
)
def test_split_name(name: str, expected: tuple[str, str]) -> None:
    assert split_name(name) == expected
