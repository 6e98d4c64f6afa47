"""`gdsload convert CORPUS DST --tokenizer tokenizer.json`: text documents into token shards.

Inputs: JSON lines (`.jsonl`, `.jsonl.gz`; the text in field `text_field`, default "text"), or
Parquet / `datasets` Arrow folders, whose text column is named by `--columns COL:txt`
(`gdsload.convert.columnar`). Documents keep their input order; numbered 0, 1, ... in it.

With a tokenizer (HF `tokenizers`, a local `tokenizer.json`: no network) the output is a token
dataset (`gdsload.format.tokens`: chunks of about `chunk_tokens` tokens of whole documents, each
document's length and CRC32 in the shard's index). Tokenizing runs on `workers` processes over
batches of `BATCH_DOCS` documents, results taken back in input order (`imap`), and each worker's
tokenizer uses one thread; the shards are cut by the writer alone from the token counts, so the
output bytes are the same for any worker count. Ids are encoded without the tokenizer's
post-processing (`add_special_tokens=False`): a loader adds `eos_token` per document.

Without a tokenizer, JSON lines give a text dataset (one `txt` member per document, key
``%012d`` of its number) through `gdsload.ShardWriter`; Parquet and Arrow inputs are converted by
`gdsload convert` as ever (`columnar`).

A token conversion writes the manifest last, as every writer does, but does not resume: a killed
run leaves shards without a manifest (the folder is refused as incomplete) and is started again
with `overwrite=True`.
"""

from __future__ import annotations

import gzip
import io
import json
import multiprocessing as mp
import os
import time
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from gdsload.convert.shards import ShardFile, make_manifest, shard_name
from gdsload.errors import DestinationError, InputError
from gdsload.format import manifest as mf
from gdsload.format import tokens as tf
from gdsload.io.store import LOCK, open_store, save_manifest

BATCH_DOCS = 256  # documents per tokenizing task
CHUNK_TOKENS = 1 << 20  # tokens per chunk member (2 MiB of uint16): tar overhead < 0.3 %


def is_jsonl(src: str) -> bool:
    return src.endswith((".jsonl", ".jsonl.gz"))


# -- documents in -----------------------------------------------------------------------------------
def jsonl_texts(src: str, text_field: str) -> Iterator[str]:
    """The texts of a JSON-lines file in order; a line without the field, or not a JSON object
    with a string there, is an `InputError` naming the line."""
    opener = gzip.open if src.endswith(".gz") else open
    try:
        f = opener(src, "rb")
    except OSError as exc:
        raise InputError(f"{src}: cannot open ({exc})") from exc
    with f, io.TextIOWrapper(f, encoding="utf-8") as text:
        for n, line in enumerate(text, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(f"{src}, line {n}: not JSON ({exc})") from None
            value = obj.get(text_field) if isinstance(obj, dict) else None
            if not isinstance(value, str):
                have = ", ".join(map(repr, list(obj)[:6])) if isinstance(obj, dict) else type(obj).__name__
                raise InputError(f"{src}, line {n}: no string field {text_field!r} (it has {have}); "
                                 f"name the text field with --text-field")
            yield value


def columnar_texts(src: str, columns: str | None) -> Iterator[str]:
    """The `txt` field of a Parquet / Arrow source's rows, in order (`--columns COL:txt`)."""
    from gdsload.convert import columnar

    source = columnar.open_columnar(src)
    cols, _ = columnar.plan_columns(source, columns)
    text = [c for c in cols if c.field == tf.TEXT_FIELD]
    if len(text) != 1:
        raise InputError(f"{src}: name the text column as field 'txt' (--columns COLUMN:txt); "
                         f"the fields are {', '.join(c.field for c in cols)}")
    rows = columnar.Rows(source, [c for c in cols if c is text[0] or c.how == "key"])
    for unit in source.units:
        for sample in rows(unit):
            v = sample.get(tf.TEXT_FIELD)
            if v is None:
                continue  # a null row: rejected by the columnar reader
            yield v.decode("utf-8") if isinstance(v, (bytes, memoryview)) else str(v)


def texts(src: str, *, text_field: str = "text", columns: str | None = None) -> Iterator[str]:
    if is_jsonl(src):
        if columns:
            raise InputError("--columns names Parquet/Arrow columns; a JSON-lines input names its text with --text-field")
        return jsonl_texts(src, text_field)
    from gdsload.convert.columnar import is_columnar

    if is_columnar(src):
        return columnar_texts(src, columns)
    raise InputError(f"{src}: not a text corpus (give a .jsonl, .jsonl.gz, Parquet or datasets Arrow input)")


# -- tokenizing -------------------------------------------------------------------------------------
_TOK: Any = None


def _init_worker(tok_json: str) -> None:
    os.environ["RAYON_NUM_THREADS"] = "1"  # one core per worker process (read at the first encode)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    global _TOK
    _TOK = Tokenizer.from_str(tok_json)


def _encode(tok: Any, batch: list[str], dtype: str) -> tuple[bytes, list[int]]:
    """A batch of texts as (the ids of all, concatenated, in `dtype`; each document's length)."""
    enc = tok.encode_batch(batch, add_special_tokens=False)
    ids = [e.ids for e in enc]
    lengths = [len(i) for i in ids]
    flat = np.fromiter((t for i in ids for t in i), dtype=np.int64, count=sum(lengths))
    if len(flat) and int(flat.max()) > np.iinfo(dtype).max:
        raise InputError(f"the tokenizer produced id {int(flat.max())}, beyond {dtype}")
    return flat.astype(dtype).tobytes(), lengths


def _encode_in_worker(args: tuple[list[str], str]) -> tuple[bytes, list[int]]:
    return _encode(_TOK, *args)


def _batches(docs: Iterator[str], n: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for d in docs:
        batch.append(d)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def encoded(docs: Iterator[str], tok: Any, dtype: str, workers: int) -> Iterator[tuple[bytes, list[int]]]:
    """(ids, lengths) per batch of documents, in input order, tokenized on `workers` processes."""
    batches = _batches(docs, BATCH_DOCS)
    if workers <= 1:
        for b in batches:
            yield _encode(tok, b, dtype)
        return
    ctx = mp.get_context("spawn")  # no fork of a process whose tokenizer threads may be running
    with ctx.Pool(workers, initializer=_init_worker, initargs=(tok.to_str(),)) as pool:
        yield from pool.imap(_encode_in_worker, ((b, dtype) for b in batches), chunksize=1)


# -- shards out -------------------------------------------------------------------------------------
class _TokenShards:
    """Chunks of whole documents into shards; each shard's document table into its index."""

    def __init__(self, store: Any, *, prefix: str, shard_size: int, chunk_tokens: int, dtype: np.dtype):
        self.store, self.prefix, self.shard_size, self.chunk_tokens = store, prefix, shard_size, chunk_tokens
        self.itemsize = dtype.itemsize
        self.entries: list[mf.ShardEntry] = []
        self._cur: ShardFile | None = None
        self._chunk: list[bytes] = []
        self._chunk_docs = 0
        self._chunk_tokens = 0
        self._chunks = 0  # over the dataset: the chunk keys
        self._shard_chunks: list[int] = []
        self._ntokens: list[int] = []
        self._crc: list[int] = []

    def add(self, data: bytes, length: int) -> None:
        if self._chunk_docs and self._chunk_tokens + length > self.chunk_tokens:
            self._flush_chunk()
        self._chunk.append(data)
        self._chunk_docs += 1
        self._chunk_tokens += length
        self._ntokens.append(length)
        self._crc.append(zlib.crc32(data))

    def _flush_chunk(self) -> None:
        if not self._chunk_docs:
            return
        if self._cur is None:
            self._cur = ShardFile(self.store, shard_name(self.prefix, len(self.entries)))
        self._cur.add(f"{self._chunks:010d}", {tf.FIELD: b"".join(self._chunk)})
        self._chunks += 1
        self._shard_chunks.append(self._chunk_docs)
        self._chunk, self._chunk_docs, self._chunk_tokens = [], 0, 0
        if self._cur.nbytes >= self.shard_size:
            self._finish_shard()

    def _finish_shard(self) -> None:
        cur, docs = self._cur, self._ntokens  # the shard's documents: its chunks are all flushed
        if cur is None:
            return
        entry = cur.finish(index_extra=tf.doc_arrays(self._shard_chunks, docs, self._crc))
        cur.publish()
        entry["documents"], entry["tokens"] = len(docs), int(sum(docs))  # type: ignore[typeddict-unknown-key]
        self.entries.append(entry)
        self._cur, self._shard_chunks, self._ntokens, self._crc = None, [], [], []

    def close(self) -> list[mf.ShardEntry]:
        self._flush_chunk()
        self._finish_shard()
        return self.entries

    def abort(self) -> None:
        if self._cur is not None:
            self._cur.abort()


def _open_destination(dst: str, overwrite: bool) -> Any:
    store = open_store(dst)
    if store.is_file():
        raise DestinationError(f"{store.root}: exists and is not a folder")
    store.make_dirs()
    return store


def _clear(store: Any, overwrite: bool) -> None:
    from gdsload.convert.engine import _clean, _ours

    entries = [n for n in store.list() if n != LOCK]
    if not entries:
        return
    ours = store.exists(mf.MANIFEST) and all(_ours(n) for n in entries)
    if not overwrite or not ours:
        what = "a dataset" if store.exists(mf.MANIFEST) else "files"
        raise DestinationError(f"{store.root} already holds {what} ({', '.join(sorted(entries)[:3])}); choose an "
                               f"empty or new folder" + (", or pass overwrite=True (--overwrite)" if ours else ""))
    _clean(store)


def convert_corpus(src: str, dst: str, *, tokenizer: Any = None, text_field: str = "text",
                   columns: str | None = None, shard_size: int = 1 << 30, chunk_tokens: int = CHUNK_TOKENS,
                   workers: int | None = None, prefix: str = "shard", overwrite: bool = False) -> dict[str, Any]:
    """Convert a text corpus (module docstring); returns the summary `gdsload convert` prints."""
    t0 = time.perf_counter()
    if chunk_tokens < 1:
        raise InputError(f"chunk_tokens must be >= 1, got {chunk_tokens!r}")
    if tokenizer is None:
        return _text_dataset(src, dst, text_field=text_field, columns=columns, shard_size=shard_size,
                             prefix=prefix, overwrite=overwrite, t0=t0)
    tok = tf.load_tokenizer(tokenizer)
    info = tf.tokenizer_info(tok)
    dtype = tf.token_dtype(info["vocab_size"])
    docs = texts(src, text_field=text_field, columns=columns)
    workers = max(1, workers or os.cpu_count() or 1)
    store = _open_destination(dst, overwrite)
    with store.lock():
        _clear(store, overwrite)
        out = _TokenShards(store, prefix=prefix, shard_size=shard_size, chunk_tokens=chunk_tokens, dtype=dtype)
        try:
            for data, lengths in encoded(docs, tok, dtype.name, workers):
                at = 0
                for n in lengths:
                    out.add(data[at:at + n * dtype.itemsize], n)
                    at += n * dtype.itemsize
            entries = out.close()
        except BaseException:
            out.abort()
            raise
        created = {"source": src, "source_format": "jsonl" if is_jsonl(src) else "columnar",
                   "text_field": text_field if is_jsonl(src) else None, "chunk_tokens": chunk_tokens}
        m = make_manifest(entries, {tf.FIELD: "bytes"}, created=created)
        m["tokens"] = {"version": tf.TOKENS_VERSION, "dtype": dtype.name, **info,
                       "num_documents": sum(e["documents"] for e in entries),  # type: ignore[typeddict-item]
                       "num_tokens": sum(e["tokens"] for e in entries)}  # type: ignore[typeddict-item]
        save_manifest(store, m)
    seconds = time.perf_counter() - t0
    nbytes = m["num_bytes"]
    return {"manifest": m, "complete": False, "samples": m["tokens"]["num_documents"], "rejected": 0,
            "shards": len(entries), "bytes": nbytes, "seconds": seconds,
            "samples_per_s": m["tokens"]["num_documents"] / seconds if seconds else 0.0,
            "mb_per_s": nbytes / 1e6 / seconds if seconds else 0.0, "resumed_shards": 0, "workers": workers,
            "appended": False, "tokens": m["tokens"]["num_tokens"]}


def _text_dataset(src: str, dst: str, *, text_field: str, columns: str | None, shard_size: int, prefix: str,
                  overwrite: bool, t0: float) -> dict[str, Any]:
    from gdsload.convert.route import summary
    from gdsload.convert.writer import ShardWriter

    docs = texts(src, text_field=text_field, columns=columns)
    with ShardWriter(dst, shard_size, prefix=prefix, overwrite=overwrite, source_format="jsonl",
                     created={"source": src, "text_field": text_field}) as w:
        for i, text in enumerate(docs):
            w.write({"__key__": f"{i:012d}", tf.TEXT_FIELD: text})
    return summary(w.manifest or {}, t0, 1)
