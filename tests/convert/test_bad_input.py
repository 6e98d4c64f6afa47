"""`gdsload convert` on hostile, broken or ambiguous input and on unsafe destinations.

Every fatal case must: exit 1 through `gdsload.cli.main`, print one clear line naming the file
(and the tar member) on stderr, write nothing outside DST, and leave no `manifest.json` in DST.
Per-file problems that lose one sample (empty file, non-image file, unreadable file, an image that
does not decode under `--validate`) are not fatal: the dataset is written and the file is listed
in `DST/rejected.jsonl` with a reason.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest
from convertkit import write
from PIL import Image

import gdsload
from gdsload.cli import main


# -- helpers -------------------------------------------------------------------------------------
def jpeg_bytes(seed: int, size: int = 48) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def tar_info(name: str, size: int = 0, type_: bytes = tarfile.REGTYPE, **kw) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.size = size
    ti.type = type_
    ti.mtime = 1_600_000_000
    for k, v in kw.items():
        setattr(ti, k, v)
    return ti


def make_tar(path: Path, members: list, fmt: int = tarfile.GNU_FORMAT) -> Path:
    """members: (name, bytes) for regular files, or ready TarInfo objects (no payload)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w", format=fmt) as tf:
        for m in members:
            if isinstance(m, tarfile.TarInfo):
                tf.addfile(m)
            else:
                name, data = m
                tf.addfile(tar_info(name, len(data)), io.BytesIO(data))
    return path


GOOD = [("good0.jpg", b"\xff\xd8" + b"g" * 6000), ("good0.cls", b"1")]


def snapshot(root: Path, skip: Path | None = None) -> dict[str, tuple]:
    """Everything under root (links not followed), except the tree at `skip`."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        d = Path(dirpath)
        if skip is not None:
            dirnames[:] = [n for n in dirnames if d / n != skip]
        for n in dirnames + filenames:
            p = d / n
            if skip is not None and p == skip:
                continue
            st = os.lstat(p)
            if os.path.islink(p):
                out[str(p.relative_to(root))] = ("link", os.readlink(p))
            elif p.is_file():
                out[str(p.relative_to(root))] = ("file", st.st_mode, hashlib.sha256(p.read_bytes()).hexdigest())
            else:
                out[str(p.relative_to(root))] = ("other", st.st_mode)
    return out


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["convert", *map(str, argv), "-q"])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def assert_fatal(capsys, tmp_path: Path, src, dst: Path, *needles: str, extra=()) -> str:
    """Run convert, expect exit 1 with every needle in one stderr line, nothing written outside DST."""
    before = snapshot(tmp_path, skip=dst)
    rc, out, err = run(capsys, src, dst, *extra)
    assert rc == 1, (out, err)
    assert err.startswith("gdsload convert: error: "), err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in err, (n, err)
    assert snapshot(tmp_path, skip=dst) == before
    assert not (dst / "manifest.json").exists()
    return err


def rejected(dst: Path) -> list[dict]:
    return [json.loads(line) for line in (dst / "rejected.jsonl").read_text().splitlines()]


# -- hostile tars --------------------------------------------------------------------------------
@pytest.mark.parametrize("absolute", ["/etc/passwd", "ABS_IN_TMP"])
def test_tar_member_with_absolute_path_is_refused(tmp_path, capsys, absolute):
    if absolute == "ABS_IN_TMP":
        absolute = str(tmp_path / "written-by-attacker.txt")
    tar = make_tar(tmp_path / "in" / "evil.tar", GOOD + [(absolute, b"root:x:0:0\n")])
    assert absolute in tarfile.open(tar).getnames()  # the name really is absolute in the tar
    err = assert_fatal(capsys, tmp_path, tar, tmp_path / "dst", "evil.tar", repr(absolute), "absolute")
    assert not (tmp_path / "written-by-attacker.txt").exists()
    assert "refusing" in err


@pytest.mark.parametrize("name", ["../evil.txt", "sub/../../evil.txt", "a/..\\..\\evil.txt"])
def test_tar_member_with_dotdot_traversal_is_refused(tmp_path, capsys, name):
    tar = make_tar(tmp_path / "in" / "trav.tar", GOOD + [(name, b"pwned")])
    assert_fatal(capsys, tmp_path, tar, tmp_path / "out" / "dst", "trav.tar", repr(name), "'..'")
    assert not (tmp_path / "evil.txt").exists() and not (tmp_path / "out" / "evil.txt").exists()


@pytest.mark.parametrize(
    "type_, word, target",
    [(tarfile.SYMTYPE, "symbolic link", "/etc/shadow"), (tarfile.LNKTYPE, "hard link", "good0.jpg")],
)
def test_tar_link_members_are_refused(tmp_path, capsys, type_, word, target):
    tar = make_tar(tmp_path / "in" / "links.tar", GOOD + [tar_info("alias.jpg", 0, type_, linkname=target)])
    assert_fatal(capsys, tmp_path, tar, tmp_path / "dst", "links.tar", "'alias.jpg'", word, repr(target))


@pytest.mark.parametrize("type_", [tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.FIFOTYPE])
def test_tar_device_and_fifo_members_are_refused(tmp_path, capsys, type_):
    special = tar_info("weird.bin", 0, type_, devmajor=1, devminor=3)
    tar = make_tar(tmp_path / "in" / "dev.tar", GOOD + [special])
    assert_fatal(capsys, tmp_path, tar, tmp_path / "dst", "dev.tar", "'weird.bin'", "device, FIFO")


def test_tar_with_oversized_pax_header_is_refused(tmp_path, capsys):
    big = tar_info("a.txt", 3, pax_headers={"comment": "x" * (2 << 20)})
    path = tmp_path / "in" / "pax.tar"
    path.parent.mkdir()
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        tf.addfile(tar_info("first.txt", 2), io.BytesIO(b"ok"))
        tf.addfile(big, io.BytesIO(b"abc"))
    assert path.stat().st_size > 2 << 20
    err = assert_fatal(capsys, tmp_path, path, tmp_path / "dst", "pax.tar", "extended header", "limit 1048576")
    assert "offset 1024" in err  # the header after first.txt (512 header + 512 data)


def test_tar_with_oversized_gnu_longname_is_refused(tmp_path, capsys):
    path = tmp_path / "in" / "gnu.tar"
    make_tar(path, [(("d" * 200 + "/") * 6000 + "x.txt", b"abc")], fmt=tarfile.GNU_FORMAT)
    assert_fatal(capsys, tmp_path, path, tmp_path / "dst", "gnu.tar", "extended header", "limit")


@pytest.mark.parametrize("where", ["first", "last"])
def test_truncated_tar_is_refused(tmp_path, capsys, where):
    members = [("s0.bin", os.urandom(10_000)), ("s1.bin", os.urandom(10_000))]
    full = make_tar(tmp_path / "full.tar", members)
    with tarfile.open(full) as tf:
        m = tf.getmember("s0.bin" if where == "first" else "s1.bin")
    cut = full.read_bytes()[: m.offset_data + m.size // 2]  # in the middle of the member's data
    tar = write(tmp_path / "in" / "cut.tar", cut)
    assert_fatal(capsys, tmp_path, tar, tmp_path / "dst", "cut.tar", repr(m.name), "truncated")


def test_garbage_file_named_tar_is_refused(tmp_path, capsys):
    tar = write(tmp_path / "in" / "junk.tar", b"this is not a tar file at all" * 100)
    assert_fatal(capsys, tmp_path, tar, tmp_path / "dst", "junk.tar")


def test_compressed_tar_is_refused_with_hint(tmp_path, capsys):
    write(tmp_path / "in" / "data.tar.gz", b"\x1f\x8b" + b"\0" * 100)
    assert_fatal(capsys, tmp_path, tmp_path / "in" / "data.tar.gz", tmp_path / "dst", "data.tar.gz",
                 "decompress", extra=["--format", "tar"])


@pytest.mark.parametrize("name", [
    "my key.jpg",
    "tab\there.jpg",
    "line\nbreak.jpg",
])
def test_tar_keys_with_whitespace_are_refused(tmp_path, capsys, name):
    tar = make_tar(tmp_path / "in" / "ws.tar", GOOD + [(name, b"data")])
    key = name.split(".")[0]
    assert_fatal(capsys, tmp_path, tar, tmp_path / "dst", "ws.tar", repr(key), "whitespace")


def test_tar_member_without_extension_is_refused(tmp_path, capsys):
    tar = make_tar(tmp_path / "in" / "noext.tar", GOOD + [("README", b"hello")])
    assert_fatal(capsys, tmp_path, tar, tmp_path / "dst", "noext.tar", "'README'", "no extension")


# -- duplicate keys ------------------------------------------------------------------------------
def test_imagefolder_duplicate_key_from_two_extensions(tmp_path, capsys):
    src = tmp_path / "src"
    write(src / "a" / "x.jpg", jpeg_bytes(1))
    write(src / "a" / "x.png", b"\x89PNG fake")
    write(src / "a" / "y.jpg", jpeg_bytes(2))
    err = assert_fatal(capsys, tmp_path, src, tmp_path / "dst", "duplicate", "'a/x'")
    assert str(src / "a" / "x.jpg") in err and str(src / "a" / "x.png") in err


def test_tar_duplicate_key_in_two_non_adjacent_places(tmp_path, capsys):
    tar = make_tar(tmp_path / "in" / "dup.tar", [("x.jpg", b"1" * 100), ("y.jpg", b"2" * 100), ("x.txt", b"3")])
    with tarfile.open(tar) as tf:
        offs = [m.offset_data for m in tf]
    err = assert_fatal(capsys, tmp_path, tar, tmp_path / "dst", "duplicate", "'x'", "dup.tar")
    assert f"'x.jpg' at offset {offs[0]}" in err and f"'x.txt' at offset {offs[2]}" in err


def test_tar_duplicate_key_across_two_tars(tmp_path, capsys):
    make_tar(tmp_path / "tars" / "a.tar", [("k.jpg", b"1")])
    make_tar(tmp_path / "tars" / "b.tar", [("k.jpg", b"2")])
    err = assert_fatal(capsys, tmp_path, tmp_path / "tars", tmp_path / "dst", "duplicate", "'k'")
    assert "a.tar" in err and "b.tar" in err


def test_tar_same_field_twice_in_one_sample(tmp_path, capsys):
    tar = make_tar(tmp_path / "in" / "twice.tar", [("x.jpg", b"1"), ("x.jpg", b"2")])
    assert_fatal(capsys, tmp_path, tar, tmp_path / "dst", "twice.tar", "x.jpg", "twice")


def test_files_folder_duplicate_field_differing_in_case(tmp_path, capsys):
    src = tmp_path / "src"
    write(src / "x.jpg", b"lower")
    write(src / "x.JPG", b"upper")
    write(src / "x.txt", b"caption")
    if len(os.listdir(src)) < 3:
        pytest.skip("case-insensitive file system")
    err = assert_fatal(capsys, tmp_path, src, tmp_path / "dst", "duplicate field x.jpg")
    assert str(src / "x.jpg") in err and str(src / "x.JPG") in err


# -- non-fatal rejects ---------------------------------------------------------------------------
def test_empty_and_non_image_files_in_imagefolder_are_rejected_not_fatal(tmp_path, capsys):
    src = tmp_path / "src"
    write(src / "cat" / "ok.jpg", jpeg_bytes(1))
    write(src / "cat" / "empty.jpg", b"")
    write(src / "dog" / "notes.txt", b"not an image")
    write(src / "dog" / "Makefile", b"all:")
    write(src / "dog" / "ok2.png", b"\x89PNG whatever")
    dst = tmp_path / "dst"
    rc, out, err = run(capsys, src, dst, "--workers", "1")
    assert rc == 0, err
    assert "3 inputs rejected" in out and "rejected.jsonl" in out
    rej = {Path(r["source"]).name: r for r in rejected(dst)}
    assert set(rej) == {"empty.jpg", "notes.txt", "Makefile"}
    assert rej["empty.jpg"]["reason"] == "empty file (0 bytes)"
    assert rej["empty.jpg"]["source"] == str(src / "cat" / "empty.jpg")
    assert rej["empty.jpg"]["key"] == "cat/empty"
    assert "not an image" in rej["notes.txt"]["reason"] and "'txt'" in rej["notes.txt"]["reason"]
    assert "no extension" in rej["Makefile"]["reason"]
    with gdsload.open_dataset(dst) as ds:
        assert sorted(ds.keys()) == ["cat/ok", "dog/ok2"]
        assert ds.manifest["created"]["rejected"] == 3
        assert ds.manifest["classes"] == ["cat", "dog"]


def test_links_in_imagefolder_are_rejected_not_followed(tmp_path, capsys):
    src = tmp_path / "src"
    write(src / "cat" / "ok.jpg", jpeg_bytes(1))
    os.symlink(tmp_path / "does-not-exist.jpg", src / "cat" / "gone.jpg")
    os.symlink(src / "cat" / "ok.jpg", src / "cat" / "alias.jpg")  # a working link is not followed either
    dst = tmp_path / "dst"
    rc, out, err = run(capsys, src, dst, "--workers", "1")
    assert rc == 0, err
    assert "2 inputs rejected" in out
    rej = {r["source"]: r["reason"] for r in rejected(dst)}
    assert set(rej) == {str(src / "cat" / "gone.jpg"), str(src / "cat" / "alias.jpg")}
    assert all(r.startswith("symbolic link") and "not followed" in r for r in rej.values())
    with gdsload.open_dataset(dst) as ds:
        got = {s["__key__"]: s["jpg"] for s in ds.iter_samples()}
    assert got == {"cat/ok": jpeg_bytes(1)}


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root reads chmod-000 files")
def test_chmod_000_file_in_imagefolder_is_rejected_as_unreadable(tmp_path, capsys):
    src = tmp_path / "src"
    write(src / "cat" / "ok.jpg", jpeg_bytes(1))
    locked = write(src / "cat" / "locked.jpg", jpeg_bytes(2))
    locked.chmod(0)
    try:
        dst = tmp_path / "dst"
        rc, out, err = run(capsys, src, dst, "--workers", "1")
        assert rc == 0, err
        [r] = rejected(dst)
        assert r["source"] == str(locked) and "unreadable" in r["reason"]
    finally:
        locked.chmod(0o644)


def test_corrupt_jpeg_with_validate_is_rejected_and_named(tmp_path, capsys):
    src = tmp_path / "src"
    good = jpeg_bytes(1, 96)
    write(src / "cat" / "good.jpg", good)
    write(src / "cat" / "truncated.jpg", jpeg_bytes(2, 96)[:600])
    write(src / "cat" / "garbage.jpg", os.urandom(3000))
    dst = tmp_path / "dst"
    rc, out, err = run(capsys, src, dst, "--workers", "1", "--validate")
    assert rc == 0, err
    assert "2 inputs rejected" in out
    rej = {Path(r["source"]).name: r["reason"] for r in rejected(dst)}
    assert set(rej) == {"truncated.jpg", "garbage.jpg"}
    assert rej["truncated.jpg"].startswith("invalid: corrupt image")
    assert "not a decodable image" in rej["garbage.jpg"]
    with gdsload.open_dataset(dst) as ds:
        assert [s["jpg"] for s in ds.iter_samples()] == [good]
        assert ds.manifest["created"]["rejected"] == 2


def test_corrupt_jpeg_without_validate_passes_through_unchecked(tmp_path, capsys):
    src = tmp_path / "src"
    bad = jpeg_bytes(2, 96)[:600]
    write(src / "cat" / "good.jpg", jpeg_bytes(1, 96))
    write(src / "cat" / "truncated.jpg", bad)
    dst = tmp_path / "dst"
    rc, out, err = run(capsys, src, dst, "--workers", "1")
    assert rc == 0, err
    assert "rejected" not in out
    assert not (dst / "rejected.jsonl").exists()
    with gdsload.open_dataset(dst) as ds:
        got = {s["__key__"]: s["jpg"] for s in ds.iter_samples()}
    assert got["cat/truncated"] == bad  # stored byte-for-byte, not decoded


def test_all_inputs_rejected_is_fatal(tmp_path, capsys):
    src = tmp_path / "src"
    write(src / "cat" / "empty.jpg", b"")
    write(src / "cat" / "notes.txt", b"x")
    err = assert_fatal(capsys, tmp_path, src, tmp_path / "dst", "nothing to convert", "2 inputs")
    assert "empty.jpg" in err or "notes.txt" in err


# -- paths and destinations ----------------------------------------------------------------------
def test_missing_src(tmp_path, capsys):
    assert_fatal(capsys, tmp_path, tmp_path / "nope", tmp_path / "dst", str(tmp_path / "nope"), "no such file")
    assert not (tmp_path / "dst").exists()
    assert_fatal(capsys, tmp_path, tmp_path / "nope.tar", tmp_path / "dst", "nope.tar", "no such file")


def test_dst_inside_src_is_refused(tmp_path, capsys):
    src = tmp_path / "src"
    write(src / "cat" / "a.jpg", jpeg_bytes(1))
    before = snapshot(tmp_path)
    for dst in (src / "out", src / "cat" / "deeper" / "out", src):
        rc, out, err = run(capsys, src, dst)
        assert rc == 1
        assert "inside the source" in err and str(dst) in err
        assert snapshot(tmp_path) == before  # nothing created, not even DST


def test_dst_holding_a_dataset_is_refused_and_left_untouched(tmp_path, capsys):
    src = tmp_path / "src"
    write(src / "cat" / "a.jpg", jpeg_bytes(1))
    write(src / "cat" / "empty.jpg", b"")
    dst = tmp_path / "dst"
    rc, _, err = run(capsys, src, dst, "--workers", "1")
    assert rc == 0, err
    write(src / "cat" / "b.jpg", jpeg_bytes(2))  # the new run would produce other bytes
    before = snapshot(tmp_path)
    for extra in ([], ["--resume"]):
        rc, out, err = run(capsys, src, dst, *extra)
        assert rc == 1
        assert "already holds a dataset" in err and "--overwrite" in err and str(dst) in err
        assert snapshot(tmp_path) == before  # byte for byte, mode for mode


def test_dst_with_unrelated_files_is_refused_even_with_overwrite(tmp_path, capsys):
    src = tmp_path / "src"
    write(src / "cat" / "a.jpg", jpeg_bytes(1))
    dst = tmp_path / "dst"
    write(dst / "notes.txt", b"my precious notes")
    write(dst / "results" / "run1.csv", b"1,2,3")
    before = snapshot(tmp_path)
    for extra in ([], ["--overwrite"], ["--resume"]):
        rc, out, err = run(capsys, src, dst, *extra)
        assert rc == 1
        assert "not gdsload's" in err and "notes.txt" in err and "results" in err
        assert snapshot(tmp_path) == before
    # unrelated files next to a real dataset are not removed by --overwrite either
    rc, _, err = run(capsys, src, tmp_path / "ds", "--workers", "1")
    assert rc == 0, err
    write(tmp_path / "ds" / "README.md", b"keep me")
    before = snapshot(tmp_path)
    rc, _, err = run(capsys, src, tmp_path / "ds", "--overwrite")
    assert rc == 1 and "README.md" in err
    assert snapshot(tmp_path) == before


def test_dst_that_is_a_file_is_refused(tmp_path, capsys):
    src = tmp_path / "src"
    write(src / "cat" / "a.jpg", jpeg_bytes(1))
    write(tmp_path / "dst", b"a file")
    assert_fatal(capsys, tmp_path, src, tmp_path / "dst", "not a folder")
    assert (tmp_path / "dst").read_bytes() == b"a file"


def test_user_tar_and_idx_files_in_dst_are_not_deleted(tmp_path, capsys):
    src = tmp_path / "src"
    write(src / "cat" / "a.jpg", jpeg_bytes(1))
    dst = tmp_path / "dst"
    write(dst / "backup.tar", b"user data")
    write(dst / "notes.idx", b"user index")
    run(capsys, src, dst, "--workers", "1")
    assert (dst / "backup.tar").is_file() and (dst / "notes.idx").is_file()
    assert (dst / "backup.tar").read_bytes() == b"user data"
    assert (dst / "notes.idx").read_bytes() == b"user index"


def test_converting_tars_into_their_own_folder_keeps_the_inputs(tmp_path, capsys):
    make_tar(tmp_path / "data" / "train-0.tar", [("a.bin", b"x" * 5000)])
    make_tar(tmp_path / "data" / "train-1.tar", [("b.bin", b"y" * 5000)])
    before = snapshot(tmp_path / "data")
    rc, out, err = run(capsys, tmp_path / "data" / "train-{0..1}.tar", tmp_path / "data", "--workers", "1")
    after = snapshot(tmp_path / "data")
    # either refused, or converted; never the inputs destroyed
    assert {k: v for k, v in after.items() if k.startswith("train-")} == before


def test_overwrite_replaces_a_dataset(tmp_path, capsys):
    rng = np.random.default_rng(0)
    a = tmp_path / "a"
    for i in range(12):
        write(a / "cat" / f"{i}.jpg", rng.bytes(9000))
    write(a / "cat" / "empty.jpg", b"")
    b = tmp_path / "b"
    write(b / "dog" / "only.jpg", jpeg_bytes(5))
    dst = tmp_path / "dst"
    rc, _, err = run(capsys, a, dst, "--workers", "1", "--shard-size", "32KB")
    assert rc == 0, err
    old = json.loads((dst / "manifest.json").read_text())
    assert len(old["shards"]) >= 3 and (dst / "rejected.jsonl").exists()

    rc, out, err = run(capsys, b, dst, "--workers", "1", "--overwrite")
    assert rc == 0, err
    with gdsload.open_dataset(dst) as ds:
        assert ds.verify() == {}
        assert ds.keys() == ["dog/only"] and ds.classes == ["dog"]
        assert ds.sample(0)["jpg"] == jpeg_bytes(5)
    # nothing of the old dataset is left: no stale shards, indexes or rejects
    assert sorted(os.listdir(dst)) == ["manifest.json", "shard-000000.dali.idx", "shard-000000.idx", "shard-000000.tar"]
