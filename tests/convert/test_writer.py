"""`gdsload.ShardWriter` and `gdsload.write(fn, inputs, dst, workers)`: round trip of every value
type, output bytes independent of the worker count, kill and resume, collisions, rejects."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import gdsload
from gdsload.convert.writer import WriteFnError
from gdsload.dataset.sharded import open_dataset
from gdsload.errors import DestinationError, FormatError, InputError
from convertkit import die

ROOT = Path(__file__).resolve().parents[2]


def jpeg(i: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((16, 16, 3), i % 256, np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


def sample_of(i: int) -> dict:
    """Every value type the writer takes, including a big aligned tensor and a Fortran array."""
    rng = np.random.default_rng(i)
    return {
        "__key__": f"s{i:05d}",
        "jpg": jpeg(i),
        "cls": i % 3,
        "txt": f"caption {i} ünïcode",
        "emb.npy": rng.standard_normal((3, 5)).astype(np.float32),
        "big.npy": np.asfortranarray(rng.integers(0, 100, (40, 60), dtype=np.int32)),
        "json": {"i": i, "tags": ["a", "b"], "score": 0.5},
        "raw.bin": bytearray(b"\x00\x01" * (i + 1)),
        "meta.json": [i, None, True],
    }


def test_round_trip_every_field_type(tmp_path):
    src = [sample_of(i) for i in range(12)]
    with gdsload.ShardWriter(tmp_path / "ds", shard_size="40KB", classes=["a", "b", "c"]) as w:
        for s in src:
            w.write(s)
    m = w.manifest
    assert len(m["shards"]) > 1 and m["num_samples"] == 12 and m["classes"] == ["a", "b", "c"]
    assert m["fields"] == {"big.npy": "tensor", "cls": "label", "emb.npy": "tensor", "jpg": "image",
                           "json": "json", "meta.json": "json", "raw.bin": "bytes", "txt": "text"}
    ds = open_dataset(tmp_path / "ds")
    assert ds.verify() == {}
    for i, s in enumerate(src):
        got = ds.sample(i)
        assert got["__key__"] == s["__key__"]
        assert got["jpg"] == s["jpg"]
        assert int(got["cls"]) == s["cls"]
        assert got["txt"].decode() == s["txt"]
        for f in ("emb.npy", "big.npy"):
            arr = np.load(io.BytesIO(got[f]))
            assert arr.dtype == s[f].dtype and np.array_equal(arr, s[f]) and arr.flags.c_contiguous
        assert json.loads(got["json"]) == s["json"] and json.loads(got["meta.json"]) == s["meta.json"]
        assert got["raw.bin"] == bytes(s["raw.bin"])
    # tensors of 4 KiB or more have their data 4 KiB-aligned in the tar
    assert ds.alignment()["aligned"] == ds.alignment()["payloads_4k_or_more"] > 0


def test_values_that_cannot_be_stored_are_refused(tmp_path):
    with pytest.raises(FormatError, match="__key__"), gdsload.ShardWriter(tmp_path / "a") as w:
        w.write({"jpg": b"x"})
    with pytest.raises(FormatError, match="name the field NAME.npy"), gdsload.ShardWriter(tmp_path / "b") as w:
        w.write({"__key__": "k", "data": np.zeros(3)})
    with pytest.raises(FormatError, match="type object"), gdsload.ShardWriter(tmp_path / "c") as w:
        w.write({"__key__": "k", "x": object()})
    with pytest.raises(FormatError, match="not a decimal integer"), gdsload.ShardWriter(tmp_path / "d") as w:
        w.write({"__key__": "k", "cls": "cat"})
    for d in "abcd":  # nothing that looks like a dataset is left
        assert not (tmp_path / d / "manifest.json").exists()
        assert not [n for n in os.listdir(tmp_path / d) if n.endswith(".tar")]


def nothing_written(root: Path) -> bool:
    """No dataset and no shard at `root` (a refused write leaves nothing that looks like one)."""
    return not (root / "manifest.json").exists() and not [n for n in os.listdir(root) if n.endswith(".tar")]


@pytest.mark.parametrize("second, message", [
    ({"__key__": "k1", "jpg": b"x"}, r"sample 'k1': its fields \['jpg'\] are not the dataset's \['cls', 'jpg'\] "
                                     r"\(missing \['cls'\]\); a dataset's fields are its first sample's"),
    ({"__key__": "k1", "jpg": b"x", "cls": 1, "txt": "hi"}, r"sample 'k1': .*\(not in the dataset \['txt'\]\)"),
    ({"__key__": "k1", "png": b"x", "cls": 1}, r"sample 'k1': .*\(missing \['jpg'\]; not in the dataset \['png'\]\)"),
])
def test_a_sample_with_other_fields_than_the_first_is_refused_at_write_time(tmp_path, second, message):
    """Issue 46 row 13: the dataset's fields are the first sample's; a later sample with a field
    missing or extra is refused when written, naming the sample and the field (it used to be
    written, and the loader failed on it)."""
    with pytest.raises(InputError, match=message), gdsload.ShardWriter(tmp_path / "ds") as w:
        w.write({"__key__": "k0", "jpg": b"x", "cls": 0})
        w.write(second)
    assert nothing_written(tmp_path / "ds")


def test_a_field_name_without_an_extension_is_refused(tmp_path):
    """Issue 46 row 13: `{"image": ..., "label": 1}` is refused naming the fields and the NAME.EXT
    form (it used to be stored as raw bytes, a field no loader decodes); a known extension alone
    (`jpg`, `cls`, `bin`) or NAME.EXT (`raw.bin`, `x.foo`) is a field name."""
    with pytest.raises(InputError, match=r"sample 'k0': fields 'image', 'label' have no extension; name a field "
                                         r"NAME.EXT \(e.g. 'image.jpg', .*'image.bin' for raw bytes\)"):
        with gdsload.ShardWriter(tmp_path / "a") as w:
            w.write({"__key__": "k0", "image": b"\xff\xd8\xff", "label": 1})
    assert nothing_written(tmp_path / "a")
    with pytest.raises(InputError, match=r"field 'caption.' has no extension"), gdsload.ShardWriter(tmp_path / "b") as w:
        w.write({"__key__": "k0", "jpg": b"x", "caption.": "hi"})
    with gdsload.ShardWriter(tmp_path / "c") as w:
        w.write({"__key__": "k0", "jpg": b"x", "cls": 1, "bin": b"y", "raw.bin": b"z", "x.foo": b"w"})
    assert sorted(w.manifest["fields"]) == ["bin", "cls", "jpg", "raw.bin", "x.foo"]


@pytest.mark.parametrize("workers, executor", [(1, "process"), (2, "process"), (2, "thread")])
def test_write_refuses_a_sample_whose_fields_differ_naming_it_and_its_input(tmp_path, workers, executor):
    def fn(i):
        return {"__key__": f"k{i}", "bin": b"x" * 3000, **({"cls": i} if i != 7 else {})}

    with pytest.raises(InputError, match=r"sample 'k7' \(input 7 \(7\)\): .*\(missing \['cls'\]\)"):
        gdsload.write(fn, range(10), tmp_path / "ds", shard_size="20KB", workers=workers, executor=executor,
                      progress=False)
    assert nothing_written(tmp_path / "ds")
    with pytest.raises(InputError, match=r"sample 'k0' \(input 0 \(0\)\): field 'label' has no extension"):
        gdsload.write(lambda i: {"__key__": f"k{i}", "label": i}, range(3), tmp_path / "ds2", workers=workers,
                      executor=executor, progress=False)


def gen(i: int):
    """Zero to three samples per input (filtering is free); sizes vary so shards cut unevenly."""
    for j in range(i % 4):
        yield {"__key__": f"in{i:03d}_{j}", "bin": bytes([i % 256, j]) * (500 + 37 * i), "cls": j}


def shard_files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.name != "manifest.json"}


def stable(m: dict) -> dict:
    m = json.loads(json.dumps(m))
    m["created"].pop("at")
    return m


def test_same_bytes_for_1_and_4_workers(tmp_path):
    m1 = gdsload.write(gen, range(60), tmp_path / "w1", shard_size="24KB", progress=False)
    m4 = gdsload.write(gen, range(60), tmp_path / "w4", shard_size="24KB", workers=4, progress=False)
    assert m1["num_samples"] == sum(i % 4 for i in range(60)) and len(m1["shards"]) > 3
    m4t = gdsload.write(gen, range(60), tmp_path / "w4t", shard_size="24KB", workers=4, executor="thread",
                        progress=False)
    assert shard_files(tmp_path / "w1") == shard_files(tmp_path / "w4") == shard_files(tmp_path / "w4t")
    assert stable(m1) == stable(m4) == stable(m4t)
    keys = [k for i in range(len(m1["shards"])) for k in open_dataset(tmp_path / "w1").index(i).keys()]
    assert keys == [f"in{i:03d}_{j}" for i in range(60) for j in range(i % 4)]  # input order


def test_key_collision_names_both_inputs_and_leaves_nothing(tmp_path):
    def fn(i):
        return {"__key__": "same" if i in (3, 7) else f"k{i}", "bin": b"x" * 100}

    with pytest.raises(InputError, match=r"duplicate sample key 'same': input 3 \(3\) and input 7 \(7\)"):
        gdsload.write(fn, range(10), tmp_path / "ds", workers=2, progress=False)
    assert not [n for n in os.listdir(tmp_path / "ds") if not n.startswith(".gdsload.lock")]


def test_error_in_fn_names_the_input_and_keeps_finished_shards(tmp_path):
    def fn(i):
        if i == 40:
            raise ValueError("broken record")
        yield {"__key__": f"k{i}", "bin": os.urandom(3000)}

    with pytest.raises(WriteFnError, match="input 40: ValueError: broken record"):
        gdsload.write(fn, range(50), tmp_path / "thr", shard_size="20KB", workers=3, executor="thread", progress=False)
    with pytest.raises(WriteFnError, match="input 40: ValueError: broken record"):
        gdsload.write(fn, range(50), tmp_path / "ds", shard_size="20KB", workers=2, progress=False)
    assert (tmp_path / "ds" / ".gdsload-convert").is_dir() and not (tmp_path / "ds" / "manifest.json").exists()
    with pytest.raises(DestinationError, match="interrupted conversion; pass resume=True"):
        gdsload.write(fn, range(50), tmp_path / "ds", progress=False)


def test_rejects_are_recorded_with_reasons(tmp_path):
    def fn(i):
        if i == 2:
            return {"__key__": "bad-label", "cls": "not a number"}
        if i == 4:
            return {"__key__": "gone", "__reject__": "source row was deleted"}
        return {"__key__": f"k{i}", "cls": i}

    m = gdsload.write(fn, range(6), tmp_path / "ds", progress=False)
    assert m["num_samples"] == 4 and m["created"]["rejected"] == 2
    rejects = [json.loads(line) for line in (tmp_path / "ds" / "rejected.jsonl").read_text().splitlines()]
    assert [(r["key"], r["source"]) for r in rejects] == [("bad-label", "input 2 (2)"), ("gone", "input 4 (4)")]
    assert "not a decimal integer" in rejects[0]["reason"] and rejects[1]["reason"] == "source row was deleted"


KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    import gdsload

    def fn(i):
        if i == int(os.environ.get("KILL_AT", "-1")):
            os.kill(os.getpid(), signal.SIGKILL)  # mid-shard: the current shard is half written
        for j in range(2):
            yield {"__key__": f"k{i:03d}_{j}", "bin": bytes([i, j]) * 1500, "cls": j}

    gdsload.write(fn, range(40), sys.argv[1], shard_size="30KB", resume=len(sys.argv) > 2, progress=False)
""")


def test_killed_mid_shard_then_resume_gives_the_same_dataset(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(KILL_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ref = subprocess.run([sys.executable, str(script), str(tmp_path / "ref")], env=env, timeout=60, check=False)
    assert ref.returncode == 0
    killed = subprocess.run([sys.executable, str(script), str(tmp_path / "ds")], timeout=60, check=False,
                            env={**env, "KILL_AT": "27"})
    assert killed.returncode == -signal.SIGKILL
    dst = tmp_path / "ds"
    assert not (dst / "manifest.json").exists()
    done = sorted(os.listdir(dst / ".gdsload-convert" / "done"))
    assert len(done) >= 2  # finished shards were recorded before the kill
    assert any(n.startswith(".") and ".tmp-" in n for n in os.listdir(dst))  # the half-written shard
    first_kept = (dst / "shard-000000.tar").stat().st_mtime_ns
    resumed = subprocess.run([sys.executable, str(script), str(dst), "resume"], env=env, timeout=60, check=False)
    assert resumed.returncode == 0
    assert (dst / "shard-000000.tar").stat().st_mtime_ns == first_kept  # kept, not rewritten
    assert shard_files(dst) == shard_files(tmp_path / "ref")
    assert open_dataset(dst).verify() == {}


def test_shardwriter_resume_skips_what_was_written(tmp_path):
    samples = [{"__key__": f"k{i}", "bin": os.urandom(2500)} for i in range(30)]
    w = gdsload.ShardWriter(tmp_path / "ds", shard_size="20KB")
    for s in samples[:20]:
        w.write(s)
    die(w)  # the process "dies": lock released, nothing finished
    kept = sorted(n for n in os.listdir(tmp_path / "ds" / ".gdsload-convert" / "done"))
    assert kept
    with gdsload.ShardWriter(tmp_path / "ds", shard_size="20KB", resume=True) as w2:
        for s in samples:
            w2.write(s)
    ds = open_dataset(tmp_path / "ds")
    assert [ds.sample(i)["__key__"] for i in range(len(ds))] == [s["__key__"] for s in samples]
    assert all(ds.sample(i)["bin"] == samples[i]["bin"] for i in range(30))
    with pytest.raises(DestinationError, match="already holds a dataset"):
        gdsload.ShardWriter(tmp_path / "ds")


def test_import_gdsload_exports_the_writer_lazily():
    code = ("import sys, gdsload; assert 'gdsload.convert.writer' not in sys.modules; "
            "assert gdsload.ShardWriter.__module__ == 'gdsload.convert.writer'; "
            "assert callable(gdsload.write); assert 'pyarrow' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)


def test_shard_bytes_are_written_and_hashed_in_order_off_the_callers_thread(tmp_path):
    """ShardFile hands its bytes to a write thread and a hash thread (`_Pipe`): a bytearray
    payload reused by the caller right after `add` is stored as it was, big and small members keep
    their order, the manifest hash is the file's, and a write error surfaces in the caller."""
    import hashlib

    from gdsload.convert import shards

    buf = bytearray(b"a" * (300 << 10))  # above the gathering threshold: queued as one item
    w = shards.ShardFile(tmp_path, "s")
    w.add("k0", {"bin": buf, "txt": b"small"})
    buf[:] = b"b" * len(buf)  # the caller reuses its buffer
    w.add("k1", {"bin": memoryview(buf), "txt": b"tiny"})
    buf[:] = b"c" * len(buf)
    entry = w.close()
    data = (tmp_path / "s.tar").read_bytes()
    assert hashlib.sha256(data).hexdigest() == entry["sha256"] and len(data) == entry["bytes"]
    from gdsload.format.index import ShardIndex

    idx = ShardIndex.from_bytes((tmp_path / "s.idx").read_bytes())
    got = {}
    for i, key in enumerate(idx.keys()):
        for ext, off, n in idx.members(i):
            got[(key, ext)] = data[off:off + n]
    assert got[("k0", "bin")] == b"a" * (300 << 10) and got[("k1", "bin")] == b"b" * (300 << 10)
    assert got[("k0", "txt")] == b"small" and got[("k1", "txt")] == b"tiny"

    class Broken:
        def write(self, data):
            raise OSError(28, "No space left on device: /x/.s.tar.tmp")

    pipe = shards._Pipe(Broken().write, hashlib.sha256().update, limit=1 << 20)
    with pytest.raises(OSError, match="No space left"):
        for _ in range(64):
            pipe.put(b"x" * (512 << 10))
        pipe.finish()


def test_small_arrays_are_packed_and_big_ones_aligned(tmp_path):
    """Issue 50 item 4: a 514-byte row is stored with NumPy's own npy header, packed (<= 3.3x its
    bytes on disk, dataset files included; every array padded to 4 KiB took 16x), while an array
    of 4 KiB or more keeps its data on a 4 KiB boundary; the loader reads both back exactly."""
    from gdsload import DataLoader
    from gdsload.format.tar import ALIGN

    n = 600
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, 50_000, (n, 257), dtype=np.uint16)  # 514 bytes per row
    big = rng.standard_normal((n, 1024)).astype(np.float32)  # 4,096 bytes per row
    with gdsload.ShardWriter(tmp_path / "tok") as w:
        for i in range(n):
            w.write({"__key__": f"{i:05d}", "tokens.npy": tokens[i]})
    on_disk = sum(p.stat().st_size for p in (tmp_path / "tok").rglob("*") if p.is_file())
    assert on_disk <= 3.3 * tokens.nbytes, on_disk / tokens.nbytes

    with gdsload.ShardWriter(tmp_path / "both", shard_size="1MB") as w:
        for i in range(n):
            w.write({"__key__": f"{i:05d}", "tokens.npy": tokens[i], "big.npy": big[i]})
    ds = open_dataset(tmp_path / "both")
    assert ds.verify() == {} and len(ds.shards) > 1
    small_heads = set()
    for s in range(len(ds.shards)):
        idx = ds.index(s)
        for off, size in zip(idx.member_offset.tolist(), idx.member_size.tolist()):
            head = ds.read_extent(s, off, min(size, 2 * ALIGN))
            dtype, shape, _, data_off = gdsload.format.npy.parse_header(head)
            if shape == (1024,):
                assert data_off == ALIGN and (off + data_off) % ALIGN == 0
            else:
                assert shape == (257,) and size == data_off + 514 < ALIGN
                small_heads.add(data_off)
    assert small_heads == {128}  # NumPy's header, not padded
    loader = DataLoader(str(tmp_path / "both"), batch_size=64, decode=False, output="numpy", device="cpu",
                        fields=["tokens.npy", "big.npy"])
    got = list(loader)
    assert np.array_equal(np.concatenate([b[0] for b in got]), tokens)
    assert np.array_equal(np.concatenate([b[1] for b in got]), big)


@pytest.mark.parametrize("shape, dtype", [((257,), np.uint16), ((3, 5), np.float32), ((), np.int64),
                                          ((991,), np.float32), ((992,), np.float32), ((1024,), np.float32),
                                          ((40, 60), np.int32)])
@pytest.mark.parametrize("fortran", [False, True])
def test_stored_npy_follows_the_converters_rule(shape, dtype, fortran):
    """The writer stores an array as `convert` stores the same array saved as a `.npy` file
    (`npy.normalize`): C order; NumPy's own header while the payload is under 4 KiB (991 float32:
    128 + 3,964 bytes), the 4 KiB header from there on (992 float32: 128 + 3,968 = 4,096 bytes)."""
    from gdsload.format import npy
    from gdsload.format.tar import ALIGN

    a = np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape)
    a = np.asfortranarray(a) if fortran else a
    stored = npy.encode_stored(a)
    buf = io.BytesIO()
    np.save(buf, a)
    assert stored == bytes(npy.normalize(buf.getvalue())[0])
    dtype_, shape_, fortran_, data_off = npy.parse_header(stored)
    assert (dtype_, shape_, fortran_) == (a.dtype, a.shape, False)
    assert (data_off == ALIGN) == (a.nbytes + 128 >= ALIGN)
    assert np.array_equal(np.load(io.BytesIO(stored)), a)
