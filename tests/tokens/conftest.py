"""The token tests' session fixture: the corpus of `tokkit` (real text, a trained tokenizer, token
shards), made once."""

from __future__ import annotations

import pytest

pytest.importorskip("tokenizers")

from tokkit import Corpus  # noqa: E402


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Corpus:
    return Corpus(tmp_path_factory.mktemp("tokens"))
