"""Token shards: the token ids of many documents in large members, and each document in the index.

A token dataset is a gdsload dataset (standard tar shards, `NAME.idx`, `NAME.dali.idx`,
`manifest.json`) whose samples are *chunks*: one member `KEY.tokens` per chunk, the raw
little-endian token ids of consecutive documents, concatenated with nothing between them
(`dtype`: uint16 where the vocabulary fits, ids < 65536, else uint32). A chunk holds whole documents
(a document longer than the chunk target is a chunk of its own), so a chunk member of 4 KiB or more
starts 4 KiB-aligned like every payload (`gdsload.format.tar`) and tar headers and padding are
paid per chunk, not per document.

Each shard's `NAME.idx` holds, beside the arrays every index has (`gdsload.format.index`; its
reader ignores these), the shard's document table:

- `doc_chunk_start` (int64, chunks + 1): the documents of chunk (sample) ``c`` are the shard's
  documents ``doc_chunk_start[c]:doc_chunk_start[c+1]``, in the order of their tokens
- `doc_ntokens` (uint32, documents): each document's length in tokens (0 for an empty text)
- `doc_crc` (uint32, documents): CRC32 (`zlib.crc32`) of the document's token bytes, so one
  document read from inside a chunk is checked on its own

A document's bytes are at ``member_offset[c] + itemsize * (tokens of the chunk's documents before
it)`` (`DocTable.byte_offsets`): 8 bytes per document in the index, no offsets stored. The
documents of the dataset are numbered shard-major (shard 0's first, ...), as samples are.

`manifest.json` carries a top-level ``"tokens"`` object (`TokensMeta`): ``{"version": 1,
"dtype": "uint16", "vocab_size": V, "tokenizer_sha256": ..., "special_tokens": {token: id},
"num_documents": D, "num_tokens": T}``, and every shard entry ``"documents"`` and ``"tokens"``,
so a loader sizes an epoch (documents per shard for the order, tokens for ``len()``) from the
manifest alone. A text dataset (converted without a tokenizer) is an ordinary dataset with one
``txt`` member per document and no ``"tokens"`` object.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import numpy as np

from gdsload.errors import FormatError, MissingDependencyError

TOKENS_VERSION = 1
FIELD = "tokens"  # the chunk member's extension (kind "bytes": raw ids, no header)
TEXT_FIELD = "txt"  # a text dataset's document member
# `gdsload serve` serves a token dataset NAME's documents (one sample each) as NAME + this
# (`gdsload.dataset.documents`); a remote TokenLoader reads them (`gdsload.service.client.tokens`)
DOCUMENTS_SUFFIX = "#documents"
_DTYPES = ("uint16", "uint32")


class TokensMeta(TypedDict):
    version: int
    dtype: str
    vocab_size: int
    tokenizer_sha256: str
    special_tokens: dict[str, int]
    num_documents: int
    num_tokens: int


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id of a vocabulary of `vocab_size` fits (<= 65536 ids), else uint32."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def doc_arrays(chunk_ndocs: list[int], ntokens: list[int], crc: list[int]) -> dict[str, np.ndarray]:
    """The document-table arrays of one shard, for `ShardIndex.to_bytes(extra=...)`."""
    start = np.zeros(len(chunk_ndocs) + 1, np.int64)
    np.cumsum(chunk_ndocs, out=start[1:])
    return {"doc_chunk_start": start, "doc_ntokens": np.asarray(ntokens, np.uint32),
            "doc_crc": np.asarray(crc, np.uint32)}


@dataclass(frozen=True)
class DocTable:
    """The documents of one token shard (module docstring). Read-only arrays."""

    chunk_start: np.ndarray  # int64, chunks + 1
    ntokens: np.ndarray  # uint32, documents
    crc: np.ndarray  # uint32, documents

    @property
    def num_documents(self) -> int:
        return len(self.ntokens)

    def byte_offsets(self, member_offset: np.ndarray, itemsize: int) -> np.ndarray:
        """int64 byte offset in the shard of every document's first token, from the chunks'
        member offsets (the shard index's `member_offset`, one member per chunk)."""
        n = self.ntokens.astype(np.int64) * itemsize
        before = np.zeros(len(n) + 1, np.int64)
        np.cumsum(n, out=before[1:])
        chunk = np.repeat(np.arange(len(self.chunk_start) - 1), np.diff(self.chunk_start))
        return np.asarray(member_offset, np.int64)[chunk] + before[:-1] - before[self.chunk_start[chunk]]

    @classmethod
    def from_index_bytes(cls, data: bytes, *, name: str, num_chunks: int) -> "DocTable":
        """The table stored in a shard's `.idx` file, checked against its `num_chunks` samples."""
        try:
            with np.load(io.BytesIO(data), allow_pickle=False) as z:
                missing = {"doc_chunk_start", "doc_ntokens", "doc_crc"} - set(z.files)
                if missing:
                    raise FormatError(f"{name}: not a token shard's index (it lacks {sorted(missing)}); "
                                      f"convert the corpus with --tokenizer")
                t = cls(z["doc_chunk_start"], z["doc_ntokens"], z["doc_crc"])
        except FormatError:
            raise
        except Exception as exc:  # zipfile/numpy raise many types for a damaged file
            raise FormatError(f"{name}: unreadable index ({type(exc).__name__}: {exc})") from exc
        s = t.chunk_start
        if (s.dtype != np.int64 or s.ndim != 1 or len(s) != num_chunks + 1 or s[0] != 0
                or np.any(s[1:] < s[:-1]) or s[-1] != len(t.ntokens)
                or t.ntokens.dtype != np.uint32 or t.crc.dtype != np.uint32 or t.crc.shape != t.ntokens.shape):
            raise FormatError(f"{name}: the document table is inconsistent (damaged index: re-run gdsload convert)")
        return t


def check_meta(manifest: dict[str, Any], *, name: str) -> TokensMeta | None:
    """The manifest's ``"tokens"`` object, checked (None: not a token dataset)."""
    meta = manifest.get("tokens")
    if meta is None:
        return None
    ok = (isinstance(meta, dict) and meta.get("version") == TOKENS_VERSION and meta.get("dtype") in _DTYPES
          and all(isinstance(meta.get(k), int) and meta[k] >= 0 for k in ("vocab_size", "num_documents", "num_tokens"))
          and isinstance(meta.get("special_tokens"), dict))
    if not ok:
        raise FormatError(f"{name}: the manifest's 'tokens' entry is malformed or of another version "
                          f"(this gdsload reads version {TOKENS_VERSION})")
    shards = manifest["shards"]
    if any(not isinstance(s.get("documents"), int) or not isinstance(s.get("tokens"), int) for s in shards) \
            or sum(s["documents"] for s in shards) != meta["num_documents"] \
            or sum(s["tokens"] for s in shards) != meta["num_tokens"]:
        raise FormatError(f"{name}: the shards' document and token counts do not add up to the manifest's")
    return meta  # type: ignore[return-value]


# -- tokenizers (HF `tokenizers`, a local tokenizer.json; imported only here) ---------------------
def load_tokenizer(tokenizer: Any) -> Any:
    """A `tokenizers.Tokenizer` from a path to a local `tokenizer.json` (never the network), or
    the object itself when given one."""
    if not isinstance(tokenizer, (str, Path)):
        if not hasattr(tokenizer, "encode_batch"):
            raise FormatError(f"tokenizer must be a path to a tokenizer.json or a tokenizers.Tokenizer, "
                              f"got {type(tokenizer).__name__}")
        return tokenizer
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise MissingDependencyError("tokenizing needs HF tokenizers: pip install 'gdsload[tokens]'") from exc
    path = Path(tokenizer)
    if not path.is_file():
        raise FormatError(f"tokenizer {str(path)!r}: no such file (give a local tokenizer.json)")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises a bare Exception
        raise FormatError(f"tokenizer {str(path)!r}: not a tokenizers JSON file ({exc})") from exc


def tokenizer_info(tok: Any) -> dict[str, Any]:
    """What a dataset records of its tokenizer: SHA-256 of its JSON, vocabulary size (added tokens
    included), and its added (special) tokens with their ids."""
    text = tok.to_str()
    added = tok.get_added_tokens_decoder() if hasattr(tok, "get_added_tokens_decoder") else {}
    return {"tokenizer_sha256": hashlib.sha256(text.encode()).hexdigest(),
            "vocab_size": int(tok.get_vocab_size(with_added_tokens=True)),
            "special_tokens": {getattr(t, "content", str(t)): int(i) for i, t in sorted(added.items())}}


def resolve_token(token: Any, *, tok: Any = None, special: dict[str, int] | None = None,
                  vocab_size: int | None = None, what: str = "eos_token") -> int | None:
    """An id from `token` (an int id, or a string of the tokenizer or of the dataset's special
    tokens); None stays None. A string that is no single token is refused naming it."""
    if token is None:
        return None
    if isinstance(token, (int, np.integer)) and not isinstance(token, bool):
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            raise FormatError(f"{what}={int(token)} is not a token id of this vocabulary ({vocab_size} ids)")
        return int(token)
    if isinstance(token, str):
        got = tok.token_to_id(token) if tok is not None else (special or {}).get(token)
        if got is None:
            known = ", ".join(map(repr, list((special or {}))[:8])) or "none recorded"
            raise FormatError(f"{what}={token!r} is not a token of the tokenizer (special tokens: {known}); "
                              f"give its id or pass tokenizer=")
        return int(got)
    raise FormatError(f"{what} must be a token string or an int id, got {type(token).__name__}")

