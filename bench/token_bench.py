"""Tokens per second of `gdsload.TokenLoader` against the token loaders of its peers (issue 51 item 6).

One corpus for everyone: real text of mixed document lengths (this interpreter's standard-library
sources cut at line ends into documents of 40 to 30,000 characters, log-uniform, seeded, as
tests/tokens/conftest.py), written as JSON lines; a byte-level BPE tokenizer trained on it
(`tokenizers`, or `--tokenizer tokenizer.json`); the corpus converted once with `gdsload convert`
into token shards and into text shards. The corpus's document-length histogram (tokens, powers of
2) is printed and written.

Contestants, each a whole pass over the corpus, interleaved over `--rounds` rounds (after one
warm-up each: page cache hot for all); every tokenizer runs with `RAYON_NUM_THREADS=--threads`
(set before `tokenizers` is imported, for every contestant) and torch with as many threads:

* `raw_read`: reading the token shards' bytes (every shard file, 8 MiB reads): the baseline of the
  pre-tokenized contestants (its tokens are the manifest's).
* `format_floor`: the raw read plus the least work of TokenLoader's batch format (four int64
  [batch, seq_len] arrays from two bytes a token; no packing, eos or checks): a bound on the
  pre-tokenized ratio over the raw read that no loader of this format can pass.
* `encode_batch`: bare `tokenizers.Tokenizer.encode_batch` over the corpus's texts, in memory, in
  batches of 1,000 documents: the baseline of tokenizing on the fly.
* `gdsload_tokens_concat`, `gdsload_tokens_best_fit`: `TokenLoader` over the token shards
  (pre-tokenized), `seq_len` x `batch`, eos appended, NumPy output.
* `gdsload_text_concat`: `TokenLoader` over the text shards with `tokenizer=` (tokenized on the fly).
* `hf_streaming`: HF `datasets.load_dataset("json", streaming=True)` of the JSON lines, `.map` of
  `PreTrainedTokenizerFast(tokenizer_file=...)` batched (eos appended), then
  `DataCollatorWithFlattening` over groups of about `seq_len * batch` tokens (the padding-free
  recipe; a document longer than `seq_len` goes in pieces of `seq_len`, so every token is passed).
* `litdata`: LitData's token loader: the documents' ids written once by `litdata.optimize`
  (`TokensLoader`, not timed), then `StreamingDataset(item_loader=TokensLoader(block_size=seq_len))`
  + `StreamingDataLoader(batch_size=batch)`.
* `grain`: Grain over the JSON lines: `MapDataset.source(lines).map(tokenize)` then
  `ConcatThenSplitIterDataset` packing to `seq_len` rows and batches of `batch`.

A contestant whose package does not import is reported as such ("not installed: ...") and left
out; nothing is installed by this script. Per contestant: median tokens/s over rounds (real
tokens: padding not counted), min and max; ratios (paired by round): on the fly over
`encode_batch` (target >= 0.9), pre-tokenized over `raw_read` (>= 0.9) and over `hf_streaming`
(>= 1.5); the real-token share of each packing.

The lead's run (a quiet machine; `datasets`, `transformers`, `litdata` and `grain` in a bench venv,
never in CI's extras: /work/tokbenchvenv has them, with torch 2.14.1 from PyPI, and the script puts
this checkout first on sys.path):

    RAYON_NUM_THREADS=2 /work/tokbenchvenv/bin/python bench/token_bench.py --workdir /tmp/tokbench \\
        --chars 60000000 --threads 2 --rounds 5 --seq-len 2048 --batch 8 --out bench/results/tokens-cpu2.json

    python bench/token_bench.py --tiny      # smoke run (one round, a small corpus): no figures
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from gdsload.bench.textgen import stdlib_documents  # noqa: E402  (this checkout's gdsload)


# -- the corpus -------------------------------------------------------------------------------
def ensure_corpus(work: Path, chars: int, tokenizer: str | None, vocab: int) -> dict[str, Path]:
    """corpus.jsonl, tokenizer.json, tokens/ and text/ under work/c{chars}, made once."""
    base = work / f"c{chars}-v{vocab}" if tokenizer is None else work / f"c{chars}-{Path(tokenizer).stem}"
    base.mkdir(parents=True, exist_ok=True)
    out = {"jsonl": base / "corpus.jsonl", "tokenizer": base / "tokenizer.json", "tokens": base / "tokens",
           "text": base / "text", "litdata": base / "litdata"}
    if not out["jsonl"].is_file():
        docs = stdlib_documents(chars, recursive=True)
        tmp = out["jsonl"].with_suffix(".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for d in docs:
                f.write(json.dumps({"text": d}) + "\n")
        tmp.rename(out["jsonl"])
    if not out["tokenizer"].is_file():
        if tokenizer is not None:
            out["tokenizer"].write_bytes(Path(tokenizer).read_bytes())
        else:
            from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

            tok = Tokenizer(models.BPE(unk_token="<unk>"))
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            tok.decoder = decoders.ByteLevel()
            tok.train_from_iterator(read_texts(out["jsonl"]), trainers.BpeTrainer(
                vocab_size=vocab, special_tokens=["<unk>", "<eos>", "<pad>"], show_progress=False,
                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
            tok.save(str(out["tokenizer"]))
    from gdsload.convert.tokens import convert_corpus

    if not (out["tokens"] / "manifest.json").is_file():
        convert_corpus(str(out["jsonl"]), str(out["tokens"]), tokenizer=str(out["tokenizer"]), overwrite=True,
                       shard_size=256 << 20)
    if not (out["text"] / "manifest.json").is_file():
        convert_corpus(str(out["jsonl"]), str(out["text"]), overwrite=True, shard_size=256 << 20)
    return out


def read_texts(jsonl: Path) -> list[str]:
    with open(jsonl, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def histogram(lengths: list[int]) -> dict[str, int]:
    """Documents per length bucket [2^k, 2^(k+1)) tokens (end-of-document token not counted)."""
    out: dict[str, int] = {}
    for n in lengths:
        k = max(0, int(n).bit_length() - 1)
        key = f"{1 << k}-{(1 << (k + 1)) - 1}" if n else "0"
        out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: int(kv[0].split("-")[0])))


# -- contestants: each returns (real tokens, seconds) -------------------------------------------
class Ctx:
    def __init__(self, paths: dict[str, Path], args: argparse.Namespace):
        self.paths, self.args = paths, args
        self.seq, self.batch = args.seq_len, args.batch
        self.texts = read_texts(paths["jsonl"])
        manifest = json.loads((paths["tokens"] / "manifest.json").read_text())
        self.num_tokens = manifest["tokens"]["num_tokens"]
        self.num_docs = manifest["tokens"]["num_documents"]


def raw_read(ctx: Ctx) -> tuple[int, float]:
    files = sorted(ctx.paths["tokens"].glob("*.tar"))
    buf = bytearray(8 << 20)
    view = memoryview(buf)
    t0 = time.perf_counter()
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(view):
                pass
    return ctx.num_tokens, time.perf_counter() - t0


def format_floor(ctx: Ctx) -> tuple[int, float]:
    """The raw read plus the least a batch of TokenLoader's format costs: per global step, the
    step's tokens (as stored, uint16/uint32) widened into int64 `input_ids`, `labels` a copy,
    `position_ids` and `attention_mask` written whole (four int64 [batch, seq_len] arrays from
    two bytes a token). No packing, no eos, no CRC, tar headers counted as tokens: a bound no
    loader of this batch format can beat, so `pretokenized_over_raw_read` can be read against
    `format_floor_over_raw_read`."""
    import numpy as np

    files = sorted(ctx.paths["tokens"].glob("*.tar"))
    dtype = np.dtype(json.loads((ctx.paths["tokens"] / "manifest.json").read_text())["tokens"]["dtype"])
    step = ctx.seq * ctx.batch
    row = np.arange(ctx.seq, dtype=np.int64)
    t0 = time.perf_counter()
    n = 0
    for p in files:
        with open(p, "rb", buffering=0) as f:
            data = f.read()
        toks = np.frombuffer(data, dtype, count=len(data) // dtype.itemsize)
        for a in range(0, len(toks) - step + 1, step):
            ids = toks[a:a + step].astype(np.int64).reshape(ctx.batch, ctx.seq)
            labels = ids.copy()
            pos = np.empty_like(ids)
            pos[:] = row
            mask = np.ones_like(ids)
            n += step
            del ids, labels, pos, mask
    return min(n, ctx.num_tokens), time.perf_counter() - t0


def encode_batch(ctx: Ctx) -> tuple[int, float]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ctx.paths["tokenizer"]))
    t0 = time.perf_counter()
    n = 0
    for i in range(0, len(ctx.texts), 1000):
        n += sum(len(e.ids) for e in tok.encode_batch(ctx.texts[i:i + 1000], add_special_tokens=False))
    return n, time.perf_counter() - t0


def _gdsload(ctx: Ctx, data: Path, pack: str, **kw) -> tuple[int, float]:
    import gdsload

    t0 = time.perf_counter()
    ld = gdsload.TokenLoader(str(data), ctx.seq, ctx.batch, pack=pack, eos_token="<eos>", output="numpy", **kw)
    n = 0
    for b in ld:
        n += int(b["attention_mask"].sum())
    return n, time.perf_counter() - t0


def gdsload_tokens_concat(ctx: Ctx) -> tuple[int, float]:
    return _gdsload(ctx, ctx.paths["tokens"], "concat")


def gdsload_tokens_best_fit(ctx: Ctx) -> tuple[int, float]:
    return _gdsload(ctx, ctx.paths["tokens"], "best_fit")


def gdsload_text_concat(ctx: Ctx) -> tuple[int, float]:
    return _gdsload(ctx, ctx.paths["text"], "concat", tokenizer=str(ctx.paths["tokenizer"]))


def hf_streaming(ctx: Ctx) -> tuple[int, float]:
    import datasets
    from transformers import DataCollatorWithFlattening, PreTrainedTokenizerFast

    datasets.disable_progress_bars()
    t0 = time.perf_counter()
    tok = PreTrainedTokenizerFast(tokenizer_file=str(ctx.paths["tokenizer"]), eos_token="<eos>")
    ds = datasets.load_dataset("json", data_files=str(ctx.paths["jsonl"]), split="train", streaming=True)
    eos = tok.eos_token_id

    def tokenize(batch):
        return {"input_ids": [ids + [eos] for ids in tok(batch["text"], add_special_tokens=False)["input_ids"]]}

    ds = ds.map(tokenize, batched=True, batch_size=1000, remove_columns=["text"])
    collate = DataCollatorWithFlattening(return_tensors="np")
    budget, group, held, n = ctx.seq * ctx.batch, [], 0, 0
    for ex in ds:
        ids = ex["input_ids"]
        for at in range(0, len(ids), ctx.seq):  # a document longer than a row: pieces of seq_len (all tokens kept)
            group.append({"input_ids": ids[at:at + ctx.seq]})
            held += len(group[-1]["input_ids"])
            if held >= budget:
                n += int(collate(group)["input_ids"].size)
                group, held = [], 0
    if group:
        n += int(collate(group)["input_ids"].size)
    return n, time.perf_counter() - t0


def _litdata_ready(ctx: Ctx) -> Path:
    out = ctx.paths["litdata"]
    if (out / "index.json").is_file():
        return out
    import litdata as ld
    import torch

    tok_path = str(ctx.paths["tokenizer"])
    files = []
    part = ctx.paths["litdata"].parent / "litdata_src"
    part.mkdir(exist_ok=True)
    per = max(1, len(ctx.texts) // 8)
    for i in range(0, len(ctx.texts), per):
        p = part / f"part{i // per:03d}.jsonl"
        if not p.is_file():
            p.write_text("".join(json.dumps({"text": t}) + "\n" for t in ctx.texts[i:i + per]))
        files.append(str(p))

    ld.optimize(fn=_LitTokenize(tok_path), inputs=files, output_dir=str(out), num_workers=1,
                chunk_size=(ctx.seq + 1) * 1024, item_loader=ld.streaming.item_loader.TokensLoader())
    del torch
    return out


class _LitTokenize:
    def __init__(self, tokenizer: str):
        self.tokenizer = tokenizer

    def __call__(self, path: str):
        import torch
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(self.tokenizer)
        eos = tok.token_to_id("<eos>")
        with open(path, encoding="utf-8") as f:
            texts = [json.loads(line)["text"] for line in f]
        for e in tok.encode_batch(texts, add_special_tokens=False):
            yield torch.tensor(e.ids + [eos], dtype=torch.int32)


def litdata(ctx: Ctx) -> tuple[int, float]:
    import litdata as ld

    src = _litdata_ready(ctx)
    t0 = time.perf_counter()
    ds = ld.StreamingDataset(str(src), item_loader=ld.streaming.item_loader.TokensLoader(block_size=ctx.seq),
                             shuffle=False)
    dl = ld.StreamingDataLoader(ds, batch_size=ctx.batch, num_workers=0)
    n = 0
    for b in dl:
        n += int(b.numel())
    return n, time.perf_counter() - t0


def grain(ctx: Ctx) -> tuple[int, float]:
    import grain as gr
    import numpy as np
    from tokenizers import Tokenizer

    t0 = time.perf_counter()
    tok = Tokenizer.from_file(str(ctx.paths["tokenizer"]))
    eos = tok.token_to_id("<eos>")
    with open(ctx.paths["jsonl"], encoding="utf-8") as f:
        lines = f.readlines()
    ds = gr.MapDataset.source(lines).map(
        lambda line: {"tokens": np.asarray(tok.encode(json.loads(line)["text"], add_special_tokens=False).ids + [eos],
                                           np.int32)})
    packed = gr.experimental.ConcatThenSplitIterDataset(ds.to_iter_dataset(), length_struct={"tokens": ctx.seq})
    n = 0
    for b in packed.batch(ctx.batch):
        n += int((b["tokens_segment_ids"] > 0).sum()) if "tokens_segment_ids" in b else int(b["tokens"].size)
    return n, time.perf_counter() - t0


CONTESTANTS = {
    "raw_read": (raw_read, None),
    "format_floor": (format_floor, None),
    "encode_batch": (encode_batch, "tokenizers"),
    "gdsload_tokens_concat": (gdsload_tokens_concat, None),
    "gdsload_tokens_best_fit": (gdsload_tokens_best_fit, None),
    "gdsload_text_concat": (gdsload_text_concat, "tokenizers"),
    "hf_streaming": (hf_streaming, "datasets transformers"),
    "litdata": (litdata, "litdata"),
    "grain": (grain, "grain"),
}


def available(names: list[str]) -> tuple[list[str], dict[str, str]]:
    import importlib

    ok, missing = [], {}
    for name in names:
        need = CONTESTANTS[name][1]
        try:
            for mod in (need or "").split():
                importlib.import_module(mod)
            ok.append(name)
        except Exception as exc:  # an import that fails for any reason: not installed here
            missing[name] = f"not installed: {type(exc).__name__}: {exc}"
    return ok, missing


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/tokbench"))
    ap.add_argument("--chars", type=int, default=60_000_000, help="characters of text in the corpus")
    ap.add_argument("--tokenizer", default=None, help="a tokenizer.json (default: a BPE trained on the corpus)")
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--only", default="", help="comma-separated contestants (default: all available)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--tiny", action="store_true", help="smoke run: small corpus, one round, no figures")
    args = ap.parse_args(argv)
    if args.tiny:
        args.chars, args.rounds, args.seq_len, args.batch, args.vocab = 200_000, 1, 256, 4, 500
        if args.workdir == Path("/tmp/tokbench"):
            args.workdir = Path("/tmp/tokbench-tiny")
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)  # before tokenizers is imported, for all
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    try:
        import torch

        torch.set_num_threads(args.threads)
    except ImportError:
        pass
    paths = ensure_corpus(args.workdir, args.chars, args.tokenizer, args.vocab)
    ctx = Ctx(paths, args)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(paths["tokenizer"]))
    lengths = [len(e.ids) for e in tok.encode_batch(ctx.texts, add_special_tokens=False)]
    hist = histogram(lengths)
    names = [n for n in (args.only.split(",") if args.only else CONTESTANTS) if n]
    unknown = [n for n in names if n not in CONTESTANTS]
    if unknown:
        ap.error(f"unknown contestants {unknown}; known: {', '.join(CONTESTANTS)}")
    names, missing = available(names)
    print(f"corpus: {len(ctx.texts)} documents, {ctx.num_tokens} tokens; threads {args.threads}; "
          f"seq_len {args.seq_len} x batch {args.batch}; rounds {args.rounds}")
    print("document lengths (tokens):", json.dumps(hist))
    for n, why in missing.items():
        print(f"{n}: {why}")
    for n in names:  # warm-up (page cache, one-time preparation such as LitData's optimize)
        CONTESTANTS[n][0](ctx)
    runs: dict[str, list[tuple[int, float]]] = {n: [] for n in names}
    for r in range(args.rounds):
        for n in (names if r % 2 == 0 else names[::-1]):  # interleaved, alternating order
            runs[n].append(CONTESTANTS[n][0](ctx))
            tokens, secs = runs[n][-1]
            print(f"round {r} {n}: {tokens} tokens in {secs:.3f} s", flush=True)
    result: dict = {"corpus": {"documents": len(ctx.texts), "tokens": ctx.num_tokens, "histogram": hist},
                    "threads": args.threads, "seq_len": args.seq_len, "batch": args.batch, "rounds": args.rounds,
                    "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                    "missing": missing, "contestants": {}, "ratios": {}}
    for n, rs in runs.items():
        rates = [t / s for t, s in rs]
        result["contestants"][n] = {"tokens": rs[0][0], "median_tokens_per_s": statistics.median(rates),
                                    "min": min(rates), "max": max(rates)}
    for key, a, b in (("text_on_the_fly_over_encode_batch", "gdsload_text_concat", "encode_batch"),
                      ("pretokenized_over_raw_read", "gdsload_tokens_concat", "raw_read"),
                      ("format_floor_over_raw_read", "format_floor", "raw_read"),
                      ("pretokenized_over_format_floor", "gdsload_tokens_concat", "format_floor"),
                      ("pretokenized_over_litdata", "gdsload_tokens_concat", "litdata"),
                      ("pretokenized_over_hf_streaming", "gdsload_tokens_concat", "hf_streaming"),
                      ("best_fit_over_hf_streaming", "gdsload_tokens_best_fit", "hf_streaming")):
        if a in runs and b in runs:
            rs = [(ta / sa) / (tb / sb) for (ta, sa), (tb, sb) in zip(runs[a], runs[b])]
            result["ratios"][key] = {"median": statistics.median(rs), "min": min(rs), "max": max(rs)}
    if args.tiny:
        print("(--tiny: a smoke run; these numbers are not figures)")
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
