"""`gdsload convert` on every source layout, checked by reading the result back.

Covers `gdsload/convert/sources.py` (image folder, KEY.EXT folder, tars incl. folders and brace
patterns, `.npy` folders with labels) and the deterministic parts of `gdsload/convert/engine.py`
(shuffle seeds, worker counts, shard sizes), plus `gdsload.cli.parse_size`.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import json
import os
from pathlib import Path

import numpy as np
import pytest
from numpy.lib import format as npformat
from PIL import Image

import gdsload
from convertkit import make_tar, write
from gdsload.cli import main, parse_size

ALIGN = 4096


# -- helpers -------------------------------------------------------------------------------------
def jpeg_bytes(seed: int, size: tuple[int, int] = (24, 16)) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(buf, "JPEG", quality=80)
    return buf.getvalue()


def png_bytes(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()



def convert(src, dst, *extra: str, capsys=None) -> str:
    """Run `gdsload convert` in-process; assert it succeeds; return stdout if capsys is given."""
    rc = main(["convert", str(src), str(dst), "-q", *extra])
    out = ""
    if capsys is not None:
        cap = capsys.readouterr()
        out = cap.out
        assert rc == 0, cap.err
    assert rc == 0
    return out


def read_all(dst) -> tuple[dict, dict[str, dict]]:
    """(manifest, {key: sample}) of the dataset at dst, after checking it verifies clean."""
    with gdsload.open_dataset(dst) as ds:
        assert ds.verify() == {}
        samples = {}
        for s in ds.iter_samples():
            assert s["__key__"] not in samples
            samples[s["__key__"]] = s
        assert len(samples) == len(ds)
        return ds.manifest, samples


def keys_in_order(dst) -> list[str]:
    with gdsload.open_dataset(dst) as ds:
        return ds.keys()


def shard_hashes(dst) -> list[str]:
    m = json.loads((Path(dst) / "manifest.json").read_text())
    return [s["sha256"] for s in m["shards"]]


def random_image_folder(root: Path, n_classes: int, per_class: int, lo: int, hi: int, seed: int = 0) -> Path:
    """An image folder of random-bytes `.jpg` files (valid only without --validate), quick to make."""
    rng = np.random.default_rng(seed)
    for c in range(n_classes):
        for i in range(per_class):
            write(root / f"class{c}" / f"img{i:04d}.jpg", rng.bytes(int(rng.integers(lo, hi))))
    return root


# -- (a) image folder ----------------------------------------------------------------------------
def test_imagefolder_labels_follow_sorted_class_folders_and_jpeg_ext_is_normalised(tmp_path, capsys):
    src = tmp_path / "src"
    files = {
        "zebra/z1.jpg": jpeg_bytes(1),
        "zebra/z2.JPEG": jpeg_bytes(2),
        "ant/a1.JPEG": jpeg_bytes(3),
        "ant/a2.png": png_bytes(4),
        "moth/m1.jpeg": jpeg_bytes(5, (64, 64)),
        "moth/sub.dir x/m 2.jpg": jpeg_bytes(6),  # nested folder; whitespace and dots -> '_'
    }
    for rel, data in files.items():
        write(src / rel, data)
    write(src / ".hidden" / "h.jpg", jpeg_bytes(7))  # hidden folder: not a class
    write(src / "ant" / ".DS_Store", b"junk")  # hidden file: ignored

    out = convert(src, tmp_path / "dst", "--workers", "1", capsys=capsys)
    assert "converted 6 samples" in out
    manifest, samples = read_all(tmp_path / "dst")

    assert manifest["classes"] == ["ant", "moth", "zebra"]
    assert manifest["created"]["source_format"] == "imagefolder"
    # one image field for all: with several types it is "jpg" (the PNG's bytes stay a PNG)
    assert manifest["fields"] == {"cls": "label", "jpg": "image"}
    expected = {
        "zebra/z1": ("jpg", files["zebra/z1.jpg"], 2),
        "zebra/z2": ("jpg", files["zebra/z2.JPEG"], 2),
        "ant/a1": ("jpg", files["ant/a1.JPEG"], 0),
        "ant/a2": ("jpg", files["ant/a2.png"], 0),
        "moth/m1": ("jpg", files["moth/m1.jpeg"], 1),
        "moth/sub_dir_x/m_2": ("jpg", files["moth/sub.dir x/m 2.jpg"], 1),
    }
    assert set(samples) == set(expected)
    for key, (ext, data, label) in expected.items():
        s = samples[key]
        assert set(s) - {"__key__", "__shard__"} == {ext, "cls"}, key
        assert s[ext] == data, key
        assert int(s["cls"]) == label, key
    assert not (tmp_path / "dst" / "rejected.jsonl").exists()
    assert not (tmp_path / "dst" / ".gdsload-convert").exists()  # state removed when complete


def test_imagefolder_readable_by_webdataset(tmp_path):
    wds = pytest.importorskip("webdataset")
    src = tmp_path / "src"
    for i in range(3):
        write(src / "c" / f"i{i}.jpg", jpeg_bytes(i, (80, 80)))
    convert(src, tmp_path / "dst", "--workers", "1")
    m = json.loads((tmp_path / "dst" / "manifest.json").read_text())
    urls = [str(tmp_path / "dst" / s["name"]) for s in m["shards"]]
    got = {s["__key__"]: s for s in wds.WebDataset(urls, shardshuffle=False)}
    assert set(got) == {"c/i0", "c/i1", "c/i2"}
    assert got["c/i1"]["jpg"] == (src / "c" / "i1.jpg").read_bytes()
    assert got["c/i1"]["cls"] == b"0"


# -- (b) KEY.EXT folder --------------------------------------------------------------------------
def test_files_folder_groups_fields_by_key(tmp_path, capsys):
    src = tmp_path / "src"
    expected = {}
    for i in range(5):
        key = f"item{i:02d}"
        fields = {
            "jpg": jpeg_bytes(i, (70, 50)),
            "json": json.dumps({"id": i, "tags": ["a", "b"][: i % 3]}).encode(),
            "txt": f"caption number {i}".encode(),
        }
        for ext, data in fields.items():
            write(src / f"{key}.{ext}", data)
        expected[key] = fields
    # a sample in a sub-folder with two fields only, and a double extension kept as one field
    write(src / "extra" / "item99.txt", b"only text")
    write(src / "extra" / "item99.seg.png", png_bytes(9))
    expected["extra/item99"] = {"txt": b"only text", "seg.png": png_bytes(9)}

    out = convert(src, tmp_path / "dst", "--workers", "1", capsys=capsys)
    assert "converted 6 samples" in out
    manifest, samples = read_all(tmp_path / "dst")
    assert manifest["created"]["source_format"] == "files"
    assert manifest["classes"] is None
    assert manifest["fields"] == {"jpg": "image", "json": "json", "seg.png": "image", "txt": "text"}
    assert set(samples) == set(expected)
    for key, fields in expected.items():
        s = samples[key]
        assert {k: v for k, v in s.items() if not k.startswith("__")} == fields, key
    assert json.loads(samples["item03"]["json"]) == {"id": 3, "tags": []}
    # every sample's members are adjacent in storage order and sorted by key
    assert keys_in_order(tmp_path / "dst") == sorted(expected)


# -- (c) tars ------------------------------------------------------------------------------------
def _tar_members(t: int, n: int) -> tuple[list[tuple[str, bytes]], dict[str, dict[str, bytes]]]:
    rng = np.random.default_rng(t)
    members, expected = [], {}
    for i in range(n):
        key = f"t{t}/s{i:03d}"
        big = rng.bytes(5000 + 700 * i)  # >= 4 KiB: must come out 4096-aligned
        small = b"%d" % (1000 * t + i)  # a label: .cls payloads must be decimal integers
        members += [(f"{key}.bin", big), (f"{key}.cls", small)]
        expected[key] = {"bin": big, "cls": small}
    return members, expected


def _check_tar_dataset(dst: Path, expected: dict[str, dict[str, bytes]]) -> None:
    manifest, samples = read_all(dst)
    assert manifest["created"]["source_format"] == "tar"
    assert set(samples) == set(expected)
    for key, fields in expected.items():
        assert {k: v for k, v in samples[key].items() if not k.startswith("__")} == fields
    with gdsload.open_dataset(dst) as ds:
        al = ds.alignment()
        assert al["aligned"] == al["payloads_4k_or_more"] == len(expected)


def test_single_tar(tmp_path):
    members, expected = _tar_members(0, 4)
    members.insert(0, ("__meta__.json", b"{}"))  # '__' members are not samples
    members.insert(1, ("./.hidden.txt", b"x"))  # hidden members are skipped
    src = make_tar(tmp_path / "in" / "data.tar", members)
    convert(src, tmp_path / "dst", "--workers", "1")
    _check_tar_dataset(tmp_path / "dst", expected)
    # storage order is tar order
    assert keys_in_order(tmp_path / "dst") == list(expected)


def test_folder_of_tars(tmp_path):
    expected = {}
    for t in range(3):
        members, exp = _tar_members(t, 3)
        make_tar(tmp_path / "tars" / f"part-{t}.tar", members)
        expected.update(exp)
    write(tmp_path / "tars" / ".partial.tar", b"not read: hidden")
    convert(tmp_path / "tars", tmp_path / "dst", "--workers", "1")
    _check_tar_dataset(tmp_path / "dst", expected)
    assert keys_in_order(tmp_path / "dst") == list(expected)  # tars in sorted order


def test_brace_pattern_of_tars(tmp_path):
    expected = {}
    for t in range(4):
        members, exp = _tar_members(t, 2)
        make_tar(tmp_path / "tars" / f"train-{t:06d}.tar", members)
        if t < 3:  # the pattern selects three of the four
            expected.update(exp)
    pattern = str(tmp_path / "tars" / "train-{000000..000002}.tar")
    convert(pattern, tmp_path / "dst", "--workers", "1")
    _check_tar_dataset(tmp_path / "dst", expected)
    m = json.loads((tmp_path / "dst" / "manifest.json").read_text())
    assert m["created"]["source"] == pattern


def test_brace_pattern_with_a_missing_tar_is_refused(tmp_path, capsys):
    members, _ = _tar_members(0, 1)
    make_tar(tmp_path / "tars" / "train-0.tar", members)
    rc = main(["convert", str(tmp_path / "tars" / "train-{0..2}.tar"), str(tmp_path / "dst"), "-q"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "2 of 3" in err and "train-1.tar" in err
    assert not (tmp_path / "dst").exists()


# -- (d) npy folder ------------------------------------------------------------------------------
def _npy_arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    return {
        "a": rng.standard_normal((40, 30)).astype(np.float32),  # 4800 B: realigned
        "b": rng.integers(0, 255, (3, 50, 50), dtype=np.uint8),  # 7500 B
        "c": np.asfortranarray(rng.standard_normal((20, 70))),  # fortran order, float64
        "d": np.arange(10, dtype=np.int16),  # tiny: no alignment needed
    }


def _write_npy_folder(root: Path, arrays: dict[str, np.ndarray]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for k, a in arrays.items():
        np.save(root / f"{k}.npy", a)


def _check_npy_dataset(dst: Path, arrays: dict[str, np.ndarray]) -> dict[str, dict]:
    manifest, samples = read_all(dst)
    assert manifest["created"]["source_format"] == "npy"
    assert manifest["fields"]["npy"] == "tensor"
    assert set(samples) == set(arrays)
    for k, a in arrays.items():
        got = np.load(io.BytesIO(samples[k]["npy"]), allow_pickle=False)
        assert got.dtype == a.dtype and got.shape == a.shape
        np.testing.assert_array_equal(got, a)
    # array data of every big array starts 4096-aligned in the shard file itself
    with gdsload.open_dataset(dst) as ds:
        checked = 0
        for s, entry in enumerate(ds.shards):
            idx = ds.index(s)
            with open(dst / entry["name"], "rb") as f:
                for j in range(idx.num_samples):
                    for ext, off, n in idx.members(j):
                        if ext != "npy" or n < ALIGN:
                            continue
                        f.seek(off)
                        version = npformat.read_magic(f)
                        assert version == (1, 0)
                        npformat.read_array_header_1_0(f)
                        header_len = f.tell() - off
                        assert off % ALIGN == 0
                        assert (off + header_len) % ALIGN == 0, (idx.key(j), off, header_len)
                        checked += 1
    assert checked == sum(a.nbytes >= ALIGN for a in arrays.values())
    return samples


def test_npy_folder_without_labels(tmp_path):
    arrays = _npy_arrays()
    _write_npy_folder(tmp_path / "src", arrays)
    convert(tmp_path / "src", tmp_path / "dst", "--workers", "1")
    samples = _check_npy_dataset(tmp_path / "dst", arrays)
    assert all(set(s) == {"__key__", "__shard__", "npy"} for s in samples.values())
    m = json.loads((tmp_path / "dst" / "manifest.json").read_text())
    assert m["classes"] is None and "cls" not in m["fields"]


def test_npy_folder_with_labels_csv(tmp_path):
    arrays = _npy_arrays()
    _write_npy_folder(tmp_path / "src", arrays)
    labels = {"a": 3, "b": 0, "c": 7, "d": 3}
    with open(tmp_path / "src" / "labels.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["key", "label"])
        w.writerows(labels.items())
    convert(tmp_path / "src", tmp_path / "dst", "--workers", "1")
    samples = _check_npy_dataset(tmp_path / "dst", arrays)  # labels.csv itself is not a sample
    assert {k: int(s["cls"]) for k, s in samples.items()} == labels
    m = json.loads((tmp_path / "dst" / "manifest.json").read_text())
    assert m["classes"] is None  # integer labels: no class names
    assert not (tmp_path / "dst" / "rejected.jsonl").exists()


def test_npy_folder_with_labels_json_option_of_string_labels(tmp_path):
    arrays = _npy_arrays()
    _write_npy_folder(tmp_path / "src", arrays)
    labels_file = tmp_path / "my-labels.json"
    labels = {"a": "tiger", "b": "cat", "c": "tiger", "d": "dog"}
    labels_file.write_text(json.dumps(labels))
    convert(tmp_path / "src", tmp_path / "dst", "--workers", "1", "--labels", str(labels_file))
    samples = _check_npy_dataset(tmp_path / "dst", arrays)
    m = json.loads((tmp_path / "dst" / "manifest.json").read_text())
    assert m["classes"] == ["cat", "dog", "tiger"]
    assert {k: m["classes"][int(s["cls"])] for k, s in samples.items()} == labels
    with gdsload.open_dataset(tmp_path / "dst") as ds:
        assert ds.class_histogram() == {0: 1, 1: 1, 2: 2}


def test_npy_label_missing_for_a_key_is_an_error(tmp_path, capsys):
    arrays = _npy_arrays()
    _write_npy_folder(tmp_path / "src", arrays)
    (tmp_path / "src" / "labels.csv").write_text("key,label\na,1\nb,2\nc,3\n")
    rc = main(["convert", str(tmp_path / "src"), str(tmp_path / "dst"), "-q"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "'d'" in err and "labels.csv" in err
    assert not (tmp_path / "dst" / "manifest.json").exists()


# -- detection and --format ----------------------------------------------------------------------
def test_format_auto_detection(tmp_path):
    random_image_folder(tmp_path / "img", 2, 2, 100, 200)
    write(tmp_path / "files" / "k.txt", b"t")
    write(tmp_path / "files" / "k.json", b"{}")
    _write_npy_folder(tmp_path / "npy", {"x": np.zeros(3)})
    members, _ = _tar_members(0, 1)
    make_tar(tmp_path / "tars" / "a.tar", members)
    make_tar(tmp_path / "one.tar", members)
    for name, fmt in [("img", "imagefolder"), ("files", "files"), ("npy", "npy"), ("tars", "tar"), ("one.tar", "tar")]:
        dst = tmp_path / f"out-{name}"
        convert(tmp_path / name, dst, "--workers", "1")
        m = json.loads((dst / "manifest.json").read_text())
        assert m["created"]["source_format"] == fmt, name


def test_format_option_overrides_detection(tmp_path):
    # an image folder with a stray top-level file is still detected as an image folder ...
    src = random_image_folder(tmp_path / "src", 2, 3, 100, 200)
    write(src / "README.txt", b"about this data set")
    convert(src, tmp_path / "auto", "--workers", "1")
    m, samples = read_all(tmp_path / "auto")
    assert m["created"]["source_format"] == "imagefolder"
    assert m["classes"] == ["class0", "class1"]
    assert len(samples) == 6 and "README" not in samples
    # ... and --format files reads it as KEY.EXT files, the top-level file a sample of its own
    convert(src, tmp_path / "forced", "--workers", "1", "--format", "files")
    m, samples = read_all(tmp_path / "forced")
    assert m["created"]["source_format"] == "files"
    assert "README" in samples and "cls" not in m["fields"]
    # an npy folder read as plain files: labels.csv becomes a sample of its own
    _write_npy_folder(tmp_path / "npy", {"x": np.ones(5)})
    (tmp_path / "npy" / "labels.csv").write_text("key,label\nx,1\n")
    convert(tmp_path / "npy", tmp_path / "npy-files", "--workers", "1", "--format", "files")
    m, samples = read_all(tmp_path / "npy-files")
    assert m["created"]["source_format"] == "files"
    assert set(samples) == {"x", "labels"}
    assert samples["labels"]["csv"] == b"key,label\nx,1\n"
    np.testing.assert_array_equal(np.load(io.BytesIO(samples["x"]["npy"])), np.ones(5))


def test_format_option_tar_on_a_folder_of_non_tars_fails_clearly(tmp_path, capsys):
    src = random_image_folder(tmp_path / "src", 1, 2, 100, 200)
    rc = main(["convert", str(src), str(tmp_path / "dst"), "-q", "--format", "tar"])
    assert rc == 1
    assert "no .tar files" in capsys.readouterr().err


# -- determinism: shuffle, workers, shard size ---------------------------------------------------
@pytest.fixture
def medium_folder(tmp_path) -> Path:
    # 60 samples of 3-9 KB: several shards at a 64 KB shard size
    return random_image_folder(tmp_path / "src", 3, 20, 3000, 9000, seed=11)


def test_shuffle_seed_changes_order_not_content(tmp_path, medium_folder):
    runs = {}
    for name, seed in [("s1", "1"), ("s2", "2"), ("s1b", "1")]:
        dst = tmp_path / name
        convert(medium_folder, dst, "--workers", "1", "--shuffle", "--seed", seed, "--shard-size", "64KB")
        runs[name] = keys_in_order(dst)
    convert(medium_folder, tmp_path / "plain", "--workers", "1", "--shard-size", "64KB")
    plain = keys_in_order(tmp_path / "plain")

    assert plain == sorted(plain)
    assert runs["s1"] != runs["s2"]
    assert runs["s1"] != plain and runs["s2"] != plain
    assert sorted(runs["s1"]) == sorted(runs["s2"]) == plain
    # same seed twice: byte-identical shards
    assert runs["s1"] == runs["s1b"]
    assert shard_hashes(tmp_path / "s1") == shard_hashes(tmp_path / "s1b")
    m = json.loads((tmp_path / "s1" / "manifest.json").read_text())
    for s in m["shards"]:
        for f in ("name", "index", "dali_index"):
            assert (tmp_path / "s1" / s[f]).read_bytes() == (tmp_path / "s1b" / s[f]).read_bytes()
    # shuffled samples keep their content and labels
    _, a = read_all(tmp_path / "s1")
    _, b = read_all(tmp_path / "plain")
    assert {k: (v["jpg"], v["cls"]) for k, v in a.items()} == {k: (v["jpg"], v["cls"]) for k, v in b.items()}


def test_one_and_two_workers_give_identical_shards(tmp_path, medium_folder, capsys):
    out1 = convert(medium_folder, tmp_path / "w1", "--workers", "1", "--shard-size", "64KB", capsys=capsys)
    out2 = convert(medium_folder, tmp_path / "w2", "--workers", "2", "--shard-size", "64KB", capsys=capsys)
    assert "1 worker(s)" in out1 and "2 worker(s)" in out2
    h1, h2 = shard_hashes(tmp_path / "w1"), shard_hashes(tmp_path / "w2")
    assert len(h1) >= 3
    assert h1 == h2
    for name in os.listdir(tmp_path / "w1"):
        if name != "manifest.json":
            assert (tmp_path / "w1" / name).read_bytes() == (tmp_path / "w2" / name).read_bytes(), name
    assert sorted(os.listdir(tmp_path / "w1")) == sorted(os.listdir(tmp_path / "w2"))
    # the recorded hashes are the real ones
    m = json.loads((tmp_path / "w2" / "manifest.json").read_text())
    for s in m["shards"]:
        assert hashlib.sha256((tmp_path / "w2" / s["name"]).read_bytes()).hexdigest() == s["sha256"]


def test_shard_size_splits_into_several_shards_near_the_target(tmp_path):
    src = random_image_folder(tmp_path / "src", 2, 40, 8000, 24000, seed=3)
    target = 200_000
    convert(src, tmp_path / "dst", "--workers", "1", "--shard-size", "200KB")
    m, samples = read_all(tmp_path / "dst")
    assert len(samples) == 80
    sizes = [s["bytes"] for s in m["shards"]]
    total = sum((src / f"{k}.jpg").stat().st_size for k in samples)
    assert len(sizes) >= total // target  # several shards, none wildly oversized
    assert len(sizes) >= 4
    # one sample of slack: largest payload plus its headers and alignment padding
    slack = 24000 + 3 * 512 + 4096 + 1024
    for s, size in zip(m["shards"], sizes):
        assert size <= target + slack, (s["name"], size)
        assert (tmp_path / "dst" / s["name"]).stat().st_size == size
    assert all(size >= target / 3 for size in sizes[:-1])  # not cut absurdly small either
    assert [s["name"] for s in m["shards"]] == [f"shard-{i:06d}.tar" for i in range(len(sizes))]


def test_prefix_names_the_shards(tmp_path):
    src = random_image_folder(tmp_path / "src", 1, 2, 100, 200)
    convert(src, tmp_path / "dst", "--workers", "1", "--prefix", "train")
    m = json.loads((tmp_path / "dst" / "manifest.json").read_text())
    assert [s["name"] for s in m["shards"]] == ["train-000000.tar"]
    assert (tmp_path / "dst" / "train-000000.idx").is_file()
    assert (tmp_path / "dst" / "train-000000.dali.idx").is_file()


# -- --shard-size parsing ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, expected",
    [
        ("1073741824", 1073741824),
        ("512MB", 512 * 10**6),
        ("512mb", 512 * 10**6),
        ("200KB", 200_000),
        ("64KiB", 65536),
        ("1GiB", 2**30),
        ("1.5G", 1_500_000_000),
        ("2TB", 2 * 10**12),
        (" 10 MiB ", 10 * 2**20),
        ("100b", 100),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "MB", "12XB", "-5MB", "0", "0KB", "1..5G", "1 G B", "5 mebibytes"])
def test_parse_size_rejects_bad_values(text):
    with pytest.raises(argparse.ArgumentTypeError, match="invalid size"):
        parse_size(text)


def test_bad_shard_size_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["convert", str(tmp_path), str(tmp_path / "dst"), "--shard-size", "lots"])
    assert exc.value.code == 2
    assert "invalid size 'lots'" in capsys.readouterr().err


def test_too_small_shard_size_is_refused(tmp_path, capsys):
    src = random_image_folder(tmp_path / "src", 1, 2, 100, 200)
    rc = main(["convert", str(src), str(tmp_path / "dst"), "-q", "--shard-size", "1KB"])
    assert rc == 1
    assert "too small" in capsys.readouterr().err
    assert not (tmp_path / "dst").exists()


def test_imagefolder_names_with_several_dots_keep_their_image_type(tmp_path):
    from PIL import Image

    from gdsload import open_dataset
    from gdsload.convert.engine import ConvertOptions, convert

    src = tmp_path / "src" / "cat"
    src.mkdir(parents=True)
    for name in ("img.001.jpg", "img.002.jpg", "photo.v2.JPEG"):
        Image.new("RGB", (8, 8), (1, 2, 3)).save(src / name, format="JPEG")
    convert(str(tmp_path / "src"), tmp_path / "out", ConvertOptions(workers=1, progress=False))
    ds = open_dataset(tmp_path / "out")
    assert sorted(ds.keys()) == ["cat/img_001", "cat/img_002", "cat/photo_v2"]
    assert set(ds.fields) == {"jpg", "cls"}
