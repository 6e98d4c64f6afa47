"""Columnar inputs to `gdsload convert`: Parquet (HuggingFace image structs, ClassLabel), folders
of Parquet files, `datasets` `save_to_disk` folders, row groups streamed under a memory bound,
fsspec URLs, and bad columns refused before anything is written.

The `save_to_disk` layout is written here with pyarrow as `datasets` 5.2 writes it (checked against
the real library): `state.json` listing `data-0000K-of-0000N.arrow` Arrow IPC *streams*,
`dataset_info.json` with the features; Parquet files carry the same features in the schema
metadata under `huggingface` (`{"info": {"features": ...}}`)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from gdsload.cli import main
from gdsload.dataset.sharded import open_dataset

ROOT = Path(__file__).resolve().parents[2]
NAMES = ["cat", "dog", "fox"]
FEATURES = {"image": {"_type": "Image"}, "label": {"names": NAMES, "_type": "ClassLabel"},
            "caption": {"dtype": "string", "_type": "Value"},
            "emb": {"feature": {"dtype": "float32", "_type": "Value"}, "_type": "List"},
            "arr": {"shape": [2, 3], "dtype": "int16", "_type": "Array2D"}}
IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def jpeg(i: int, fmt: str = "JPEG") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((8, 8, 3), (i * 7) % 256, np.uint8)).save(buf, fmt)
    return buf.getvalue()


def hf_table(n: int, start: int = 0) -> pa.Table:
    rows = range(start, start + n)
    schema = pa.schema([("image", IMAGE), ("label", pa.int64()), ("caption", pa.string()),
                        ("emb", pa.list_(pa.float32())), ("arr", pa.list_(pa.list_(pa.int16())))],
                       metadata={"huggingface": json.dumps({"info": {"features": FEATURES}})})
    return pa.table({
        "image": [{"bytes": jpeg(i), "path": None} for i in rows],
        "label": [i % 3 for i in rows],
        "caption": [f"photo {i}" for i in rows],
        "emb": [[float(i), 0.5] for i in rows],
        "arr": [np.full((2, 3), i, np.int16).tolist() for i in rows],
    }, schema=schema)


def convert(*args: str) -> int:
    return main(["convert", *map(str, args), "-q"])


def check_rows(ds, rows) -> None:
    for i, r in enumerate(rows):
        s = ds.sample(i)
        assert s["__key__"] == f"{r:010d}"
        assert s["jpg"] == jpeg(r) and int(s["cls"]) == r % 3 and s["txt"] == f"photo {r}".encode()
        assert np.array_equal(np.load(io.BytesIO(s["emb.npy"])), np.array([r, 0.5], np.float32))
        arr = np.load(io.BytesIO(s["arr.npy"]))
        assert arr.dtype == np.int16 and arr.shape == (2, 3) and (arr == r).all()


def test_parquet_with_hf_image_structs_and_classlabel(tmp_path):
    t = hf_table(10)
    images = t.column("image").to_pylist()
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "four.jpg").write_bytes(jpeg(4))
    images[4] = {"bytes": None, "path": "img/four.jpg"}  # path only: read next to the Parquet file
    images[6] = {"bytes": None, "path": "img/missing.jpg"}  # path only, no such file: rejected
    labels = t.column("label").to_pylist()
    labels[8] = None  # a null in a used column: rejected
    t = t.set_column(0, "image", pa.array(images, IMAGE)).set_column(1, "label", pa.array(labels, pa.int64()))
    pq.write_table(t, tmp_path / "train.parquet", row_group_size=4)
    assert convert(tmp_path / "train.parquet", tmp_path / "ds", "--workers", "2") == 0
    ds = open_dataset(tmp_path / "ds")
    assert ds.fields == {"jpg": "image", "cls": "label", "txt": "text", "emb.npy": "tensor", "arr.npy": "tensor"}
    assert ds.classes == NAMES and ds.manifest["created"]["source_format"] == "parquet"
    check_rows(ds, [0, 1, 2, 3, 4, 5, 7, 9])
    rejects = [json.loads(x) for x in (tmp_path / "ds" / "rejected.jsonl").read_text().splitlines()]
    assert [r["key"] for r in rejects] == ["0000000006", "0000000008"]
    assert "path 'img/missing.jpg' cannot be read" in rejects[0]["reason"]
    assert rejects[1]["reason"] == "column 'label' is null in row 8"


def test_columns_option_and_a_key_column(tmp_path):
    t = hf_table(6).append_column("id", pa.array([f"img-{i}" for i in range(6)]))
    pq.write_table(t, tmp_path / "t.parquet")
    assert convert(tmp_path / "t.parquet", tmp_path / "ds", "--columns", "id:__key__,image:jpg,label:cls,caption:txt") == 0
    ds = open_dataset(tmp_path / "ds")
    assert sorted(ds.fields) == ["cls", "jpg", "txt"] and ds.classes == NAMES
    assert [ds.sample(i)["__key__"] for i in range(6)] == [f"img-{i}" for i in range(6)]


@pytest.mark.parametrize("columns, message", [
    ("picture:jpg", "column 'picture' does not exist in .*; its columns are image, label, caption, emb, arr"),
    ("caption:jpg", "column 'caption' \\(string\\) is not bytes; an image jpg field needs a binary column"),
    ("caption:cls", "column 'caption' \\(string\\) is not an integer column"),
    ("image", "'image' is not COLUMN:FIELD"),
])
def test_bad_columns_are_refused_before_anything_is_written(tmp_path, capsys, columns, message):
    pq.write_table(hf_table(3), tmp_path / "t.parquet")
    assert convert(tmp_path / "t.parquet", tmp_path / "ds", "--columns", columns) == 1
    import re

    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "ds").exists()


def test_folder_of_parquet_files_same_bytes_for_any_worker_count(tmp_path):
    src = tmp_path / "src"
    (src / "data").mkdir(parents=True)
    pq.write_table(hf_table(9), src / "data" / "train-00000-of-00002.parquet", row_group_size=2)
    pq.write_table(hf_table(7, start=9), src / "data" / "train-00001-of-00002.parquet", row_group_size=3)
    (src / "README.md").write_text("a dataset card")
    assert convert(src, tmp_path / "w1", "--workers", "1", "--shard-size", "20KB") == 0
    assert convert(src, tmp_path / "w3", "--workers", "3", "--shard-size", "20KB") == 0
    files = sorted(p.name for p in (tmp_path / "w1").iterdir())
    assert len([f for f in files if f.endswith(".tar")]) > 1
    for name in files:
        if name != "manifest.json":
            assert (tmp_path / "w1" / name).read_bytes() == (tmp_path / "w3" / name).read_bytes(), name
    check_rows(open_dataset(tmp_path / "w1"), range(16))


def write_save_to_disk(folder: Path, tables: list[pa.Table]) -> None:
    folder.mkdir(parents=True)
    names = [f"data-{k:05d}-of-{len(tables):05d}.arrow" for k in range(len(tables))]
    for name, t in zip(names, tables):
        with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, t.schema) as w:
            for batch in t.to_batches(max_chunksize=3):
                w.write_batch(batch)
    (folder / "state.json").write_text(json.dumps({
        "_data_files": [{"filename": n} for n in names], "_fingerprint": "f3ac91a5309afdd7",
        "_format_columns": None, "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False,
        "_split": None}, indent=2))
    (folder / "dataset_info.json").write_text(json.dumps({"citation": "", "description": "",
                                                          "features": FEATURES, "homepage": "", "license": ""}))


def test_save_to_disk_folder(tmp_path):
    write_save_to_disk(tmp_path / "saved", [hf_table(5), hf_table(6, start=5)])
    assert convert(tmp_path / "saved", tmp_path / "ds", "--workers", "2") == 0
    ds = open_dataset(tmp_path / "ds")
    assert ds.classes == NAMES and ds.manifest["created"]["source_format"] == "arrow"
    check_rows(ds, range(11))  # keys number the rows across both files


def test_dataset_dict_folder_asks_for_a_split(tmp_path, capsys):
    write_save_to_disk(tmp_path / "dd" / "train", [hf_table(2)])
    (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["train"]}')
    assert convert(tmp_path / "dd", tmp_path / "ds") == 1
    assert "DatasetDict with splits ['train']: convert one split's folder" in capsys.readouterr().err


def test_parquet_from_an_fsspec_url(tmp_path):
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    buf = io.BytesIO()
    pq.write_table(hf_table(5), buf, row_group_size=2)
    fs.pipe("/colsrc/part-0.parquet", buf.getvalue())
    try:
        assert convert("memory://colsrc", tmp_path / "ds") == 0
        check_rows(open_dataset(tmp_path / "ds"), range(5))
    finally:
        fs.rm("/colsrc", recursive=True)


def test_a_row_group_larger_than_the_memory_bound_is_streamed(tmp_path):
    n, nbytes = 160, 256 << 10
    rows = [{"bytes": b"\xff\xd8\xff" + os.urandom(nbytes - 3), "path": None} for _ in range(n)]
    t = pa.table({"image": pa.array(rows, IMAGE), "label": list(range(n))})
    # one row group of 40 MiB, in pages of about 1 MiB (as writers that flush pages by size make them)
    pq.write_table(t, tmp_path / "big.parquet", row_group_size=n, compression="none", write_batch_size=4)
    del t, rows
    assert pq.ParquetFile(tmp_path / "big.parquet").metadata.num_row_groups == 1
    # a fresh process, so that the Arrow memory pool's high-water mark is the conversion's alone
    code = textwrap.dedent(f"""
        import pyarrow as pa
        from gdsload.convert.engine import ConvertOptions
        from gdsload.convert.route import convert_columnar
        r = convert_columnar({str(tmp_path / 'big.parquet')!r}, {str(tmp_path / 'ds')!r},
                             ConvertOptions(workers=1, progress=False, shard_size=8 << 20), batch_nbytes=2 << 20)
        print(r["samples"], pa.default_memory_pool().max_memory())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    samples, peak = map(int, out.stdout.split())
    row_group = (tmp_path / "big.parquet").stat().st_size
    assert samples == n and row_group > 40 << 20
    # streamed: well under the row group (batches of 2 MiB, Arrow's 1 MiB read buffer and pages in its pool)
    assert 1 << 20 < peak < 16 << 20, f"Arrow peak {peak / 2**20:.1f} MiB reading a {row_group / 2**20:.0f} MiB row group"
    ds = open_dataset(tmp_path / "ds")
    assert len(ds) == n and len(ds.shards) >= 4 and ds.verify(hashes=False) == {}


def wav() -> bytes:
    import wave

    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(8000)
        w.writeframes(b"\0\1" * 400)
    return buf.getvalue()


def test_detection_of_audio_structs_plain_binary_and_json(tmp_path):
    features = {"audio": {"_type": "Audio"}, "speaker_id": {"dtype": "int64", "_type": "Value"}}
    schema = pa.schema([("audio", IMAGE), ("thumb", pa.binary()), ("speaker_id", pa.int64()),
                        ("text", pa.string()), ("notes", pa.string())],
                       metadata={"huggingface": json.dumps({"info": {"features": features}})})
    t = pa.table({"audio": [{"bytes": wav(), "path": "a.wav"}] * 3, "thumb": [jpeg(1, "PNG")] * 3,
                  "speaker_id": [7, 8, 9], "text": ["a", "b", "c"], "notes": ["x", "y", "z"]}, schema=schema)
    pq.write_table(t, tmp_path / "speech.parquet")
    assert convert(tmp_path / "speech.parquet", tmp_path / "ds") == 0
    ds = open_dataset(tmp_path / "ds")
    # the audio struct by its HF type and bytes, binary by its bytes, a non-label integer as JSON,
    # two string columns named COLUMN.txt
    # (wav is kind "audio" since media are probed: still bytes to a loader without an AudioTransform)
    assert ds.fields == {"wav": "audio", "png": "image", "json": "json", "text.txt": "text", "notes.txt": "text"}
    s = ds.sample(2)
    assert s["wav"] == wav() and s["png"] == jpeg(1, "PNG") and json.loads(s["json"]) == 9
    assert s["notes.txt"] == b"z" and ds.classes is None


def test_a_ragged_nested_list_rejects_its_row_and_the_convert_goes_on(tmp_path):
    """Row 9 of issue 46: a `list<list<int>>` value that is not a rectangle (or holds a null) is
    a rejected row naming the row and the column, not NumPy's "setting an array element with a
    sequence" ending the whole convert."""
    t = hf_table(6)
    arr = t.column("arr").to_pylist()
    arr[2] = [[1, 2, 3], [4]]  # ragged
    arr[4] = [[1, None, 3], [4, 5, 6]]  # a null inside
    t = t.set_column(4, "arr", pa.array(arr, pa.list_(pa.list_(pa.int16()))))
    pq.write_table(t, tmp_path / "t.parquet", row_group_size=3)
    assert convert(tmp_path / "t.parquet", tmp_path / "ds", "--workers", "2") == 0
    ds = open_dataset(tmp_path / "ds")
    check_rows(ds, [0, 1, 3, 5])
    rejects = [json.loads(x) for x in (tmp_path / "ds" / "rejected.jsonl").read_text().splitlines()]
    assert [r["key"] for r in rejects] == ["0000000002", "0000000004"]
    assert rejects[0]["reason"].startswith("column 'arr' in row 2 is not a rectangular list of numbers"), rejects[0]
    assert rejects[1]["reason"].startswith("column 'arr' in row 4 is not a rectangular list of numbers"), rejects[1]


def test_the_summary_lists_the_fields_and_the_columns_they_came_from(tmp_path, capsys):
    """Row 14 of issue 46: an HF `Image` column of PNGs becomes the field `png`; the summary says
    so (a user reading `batch["jpg"]` in an example needs to see it), for any input."""
    schema = pa.schema([("image", IMAGE), ("label", pa.int64()), ("caption", pa.string())],
                       metadata={"huggingface": json.dumps({"info": {"features": FEATURES}})})
    t = pa.table({"image": [{"bytes": jpeg(i, "PNG"), "path": None} for i in range(3)], "label": [0, 1, 2],
                  "caption": ["a", "b", "c"]}, schema=schema)
    pq.write_table(t, tmp_path / "t.parquet")
    capsys.readouterr()
    assert convert(tmp_path / "t.parquet", tmp_path / "ds") == 0
    out = capsys.readouterr().out
    assert "fields: cls (label, column 'label'), png (image, column 'image'), txt (text, column 'caption')\n" in out
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "k0.txt").write_text("hi")
    (tmp_path / "files" / "k0.json").write_text("{}")
    assert convert(tmp_path / "files", tmp_path / "ds2") == 0
    assert "fields: json (json), txt (text)\n" in capsys.readouterr().out
