"""`gdsload.plan.pack.ConcatChunk` (the loader's ``concat`` path over local token shards: many
steps' states at once, then each batch made on its own) against the simple reference: `Packer.step`
then `assemble` for every step (`assemble` itself checked token by token in test_pack.py). Long
runs of random lengths (documents of 0 tokens included: no eos), every rank of several world
sizes, chunks of 1 to many steps, resumed mid-document; and through the loader, a whole pass at
the default chunk size against step by step."""

from __future__ import annotations

import numpy as np
import pytest

import gdsload
from gdsload.frontend import tokens as tk
from gdsload.plan import pack as pk


def reference(docs, seq, rows, rank, world, pad_id, state):
    """[(batch of rank `rank`, state after)] from `state` to the epoch's end, step by step."""
    lengths = np.asarray([len(d) for d in docs], np.int64)
    p = pk.Packer(seq_len=seq, rows=rows, pack="concat", num_documents=len(docs), lengths=lambda pos: lengths[pos])
    out = []
    while True:
        got, state = p.step(state)
        if not any(got):
            return out
        part = got[rank::world]
        out.append((pk.assemble(part, seq, lambda q: docs[q[0]][q[1]:q[1] + q[2]], pad_id), dict(state)))
        if p.exhausted(state):
            return out


def chunked(docs, seq, rows, rank, world, pad_id, state, ahead):
    """The same through `concat_ahead` + `rank_documents` + `ConcatChunk`, `ahead` steps a chunk,
    the documents as stored (uint16) end to end, as the loader lays them."""
    lengths = np.asarray([len(d) for d in docs], np.int64)
    pos, off, out = state["position"], state["offset"], []
    while True:
        consumed, offs, real = pk.concat_ahead(lengths[pos:], off, seq_len=seq, rows=rows, steps=ahead,
                                               complete=True)
        span = lengths[pos:pos + int(consumed[-1]) + int(offs[-1] > 0)]
        total = int(real.sum())
        need = pk.rank_documents(span, off, total, seq_len=seq, rows=rows, rank=rank, world=world)
        picked = [docs[pos + i] for i in np.flatnonzero(need).tolist()]
        flat = np.concatenate(picked).astype(np.uint16) if picked else np.zeros(0, np.uint16)
        chunk = pk.ConcatChunk(flat, span, off, total, seq_len=seq, rows=rows, rank=rank, world=world,
                               pad_id=pad_id, need=need)
        assert chunk.steps == int((real > 0).sum())
        for t in range(len(real)):
            if not real[t]:
                return out
            nxt = {"position": pos + int(consumed[t]), "offset": int(offs[t]), "carry": []}
            out.append((chunk.batch(t), nxt))
            if nxt["position"] >= len(docs) and not nxt["offset"]:
                return out
        pos, off = pos + int(consumed[-1]), int(offs[-1])


def same(got, want):
    assert len(got) == len(want)
    for k, ((bg, sg), (bw, sw)) in enumerate(zip(got, want)):
        assert sg == sw, k
        assert bg.keys() == bw.keys()
        for f in bw:
            assert bg[f].dtype == bw[f].dtype and bg[f].shape == bw[f].shape, (k, f)
            assert np.array_equal(bg[f], bw[f]), (k, f)


@pytest.mark.parametrize("seq,rows,worlds,zeros", [
    (64, 4, (1, 2, 4), False),
    (50, 6, (1, 3, 6), True),
    (128, 1, (1,), True),
    (17, 5, (1, 5), False),
])
def test_chunks_equal_the_step_by_step_reference(seq, rows, worlds, zeros):
    rng = np.random.default_rng(seq * rows)
    n = rng.integers(0, 300, 400)  # a long run: ~60k tokens, hundreds of steps
    if zeros:
        n[rng.random(len(n)) < 0.1] = 0  # documents of 0 tokens (no eos), some at step edges
    docs = [rng.integers(0, 60000, k).astype(np.uint16) for k in n]
    for world in worlds:
        for rank in range(world):
            want = reference(docs, seq, rows, rank, world, 7, pk.start_state())
            assert len(want) > 20
            for ahead in (1, 3, 64, 10 ** 6):
                same(chunked(docs, seq, rows, rank, world, 7, pk.start_state(), ahead), want)
            for k in (1, len(want) // 3, len(want) - 1):  # resumed, mid-document where offset > 0
                st = want[k - 1][1]
                same(chunked(docs, seq, rows, rank, world, 7, st, 5), want[k:])


def test_batches_are_new_arrays_of_the_batch_shape():
    docs = [np.arange(i, i + 90, dtype=np.uint16) for i in range(30)]
    got = chunked(docs, 32, 2, 0, 1, 0, pk.start_state(), 10 ** 6)
    for b, _ in got:
        for f, v in b.items():
            if f != "cu_seqlens":
                assert v.shape == (2, 32) and v.flags.c_contiguous, f
    b0 = {f: v.copy() for f, v in got[0][0].items()}
    for b, _ in got[1:]:
        for v in b.values():
            v[...] = 3  # a training step writing its batch in place touches no other batch
    assert all(np.array_equal(got[0][0][f], b0[f]) for f in b0)


@pytest.mark.parametrize("world,kw", [(1, {}), (2, {"shuffle": True, "seed": 1}), (3, {"drop_last": True})])
def test_a_whole_pass_at_the_default_chunk_equals_step_by_step(corpus, monkeypatch, world, kw):
    """The loader's chunked path at its default `_AHEAD` (many steps a chunk) against `_AHEAD` 0
    (the packer and `assemble` step by step): every batch and every state of a pass, each rank."""
    def run(ahead, rank):
        monkeypatch.setattr(tk, "_AHEAD", ahead)
        ld = gdsload.TokenLoader(str(corpus.tokens), 256, 3, eos_token="<eos>", output="numpy", prefetch=0,
                                 rank=rank, world_size=world, **kw)
        return [(b, ld.state_dict()) for b in ld]

    default = tk._AHEAD
    assert default >= 64 * 256 * 3 * 3  # many steps a chunk here
    for rank in range(world):
        want = run(0, rank)
        assert len(want) > 50
        same(run(default, rank), want)


def test_steps_handed_over_in_lists_keep_every_state_exact(corpus):
    """With prefetch, the chunked path hands steps to the training thread in lists of `prefetch`:
    the batches and the state after each are those of prefetch=0; a state saved in the middle of
    a list resumes there, and a new iter() mid-list continues with the next batch."""
    def make(prefetch):
        return gdsload.TokenLoader(str(corpus.tokens), 128, 2, eos_token="<eos>", output="numpy",
                                   prefetch=prefetch, shuffle=True, seed=4)

    ref = make(0)
    want = [(b, ref.state_dict()) for b in ref]
    assert len(want) > 40
    ld = make(3)
    it = iter(ld)
    got = []
    for _ in range(10):  # 10 = 3 lists of 3 and one more: mid-list
        got.append((next(it), ld.state_dict()))
    same(got, want[:10])
    rest = [(b, ld.state_dict()) for b in iter(ld)]  # a new iter() closes the live pass, continues
    same(rest, want[10:])
    again = make(3)
    again.load_state_dict(want[4][1])  # the middle of the second list
    same([(b, again.state_dict()) for b in again], want[5:])
