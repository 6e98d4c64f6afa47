"""`TokenLoader(gdsload.Mix(...))`: token datasets mixed by tokens, a weight schedule in tokens
consumed, exact resume (also across an epoch's end and onto another world size), refusals.

Two token datasets from the session corpus with one tokenizer: its short documents (under 1,500
characters) and its long ones, so a mix by documents would give very different token shares than
a mix by tokens."""

from __future__ import annotations

import json

import numpy as np
import pytest

import gdsload
from gdsload.errors import ConfigError, StateError
from gdsload.plan import pack as pk
from gdsload.plan.mix import PlanError

SEQ, G = 256, 8


@pytest.fixture(scope="module")
def parts(corpus, tmp_path_factory):
    from gdsload.convert.tokens import convert_corpus

    root = tmp_path_factory.mktemp("tokmix")
    docs = corpus.docs[:400]
    out = []
    for name, keep in (("short", lambda d: len(d) < 1500), ("long", lambda d: len(d) >= 1500)):
        src = root / f"{name}.jsonl"
        src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs if keep(d)))
        convert_corpus(str(src), str(root / name), tokenizer=str(corpus.tokenizer_json), workers=1,
                       shard_size=256 << 10, chunk_tokens=32 << 10)
        out.append(str(root / name))
    return out


def make(parts, weights=(1.0, 1.0), schedule=None, batch=G, **kw):
    kw = {"shuffle": True, "seed": 11, "eos_token": "<eos>", "output": "numpy", "pack": "concat", **kw}
    return gdsload.TokenLoader(gdsload.Mix(parts, weights=list(weights), schedule=schedule), SEQ, batch, **kw)


def epoch_pieces(ld, epoch=0):
    """Every global step's rows of (document id, start, length) over one epoch, from its start."""
    out, st = [], pk.start_state()
    at, packer, _ = ld._epoch_packer(epoch, None)  # one packer for the epoch (rows() makes one a call)
    while True:
        rows, st = packer.step(st)
        if not any(rows):
            return out
        out.append(ld._named(at, rows))


def shares(pieces, split):
    """Tokens from dataset 0 (ids < split) and dataset 1, and documents begun of each."""
    tokens, docs = np.zeros(2, np.int64), np.zeros(2, np.int64)
    for rows in pieces:
        for row in rows:
            for d, start, n in row:
                tokens[int(d >= split)] += n
                docs[int(d >= split)] += start == 0
    return tokens, docs


def test_the_mix_weighs_by_tokens_not_documents(parts):
    ld = make(parts, weights=(3, 1))
    split = ld._mixer._offsets[1]
    tokens, docs = shares(epoch_pieces(ld), split)
    longest = 30_000  # no document of the corpus has more tokens than characters
    assert abs(tokens[0] / tokens.sum() - 0.75) * tokens.sum() < 2 * longest
    assert abs(tokens[0] / tokens.sum() - 0.75) < 0.02, tokens
    # the short documents' dataset gives far more than 3/4 of the documents: a mix by documents
    # would have given it 3/4 of them and a much smaller share of the tokens
    assert docs[0] / docs.sum() > 0.9, docs
    assert tokens.sum() >= ld.tokens_per_epoch  # the epoch ends with the document crossing its count


def test_default_weights_are_the_datasets_tokens(parts):
    ld = gdsload.TokenLoader(gdsload.Mix(parts), SEQ, G, eos_token="<eos>", output="numpy")
    a, b = (gdsload.TokenLoader(p, SEQ, G, eos_token="<eos>", output="numpy").num_tokens for p in parts)
    assert [s.weight for s in ld.mix.sources] == [float(a), float(b)] and ld.tokens_per_epoch == a + b
    tokens, _ = shares(epoch_pieces(ld), ld._mixer._offsets[1])
    assert abs(tokens[0] / tokens.sum() - a / (a + b)) < 0.02


@pytest.mark.parametrize("pack", ["concat", "best_fit"])
def test_a_schedule_changes_the_token_shares_and_resumes_exactly(parts, pack):
    """Weights 1:1, then 1:4 from a quarter of an epoch's tokens, then 4:1 from 1.25 epochs: two
    epochs uninterrupted equal the same run resumed (JSON state, fresh loader) before and after
    each change, mid-epoch and at the epoch's end, on another world size with the same global
    batch; the token shares follow the schedule."""
    probe = make(parts)
    t = probe.tokens_per_epoch
    schedule = [(t // 4, [1, 4]), (5 * t // 4, [4, 1])]
    ref = make(parts, schedule=schedule, pack=pack)
    whole = [b["input_ids"] for b in ref] + [b["input_ids"] for b in ref]
    steps0 = len(epoch_pieces(make(parts, schedule=schedule, pack=pack)))
    assert ref.epoch == 2 and len(whole) > steps0
    for at in (steps0 // 3, steps0, steps0 + 7):
        run = make(parts, schedule=schedule, pack=pack)
        it = iter(run)
        got = []
        while len(got) < at:
            try:
                got.append(next(it)["input_ids"])
            except StopIteration:
                it = iter(run)
        state = json.loads(json.dumps(run.state_dict()))
        halves = [make(parts, schedule=schedule, pack=pack, batch=G // 2, rank=r, world_size=2) for r in range(2)]
        for h in halves:
            h.load_state_dict(state)
        while len(got) < len(whole):
            its = [iter(h) for h in halves]
            for a, b in zip(*its):
                rows = np.empty((G, SEQ), np.int64)
                rows[0::2], rows[1::2] = a["input_ids"], b["input_ids"]
                got.append(rows)
        assert len(got) == len(whole), at
        assert all(np.array_equal(x, y) for x, y in zip(got, whole)), at
    # the shares follow the schedule (epoch 0: 1:1 up to t/4, then 1:4)
    ld = make(parts, schedule=schedule, pack="concat")
    split = ld._mixer._offsets[1]
    pieces = epoch_pieces(ld)
    cut = (t // 4) // (SEQ * G)
    before, _ = shares(pieces[:cut], split)
    after, _ = shares(pieces[cut + 2:], split)
    assert abs(before[0] / before.sum() - 0.5) < 0.1, before
    assert abs(after[0] / after.sum() - 0.2) < 0.05, after


def test_set_epoch_on_a_fresh_loader_gives_that_epoch_of_the_run(parts):
    schedule = [(1000, [1, 2])]
    ref = make(parts, schedule=schedule)
    for _ in ref:
        pass
    e1 = [b["input_ids"] for b in ref]
    fresh = make(parts, schedule=schedule)
    fresh.set_epoch(1)  # found by running epoch 0's lengths
    assert fresh.state_dict()["mix_cursor"]["total"] >= fresh.tokens_per_epoch
    assert all(np.array_equal(x, y) for x, y in zip((b["input_ids"] for b in fresh), e1, strict=True))


def test_a_state_of_another_mix_or_schedule_is_refused(parts):
    ld = make(parts, schedule=[(5000, [1, 2])])
    it = iter(ld)
    next(it)
    state = ld.state_dict()
    with pytest.raises(StateError, match="weight schedule differs"):
        make(parts, schedule=[(6000, [1, 2])]).load_state_dict(state)
    with pytest.raises(StateError, match="'weight'"):
        make(parts, weights=(2, 1), schedule=[(5000, [1, 2])]).load_state_dict(state)
    with pytest.raises(StateError, match="single dataset"):
        make(parts).load_state_dict(gdsload.TokenLoader(parts[0], SEQ, G, eos_token="<eos>",
                                                        output="numpy").state_dict())
    with pytest.raises(StateError, match="mix_cursor"):
        make(parts, schedule=[(5000, [1, 2])]).load_state_dict({**state, "mix_cursor": {"base": 0}})


def test_refusals(parts, corpus):
    with pytest.raises(PlanError, match="increase"):
        gdsload.Mix(parts, schedule=[(100, [1, 1]), (50, [1, 2])])
    with pytest.raises(PlanError, match="give 2 weights"):
        gdsload.Mix(parts, schedule=[(100, [1])])
    with pytest.raises(PlanError, match="all 0"):
        gdsload.Mix(parts, schedule=[(100, [0, 0])])
    with pytest.raises(ConfigError, match="repeat= and samples="):
        gdsload.TokenLoader(gdsload.Mix(parts, weights=[1, None], repeat=[None, 2.0]), SEQ, G, output="numpy")
    with pytest.raises(ConfigError, match="mix_by='batch'"):
        gdsload.TokenLoader(gdsload.Mix(parts, mix_by="batch"), SEQ, G, output="numpy")
    with pytest.raises(ConfigError, match="not a token dataset"):
        gdsload.TokenLoader(gdsload.Mix([parts[0], str(corpus.text)]), SEQ, G, output="numpy")
    with pytest.raises(TypeError, match="max_steps"):
        len(make(parts))
    # a DataLoader mixes samples: a schedule in tokens is refused there
    with pytest.raises(PlanError, match="TokenLoader"):
        gdsload.Mix([gdsload.Dataset(p) for p in parts], schedule=[(100, [1, 2])]).make_plan(
            seed=0, shuffle=False, batch_size=1, rank=0, world_size=1)


def test_a_resume_does_not_replay_the_stream(parts):
    """The state's mix_cursor is where the stream stands: a loader resumed mid-epoch looks its
    datasets' streams up from there on only, not from the epoch's start."""
    run = make(parts, schedule=[(3000, [1, 2])])
    it = iter(run)
    for _ in range(60):
        next(it)
    state = run.state_dict()
    streams = state["mix_cursor"]["streams"]
    assert min(streams) > 0
    again = make(parts, schedule=[(3000, [1, 2])], prefetch=0)
    asked = []
    real = again._mixer._ids
    again._mixer._ids = lambda i, start, count: (asked.append((i, start)), real(i, start, count))[1]
    again.load_state_dict(state)
    assert np.array_equal(next(iter(again))["input_ids"], next(it)["input_ids"])
    assert asked and all(start >= streams[i] - 1 for i, start in asked), (asked, streams)
