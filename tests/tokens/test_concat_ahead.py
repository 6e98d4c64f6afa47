"""`concat` over local token shards is packed and assembled many steps at a time
(`gdsload.plan.pack.concat_ahead` / `concat_batches`): it must give exactly the batches and the
states of packing step by step (`Packer.step` + `assemble`, themselves checked token by token in
test_pack.py), on every rank, across chunk edges, at the epoch's end and from a resumed state."""

from __future__ import annotations

import numpy as np
import pytest

import gdsload
from gdsload.frontend import tokens as tk
from gdsload.plan import pack as pk


def run(corpus, monkeypatch, ahead, seq, batch, state=None, **kw):
    """[(batch, state after it)] of one pass, with `ahead` tokens a chunk (0: step by step)."""
    monkeypatch.setattr(tk, "_AHEAD", ahead)
    kw.setdefault("eos_token", "<eos>")
    ld = gdsload.TokenLoader(str(corpus.tokens), seq, batch, output="numpy", prefetch=0, **kw)
    if state is not None:
        ld.load_state_dict(state)
    return [(b, ld.state_dict()) for b in ld]


def same(a, b):
    assert len(a) == len(b)
    for k, ((ba, sa), (bb, sb)) in enumerate(zip(a, b)):
        assert sa == sb, k
        assert ba.keys() == bb.keys()
        for f in ba:
            assert ba[f].dtype == bb[f].dtype and np.array_equal(ba[f], bb[f]), (k, f)


@pytest.mark.parametrize("seq,batch,world,kw", [
    (256, 2, 1, {}),
    (512, 3, 1, {"drop_last": True}),
    (512, 2, 3, {"shuffle": True, "seed": 3}),
    (384, 1, 2, {"eos_token": None}),
    (1024, 2, 2, {"drop_last": True, "shuffle": True, "pad_id": 2}),
])
def test_chunks_equal_step_by_step(corpus, monkeypatch, seq, batch, world, kw):
    cap = seq * batch * world
    for r in range(world):
        ref = run(corpus, monkeypatch, 0, seq, batch, rank=r, world_size=world, **kw)
        assert len(ref) > 10
        for ahead in (cap, 3 * cap + 1):  # one step a chunk; chunk edges mid-stream

            same(run(corpus, monkeypatch, ahead, seq, batch, rank=r, world_size=world, **kw), ref)
        mid = ref[len(ref) // 2][1]  # resumed mid-epoch (a document cut by the step: offset > 0)
        got = run(corpus, monkeypatch, 3 * cap, seq, batch, state=mid, rank=r, world_size=world, **kw)
        same(got, run(corpus, monkeypatch, 0, seq, batch, state=mid, rank=r, world_size=world, **kw))


def test_a_kept_batch_is_never_written_again(corpus, monkeypatch):
    got = run(corpus, monkeypatch, 1 << 19, 256, 2)
    first = {k: v.copy() for k, v in got[0][0].items()}
    for b, _ in got[1:]:
        b["labels"][:] = 0  # a training step writing its batch in place touches no other batch
    assert all(np.array_equal(got[0][0][k], first[k]) for k in first)


def test_concat_ahead_states_match_the_packer_with_empty_documents():
    """Documents of 0 tokens (no eos) at step edges and at the end, against `Packer.step`."""
    lengths = np.asarray([5, 3, 0, 8, 0, 0, 1, 1, 9, 2, 0, 4, 0], np.int64)
    for seq, rows in ((4, 2), (8, 1), (3, 3), (16, 2)):
        p = pk.Packer(seq_len=seq, rows=rows, pack="concat", num_documents=len(lengths),
                      lengths=lambda pos: lengths[pos])
        st, want = pk.start_state(), []
        while True:
            out, st = p.step(st)
            want.append((st["position"], st["offset"], sum(q[2] for r in out for q in r)))
            if not any(out) or p.exhausted(st):
                break
        consumed, offs, real = pk.concat_ahead(lengths, 0, seq_len=seq, rows=rows, steps=100, complete=True)
        got = list(zip(consumed.tolist(), offs.tolist(), real.tolist()))
        assert got == want, (seq, rows)
