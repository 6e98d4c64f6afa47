"""Byte layout of one aligned tar member: `gdsload.format.tar.member_header` / `write_member`."""

from __future__ import annotations

import io
import shutil
import subprocess
import tarfile

import pytest

from gdsload.format.tar import (
    ALIGN,
    ALIGN_MIN_NBYTES,
    BLOCK,
    MTIME,
    end_of_archive,
    member_header,
    needs_alignment,
    write_member,
)

OFFSETS = list(range(0, ALIGN, BLOCK))  # every tar-legal offset in one 4 KiB window
SIZES = [0, 1, 511, 512, 4095, 4096, 4097, 1 << 20]


def _payload(n: int) -> bytes:
    return bytes((i * 7 + 3) % 251 for i in range(min(n, 4096))) * (n // 4096) + bytes(
        (i * 7 + 3) % 251 for i in range(n % 4096)
    )


def _archive(offset: int, name: str, payload: bytes) -> tuple[bytes, int, int]:
    """A complete tar whose member `name` starts at `offset` (after a filler member).

    Returns (archive bytes, data offset, next offset) as `write_member` reported them.
    """
    buf = io.BytesIO()
    pos = 0
    if offset:
        # an unaligned filler of (offset/512 - 1) blocks: header 512 + payload = offset
        _, pos = write_member(buf, 0, "filler.bin", b"f" * (offset - BLOCK))
        assert pos == offset
    data_off, nxt = write_member(buf, pos, name, payload)
    assert buf.tell() == nxt
    buf.write(end_of_archive())
    return buf.getvalue(), data_off, nxt


@pytest.mark.parametrize("size", SIZES)
def test_payload_alignment_every_offset(size: int) -> None:
    payload = _payload(size)
    for offset in OFFSETS + [1 << 30, (1 << 30) + 7 * BLOCK]:
        hdr = member_header("sample0001.bin", size, offset)
        assert len(hdr) % BLOCK == 0
        start = offset + len(hdr)
        if size >= ALIGN_MIN_NBYTES:
            assert needs_alignment(size)
            assert start % ALIGN == 0, (offset, size, len(hdr))
            # PAX header block + padding + ustar block: at most one 4 KiB window more than the
            # two blocks a padded member needs at least
            assert len(hdr) <= ALIGN + 2 * BLOCK
            if (offset + BLOCK) % ALIGN == 0:
                assert len(hdr) == BLOCK, "already aligned after a plain header: no padding"
            else:
                assert len(hdr) > 2 * BLOCK
        else:
            assert not needs_alignment(size)
            assert len(hdr) == BLOCK, "small payloads get a plain ustar header, no padding"
        if offset >= 1 << 30:
            continue
        data, data_off, nxt = _archive(offset, "sample0001.bin", payload)
        assert data_off == start
        assert nxt == data_off + -(-size // BLOCK) * BLOCK
        assert data[data_off : data_off + size] == payload
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tf:
            members = [m for m in tf if m.isreg()]
            names = [m.name for m in members]
            m = members[-1]
            assert m.name == "sample0001.bin"
            assert m.size == size
            assert m.offset_data == data_off
            assert tf.extractfile(m).read() == payload
        assert names == (["filler.bin"] if offset else []) + ["sample0001.bin"]


def test_explicit_align_for_small_payload() -> None:
    for offset in OFFSETS:
        hdr = member_header("k.cls", 3, offset, align=True)
        assert (offset + len(hdr)) % ALIGN == 0
        hdr = member_header("k.bin", 8192, offset, align=False)
        assert len(hdr) == BLOCK


@pytest.mark.parametrize("offset", [1, 100, 511, 513, 4095])
def test_unaligned_offset_is_refused(offset: int) -> None:
    with pytest.raises(ValueError, match=str(offset)):
        member_header("a.bin", 10, offset)


LONG_NAMES = [
    "d" * 60 + "/" + "k" * 60 + ".jpg",  # 125 bytes, ustar would split/truncate
    "x" * 99 + ".bin",  # 103 bytes
    "y" * 96 + ".bin",  # exactly 100 bytes: still ustar
    "z" * 480 + ".npy",  # PAX path record close to one block
    "a/" * 200 + "deep.json",  # 409 bytes with many parts
    "ü" * 40 + ".jpg",  # non-ASCII, < 100 bytes
    "日本語/キー_" + "é" * 80 + ".cls",  # non-ASCII, > 100 bytes
    "emoji_😀_key.txt",
]


@pytest.mark.parametrize("name", LONG_NAMES)
@pytest.mark.parametrize("size", [0, 10, 4096, 5000])
def test_long_and_non_ascii_names_round_trip(name: str, size: int) -> None:
    payload = _payload(size)
    for offset in OFFSETS:
        data, data_off, _ = _archive(offset, name, payload)
        if size >= ALIGN:
            assert data_off % ALIGN == 0
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:", encoding="utf-8") as tf:
            m = [m for m in tf if m.isreg()][-1]
            assert m.name == name
            assert m.size == size
            assert m.offset_data == data_off
            assert tf.extractfile(m).read() == payload


def test_header_fields_are_fixed() -> None:
    data, _, _ = _archive(1024, "k.bin", b"abc")
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tf:
        for m in tf:
            assert m.mtime == MTIME
            assert m.uid == 0 and m.gid == 0
            assert m.uname == "" and m.gname == ""
            assert m.mode == 0o644
            assert m.isreg()


def test_output_is_deterministic() -> None:
    def build() -> bytes:
        buf = io.BytesIO()
        off = 0
        for i, (name, size) in enumerate(
            [("a.jpg", 5000), ("a.cls", 1), (LONG_NAMES[0], 4096), (LONG_NAMES[6], 300), ("b.bin", 1 << 16)]
        ):
            _, off = write_member(buf, off, name, _payload(size + i))
        buf.write(end_of_archive())
        return buf.getvalue()

    first = build()
    assert build() == first
    for offset in OFFSETS:
        for size in SIZES:
            assert member_header("k/long" * 30 + ".npy", size, offset) == member_header(
                "k/long" * 30 + ".npy", size, offset
            )


@pytest.mark.skipif(shutil.which("tar") is None, reason="GNU tar not installed")
def test_gnu_tar_reads_padded_members(tmp_path) -> None:
    names = ["small.cls", "big.bin", LONG_NAMES[0], LONG_NAMES[6], "exact.bin"]
    sizes = [2, 10000, 4097, 4096, 4096]
    payloads = [_payload(s) for s in sizes]
    path = tmp_path / "t.tar"
    with open(path, "wb") as f:
        off = 0
        for name, p in zip(names, payloads):
            data_off, off = write_member(f, off, name, p)
            if len(p) >= ALIGN:
                assert data_off % ALIGN == 0
        f.write(end_of_archive())
    tar = shutil.which("tar")
    env = {"LC_ALL": "C.UTF-8", "PATH": "/usr/bin:/bin"}
    listed = subprocess.run(
        [tar, "--quoting-style=literal", "-tf", str(path)], capture_output=True, check=True, env=env
    )
    assert listed.stdout.decode("utf-8").splitlines() == names
    out = tmp_path / "x"
    out.mkdir()
    subprocess.run([tar, "-xf", str(path), "-C", str(out)], capture_output=True, check=True, env=env)
    for name, p in zip(names, payloads):
        assert (out / name).read_bytes() == p
