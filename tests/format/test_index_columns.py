"""What conversion now stores in `NAME.idx` besides extents, and what opening an index checks.

- labels: `.cls` payloads are validated (`gdsload.format.labels`) and stored as an int64 column;
- CRC32 of every member payload;
- `.npy` payloads in C order (Fortran-ordered inputs rewritten, and counted in the manifest);
- member extents checked against the shard's size when the index is opened (a damaged entry is a
  `FormatError` naming the file, not an allocation of its size);
- indexes written before any of this still load.
"""

from __future__ import annotations

import dataclasses
import io
import json
import tarfile
import zlib
from pathlib import Path

import numpy as np
import pytest
from npykit import npy_bytes

from gdsload.convert.engine import ConvertOptions, convert
from gdsload.errors import FormatError
from gdsload.format import npy
from gdsload.format.index import ShardIndex
from gdsload.format.labels import parse_label
from gdsload.dataset.sharded import open_dataset
from gdsload.convert.shards import DatasetWriter


def rewrite_index(path: Path, **changes) -> None:
    """Replace fields of the stored index (e.g. drop the new columns to make an 'old' index)."""
    idx = ShardIndex.load(path)
    path.write_bytes(dataclasses.replace(idx, **changes).to_bytes())


def as_old_index(path: Path) -> None:
    """The index as a gdsload before the label/CRC/C-order columns wrote it."""
    rewrite_index(path, member_crc=None, labels={}, npy_c_order=False)


# -- labels ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("data, value", [(b"7", 7), (b"-1", -1), (b" 12\n", 12), (b"+3", 3), (b"007", 7),
                                         (b"9223372036854775807", 2**63 - 1)])
def test_parse_label_accepts_decimal_integers(data: bytes, value: int) -> None:
    assert parse_label(data) == value


@pytest.mark.parametrize("data, match", [
    (b"", "empty"), (b" \n", "empty"), (b"cat", "not a decimal integer"), (b"1.5", "not a decimal"),
    (b"1_000", "not a decimal"), ("٣".encode(), "not a decimal"), (b"0x10", "not a decimal"),
    (b"1 2", "not a decimal"), (b"9223372036854775808", "int64"), (b"1" * 100, "not a decimal"),
])
def test_parse_label_refuses_what_is_not_a_label(data: bytes, match: str) -> None:
    with pytest.raises(FormatError, match=match):
        parse_label(data)


def test_writer_stores_labels_as_an_index_column_and_refuses_bad_ones(tmp_path) -> None:
    with DatasetWriter(tmp_path / "ds", shard_size=1 << 20) as w:
        w.write("a", {"bin": b"x", "cls": b"3"})
        w.write("b", {"bin": b"y", "cls": b"-1\n"})
        w.write("c", {"bin": b"z"})  # no label field: 0 in the column, absent in the members
        for bad, why in ((b"", "empty"), (b"dog", "not a decimal integer")):
            with pytest.raises(FormatError, match=rf"sample 'bad'.*field 'cls'.*{why}"):
                w.write("bad", {"bin": b"q", "cls": bad})
    with open_dataset(tmp_path / "ds") as ds:
        assert ds.keys() == ["a", "b", "c"]  # the refused sample left nothing behind
        assert ds.verify() == {}
        idx = ds.index(0)
        assert idx.labels["cls"].dtype == np.int64
        assert idx.labels["cls"].tolist() == [3, -1, 0]
        assert ds.class_histogram() == {3: 1, -1: 1}


@pytest.mark.parametrize("source", ["files", "tar"])
def test_convert_rejects_bad_labels_with_the_reason(tmp_path, source: str) -> None:
    """An empty or non-numeric `.cls` is a reject in rejected.jsonl, not a label of -1 or a crash."""
    members = {"good.bin": b"1", "good.cls": b"4", "empty.bin": b"2", "empty.cls": b" \n",  # blank label
               "word.bin": b"3", "word.cls": b"cat"}
    if source == "files":
        src = tmp_path / "src"
        src.mkdir()
        for name, data in members.items():
            (src / name).write_bytes(data)
    else:
        src = tmp_path / "in.tar"
        with tarfile.open(src, "w", format=tarfile.USTAR_FORMAT) as tf:
            for name, data in members.items():
                ti = tarfile.TarInfo(name)
                ti.size = len(data)
                tf.addfile(ti, io.BytesIO(data))
    result = convert(str(src), tmp_path / "ds", ConvertOptions(workers=1, progress=False))
    assert result["samples"] == 1 and result["rejected"] == 2
    rejects = {r["key"]: r["reason"] for r in map(json.loads, (tmp_path / "ds" / "rejected.jsonl").open())}
    assert set(rejects) == {"empty", "word"}
    assert "label is empty" in rejects["empty"]
    assert "b'cat' is not a decimal integer" in rejects["word"]
    with open_dataset(tmp_path / "ds") as ds:
        assert ds.keys() == ["good"]
        assert ds.index(0).labels["cls"].tolist() == [4]


def test_class_histogram_of_an_old_index_parses_with_the_same_validation(tmp_path) -> None:
    with DatasetWriter(tmp_path / "ds") as w:
        w.write("a", {"cls": b"2"})
        w.write("b", {"cls": b"5"})
    as_old_index(tmp_path / "ds" / "shard-000000.idx")
    with open_dataset(tmp_path / "ds") as ds:
        assert ds.index(0).labels == {}
        assert ds.class_histogram() == {2: 1, 5: 1}
    # an old dataset whose .cls is not a label (written before labels were checked)
    tar = tmp_path / "ds" / "shard-000000.tar"
    with open_dataset(tmp_path / "ds") as ds:
        _, off, n = ds.index(0).members(1)[0]
    data = bytearray(tar.read_bytes())
    data[off:off + n] = b"x"
    tar.write_bytes(bytes(data))
    with open_dataset(tmp_path / "ds") as ds, pytest.raises(FormatError, match=r"shard-000000.tar: sample 'b'.*b'x'"):
        ds.class_histogram()


# -- CRC32 ------------------------------------------------------------------------------------------
def test_index_holds_the_crc32_of_every_member_payload(tmp_path) -> None:
    rng = np.random.default_rng(0)
    samples = {f"k{i}": {"jpg": rng.bytes(int(rng.integers(1, 9000))), "cls": b"%d" % i,
                         "npy": npy_bytes(rng.standard_normal((i + 1, 700)))} for i in range(6)}
    with DatasetWriter(tmp_path / "ds", shard_size=30_000) as w:
        for k, f in samples.items():
            w.write(k, f)
    with open_dataset(tmp_path / "ds") as ds:
        assert len(ds.shards) > 1
        checked = 0
        for s in range(len(ds.shards)):
            idx = ds.index(s)
            assert idx.member_crc is not None and idx.member_crc.dtype == np.uint32
            for j in range(idx.num_samples):
                for (ext, off, n), crc in zip(idx.members(j), idx.crcs(j)):
                    assert zlib.crc32(ds.read_extent(s, off, n)) == crc
                    checked += 1
        assert checked == 18


# -- index round trip and old indexes ----------------------------------------------------------------
def test_new_columns_round_trip_and_old_indexes_still_load() -> None:
    samples = [("a", [("jpg", 1536, 5000), ("cls", 7168, 1)]), ("b", [("jpg", 8192, 4096)])]
    idx = ShardIndex.build(samples, crc=[1, 2**32 - 1, 5], labels=[{"cls": 9}, {}], npy_c_order=True)
    again = ShardIndex.from_bytes(idx.to_bytes(), name="x.idx")
    assert again.member_crc.tolist() == [1, 2**32 - 1, 5]
    assert again.crcs(0) == [1, 2**32 - 1] and again.crcs(1) == [5]
    assert {k: v.tolist() for k, v in again.labels.items()} == {"cls": [9, 0]}
    assert again.npy_c_order is True
    assert again.to_bytes() == idx.to_bytes()
    old = ShardIndex.from_bytes(ShardIndex.build(samples).to_bytes(), name="old.idx")
    assert old.member_crc is None and old.crcs(0) is None and old.labels == {} and old.npy_c_order is False
    assert old.members(0) == again.members(0)


@pytest.mark.parametrize("change", [
    {"member_crc": np.zeros(2, np.uint32)},  # one short
    {"member_crc": np.zeros(3, np.int64)},  # wrong dtype
    {"labels": {"cls": np.zeros(3, np.int64)}},  # one per sample, not per member
    {"labels": {"cls": np.zeros(2, np.float64)}},
])
def test_inconsistent_new_columns_are_refused(change) -> None:
    samples = [("a", [("jpg", 1536, 5000), ("cls", 7168, 1)]), ("b", [("jpg", 8192, 4096)])]
    idx = dataclasses.replace(ShardIndex.build(samples, crc=[1, 2, 3], labels=[{"cls": 1}, {}]), **change)
    with pytest.raises(FormatError, match="bad.idx"):
        ShardIndex.from_bytes(idx.to_bytes(), name="bad.idx")


# -- extents against the shard size (damaged indexes) ---------------------------------------------
def _small_dataset(root: Path) -> None:
    with DatasetWriter(root) as w:
        w.write("a", {"bin": b"x" * 5000, "cls": b"1"})
        w.write("b", {"bin": b"y" * 100, "cls": b"2"})


@pytest.mark.parametrize("field, value", [("member_size", 2**40), ("member_offset", 2**40),
                                          ("member_size", 2**64 - 1), ("member_offset", 2**64 - 4)])
def test_member_outside_the_shard_is_a_format_error_naming_the_index(tmp_path, field: str, value: int) -> None:
    _small_dataset(tmp_path / "ds")
    path = tmp_path / "ds" / "shard-000000.idx"
    arr = getattr(ShardIndex.load(path), field).copy()
    arr[2] = value
    rewrite_index(path, **{field: arr})
    with open_dataset(tmp_path / "ds") as ds:
        with pytest.raises(FormatError, match=r"shard-000000\.idx: member b\.bin .*outside its shard of \d+ bytes"):
            ds.index(0)
        with pytest.raises(FormatError, match=r"shard-000000\.idx"):
            ds.sample(1)
        assert "shard-000000.tar" in ds.verify()


def test_member_ending_exactly_at_the_shard_end_is_accepted() -> None:
    idx = ShardIndex.build([("a", [("bin", 512, 100)])])
    idx.check_extents(612, "x.idx")
    with pytest.raises(FormatError, match="x.idx"):
        idx.check_extents(611, "x.idx")


# -- Fortran order ------------------------------------------------------------------------------------
def test_fortran_ordered_arrays_are_stored_in_c_order_and_counted(tmp_path) -> None:
    rng = np.random.default_rng(1)
    arrays = {"big": np.asfortranarray(rng.standard_normal((30, 70))),  # >= 4 KiB
              "small": np.asfortranarray(np.arange(12, dtype=np.int16).reshape(3, 4)),
              "c": rng.standard_normal((30, 70))}
    with DatasetWriter(tmp_path / "ds") as w:
        for k, a in arrays.items():
            w.write(k, {"npy": npy_bytes(a)})
    with open_dataset(tmp_path / "ds") as ds:
        assert ds.verify() == {}
        assert ds.manifest["created"]["fortran_to_c"] == {"npy": 2}
        assert ds.shards[0]["fortran_to_c"] == {"npy": 2}
        assert ds.index(0).npy_c_order
        for i, (k, a) in enumerate(arrays.items()):
            payload = ds.sample(i)["npy"]
            assert npy.parse_header(payload)[2] is False
            got = np.load(io.BytesIO(payload))
            np.testing.assert_array_equal(got, a)
            assert got.flags.c_contiguous


def test_c_ordered_arrays_leave_no_conversion_note(tmp_path) -> None:
    with DatasetWriter(tmp_path / "ds") as w:
        w.write("c", {"npy": npy_bytes(np.zeros((40, 40)))})
    with open_dataset(tmp_path / "ds") as ds:
        assert "fortran_to_c" not in ds.manifest["created"]
        assert "fortran_to_c" not in ds.shards[0]


def test_convert_summary_says_how_many_arrays_were_stored_in_c_order(tmp_path, capsys) -> None:
    from gdsload.cli import main

    (tmp_path / "src").mkdir()
    for i in range(3):
        a = np.arange(600, dtype=np.float64).reshape(20, 30) + i
        np.save(tmp_path / "src" / f"a{i}.npy", np.asfortranarray(a) if i else a)
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "ds"), "-q"]) == 0
    assert "2 Fortran-ordered .npy arrays stored in C order" in capsys.readouterr().out
