"""`gdsload.plan.pack`: the packer as a pure function of lengths, from tables of small cases; its
state resumes at any step; 10^10 documents plan as fast as a few."""

from __future__ import annotations

import resource
import time

import numpy as np
import pytest

from gdsload.errors import StateError
from gdsload.plan import pack as pk

CASES = [  # (lengths, seq_len, rows)
    ([5, 3, 8, 1, 1, 9, 2], 4, 2),
    ([1] * 17, 4, 3),
    ([30], 8, 2),
    ([0, 3, 0, 0, 5], 4, 1),
    ([7, 7, 7, 1, 1, 1, 2, 6], 8, 2),
    (list(range(1, 40)), 16, 4),
]


def run(lengths, seq, rows, pack, state=None):
    arr = np.asarray(lengths, np.int64)
    p = pk.Packer(seq_len=seq, rows=rows, pack=pack, num_documents=len(arr), lengths=lambda pos: arr[pos])
    st, steps, states = state or pk.start_state(), [], []
    while True:
        states.append(st)
        out, st = p.step(st)
        if not any(out):
            return steps, states
        steps.append(out)


@pytest.mark.parametrize("lengths,seq,rows", CASES)
@pytest.mark.parametrize("pack", pk.PACKS)
def test_every_token_once_rows_bounded_and_resumable(lengths, seq, rows, pack):
    steps, states = run(lengths, seq, rows, pack)
    covered = {d: np.zeros(n, int) for d, n in enumerate(lengths)}
    for step in steps:
        assert len(step) == rows
        for row in step:
            assert sum(p[2] for p in row) <= seq and all(p[2] > 0 for p in row)
            for d, s, n in row:
                covered[d][s:s + n] += 1
    assert all((c == 1).all() for c in covered.values())  # every token of every document once
    if pack == "concat":  # full rows but in the last step
        flat = [sum(p[2] for p in row) for step in steps[:-1] for row in step]
        assert all(n == seq for n in flat)
        assert len(steps) == pk.concat_steps(sum(lengths), seq_len=seq, rows=rows, drop_last=False)
    else:  # a document that fits is never cut
        for step in steps:
            for row in step:
                for d, s, n in row:
                    if lengths[d] <= seq:
                        assert (s, n) == (0, lengths[d])
        bound = pk.best_fit_steps_bound(sum(1 for n in lengths if n), sum(lengths), seq_len=seq, rows=rows)
        assert len(steps) <= bound
    for k in range(len(steps)):  # from the state after step k, the same rest
        assert run(lengths, seq, rows, pack, state=states[k])[0] == steps[k:]


def test_assemble_fields():
    toks = {0: np.arange(10, 15), 1: np.arange(20, 23)}
    rows = [[(0, 2, 3)], [(1, 0, 3), (0, 0, 1)]]
    b = pk.assemble(rows, 4, lambda p: toks[p[0]][p[1]:p[1] + p[2]], pad_id=9)
    assert b["input_ids"].tolist() == [[12, 13, 14, 9], [20, 21, 22, 10]]
    assert b["labels"].tolist() == [[12, 13, 14, -100], [-100, 21, 22, -100]]
    assert b["position_ids"].tolist() == [[2, 3, 4, 0], [0, 1, 2, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert b["cu_seqlens"].tolist() == [0, 3, 4, 7, 8] and b["cu_seqlens"].dtype == np.int32


def _assemble_by_loop(rows, seq, tokens, pad_id):
    """The batch written out token by token: what the vectorised `assemble` must equal."""
    b = len(rows)
    ids, labels = np.full((b, seq), pad_id), np.full((b, seq), pk.IGNORE)
    pos, mask, cu = np.zeros((b, seq)), np.zeros((b, seq)), [0]
    for r, row in enumerate(rows):
        at = 0
        for piece in row:
            for j, t in enumerate(tokens(piece)):
                ids[r, at + j] = labels[r, at + j] = t
                pos[r, at + j], mask[r, at + j] = piece[1] + j, 1
            if piece[1] == 0:
                labels[r, at] = pk.IGNORE
            at += piece[2]
            cu.append(r * seq + at)
        if at < seq:
            cu.append((r + 1) * seq)
    return {"input_ids": ids, "labels": labels, "position_ids": pos, "attention_mask": mask, "cu_seqlens": cu}


@pytest.mark.parametrize("lengths,seq,rows", CASES)
@pytest.mark.parametrize("pack", pk.PACKS)
def test_assemble_equals_token_by_token(lengths, seq, rows, pack):
    """Every step of both packings (full rows, a padded last step, empty rows, documents cut
    mid-row) and a rank's rows: the vectorised batch is the token-by-token one, dtypes included."""
    docs = {d: np.arange(1000 * d, 1000 * d + n, dtype=np.uint16) for d, n in enumerate(lengths)}
    steps, _ = run(lengths, seq, rows, pack)
    assert steps
    for step in steps:
        for part in (step, step[1::2]):
            def tokens(p):
                return docs[p[0]][p[1]:p[1] + p[2]]
            got, want = pk.assemble(part, seq, tokens, pad_id=7), _assemble_by_loop(part, seq, tokens, 7)
            for k, v in want.items():
                assert got[k].tolist() == np.asarray(v).tolist(), k
            assert all(got[k].dtype == np.int64 for k in want if k != "cu_seqlens")
            assert got["cu_seqlens"].dtype == np.int32
            assert not any(np.shares_memory(got[k], d) for k in want for d in docs.values())  # never a view
    bad = [[(0, 0, 2)]]
    with pytest.raises(ValueError, match="gave 1 ids, expected 2"):
        pk.assemble(bad, seq, lambda p: np.zeros(1, np.int64), pad_id=0)


def test_ten_billion_documents_plan_at_once():
    """10^10 documents in 10^4 shards, shuffled (order 2 over documents): the first steps of both
    packings in well under a second each, and no memory of the order's size."""
    sizes = [10 ** 6] * 10 ** 4
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    order = pk.DocOrder(sizes, seed=3, epoch=0, shuffle=True, window=8)

    def lengths(pos):  # a fixed function of the document id (the index's lengths stand-in)
        ids = order.at(pos)
        return 1 + (ids * 2654435761 % 4093)

    for pack in pk.PACKS:
        p = pk.Packer(seq_len=2048, rows=16, pack=pack, num_documents=10 ** 10, lengths=lengths)
        t0 = time.perf_counter()
        st = pk.start_state()
        for _ in range(3):
            rows, st = p.step(st)
        assert time.perf_counter() - t0 < 5.0  # measured ~0.05 s here
        assert all(rows)
    ids = order.at(np.arange(100))
    assert len(set(ids.tolist())) == 100 and ids.max() > 10 ** 8  # spread over the shards
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0 < 200_000  # KiB: nothing of 10^10


def test_check_state_names_fields():
    mine = {"version": 1, "kind": "tokens", "tokens_version": 1, "order": 2, "dataset": "a", "seed": 0,
            "shuffle": True, "window": 4, "drop_last": False, "global_batch": 12, "num_samples": 5,
            "seq_len": 8, "pack": "concat", "eos": None, "tokenizer": "x", "epoch": 0, "step": 1,
            "position": 2, "offset": 3, "carry": []}
    assert pk.check_state(dict(mine), mine) == (0, 1, {"position": 2, "offset": 3, "carry": []})
    with pytest.raises(StateError, match="window: 5 there, 4 here"):
        pk.check_state(dict(mine, window=5), mine)
    with pytest.raises(StateError, match="'carry' must be a list"):
        pk.check_state(dict(mine, carry=[[1, 2]]), mine)
    with pytest.raises(StateError, match="past the epoch's 5 documents"):
        pk.check_state(dict(mine, position=6), mine)


@pytest.mark.parametrize("pack", pk.PACKS)
def test_rows_do_not_depend_on_how_many_lengths_are_asked_at_once(pack):
    """Blocks of lengths growing to `block_max` (the text path's: one tokenizer call per block)
    give the same steps as blocks of `BLOCK`, and ask for each position once."""
    rng = np.random.default_rng(5)
    lengths = rng.integers(0, 900, 3000)
    asked: list[int] = []

    def fn(pos):
        asked.extend(pos.tolist())
        return lengths[pos]

    def steps(block_max, f):
        p = pk.Packer(seq_len=512, rows=4, pack=pack, num_documents=len(lengths), lengths=f, block_max=block_max)
        st, out = pk.start_state(), []
        while True:
            rows, st = p.step(st)
            if not any(rows):
                return out
            out.append(rows)

    assert steps(4096, fn) == steps(pk.BLOCK, lambda pos: lengths[pos])
    assert sorted(asked) == list(range(len(lengths)))  # blocks of 512, 1024, then 1464: each position once
