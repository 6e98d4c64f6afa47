"""bench/token_bench.py runs (--tiny, the contestants this venv has): the smoke run, no figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_token_bench_tiny_runs(tmp_path):
    out = tmp_path / "r.json"
    run = subprocess.run([sys.executable, str(REPO / "bench" / "token_bench.py"), "--tiny", "--workdir",
                          str(tmp_path / "w"), "--out", str(out),
                          "--only", "raw_read,encode_batch,gdsload_tokens_concat,gdsload_tokens_best_fit,"
                                    "gdsload_text_concat,hf_streaming"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(out.read_text())
    hist = got["corpus"]["histogram"]
    assert sum(hist.values()) == got["corpus"]["documents"] and len(hist) >= 5  # mixed lengths
    c = got["contestants"]
    # every loader passes the same tokens: the corpus's, plus one eos a document
    want = got["corpus"]["tokens"] + got["corpus"]["documents"]
    assert c["gdsload_tokens_concat"]["tokens"] == c["gdsload_text_concat"]["tokens"] == want
    assert c["encode_batch"]["tokens"] == c["raw_read"]["tokens"] == got["corpus"]["tokens"]
    assert "pretokenized_over_raw_read" in got["ratios"]
    assert "hf_streaming" in c or "not installed" in got["missing"]["hf_streaming"]
