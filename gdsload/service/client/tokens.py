"""A token dataset on a feed server, for `gdsload.TokenLoader` (issue 51 item 5).

``gdsload.TokenLoader(gdsload.ServedTokens("host:port", "corpus"), seq_len, batch_size, ...)``
packs on the client, with the local loader's code (`gdsload.plan.pack`), from the documents the
server streams: every rank reads the epoch's documents in the epoch's document order (the plan's
order 2 over documents, `DocOrder`) from the server's documents view of the dataset
(``corpus#documents``, `gdsload.dataset.documents`: one sample per document), as raw batches of
`documents_per_request` documents. Such a stream goes as stored where the server can (each
document's bytes by `sendfile` over the bulk connection, its CRC32 from the index checked here),
else through the server's loader. A document's length is known when it arrives, so the packer
runs as for text tokenized on the fly: it asks for the lengths of the next documents and this
source reads on until it has them.

The rows, the state and `len()` are the local loader's (the state names the same dataset id, so
a state saved by a local TokenLoader resumes a remote one and back). Every rank receives every
document of the epoch (it packs the whole global step from their lengths, then keeps its rows):
world_size times the corpus crosses the network per epoch, against each rank reading only its
rows' documents locally. Mixes are read locally only.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np

from gdsload.errors import ConfigError
from gdsload.format import tokens as tf


class ServedTokens:
    """The token dataset served as `dataset` by the server(s) at `address` (module docstring).

    `documents_per_request`: documents per batch of the stream (a multiple of it is where a
    resumed stream starts; the documents before the resume point in that batch are dropped).
    `options`: more `gdsload.RemoteLoader` keywords for the stream (connection, retry, tls, ...)."""

    def __init__(self, address: Any, dataset: str, *, documents_per_request: int = 256, **options: Any):
        if not isinstance(dataset, str) or not dataset or dataset.endswith(tf.DOCUMENTS_SUFFIX):
            raise ConfigError(f"dataset must be the served token dataset's name, got {dataset!r}")
        if isinstance(documents_per_request, bool) or not isinstance(documents_per_request, int) \
                or documents_per_request < 1:
            raise ConfigError(f"documents_per_request must be an int >= 1, got {documents_per_request!r}")
        for k in ("batch_size", "shuffle", "seed", "shuffle_window", "order", "fields", "decode", "rank",
                  "world_size", "output", "dataset"):
            if k in options:
                raise ConfigError(f"{k}= is set by the TokenLoader, not by ServedTokens")
        self.address, self.dataset, self.batch_documents = address, dataset, documents_per_request
        self.options = options
        probe = self._loader(shuffle=False, seed=0, window=4)
        try:
            info = probe.dataset_info()
        finally:
            probe.close()
        self.manifest = json.loads(info.manifest_json)
        self.root = f"{address}/{dataset}"
        if tf.check_meta(self.manifest, name=self.root) is None:
            raise ConfigError(f"{self.root} is not a token dataset (converted without --tokenizer)")

    def _loader(self, *, shuffle: bool, seed: int, window: int) -> Any:
        from gdsload.service.client.loader import RemoteLoader

        return RemoteLoader(self.address, dataset=self.dataset + tf.DOCUMENTS_SUFFIX,
                            batch_size=self.batch_documents, shuffle=shuffle, seed=seed, shuffle_window=window,
                            order=2, decode=False, fields=[tf.FIELD, "__key__"], output="numpy", rank=0,
                            world_size=1, **self.options)

    def documents(self, *, epoch: int, start: int, shuffle: bool, seed: int, window: int,
                  dtype: np.dtype) -> Iterator[tuple[int, np.ndarray]]:
        """(global document number, token ids) of `epoch`'s document order from position `start`."""
        rl = self._loader(shuffle=shuffle, seed=seed, window=window)
        try:
            first = start - start % self.batch_documents
            rl.load_state_dict(rl.plan.state(epoch, first))
            skip = start - first
            for column, keys in rl:
                for i, key in enumerate(keys):
                    if skip:
                        skip -= 1
                        continue
                    yield int(key), np.frombuffer(column[i], dtype)
        finally:
            rl.close()

    def __repr__(self) -> str:
        return f"gdsload.ServedTokens({self.address!r}, {self.dataset!r})"
