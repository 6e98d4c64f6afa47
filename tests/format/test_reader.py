"""`open_dataset` / `ShardedDataset`: random access, streaming, integrity checks, URLs, CLI verify."""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import numpy as np
import pytest

from gdsload.cli import main
from gdsload.errors import FormatError, StorageError
from gdsload.io.store import load_manifest, save_manifest
from gdsload.dataset.sharded import ShardedDataset, open_dataset
from gdsload.format.tar import ALIGN
from gdsload.convert.shards import DatasetWriter, ShardFile, make_manifest, shard_name

NUM_SHARDS = 3
PER_SHARD = 4


def _fields(i: int) -> dict[str, bytes]:
    rng = np.random.default_rng(i)
    return {
        "jpg": rng.bytes(4000 + 1500 * (i % 3)),  # some below, some above 4 KiB
        "cls": str(i % 3).encode(),
        "bin": rng.bytes(9000 + i),
    }


def _key(i: int) -> str:
    return f"sample_{i:04d}"


def _make(root: Path) -> Path:
    root.mkdir(parents=True)
    entries = []
    for s in range(NUM_SHARDS):
        w = ShardFile(root, shard_name("shard", s))
        for j in range(PER_SHARD):
            i = s * PER_SHARD + j
            w.add(_key(i), _fields(i))
        entries.append(w.close())
    m = make_manifest(entries, {"jpg": "image", "cls": "label", "bin": "bytes"}, classes=["a", "b", "c"])
    save_manifest(root, m)
    return root


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return _make(tmp_path_factory.mktemp("reader") / "ds")


@pytest.fixture
def ds_path(pristine: Path, tmp_path: Path) -> Path:
    """A private copy of the dataset that a test may damage."""
    dst = tmp_path / "ds"
    shutil.copytree(pristine, dst)
    return dst


N = NUM_SHARDS * PER_SHARD


# -- reading -------------------------------------------------------------------------------------
def test_basics(pristine: Path) -> None:
    with open_dataset(pristine) as ds:
        assert len(ds) == N
        assert len(ds.shards) == NUM_SHARDS
        assert ds.keys() == [_key(i) for i in range(N)]
        assert ds.fields == {"bin": "bytes", "cls": "label", "jpg": "image"}
        assert ds.classes == ["a", "b", "c"]
        assert ds.class_histogram() == {0: 4, 1: 4, 2: 4}
        al = ds.alignment()
        big = sum(1 for i in range(N) for p in _fields(i).values() if len(p) >= ALIGN)
        assert al == {"payloads_4k_or_more": big, "aligned": big, "smaller_payloads": 3 * N - big}
        with pytest.raises(IndexError):
            ds.sample(N)
        with pytest.raises(IndexError):
            ds.sample(-1)


def test_random_access_equals_streaming(pristine: Path) -> None:
    with open_dataset(pristine) as ds:
        streamed = list(ds.iter_samples())
        assert [s["__key__"] for s in streamed] == [_key(i) for i in range(N)]
        order = list(range(N))
        random.Random(0).shuffle(order)
        for i in order:
            got = ds[i]
            assert got == streamed[i]
            assert got["__shard__"] == f"shard-{i // PER_SHARD:06d}.tar"
            for ext, payload in _fields(i).items():
                assert got[ext] == payload
        # only the requested shards, in the requested order
        part = list(ds.iter_samples([2, 0]))
        assert [s["__key__"] for s in part] == [_key(i) for i in [*range(8, 12), *range(0, 4)]]
        # concurrent random access from threads (pread, no shared file position)
        with ThreadPoolExecutor(4) as pool:
            many = list(pool.map(ds.sample, order * 4))
        assert many == [streamed[i] for i in order * 4]


def test_file_url(pristine: Path) -> None:
    with open_dataset(f"file://{pristine}") as ds:
        assert len(ds) == N
        assert ds.sample(5)["bin"] == _fields(5)["bin"]
        assert ds.verify() == {}


def test_fsspec_memory_url(pristine: Path) -> None:
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    base = f"/gdsload-test-{uuid.uuid4().hex}"
    try:
        for p in pristine.iterdir():
            fs.pipe_file(f"{base}/{p.name}", p.read_bytes())
        with open_dataset(f"memory://{base}") as ds:
            assert len(ds) == N
            assert ds.keys() == [_key(i) for i in range(N)]
            for i in (0, 5, N - 1):
                got = ds.sample(i)
                assert {k: v for k, v in got.items() if not k.startswith("__")} == _fields(i)
            assert [s["__key__"] for s in ds.iter_samples()] == [_key(i) for i in range(N)]
            assert ds.class_histogram() == {0: 4, 1: 4, 2: 4}
            assert ds.verify() == {}
        tar = f"{base}/{shard_name('shard', 1)}.tar"
        data = bytearray(fs.cat_file(tar))
        data[700] ^= 0xFF  # one payload byte
        fs.pipe_file(tar, bytes(data))
        with open_dataset(f"memory://{base}") as ds:
            assert ds.verify() == {f"{shard_name('shard', 1)}.tar": ["sha256 differs from the manifest"]}
    finally:
        fs.rm(base, recursive=True)


# -- verify --------------------------------------------------------------------------------------
def test_verify_good(pristine: Path) -> None:
    with open_dataset(pristine) as ds:
        assert ds.verify() == {}
        assert ds.verify(hashes=False) == {}


def _payload_offset(root: Path, shard: int, j: int, ext: str) -> int:
    with open_dataset(root) as ds:
        return next(o for e, o, _ in ds.index(shard).members(j) if e == ext)


def test_verify_flipped_byte(ds_path: Path) -> None:
    off = _payload_offset(ds_path, 1, 2, "bin") + 100
    tar = ds_path / "shard-000001.tar"
    data = bytearray(tar.read_bytes())
    data[off] ^= 0x55
    tar.write_bytes(bytes(data))
    with open_dataset(ds_path) as ds:
        bad = ds.verify()
        assert list(bad) == ["shard-000001.tar"]
        assert any("sha256" in p for p in bad["shard-000001.tar"])
        # size, index, alignment and DALI index still agree: hashing is what catches it
        assert ds.verify(hashes=False) == {}


def test_verify_truncated_shard(ds_path: Path) -> None:
    tar = ds_path / "shard-000002.tar"
    full = tar.stat().st_size
    with open(tar, "r+b") as f:
        f.truncate(full - 6000)
    with open_dataset(ds_path) as ds:
        bad = ds.verify()
        assert list(bad) == ["shard-000002.tar"]
        text = "\n".join(bad["shard-000002.tar"])
        assert f"manifest says {full}" in text
        assert "sha256" in text
        assert list(ds.verify(hashes=False)) == ["shard-000002.tar"]
        # reading the cut-off sample is an error naming the shard, not short data
        with pytest.raises(FormatError, match="shard-000002.tar.*truncated"):
            ds.sample(N - 1)
        assert ds.sample(0)["bin"] == _fields(0)["bin"]


def test_verify_swapped_index(ds_path: Path) -> None:
    shutil.copy(ds_path / "shard-000000.idx", ds_path / "shard-000001.idx")
    with open_dataset(ds_path) as ds:
        bad = ds.verify()
        assert list(bad) == ["shard-000001.tar"]
        text = "\n".join(bad["shard-000001.tar"])
        assert "index does not match the tar" in text
        assert "sha256" not in text  # the tar itself is fine


def test_verify_index_with_other_sample_count(ds_path: Path) -> None:
    # an index of another dataset's shard, with a different number of samples
    with DatasetWriter(ds_path.parent / "other") as w:
        w.write("x", {"bin": b"1"})
    shutil.copy(ds_path.parent / "other" / "shard-000000.idx", ds_path / "shard-000002.idx")
    with open_dataset(ds_path) as ds:
        bad = ds.verify()
        assert list(bad) == ["shard-000002.tar"]
        assert any("shard-000002.idx" in p and "manifest says 4" in p for p in bad["shard-000002.tar"])


def test_verify_corrupt_index(ds_path: Path) -> None:
    (ds_path / "shard-000000.idx").write_bytes(b"garbage")
    with open_dataset(ds_path) as ds:
        bad = ds.verify()
        assert list(bad) == ["shard-000000.tar"]
        assert any("shard-000000.idx" in p for p in bad["shard-000000.tar"])


def test_verify_modified_dali_index(ds_path: Path) -> None:
    p = ds_path / "shard-000001.dali.idx"
    lines = p.read_text().splitlines()
    parts = lines[2].split()
    parts[1] = str(int(parts[1]) + 512)  # a wrong offset
    lines[2] = " ".join(parts)
    p.write_text("\n".join(lines) + "\n")
    with open_dataset(ds_path) as ds:
        bad = ds.verify()
        assert list(bad) == ["shard-000001.tar"]
        assert any("shard-000001.dali.idx does not match the index" in x for x in bad["shard-000001.tar"])


def test_verify_unparsable_or_missing_dali_index(ds_path: Path) -> None:
    (ds_path / "shard-000000.dali.idx").write_text("v9 3\n")
    (ds_path / "shard-000002.dali.idx").unlink()
    with open_dataset(ds_path) as ds:
        bad = ds.verify()
        assert sorted(bad) == ["shard-000000.tar", "shard-000002.tar"]
        assert any("DALI index" in x for x in bad["shard-000000.tar"])
        assert any("DALI index" in x for x in bad["shard-000002.tar"])


def test_verify_missing_shard(ds_path: Path) -> None:
    (ds_path / "shard-000001.tar").unlink()
    with open_dataset(ds_path) as ds:
        bad = ds.verify()
        assert list(bad) == ["shard-000001.tar"]
        assert "missing file" in bad["shard-000001.tar"][0]
        with pytest.raises(StorageError, match="shard-000001.tar"):  # a storage fault, not a format one
            ds.sample(PER_SHARD)


# -- the CLI -------------------------------------------------------------------------------------
def test_cli_verify(ds_path: Path, capsys) -> None:
    assert main(["verify", str(ds_path)]) == 0
    out = capsys.readouterr()
    assert f"ok: {NUM_SHARDS} shards verified" in out.out
    assert main(["verify", "--no-hash", str(ds_path)]) == 0
    capsys.readouterr()

    off = _payload_offset(ds_path, 2, 0, "jpg")
    tar = ds_path / "shard-000002.tar"
    data = bytearray(tar.read_bytes())
    data[off] ^= 1
    tar.write_bytes(bytes(data))
    assert main(["verify", str(ds_path)]) == 1
    err = capsys.readouterr().err
    assert "BAD shard-000002.tar: sha256" in err
    assert "shard-000000" not in err and "shard-000001" not in err
    assert f"1 of {NUM_SHARDS} shards failed verification" in err


def test_cli_verify_not_a_dataset(tmp_path: Path, capsys) -> None:
    assert main(["verify", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "manifest.json" in err and "Traceback" not in err


def _gdsload_cmd() -> list[str]:
    exe = Path(sys.executable).parent / "gdsload"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "gdsload.cli"]


def test_cli_verify_subprocess(ds_path: Path) -> None:
    r = subprocess.run([*_gdsload_cmd(), "verify", str(ds_path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "ok:" in r.stdout
    shutil.copy(ds_path / "shard-000002.idx", ds_path / "shard-000000.idx")
    r = subprocess.run([*_gdsload_cmd(), "verify", str(ds_path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "BAD shard-000000.tar" in r.stderr
    assert "shard-000001.tar" not in r.stderr and "shard-000002.tar" not in r.stderr


# -- the manifest --------------------------------------------------------------------------------
def test_manifest_missing(ds_path: Path) -> None:
    (ds_path / "manifest.json").unlink()
    with pytest.raises(FormatError, match="manifest"):
        open_dataset(ds_path)
    (ds_path / ".gdsload-convert").mkdir()
    with pytest.raises(FormatError, match="manifest.*--resume"):
        open_dataset(ds_path)
    with pytest.raises(FormatError, match="manifest.*does not exist"):
        open_dataset(ds_path / "nope")


@pytest.mark.parametrize(
    "text, match",
    [
        ("{not json", "not valid JSON"),
        ('{"format": "other"}', "not a gdsload manifest"),
        ('{"format": "gdsload", "version": 99}', "version 99"),
    ],
)
def test_manifest_bad(ds_path: Path, text: str, match: str) -> None:
    (ds_path / "manifest.json").write_text(text)
    with pytest.raises(FormatError, match=match):
        open_dataset(ds_path)


def test_manifest_num_samples_mismatch(ds_path: Path) -> None:
    m = load_manifest(ds_path)
    m["num_samples"] += 1
    save_manifest(ds_path, m)
    with pytest.raises(FormatError, match="num_samples"):
        open_dataset(ds_path)


def test_manifest_sample_count_disagrees_with_index(ds_path: Path) -> None:
    m = load_manifest(ds_path)
    m["shards"][0]["samples"] += 1
    m["shards"][1]["samples"] -= 1
    save_manifest(ds_path, m)
    with open_dataset(ds_path) as ds:
        with pytest.raises(FormatError, match="shard-000000.idx.*manifest says 5"):
            ds.sample(0)


def test_load_indexes_loads_the_missing_ones_in_the_background(pristine: Path) -> None:
    ds = ShardedDataset(pristine)
    ds.index(0)
    futures = ds.load_indexes([2, 1, 2, 0])
    assert len(futures) == 2  # shards 2 and 1, once each
    wait(futures, timeout=30)
    assert sorted(ds._indexes) == [0, 1, 2] == list(range(NUM_SHARDS))
    assert ds.load_indexes(range(NUM_SHARDS)) == []  # nothing left to load: no thread


def test_load_indexes_leaves_a_damaged_index_to_the_reader(ds_path: Path) -> None:
    (ds_path / "shard-000001.idx").write_bytes(b"not an index")
    ds = ShardedDataset(ds_path)
    futures = ds.load_indexes(range(NUM_SHARDS))
    wait(futures, timeout=30)
    assert 1 not in ds._indexes and 0 in ds._indexes
    assert isinstance(futures[1].exception(), FormatError)  # kept in its future, not raised
    with pytest.raises(FormatError):
        ds.index(1)
