"""A corpus of real text of mixed document lengths, a BPE tokenizer trained on it, and the corpus
converted into token shards: what the token tests share (tests/tokens/conftest.py makes the
session's corpus with it; the test files import names from here, never from `conftest`, which
is a different module in every test folder).

Documents: Python's own standard-library sources (the `.py` files of this interpreter's stdlib
folder, sorted by name), each cut at line ends into documents whose lengths are drawn
log-uniformly between 40 and 30,000 characters (a seeded `random.Random`), so the corpus holds
one-line documents up to ones many rows long; plus the license texts of the stdlib's LICENSE.txt
cut the same way. Nothing is repeated or generated.
"""

from __future__ import annotations

import json
import math
import random
import sysconfig
from pathlib import Path

import numpy as np
CORPUS_CHARS = 3_000_000  # text taken, about 1 M tokens with the tokenizer below
VOCAB = 2000
SPECIAL = ["<unk>", "<eos>", "<pad>"]
SHARD_SIZE, CHUNK_TOKENS = 512 << 10, 128 << 10


def _documents() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py")) + [stdlib / "LICENSE.txt"]
    rng = random.Random(51)
    docs, total = [], 0
    for f in files:
        try:
            lines = f.read_text(encoding="utf-8").splitlines(keepends=True)
        except (OSError, UnicodeDecodeError):
            continue
        i = 0
        while i < len(lines) and total < CORPUS_CHARS:
            want = int(math.exp(rng.uniform(math.log(40), math.log(30_000))))
            doc, n = [], 0
            while i < len(lines) and n < want:
                doc.append(lines[i])
                n += len(lines[i])
                i += 1
            docs.append("".join(doc))
            total += n
        if total >= CORPUS_CHARS:
            break
    return docs


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
        self.docs = _documents()
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
