"""A corpus of real text of mixed document lengths, a BPE tokenizer trained on it, and the corpus
converted into token shards: what the token tests share (tests/tokens/conftest.py makes the
session's corpus with it; the test files import names from here, never from `conftest`, which
is a different module in every test folder).

Documents: `gdsload.bench.textgen.stdlib_documents` (this interpreter's stdlib sources and
licence cut at line ends into documents of 40 to 30,000 characters; bench/token_bench.py's corpus
is the same text, bigger).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from gdsload.bench.textgen import stdlib_documents
CORPUS_CHARS = 3_000_000  # text taken, about 1 M tokens with the tokenizer below
VOCAB = 2000
SPECIAL = ["<unk>", "<eos>", "<pad>"]
SHARD_SIZE, CHUNK_TOKENS = 512 << 10, 128 << 10


def train_tokenizer(docs: list[str], vocab: int = VOCAB):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer)
    return tok


class Corpus:
    def __init__(self, root: Path):
        self.root = root
        self.docs = stdlib_documents(CORPUS_CHARS)
        self.jsonl = root / "corpus.jsonl"
        with open(self.jsonl, "w", encoding="utf-8") as f:
            for d in self.docs:
                f.write(json.dumps({"id": len(d), "text": d}) + "\n")
        self.tokenizer = train_tokenizer(self.docs)
        self.tokenizer_json = root / "tokenizer.json"
        self.tokenizer.save(str(self.tokenizer_json))
        self.ids = [np.asarray(e.ids, np.int64)
                    for e in self.tokenizer.encode_batch(self.docs, add_special_tokens=False)]
        self.eos = self.tokenizer.token_to_id("<eos>")
        from gdsload.convert.tokens import convert_corpus

        self.tokens = root / "tokens"
        # small shards and chunks: several of each (4 shards of 2 chunks)
        self.summary = convert_corpus(str(self.jsonl), str(self.tokens), tokenizer=str(self.tokenizer_json),
                                      shard_size=SHARD_SIZE, chunk_tokens=CHUNK_TOKENS, workers=1)
        self.text = root / "text"
        convert_corpus(str(self.jsonl), str(self.text), shard_size=1 << 20)
