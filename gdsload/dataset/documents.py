"""A token dataset seen as its documents: one sample per document (issue 51 item 5, the feed).

A token dataset's samples are chunks of many documents (`gdsload.format.tokens`). Its *documents
view* has the same shards and the same bytes, but one sample per document, numbered as the
`TokenLoader` numbers them (shard-major, in each chunk's order): the sample's one member,
``tokens``, is the document's token ids as stored (``doc_ntokens * itemsize`` bytes at the
document's offset inside its chunk), its CRC32 the index's ``doc_crc``, its key the global
document number (12 digits). Nothing is copied or written: the view's shard indexes are built from
each shard's document table when first used.

So everything that reads a dataset by its indexes reads documents: `gdsload serve` serves the
view as ``NAME#documents`` (`DOCUMENTS_SUFFIX`), and a raw stream of it goes as stored (sendfile
over the bulk connection, each document's CRC32 checked by the client), which is what a remote
`TokenLoader` packs from (`gdsload.service.client.tokens`).
"""

from __future__ import annotations

import copy
import threading

import numpy as np

from gdsload.dataset.dataset import Dataset
from gdsload.dataset.sharded import ShardedDataset
from gdsload.errors import FormatError
from gdsload.format import tokens as tf
from gdsload.format.index import ShardIndex

DOCUMENTS_SUFFIX = tf.DOCUMENTS_SUFFIX
FIELD = tf.FIELD  # the member of each document sample: "tokens"


class DocumentShards(ShardedDataset):
    """The documents view of an open token dataset (`base`), sharing its store and manifest."""

    def __init__(self, base: ShardedDataset):
        meta = tf.check_meta(base.manifest, name=base.root)
        if meta is None:
            raise FormatError(f"{base.root} is not a token dataset (converted without --tokenizer): it has no "
                              f"documents view")
        self.__dict__.update(base.__dict__)
        self._base = base
        self._indexes, self._fds, self._lock = {}, {}, threading.Lock()
        self._item = np.dtype(meta["dtype"]).itemsize
        manifest = copy.deepcopy(base.manifest)
        self._doc_start = np.concatenate([[0], np.cumsum([s["documents"] for s in manifest["shards"]])]).tolist()
        for s, entry in enumerate(manifest["shards"]):
            sizes = self._doc_table(s).ntokens.astype(np.int64) * self._item
            entry["samples"] = entry["documents"]
            entry["max_nbytes"] = {FIELD: int(sizes.max()) if len(sizes) else 0}
            entry["min_nbytes"] = {FIELD: int(sizes.min()) if len(sizes) else 0}
        manifest["num_samples"] = meta["num_documents"]
        for v in manifest.get("versions", []) or []:
            if isinstance(v, dict) and "num_samples" in v:
                v["num_samples"] = sum(e["documents"] for e in manifest["shards"][: v["shards"]])
        self.manifest = manifest
        self.shards = manifest["shards"]
        self._starts = self._doc_start

    def _doc_table(self, shard: int) -> tf.DocTable:
        name = self._base.shard_path(shard, "index")
        return tf.DocTable.from_index_bytes(self._base._index_bytes(shard, name), name=name,
                                            num_chunks=self._base.index(shard).num_samples)

    def index(self, shard: int) -> ShardIndex:
        idx = self._indexes.get(shard)
        if idx is None:
            chunks = self._base.index(shard)
            table = self._doc_table(shard)
            n = table.num_documents
            keys = [f"{self._doc_start[shard] + j:012d}".encode() for j in range(n)]
            key_offsets = np.arange(n + 1, dtype=np.int64) * 12
            idx = ShardIndex(extensions=(FIELD,), key_blob=np.frombuffer(b"".join(keys), np.uint8),
                             key_offsets=key_offsets, sample_start=np.arange(n + 1, dtype=np.int64),
                             member_ext=np.zeros(n, np.uint16),
                             member_offset=table.byte_offsets(chunks.member_offset, self._item).astype(np.uint64),
                             member_size=(table.ntokens.astype(np.uint64) * np.uint64(self._item)),
                             member_crc=np.asarray(table.crc, np.uint32))
            with self._lock:
                idx = self._indexes.setdefault(shard, idx)
        return idx


class DocumentsDataset(Dataset):
    """A `Dataset` whose samples are the documents of the token dataset `base` (module docstring).
    Its `dataset_id` is the token dataset's (the same bytes); its one field is ``tokens``."""

    _PROCESS_LOCAL = ("_docs",)

    def __init__(self, base: Dataset):
        self.__dict__.update({k: v for k, v in base.__dict__.items() if k != "_shards"})
        self._start_process()
        self._docs = DocumentShards(base.shards)
        self.fields = [FIELD]
        self.earlier = ()

    def _init_process_local(self) -> None:
        self._docs = None

    @property
    def shards(self) -> DocumentShards:  # type: ignore[override]
        self._check_process()
        if self._docs is None:
            self._docs = DocumentShards(Dataset(self.path, verify=self.verify).shards)
        return self._docs

    def __repr__(self) -> str:
        return f"gdsload.DocumentsDataset({self.path!r}, documents={len(self)})"
