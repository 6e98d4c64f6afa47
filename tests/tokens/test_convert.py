"""`gdsload convert CORPUS DST --tokenizer`: token shards, their document table, their size, their
bytes for any worker count; text shards without a tokenizer."""

from __future__ import annotations

import gzip
import json
import shutil
import tarfile
import zlib

import numpy as np
import pytest

from tokkit import CHUNK_TOKENS, SHARD_SIZE
from gdsload.convert.tokens import convert_corpus
from gdsload.dataset.sharded import ShardedDataset
from gdsload.errors import CorruptDataError, FormatError, InputError
from gdsload.format import tokens as tf
from gdsload.format.index import ShardIndex


def _documents(root):
    """Every document's ids as stored, read through the index's document table."""
    ds = ShardedDataset(str(root))
    m = ds.manifest
    dtype = np.dtype(m["tokens"]["dtype"])
    out = []
    for s, entry in enumerate(m["shards"]):
        data = (root / entry["index"]).read_bytes()
        idx = ShardIndex.from_bytes(data)
        table = tf.DocTable.from_index_bytes(data, name=entry["index"], num_chunks=idx.num_samples)
        offsets = table.byte_offsets(idx.member_offset, dtype.itemsize)
        for d in range(table.num_documents):
            raw = ds.read_extent(s, int(offsets[d]), int(table.ntokens[d]) * dtype.itemsize)
            assert zlib.crc32(raw) == int(table.crc[d])
            out.append(np.frombuffer(raw, dtype))
    return out


def test_token_shards_hold_every_document_checked(corpus):
    m = json.loads((corpus.tokens / "manifest.json").read_text())
    meta = m["tokens"]
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 2000
    assert meta["special_tokens"] == {"<unk>": 0, "<eos>": 1, "<pad>": 2}
    assert meta["num_documents"] == len(corpus.docs) == sum(s["documents"] for s in m["shards"])
    assert meta["num_tokens"] == sum(len(i) for i in corpus.ids)
    assert len(m["shards"]) >= 3 and m["fields"] == {"tokens": "bytes"}
    got = _documents(corpus.tokens)
    assert len(got) == len(corpus.ids)
    for a, b in zip(got, corpus.ids):
        assert np.array_equal(a, b)
    # the chunks are standard tar members holding whole documents, 4 KiB-aligned
    with tarfile.open(corpus.tokens / m["shards"][0]["name"]) as t:
        members = [x for x in t.getmembers() if x.isfile()]
    assert len(members) >= 2 and all(x.name.endswith(".tokens") and x.offset_data % 4096 == 0 for x in members)
    assert all(x.size <= CHUNK_TOKENS * 2 for x in members[:-1])
    # and the dataset is an ordinary one: gdsload verify's checks pass (sizes, hashes, index, DALI index)
    assert not any(ShardedDataset(str(corpus.tokens)).verify().values())


def test_disk_is_at_most_1_05x_the_token_bytes(corpus):
    token_bytes = sum(len(i) for i in corpus.ids) * 2
    disk = sum(f.stat().st_size for f in corpus.tokens.iterdir())
    # everything in the folder: tars (headers, alignment), both indexes (8 bytes a document), manifest
    assert disk <= 1.05 * token_bytes, disk / token_bytes
    # one member per document would not: a tar header and padding each (831 documents, 4 shards)
    assert len(corpus.docs) * 1024 > 0.05 * token_bytes


def test_output_bytes_do_not_depend_on_the_worker_count(corpus, tmp_path):
    # a quarter of the corpus, 2 worker processes against 1
    part = tmp_path / "part.jsonl.gz"
    with gzip.open(part, "wt", encoding="utf-8") as f:
        for d in corpus.docs[:200]:
            f.write(json.dumps({"body": d}) + "\n")
    outs = []
    for workers in (1, 2):
        dst = tmp_path / f"w{workers}"
        r = convert_corpus(str(part), str(dst), tokenizer=str(corpus.tokenizer_json), text_field="body",
                           shard_size=128 << 10, chunk_tokens=16 << 10, workers=workers)
        assert r["workers"] == workers and r["shards"] >= 2
        outs.append(dst)
    names = sorted(p.name for p in outs[0].iterdir())
    assert names == sorted(p.name for p in outs[1].iterdir())
    for n in names:
        a, b = (outs[0] / n).read_bytes(), (outs[1] / n).read_bytes()
        if n == "manifest.json":  # the time of writing differs
            a, b = (json.loads(x) for x in (a, b))
            for x in (a, b):
                x["created"].pop("at")
        assert a == b, n
    for a, b in zip(_documents(outs[0]), corpus.ids[:200]):
        assert np.array_equal(a, b)


def test_without_tokenizer_text_shards(corpus):
    ds = ShardedDataset(str(corpus.text))
    assert ds.fields == {"txt": "text"} and len(ds) == len(corpus.docs)
    assert "tokens" not in ds.manifest
    for i in (0, 17, len(ds) - 1):
        assert ds.sample(i)["txt"].decode() == corpus.docs[i]


def test_parquet_text_column(corpus, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"title": [f"d{i}" for i in range(50)], "body": corpus.docs[:50]}), tmp_path / "c.parquet")
    convert_corpus(str(tmp_path / "c.parquet"), str(tmp_path / "t"), tokenizer=str(corpus.tokenizer_json),
                   columns="body:txt", workers=1)
    for a, b in zip(_documents(tmp_path / "t"), corpus.ids[:50]):
        assert np.array_equal(a, b)
    with pytest.raises(InputError, match="txt"):
        convert_corpus(str(tmp_path / "c.parquet"), str(tmp_path / "u"), tokenizer=str(corpus.tokenizer_json),
                       columns="body:json", workers=1)


def test_cli_convert(corpus, tmp_path, capsys):
    from gdsload.cli import main

    small = tmp_path / "small.jsonl"
    small.write_text("".join(json.dumps({"text": d}) + "\n" for d in corpus.docs[:30]))
    assert main(["convert", str(small), str(tmp_path / "t"), "--tokenizer", str(corpus.tokenizer_json),
                 "--workers", "1"]) == 0
    assert "tokens of 30 documents" in capsys.readouterr().out
    assert len(_documents(tmp_path / "t")) == 30
    assert main(["convert", str(small), str(tmp_path / "x")]) == 0  # no tokenizer: text shards
    assert ShardedDataset(str(tmp_path / "x")).fields == {"txt": "text"}


def test_bad_input_is_named(corpus, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"content": "no text field"}\n')
    with pytest.raises(InputError, match=r"line 2: no string field 'text' \(it has 'content'\)"):
        convert_corpus(str(bad), str(tmp_path / "o"), tokenizer=str(corpus.tokenizer_json), workers=1)
    with pytest.raises(FormatError, match="no such file"):
        convert_corpus(str(bad), str(tmp_path / "p"), tokenizer=str(tmp_path / "missing.json"))
    with pytest.raises(Exception, match="already holds a dataset"):
        convert_corpus(str(corpus.jsonl), str(corpus.tokens), tokenizer=str(corpus.tokenizer_json))


def test_a_damaged_document_is_caught_on_its_own(corpus, tmp_path):
    """One byte changed inside one document in the middle of a chunk: reading that document (a
    read from inside the member) fails its CRC32; its neighbours still read."""
    import gdsload

    dst = tmp_path / "copy"
    shutil.copytree(corpus.tokens, dst)
    m = json.loads((dst / "manifest.json").read_text())
    entry = m["shards"][1]
    data = (dst / entry["index"]).read_bytes()
    idx = ShardIndex.from_bytes(data)
    table = tf.DocTable.from_index_bytes(data, name="x", num_chunks=idx.num_samples)
    offsets = table.byte_offsets(idx.member_offset, 2)
    d = int(np.argmax(table.ntokens[1:-1])) + 1  # a long one, not at a chunk's edge
    assert offsets[d] > idx.member_offset[0]
    with open(dst / entry["name"], "r+b") as f:
        f.seek(int(offsets[d]) + 10)
        b = f.read(1)
        f.seek(int(offsets[d]) + 10)
        f.write(bytes([b[0] ^ 0xFF]))
    loader = gdsload.TokenLoader(str(dst), 256, 2, output="numpy")
    with pytest.raises(CorruptDataError, match=rf"{entry['name']}: document {d} of the shard .* CRC32"):
        for _ in loader:
            pass
    # the same bytes with verify=None are read as they are
    n = sum(1 for _ in gdsload.TokenLoader(gdsload.Dataset(str(dst), verify=None), 4096, 8, output="numpy"))
    assert n > 0
