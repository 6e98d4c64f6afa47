"""`gdsload convert` on inputs found by fault injection (issues 16 and 21): links in folders,
mixed image types, empty tar members, corrupt tar headers, stray files next to class folders,
non-UTF-8 names and decompression bombs.

Each test states the rule it checks; the fatal ones expect exit 1 with one `error:` line naming
the file, the others a dataset plus the left-out input in `DST/rejected.jsonl` with its reason.
"""

from __future__ import annotations

import io
import json
import os
import struct
import sys
import tarfile
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import gdsload
from convertkit import make_tar, write
from npykit import npy_bytes
from gdsload.cli import main


# -- helpers -------------------------------------------------------------------------------------
def image_bytes(seed: int, fmt: str = "JPEG", size: int = 40) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, fmt)
    return buf.getvalue()



def run(capsys, *argv) -> tuple[int, str, str]:
    rc = main(["convert", *map(str, argv), "-q", "--workers", "1"])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def ok(capsys, *argv) -> str:
    rc, out, err = run(capsys, *argv)
    assert rc == 0, err
    return out


def fatal(capsys, *argv) -> str:
    """Expect exit 1 with one clear error line and no dataset at DST (argv[1])."""
    rc, out, err = run(capsys, *argv)
    assert rc == 1, (out, err)
    assert err.startswith("gdsload convert: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    assert not (Path(argv[1]) / "manifest.json").exists()
    return err


def rejected(dst: Path) -> dict[str, str]:
    """{source: reason} of DST/rejected.jsonl ({} when there is none)."""
    p = dst / "rejected.jsonl"
    return {r["source"]: r["reason"] for r in map(json.loads, p.read_text().splitlines())} if p.exists() else {}


def samples(dst: Path) -> dict[str, dict]:
    with gdsload.open_dataset(dst) as ds:
        assert ds.verify() == {}
        return {s["__key__"]: s for s in ds.iter_samples()}


def shard_bytes(dst: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(dst.glob("*.tar")))


# -- 16.8: links in folders are not followed -----------------------------------------------------
SECRET = b"root:x:0:0:root:/root:/bin/bash\n" * 4


@pytest.fixture
def secret(tmp_path) -> Path:
    """A file outside SRC that a link inside SRC points at: it must never reach a shard."""
    return write(tmp_path / "outside" / "passwd", SECRET)


def test_file_link_in_imagefolder_is_rejected_not_followed(tmp_path, capsys, secret):
    src = tmp_path / "src"
    write(src / "c0" / "a.jpg", image_bytes(0))
    write(src / "c1" / "b.jpg", image_bytes(1))
    os.symlink(secret, src / "c1" / "link.jpg")
    os.symlink(src / "c0" / "a.jpg", src / "c1" / "alias.jpg")  # a link to a file inside SRC too
    os.symlink(tmp_path / "gone.jpg", src / "c1" / "dangling.jpg")
    dst = tmp_path / "dst"
    out = ok(capsys, src, dst)
    assert set(samples(dst)) == {"c0/a", "c1/b"}
    assert SECRET[:32] not in shard_bytes(dst)
    rej = rejected(dst)
    assert set(rej) == {str(src / "c1" / n) for n in ("link.jpg", "alias.jpg", "dangling.jpg")}
    assert "symbolic link" in rej[str(src / "c1" / "link.jpg")] and str(secret) in rej[str(src / "c1" / "link.jpg")]
    assert "not followed" in rej[str(src / "c1" / "dangling.jpg")]
    assert "3 inputs rejected" in out


def test_folder_links_in_imagefolder_are_rejected_not_followed(tmp_path, capsys, secret):
    src = tmp_path / "src"
    write(src / "c0" / "a.jpg", image_bytes(0))
    write(tmp_path / "elsewhere" / "x.jpg", image_bytes(5))
    os.symlink(tmp_path / "elsewhere", src / "c0" / "sub")  # a link to a folder inside a class
    os.symlink(tmp_path / "elsewhere", src / "c9")  # a class folder that is a link
    dst = tmp_path / "dst"
    ok(capsys, src, dst)
    assert set(samples(dst)) == {"c0/a"}
    with gdsload.open_dataset(dst) as ds:
        assert ds.manifest["classes"] == ["c0"]
    rej = rejected(dst)
    assert set(rej) == {str(src / "c0" / "sub"), str(src / "c9")}
    assert all("symbolic link" in r and str(tmp_path / "elsewhere") in r for r in rej.values())


def test_link_in_files_folder_is_rejected(tmp_path, capsys, secret):
    src = tmp_path / "src"
    write(src / "k0.txt", b"caption")
    write(src / "k1.txt", b"caption 1")
    write(src / "k1.json", b"{}")
    os.symlink(secret, src / "k1.bin")
    dst = tmp_path / "dst"
    ok(capsys, src, dst, "--format", "files")
    assert set(samples(dst)) == {"k0"}  # the sample that holds the link is left out whole
    assert SECRET[:32] not in shard_bytes(dst)
    assert "symbolic link" in rejected(dst)[str(src / "k1.bin")]


def test_link_in_npy_folder_is_rejected(tmp_path, capsys):
    src = tmp_path / "src"
    write(src / "a.npy", npy_bytes(np.arange(4)))
    write(tmp_path / "outside" / "b.npy", npy_bytes(np.ones(3)))
    os.symlink(tmp_path / "outside" / "b.npy", src / "b.npy")
    dst = tmp_path / "dst"
    ok(capsys, src, dst)
    assert set(samples(dst)) == {"a"}
    assert "symbolic link" in rejected(dst)[str(src / "b.npy")]
    # a labels file found inside SRC is not followed either; one named with --labels may be a link
    (tmp_path / "outside" / "labels.csv").write_text("key,label\na,7\n")
    os.symlink(tmp_path / "outside" / "labels.csv", src / "labels.csv")
    err = fatal(capsys, src, tmp_path / "dst2")
    assert str(src / "labels.csv") in err and "symbolic link" in err and "--labels" in err
    ok(capsys, src, tmp_path / "dst3", "--labels", src / "labels.csv")
    assert samples(tmp_path / "dst3")["a"]["cls"] == b"7"


def test_link_in_folder_of_tars_is_refused(tmp_path, capsys):
    make_tar(tmp_path / "tars" / "a.tar", [("k0.txt", b"x")])
    make_tar(tmp_path / "outside" / "b.tar", [("k1.txt", b"y")])
    os.symlink(tmp_path / "outside" / "b.tar", tmp_path / "tars" / "b.tar")
    err = fatal(capsys, tmp_path / "tars", tmp_path / "dst")
    assert str(tmp_path / "tars" / "b.tar") in err and "symbolic link" in err


def test_src_itself_may_be_a_link(tmp_path, capsys):
    write(tmp_path / "real" / "c0" / "a.jpg", image_bytes(0))
    os.symlink(tmp_path / "real", tmp_path / "src")
    make_tar(tmp_path / "real.tar", [("k0.txt", b"x")])
    os.symlink(tmp_path / "real.tar", tmp_path / "named.tar")
    ok(capsys, tmp_path / "src", tmp_path / "dst")
    assert set(samples(tmp_path / "dst")) == {"c0/a"}
    ok(capsys, tmp_path / "named.tar", tmp_path / "dst2")
    assert set(samples(tmp_path / "dst2")) == {"k0"}


def test_file_swapped_for_a_link_after_listing_is_not_followed(tmp_path, secret):
    from gdsload.convert.engine import write_shard
    from gdsload.convert.sources import list_source

    src = tmp_path / "src"
    write(src / "c0" / "a.jpg", image_bytes(0))
    victim = write(src / "c0" / "b.jpg", SECRET)  # same size as the secret: the size check passes
    listing = list_source(str(src))
    victim.unlink()
    os.symlink(secret, victim)  # swapped while the conversion runs
    (tmp_path / "dst").mkdir()
    r = write_shard(str(tmp_path / "dst"), "shard-000000", listing.samples, False)
    assert [x["key"] for x in r["rejects"]] == ["c0/b"] and "unreadable" in r["rejects"][0]["reason"]
    assert SECRET[:32] not in shard_bytes(tmp_path / "dst")


# -- 16.11: a mixed-type image folder converts into one image field that loads -------------------
MIXED = {"c0/j0.jpg": "JPEG", "c0/p0.png": "PNG", "c0/w0.webp": "WEBP", "c0/b0.bmp": "BMP",
         "c1/j1.JPEG": "JPEG", "c1/t1.tif": "TIFF", "c1/p1.png": "PNG", "c1/j2.jpeg": "JPEG"}


@pytest.mark.dali
@pytest.mark.parametrize("validate", [False, True])
def test_mixed_image_folder_loads_with_dali(tmp_path, capsys, validate):
    src = tmp_path / "src"
    for i, (rel, fmt) in enumerate(MIXED.items()):
        write(src / rel, image_bytes(i, fmt, 32 + i))
    write(src / "c1" / "anim.gif", image_bytes(99, "GIF"))  # DALI cannot decode GIF
    dst = tmp_path / "dst"
    ok(capsys, src, dst, *(["--validate"] if validate else []))
    got = samples(dst)
    with gdsload.open_dataset(dst) as ds:
        assert ds.manifest["fields"] == {"cls": "label", "jpg": "image"}
    assert {k: s["jpg"] for k, s in got.items()} == {  # bytes unchanged: DALI sniffs the type
        rel.rsplit(".", 1)[0]: (src / rel).read_bytes() for rel in MIXED}
    [reason] = rejected(dst).values()
    assert "GIF" in reason and "DALI" in reason

    loader = gdsload.DataLoader(dst, batch_size=3, transform=gdsload.ImageTransform(size=24),
                                output="numpy", num_workers=1, decode_threads=1)
    keys, labels = [], []
    for batch in loader:
        assert batch["jpg"].shape[1:] == (3, 24, 24)
        keys += batch["__key__"]
        labels += [int(c) for c in batch["cls"]]
    assert sorted(keys) == sorted(got)  # every sample decoded, none skipped
    assert labels == [0 if k.startswith("c0/") else 1 for k in keys]
    tuples = gdsload.DataLoader(dst, batch_size=4, fields=("jpg", "cls"), output="numpy",
                                transform=gdsload.ImageTransform(size=24), on_error="skip")
    assert sum(len(jpg) for jpg, _ in tuples) == len(MIXED)  # none skipped either


def test_single_type_image_folder_keeps_its_type_as_field(tmp_path, capsys):
    src = tmp_path / "src"
    for i in range(3):
        write(src / f"c{i % 2}" / f"p{i}.png", image_bytes(i, "PNG"))
    ok(capsys, src, tmp_path / "dst")
    with gdsload.open_dataset(tmp_path / "dst") as ds:
        assert ds.manifest["fields"] == {"cls": "label", "png": "image"}


# -- 16.16: an empty input is a reject in every layout -------------------------------------------
def test_empty_member_in_tar_is_rejected_like_an_empty_file(tmp_path, capsys):
    tar = make_tar(tmp_path / "in" / "a.tar", [("k0.jpg", b"\xff\xd8" + b"x" * 100), ("k0.cls", b"1"),
                                               ("k1.jpg", b""), ("k1.cls", b"2"),
                                               ("k2.jpg", b"\xff\xd8" + b"y" * 100), ("k2.cls", b"3")])
    dst = tmp_path / "dst"
    out = ok(capsys, tar, dst)
    assert set(samples(dst)) == {"k0", "k2"}
    [(source, reason)] = rejected(dst).items()
    assert source == str(tar) and "empty" in reason and "'k1.jpg'" in reason
    assert "1 inputs rejected" in out


def test_empty_file_in_files_folder_is_rejected(tmp_path, capsys):
    src = tmp_path / "src"
    write(src / "k0.txt", b"caption")
    write(src / "k1.txt", b"")
    write(src / "k1.json", b"{}")
    dst = tmp_path / "dst"
    ok(capsys, src, dst)
    assert set(samples(dst)) == {"k0"}
    assert rejected(dst) == {str(src / "k1.txt"): "empty file (0 bytes)"}


# -- 21.1: a corrupt tar header stops the conversion ---------------------------------------------
def _twenty_sample_tar(path: Path) -> tuple[Path, list[tarfile.TarInfo]]:
    make_tar(path, [(f"s{i:02d}.{e}", d) for i in range(20) for e, d in
                    (("jpg", b"\xff\xd8" + bytes([i]) * 700), ("cls", str(i).encode()))])
    with tarfile.open(path) as tf:
        return path, tf.getmembers()


@pytest.mark.parametrize("damage", ["checksum", "zeroed", "garbage"])
def test_corrupt_header_in_the_middle_of_a_tar_is_fatal(tmp_path, capsys, damage):
    tar, members = _twenty_sample_tar(tmp_path / "in" / "t.tar")
    m = members[10]  # the header of s05.jpg
    raw = bytearray(tar.read_bytes())
    if damage == "checksum":
        raw[m.offset + 3] ^= 0x20  # one bit of the name: the stored checksum no longer matches
    elif damage == "zeroed":
        raw[m.offset:m.offset + 512] = bytes(512)  # a zeroed sector reads as the end marker
    else:
        raw[m.offset:m.offset + 512] = os.urandom(512)
    tar.write_bytes(bytes(raw))
    err = fatal(capsys, tar, tmp_path / "dst")
    assert str(tar) in err and f"offset {m.offset}" in err


def test_data_after_the_end_of_archive_marker_is_fatal(tmp_path, capsys):
    tar, _ = _twenty_sample_tar(tmp_path / "in" / "t.tar")
    n = tar.stat().st_size
    tar.write_bytes(tar.read_bytes() + make_tar(tmp_path / "second.tar", [("z.txt", b"z")]).read_bytes())
    err = fatal(capsys, tar, tmp_path / "dst")
    assert str(tar) in err and f"offset {n}" in err


def test_tar_without_an_end_marker_still_converts(tmp_path, capsys):
    tar, members = _twenty_sample_tar(tmp_path / "in" / "t.tar")
    last = members[-1]
    end = last.offset_data + -(-last.size // 512) * 512
    tar.write_bytes(tar.read_bytes()[:end])  # some writers stop after the last member
    ok(capsys, tar, tmp_path / "dst")
    assert len(samples(tmp_path / "dst")) == 20


# -- 21.2: stray files next to the data do not change the detected layout ------------------------
@pytest.mark.parametrize("stray", [["README.txt"], ["LICENSE", "classes.csv"]])
def test_stray_files_next_to_class_folders_keep_the_imagefolder(tmp_path, capsys, stray):
    src = tmp_path / "src"
    for i in range(4):
        write(src / f"c{i % 2}" / f"i{i}.jpg", image_bytes(i))
    for name in stray:
        write(src / name, b"about this data set\n")
    dst = tmp_path / "dst"
    out = ok(capsys, src, dst)
    got = samples(dst)
    assert {k: int(s["cls"]) for k, s in got.items()} == {"c0/i0": 0, "c1/i1": 1, "c0/i2": 0, "c1/i3": 1}
    with gdsload.open_dataset(dst) as ds:
        assert ds.manifest["created"]["source_format"] == "imagefolder"
        assert ds.manifest["classes"] == ["c0", "c1"]
    rej = rejected(dst)
    assert set(rej) == {str(src / n) for n in stray}
    assert all("not in a class folder" in r for r in rej.values())
    assert "input: imagefolder (detected), 2 classes" in out


def test_image_files_next_to_class_folders_are_ambiguous(tmp_path, capsys):
    src = tmp_path / "src"
    write(src / "c0" / "i0.jpg", image_bytes(0))
    write(src / "top.jpg", image_bytes(1))
    err = fatal(capsys, src, tmp_path / "dst")
    assert "ambiguous" in err and "top.jpg" in err and "--format" in err


def test_stray_files_next_to_tars_and_npy_keep_their_layout(tmp_path, capsys):
    make_tar(tmp_path / "tars" / "a.tar", [("k0.txt", b"x"), ("k0.cls", b"3")])
    write(tmp_path / "tars" / "README.md", b"# shards")
    out = ok(capsys, tmp_path / "tars", tmp_path / "d1")
    assert set(samples(tmp_path / "d1")) == {"k0"}
    assert "input: tar (detected), no classes" in out
    assert "not a .tar file" in rejected(tmp_path / "d1")[str(tmp_path / "tars" / "README.md")]

    write(tmp_path / "npy" / "x.npy", npy_bytes(np.ones(3)))
    (tmp_path / "npy" / "labels.csv").write_text("key,label\nx,cat\n")
    write(tmp_path / "npy" / "LICENSE", b"MIT")
    out = ok(capsys, tmp_path / "npy", tmp_path / "d2")
    assert samples(tmp_path / "d2")["x"]["cls"] == b"0"
    assert "input: npy (detected), 1 class" in out and "1 classes" not in out


def test_summary_names_a_forced_format(tmp_path, capsys):
    write(tmp_path / "src" / "k.txt", b"t")
    out = ok(capsys, tmp_path / "src", tmp_path / "dst", "--format", "files")
    assert "input: files (--format), no classes" in out


# -- 21.3: names that are not UTF-8 --------------------------------------------------------------
needs_non_utf8_names = pytest.mark.skipif(sys.platform == "darwin", reason="macOS refuses non-UTF-8 file names")


@needs_non_utf8_names
def test_non_utf8_file_names_are_rejected(tmp_path, capsys):
    src = tmp_path / "src"
    write(src / "c0" / "ok.jpg", image_bytes(0))
    bad = os.fsencode(src / "c0") + b"/caf\xe9.jpg"
    with open(bad, "wb") as f:
        f.write(image_bytes(1))
    os.makedirs(os.fsencode(src) + b"/cl\xe4ss")
    with open(os.fsencode(src) + b"/cl\xe4ss/x.jpg", "wb") as f:
        f.write(image_bytes(2))
    dst = tmp_path / "dst"
    ok(capsys, src, dst)
    assert set(samples(dst)) == {"c0/ok"}
    with gdsload.open_dataset(dst) as ds:
        assert ds.manifest["classes"] == ["c0"]
    rej = rejected(dst)
    assert set(rej) == {str(src / "c0" / "caf\\xe9.jpg"), str(src / "cl\\xe4ss")}
    assert all("not valid UTF-8" in r for r in rej.values())


def test_non_utf8_tar_member_names_are_rejected(tmp_path, capsys):
    tar = tmp_path / "in" / "a.tar"
    tar.parent.mkdir()
    with tarfile.open(tar, "w", format=tarfile.GNU_FORMAT, encoding="latin-1") as tf:
        for name, data in [("k0.txt", b"x"), ("caf\xe9.txt", b"y"), ("caf\xe9.cls", b"1"), ("k2.txt", b"z")]:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    assert b"caf\xe9.txt" in tar.read_bytes()  # raw latin-1 bytes in the header
    dst = tmp_path / "dst"
    ok(capsys, tar, dst)
    assert set(samples(dst)) == {"k0", "k2"}
    [(source, reason)] = rejected(dst).items()
    assert source == str(tar) and "not valid UTF-8" in reason and "caf\\xe9" in reason


@needs_non_utf8_names
def test_non_utf8_names_in_files_npy_and_tar_folders(tmp_path, capsys):
    files, npys, tars = tmp_path / "files", tmp_path / "npy", tmp_path / "tars"
    write(files / "k0.txt", b"x")
    write(npys / "k0.npy", npy_bytes(np.zeros(2)))
    make_tar(tars / "a.tar", [("k0.txt", b"x")])
    for folder, name, data in [(files, b"caf\xe9.txt", b"y"), (npys, b"caf\xe9.npy", npy_bytes(np.ones(2))),
                               (tars, b"caf\xe9.tar", (tars / "a.tar").read_bytes())]:
        with open(os.fsencode(folder) + b"/" + name, "wb") as f:
            f.write(data)
    for folder in (files, npys):
        dst = tmp_path / f"out-{folder.name}"
        ok(capsys, folder, dst)
        assert set(samples(dst)) == {"k0"}
        [reason] = rejected(dst).values()
        assert "not valid UTF-8" in reason
    err = fatal(capsys, tars, tmp_path / "out-tars")  # a whole tar is not left out quietly
    assert "caf\\xe9.tar" in err and "not valid UTF-8" in err


# -- 21.4: a decompression bomb is a reject under --validate -------------------------------------
def png_header_only(width: int, height: int) -> bytes:
    """A PNG that claims width x height pixels (8-bit grey) and holds one empty IDAT."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def test_decompression_bomb_is_a_reject_under_validate(tmp_path, capsys):
    src = tmp_path / "src"
    write(src / "c0" / "ok.png", image_bytes(0, "PNG"))
    write(src / "c0" / "bomb.png", png_header_only(40_000, 40_000))  # 1.6 G pixels in 70 bytes
    write(src / "c0" / "gif.png", image_bytes(1, "GIF"))  # a GIF by its bytes: DALI cannot decode it
    dst = tmp_path / "dst"
    ok(capsys, src, dst, "--validate")
    assert set(samples(dst)) == {"c0/ok"}
    rej = rejected(dst)
    assert "too large to decode safely" in rej[str(src / "c0" / "bomb.png")]
    assert "1600000000 pixels" in rej[str(src / "c0" / "bomb.png")]
    assert "GIF images are not decoded by DALI" in rej[str(src / "c0" / "gif.png")]


# -- 46.1: a path in a Parquet image struct stays inside the Parquet file's folder ---------------
def test_parquet_struct_paths_resolve_only_inside_the_input_folder(tmp_path, capsys, secret):
    """An image struct with no bytes is read from its `path` relative to the Parquet file's folder;
    an absolute path, a URL (`file://` too), a `..` component or a link inside the folder is a
    rejected row naming the row and the path, and the file it names never reaches a shard."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    src = tmp_path / "src"
    write(src / "img" / "ok.jpg", image_bytes(1))
    os.symlink(secret, src / "img" / "link.jpg")
    hostile = [str(secret), "../outside/passwd", "img/../../outside/passwd", f"file://{secret}",
               "img/link.jpg", "memory://x/passwd", ""]
    structs = [{"bytes": image_bytes(0), "path": None}, {"bytes": None, "path": "img/ok.jpg"}] + \
        [{"bytes": None, "path": p} for p in hostile]
    t = pa.table({"image": pa.array(structs, pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
                  "label": list(range(len(structs)))})
    pq.write_table(t, src / "train.parquet")
    dst = tmp_path / "dst"
    out = ok(capsys, src / "train.parquet", dst)
    got = samples(dst)
    assert sorted(got) == ["0000000000", "0000000001"]
    assert got["0000000001"]["jpg"] == image_bytes(1)  # a relative path inside the folder still works
    assert SECRET[:32] not in shard_bytes(dst)
    rej = {r["key"]: r["reason"] for r in map(json.loads, (dst / "rejected.jsonl").read_text().splitlines())}
    assert sorted(rej) == [f"{k:010d}" for k in range(2, len(structs))]
    for k, path in enumerate(hostile, start=2):
        reason = rej[f"{k:010d}"]
        assert f"row {k}" in reason and "column 'image'" in reason, reason
        if path:
            assert repr(path) in reason, reason
    assert "absolute" in rej["0000000002"] and "'..'" in rej["0000000003"] and "'..'" in rej["0000000004"]
    assert "URL" in rej["0000000005"] and "URL" in rej["0000000007"]
    assert "symbolic link" in rej["0000000006"]
    assert f"{len(hostile)} inputs rejected" in out
