"""What `gdsload.DataLoader` checks while it reads (`gdsload.dataset.verify`), on real converted datasets.

- Fortran-ordered `.npy` inputs come back equal to the source (stored in C order at conversion);
  an older dataset that still holds Fortran-ordered payloads is refused, naming shard and field.
- labels come from the index column; older indexes are parsed with validation (no -1 for an
  empty `.cls`, a `FormatError` naming shard and key instead of a bare `ValueError`).
- `verify="fast"` (default) / `"full"` / None: a payload changed on disk after conversion, a
  shard of the wrong size, an index without CRCs.
- damaged index entries (a size of 2**40) are a `FormatError` naming the index, not a MemoryError.
- the ring is sized from what an epoch can hold, and refused when it cannot fit in memory.

Datasets on disk are changed in place where a test needs an 'older' or damaged one: the npy
header is rewritten byte for byte, or the index is rewritten without its new columns.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
from npykit import convert_folder

from gdsload.errors import CorruptDataError, FormatError, GdsloadError, StorageError
from gdsload.format.index import ShardIndex
from gdsload.dataset.sharded import ShardedDataset
from gdsload.convert.shards import DatasetWriter
from gdsload.loader.dataloader import DataLoader, Dataset
from gdsload.sampledata import make_npy_folder


def _load_all(path_or_ds, **kw) -> dict[str, dict]:
    """{key: {field: value}} over one epoch (numpy output, CPU)."""
    kw.setdefault("batch_size", 4)
    fields = kw.pop("fields", None)
    if fields is not None:
        kw["fields"] = ["__key__", *fields]
    loader = DataLoader(path_or_ds, device="cpu", output="numpy", decode=False, copy=True, **kw)
    out = {}
    try:
        for b in loader:
            if fields is not None:
                b = dict(zip(kw["fields"], b))
            for i, key in enumerate(b["__key__"]):
                out[key] = {f: v[i] for f, v in b.items() if f != "__key__"}
    finally:
        loader.close()
    return out


def _as_old_index(ds_path: Path) -> None:
    """Rewrite every index, and the manifest's shard entries, as a gdsload from before
    labels/CRCs/C order (and the entries' `max_nbytes`, `member_crc`, `npy_c_order`) wrote them."""
    for p in ds_path.glob("*.idx"):
        if not p.name.endswith(".dali.idx"):
            idx = ShardIndex.load(p)
            p.write_bytes(dataclasses.replace(idx, member_crc=None, labels={}, npy_c_order=False).to_bytes())
    m = json.loads((ds_path / "manifest.json").read_text())
    for entry in m["shards"]:
        for k in ("max_nbytes", "min_nbytes", "member_crc", "npy_c_order"):
            entry.pop(k, None)
    (ds_path / "manifest.json").write_text(json.dumps(m))


def _member(ds_path: Path, key: str, field: str) -> tuple[Path, int, int]:
    """(shard file, payload offset, size) of one member."""
    with ShardedDataset(ds_path) as ds:
        for s in range(len(ds.shards)):
            idx = ds.index(s)
            if key in idx.keys():
                j = idx.keys().index(key)
                (o, n), = [(o, n) for e, o, n in idx.members(j) if e == field]
                return ds_path / ds.shards[s]["name"], o, n
    raise KeyError(key)


def _patch(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


# -- Fortran order -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fortran_ds(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    root = tmp_path_factory.mktemp("fortran")
    rng = np.random.default_rng(3)
    arrays = {f"s{i:02d}": rng.standard_normal((24, 40)) for i in range(10)}  # 7680 B: aligned
    arrays = {k: np.asfortranarray(a) if i % 2 == 0 else a for i, (k, a) in enumerate(arrays.items())}
    (root / "src").mkdir()
    for k, a in arrays.items():
        np.save(root / "src" / f"{k}.npy", a)
    return convert_folder(root / "src", root / "ds", shard_size=40_000), arrays


def test_fortran_ordered_npy_converted_and_loaded_equals_the_source(fortran_ds):
    ds, arrays = fortran_ds
    got = _load_all(ds, batch_size=3)
    assert set(got) == set(arrays)
    for key, a in arrays.items():
        np.testing.assert_array_equal(got[key]["npy"], a, err_msg=key)
    assert ShardedDataset(ds).manifest["created"]["fortran_to_c"] == {"npy": 5}  # and it is recorded


def test_small_fortran_ordered_npy_loads_equal_too(tmp_path):
    arrays = {f"t{i}": np.asfortranarray(np.arange(12, dtype=np.int16).reshape(3, 4) * (i + 1)) for i in range(4)}
    (tmp_path / "src").mkdir()
    for k, a in arrays.items():
        np.save(tmp_path / "src" / f"{k}.npy", a)
    got = _load_all(convert_folder(tmp_path / "src", tmp_path / "ds"))
    for key, a in arrays.items():
        np.testing.assert_array_equal(got[key]["npy"], a, err_msg=key)


def _make_stored_fortran(ds: Path, key: str) -> None:
    """Flip one stored payload's header to fortran_order True (what older gdsload stored)."""
    path, off, n = _member(ds, key, "npy")
    head = path.read_bytes()[off:off + 4096]
    assert b"'fortran_order': False" in head
    _patch(path, off, head.replace(b"'fortran_order': False", b"'fortran_order': True "))


@pytest.mark.filterwarnings("ignore:.*shard sizes only")
@pytest.mark.parametrize("which", ["first", "later"])
def test_existing_dataset_still_fortran_ordered_is_refused(tmp_path, fortran_ds, which):
    ds = tmp_path / "ds"
    shutil.copytree(fortran_ds[0], ds)
    _as_old_index(ds)
    keys = ShardedDataset(ds).keys()
    key = keys[0] if which == "first" else keys[6]
    _make_stored_fortran(ds, key)
    shard = _member(ds, key, "npy")[0].name
    with pytest.raises(FormatError, match=rf"{shard}:{key}.*field 'npy' is stored in Fortran order"):
        _load_all(ds, batch_size=3)


# -- labels ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def labelled(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("labelled")
    make_npy_folder(root / "src", num_samples=12, shape=(4,), dtype="int32", seed=1, num_classes=3)
    import csv

    with open(root / "src" / "labels.csv") as f:
        labels = {row["key"]: row["label"] for row in csv.DictReader(f)}
    return convert_folder(root / "src", root / "ds", shard_size=20_000), labels


def test_labels_come_from_the_index_column_not_the_tar(tmp_path, labelled):
    ds = tmp_path / "ds"
    shutil.copytree(labelled[0], ds)
    classes = ShardedDataset(ds).classes
    key = ShardedDataset(ds).keys()[5]
    want = _load_all(ds)[key]["cls"]
    path, off, n = _member(ds, key, "cls")
    _patch(path, off, b"x" * n)  # the label text in the tar is not read any more
    got = _load_all(Dataset(str(ds), verify=None))
    assert got[key]["cls"] == want
    assert classes[want] == labelled[1][key] if classes else int(labelled[1][key]) == want


@pytest.mark.filterwarnings("ignore:.*shard sizes only")
@pytest.mark.parametrize("text, why", [(b" ", "label is empty"), (b"x", "label b'x' is not a decimal integer")])
def test_old_index_labels_are_parsed_with_validation(tmp_path, labelled, text, why):
    ds = tmp_path / "ds"
    shutil.copytree(labelled[0], ds)
    _as_old_index(ds)
    assert len(_load_all(ds)) == 12  # old indexes still load: labels parsed from the tar
    key = ShardedDataset(ds).keys()[7]
    path, off, n = _member(ds, key, "cls")
    assert n == 1
    _patch(path, off, text)
    with pytest.raises(FormatError, match=rf"{path.name}:{key}: field 'cls': {why}"):
        _load_all(ds)


# -- verify= -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> Path:
    """Bytes fields (staged in host memory) and a .npy tensor field (read straight into the batch)."""
    root = tmp_path_factory.mktemp("mixed")
    src = root / "src"
    src.mkdir()
    rng = np.random.default_rng(0)
    for i in range(8):
        (src / f"k{i}.bin").write_bytes(rng.bytes(3000))
        np.save(src / f"k{i}.npy", rng.standard_normal((30, 40)).astype(np.float32))
    return convert_folder(src, root / "ds", shard_size=30_000)


def _changed_copy(tmp_path: Path, mixed: Path, field: str, key: str = "k3") -> Path:
    ds = tmp_path / "ds"
    shutil.copytree(mixed, ds)
    path, off, n = _member(ds, key, field)
    data = path.read_bytes()
    pos = off + n - 1  # the last byte of the payload (array data, for .npy)
    _patch(path, pos, bytes([data[pos] ^ 0x01]))
    return ds


def test_default_fast_check_catches_a_changed_staged_payload(tmp_path, mixed):
    ds = _changed_copy(tmp_path, mixed, "bin")
    shard = _member(ds, "k3", "bin")[0].name
    with pytest.raises(CorruptDataError, match=rf"{shard}:k3: field 'bin' differs from what was converted \(CRC32"):
        _load_all(ds, fields=["bin"])
    # verify=None returns it as it is now (what the README says it does not check)
    got = _load_all(Dataset(str(ds), verify=None), fields=["bin"])
    assert bytes(got["k3"]["bin"]) != bytes(_load_all(mixed, fields=["bin"])["k3"]["bin"])


def test_tensor_payloads_are_checked_by_full_only(tmp_path, mixed):
    ds = _changed_copy(tmp_path, mixed, "npy")
    assert len(_load_all(ds)) == 8  # fast: tensors are read straight into the batch, unchecked
    with pytest.raises(FormatError, match=r"k3: field 'npy' differs from what was converted"):
        _load_all(Dataset(str(ds), verify="full"))
    assert len(_load_all(Dataset(str(mixed), verify="full"))) == 8  # an intact dataset passes


def test_fast_checks_shard_sizes_when_loading_starts(tmp_path, mixed):
    ds = tmp_path / "ds"
    shutil.copytree(mixed, ds)
    shard = ds / ShardedDataset(ds).shards[1]["name"]
    with open(shard, "ab") as f:
        f.write(b"\0" * 512)
    with pytest.raises(CorruptDataError, match=rf"{shard.name}: \d+ bytes, the manifest says \d+"):
        _load_all(ds)
    assert len(_load_all(Dataset(str(ds), verify=None))) == 8


def test_old_index_without_crcs_fast_warns_and_full_refuses(tmp_path, mixed):
    ds = tmp_path / "ds"
    shutil.copytree(mixed, ds)
    _as_old_index(ds)
    loader = DataLoader(str(ds), batch_size=4, device="cpu", output="numpy", decode=False)
    with pytest.warns(UserWarning, match="shard sizes only"):
        n = sum(len(b["__key__"]) for b in loader)
    assert n == 8 and "shard sizes only" in loader.stats()["verify"]
    loader.close()
    with pytest.raises(FormatError, match="verify='full' needs the CRC32s"):
        _load_all(Dataset(str(ds), verify="full"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(_load_all(Dataset(str(ds), verify=None))) == 8


def test_stats_say_what_is_verified(mixed):
    loader = DataLoader(str(mixed), batch_size=4, device="cpu", output="numpy", decode=False)
    next(iter(loader))
    assert loader.stats()["verify"] == "fast"
    loader.close()


def test_verify_mode_is_checked():
    with pytest.raises(GdsloadError, match="verify must be 'fast', 'full' or None"):
        Dataset("nowhere", verify="yes")


def test_fields_keep_the_datasets_verify_mode(tmp_path, mixed):
    ds = _changed_copy(tmp_path, mixed, "bin")
    assert len(_load_all(Dataset(str(ds), verify=None), fields=["bin", "npy"])) == 8


# -- damaged index -----------------------------------------------------------------------------------
def test_index_entry_sized_2_to_40_is_a_format_error_naming_the_index(tmp_path, mixed):
    ds = tmp_path / "ds"
    shutil.copytree(mixed, ds)
    idx_path = ds / ShardedDataset(ds).shards[0]["index"]
    idx = ShardIndex.load(idx_path)
    sizes = idx.member_size.copy()
    sizes[0] = 2**40
    idx_path.write_bytes(dataclasses.replace(idx, member_size=sizes).to_bytes())
    for dataset in (lambda: str(ds), lambda: Dataset(str(ds), verify=None)):
        with pytest.raises(FormatError, match=rf"{idx_path.name}: member .* lies outside its shard"):
            _load_all(dataset())


# -- ring size ---------------------------------------------------------------------------------------
def test_available_host_memory_is_measured():
    import os

    from gdsload.host.memory import available_host_bytes

    avail = available_host_bytes()
    assert avail is not None and 0 < avail <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def test_batch_size_larger_than_the_dataset_sizes_the_ring_from_the_epoch(mixed):
    # (and the plan from the epoch's samples: at 10**9 its positions took 8 GB and a minute)
    loader = DataLoader(str(mixed), batch_size=10**12, device="cpu", output="numpy", decode=False)
    batches = list(loader)
    assert len(batches) == 1 and sorted(batches[0]["__key__"]) == [f"k{i}" for i in range(8)]
    assert batches[0]["npy"].shape == (8, 30, 40)
    assert loader.stats()["ring_slots"] == 3
    assert loader._resources.ring.nbytes_total < 1 << 20  # 3 slots of 8 rows, not of 10**9
    loader.close()


def test_batch_size_is_capped_per_rank(mixed):
    loader = DataLoader(str(mixed), batch_size=100, rank=1, world_size=3, device="cpu",
                        output="numpy", decode=False)
    keys = [k for b in loader for k in b["__key__"]]
    assert len(keys) == 3  # ceil(8 / 3) samples for this rank, one batch of 3 rows
    assert loader._resources.ring.spec.fields["npy"][0] == (3, 30, 40)
    loader.close()


def test_ring_larger_than_host_memory_is_refused_with_a_message(mixed):
    import os

    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    per_slot = 8 * 30 * 40 * 4  # at least the npy rows of one slot
    loader = DataLoader(str(mixed), batch_size=8, device="cpu", output="numpy", decode=False,
                        prefetch_factor=2 * ram // per_slot)  # twice this machine's RAM in all
    with pytest.raises(GdsloadError, match=r"prefetch ring needs .* more than the .* of host memory "
                                           r"available; lower batch_size \(8\) or prefetch_factor"):
        next(iter(loader))
    loader.close()


# -- in a Mix ----------------------------------------------------------------------------------------
def test_each_dataset_of_a_mix_keeps_its_verify_setting(tmp_path, mixed):
    from gdsload.dataset.mix import Mix

    changed = _changed_copy(tmp_path / "c", mixed, "bin")
    intact = tmp_path / "intact"
    shutil.copytree(mixed, intact)
    loose = Mix([Dataset(str(changed), verify=None), Dataset(str(intact))], names=["changed", "intact"])
    loader = DataLoader(loose, batch_size=4, device="cpu", output="numpy", decode=False, fields=["bin"])
    assert sum(len(b[0]) for b in loader) == 16  # the changed one is not checked, as asked
    assert loader.stats()["verify"] == "changed: off; intact: fast"
    loader.close()
    strict = Mix([Dataset(str(changed)), Dataset(str(intact))], names=["changed", "intact"])
    loader = DataLoader(strict, batch_size=4, device="cpu", output="numpy", decode=False, fields=["bin"])
    with pytest.raises(FormatError, match=r"k3: field 'bin' differs from what was converted"):
        for _ in loader:
            pass
    loader.close()


@pytest.fixture(params=["memory", "s3"])
def url_fs(request):
    """A dataset URL on memory:// or on moto's real S3 server, and its fsspec filesystem."""
    import uuid

    if request.param == "memory":
        import fsspec

        fs, url = fsspec.filesystem("memory"), f"memory://gdsload-loadcheck-{uuid.uuid4().hex}"
    else:
        fs = request.getfixturevalue("s3")
        bucket = f"gdsload-loadcheck-{uuid.uuid4().hex[:12]}"
        fs.mkdir(bucket)
        url = f"s3://{bucket}/ds"
    yield url, fs
    if fs.exists(url):
        fs.rm(url, recursive=True)


def test_fast_checks_shard_sizes_at_a_url_with_one_listing(url_fs):
    """Sizes at a URL come from one listing of the dataset folder (real fsspec filesystems)."""
    url, fs = url_fs
    with DatasetWriter(url, shard_size=10_000) as w:
        for i in range(6):
            w.write(f"k{i}", {"bin": bytes([i]) * 3000, "cls": b"%d" % i})
    assert len(_load_all(url)) == 6
    with ShardedDataset(url) as ds:
        assert ds.stored_sizes() == [s["bytes"] for s in ds.shards] and len(ds.shards) > 1
        name = ds.shards[1]["name"]
    fs.pipe_file(f"{url}/{name}", fs.cat_file(f"{url}/{name}")[:-512])
    with pytest.raises(FormatError, match=rf"{name}: \d+ bytes, the manifest says"):
        _load_all(url)
    fs.rm(f"{url}/{name}")
    with pytest.raises(StorageError, match=rf"{name}: missing, the manifest says"):
        _load_all(url)


def test_full_check_copies_device_rows_to_the_host_for_the_crc():
    """verify='full' on a device ring: rows are CuPy arrays; a faithful stand-in (the parts of
    CuPy's ndarray the check uses: `__cuda_array_interface__`, slicing, `.get()` to NumPy)."""
    import types
    import zlib

    from gdsload.dataset.verify import check_crcs
    from gdsload.decode.raw import TensorField
    from gdsload.loader.gather import TensorChecks

    class DeviceArray:
        def __init__(self, host: np.ndarray):
            self._host = host
            self.__cuda_array_interface__ = {"shape": host.shape, "typestr": "|u1", "version": 3,
                                             "data": (0, False)}

        def __getitem__(self, sl):
            return DeviceArray(self._host[sl])

        def get(self) -> np.ndarray:
            return self._host.copy()

    flat = np.frombuffer(np.random.default_rng(0).bytes(17_000), np.uint8)
    staging = np.frombuffer(b"h" * 100, np.uint8)  # the members' staged .npy header
    tensor = TensorField("npy", np.dtype(np.uint8), (8000,), 100, False)
    good = zlib.crc32(flat[1000:9000], zlib.crc32(staging))  # header, then row 0 (at 1000)
    empty = np.zeros(0, np.int64)

    def reads(*crcs):
        return types.SimpleNamespace(names=["s.tar:k", "s.tar:k2"], crc=None,
                                     tensor_checks=[TensorChecks("npy", tensor, (empty, empty, empty), list(crcs))])

    rows = {"npy": (DeviceArray(flat), 1000)}
    check_crcs(reads((0, good, (0, 100))), staging, rows)
    with pytest.raises(CorruptDataError, match="s.tar:k2: field 'npy' differs"):
        check_crcs(reads((0, good, (0, 100)), (1, good, (0, 100))), staging, rows)  # row 1 differs
