"""The first batch's plan path (issue 55): NumPy's PCG64 words without `numpy.random`, the first
batch as a chunk of its own, each chunk computed once, and a loader whose first batch imports no
`numpy.random`."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from gdsload.plan import pcg
from gdsload.plan.plan import Plan, PlanBatches

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("entropy", [[0], [7], [1, 0, 0x706C616E, 2], [2**40 + 5, 3, 0x706C616E, 2],
                                     [123456789, 2**33, 0x706C616E, 2], [1, 2, 3, 4, 5, 6, 2**70 + 1]])
def test_raw_words_are_numpy_pcg64_words(entropy):
    for n in (0, 1, 2, 6, 257):
        want = np.random.PCG64(np.random.SeedSequence(entropy)).random_raw(n)
        got = pcg.raw_words(entropy, n)
        assert got.dtype == np.uint64 and np.array_equal(got, np.asarray(want, np.uint64)), (entropy, n)
    assert pcg.seed_state(entropy, 4) == [int(w) for w in np.random.SeedSequence(entropy).generate_state(4, np.uint64)]


def test_raw_words_over_the_pure_limit_are_numpy_s(monkeypatch):
    monkeypatch.setattr(pcg, "PURE_WORDS", 3)
    want = np.random.PCG64(np.random.SeedSequence([5, 1])).random_raw(10)
    assert np.array_equal(pcg.raw_words([5, 1], 10), want)


def test_raw_words_refuse_negative_entropy():
    with pytest.raises(ValueError):
        pcg.raw_words([-1], 2)


def _plan(batch_size=4):
    return Plan("ds", (30, 25, 40, 5, 0, 17), batch_size, shuffle=True, seed=3, window=3, order=2)


def test_the_first_batch_is_computed_alone_and_the_rest_in_chunks(monkeypatch):
    plan = _plan()
    want = [plan.batch(1, k) for k in range(len(plan))]
    monkeypatch.setattr(PlanBatches, "CHUNK_POSITIONS", 12)  # three steps per chunk after the first
    asked = []
    real = Plan._steps

    def steps(self, order, which):
        asked.append(list(which))
        return real(self, order, which)

    monkeypatch.setattr(Plan, "_steps", steps)
    lazy = plan.batches_at(1, range(len(plan)))
    assert np.array_equal(lazy[0], want[0])
    assert asked == [[0]]  # the first batch: its own positions only
    assert np.array_equal(lazy[2], want[2])
    assert asked[1] == [1, 2, 3]
    assert all(np.array_equal(lazy[k], want[k]) for k in range(len(plan)))
    assert lazy.computed == len(asked) == 1 + -(-(len(plan) - 1) // 3)


def test_a_chunk_asked_by_two_threads_is_computed_once(monkeypatch):
    plan = _plan()
    lazy = plan.batches_at(0, range(len(plan)))
    entered, go = threading.Event(), threading.Event()
    real = Plan._steps
    calls = []

    def slow(self, order, which):
        calls.append(list(which))
        entered.set()
        assert go.wait(10)
        return real(self, order, which)

    monkeypatch.setattr(Plan, "_steps", slow)
    got = {}

    def ask(i):
        got[i] = lazy[i]

    a = threading.Thread(target=ask, args=(1,))
    a.start()
    assert entered.wait(10)
    b = threading.Thread(target=ask, args=(2,))  # the same chunk, while the first thread computes it
    b.start()
    b.join(0.2)
    assert b.is_alive()  # waiting for the first thread's chunk, not computing its own
    go.set()
    a.join(10)
    b.join(10)
    assert not a.is_alive() and not b.is_alive()
    assert len(calls) == 1 and lazy.computed == 1
    assert np.array_equal(got[1], plan.batch(0, 1)) and np.array_equal(got[2], plan.batch(0, 2))


def test_a_failed_chunk_is_computed_again_by_the_next_asker(monkeypatch):
    plan = _plan()
    lazy = plan.batches_at(0, range(len(plan)))
    real = Plan._steps
    fail = [True]

    def flaky(self, order, which):
        if fail.pop() if fail else False:
            raise OSError("once")
        return real(self, order, which)

    monkeypatch.setattr(Plan, "_steps", flaky)
    with pytest.raises(OSError):
        lazy[3]
    assert np.array_equal(lazy[3], plan.batch(0, 3))
    assert not lazy._pending


def test_a_loader_s_first_batch_imports_no_numpy_random(tmp_path):
    """Order 2's shard places come from `gdsload.plan.pcg`: `numpy.random` (eight extension
    modules, `secrets`, `hmac`, `random`) stays out of the constructor-to-first-batch path."""
    from gdsload.cli import main
    from gdsload.sampledata import make_npy_folder

    make_npy_folder(tmp_path / "src", num_samples=40, shape=(2048,), dtype="uint8", seed=1)
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "ds"), "--shard-size", "20KB", "-q"]) == 0
    script = r'''
import json, sys
sys.path.insert(0, sys.argv[1])
import gdsload
loader = gdsload.DataLoader(gdsload.Dataset(sys.argv[2]), batch_size=8, shuffle=True, seed=2, device="cpu",
                            output="numpy")
batch = next(iter(loader))
print(json.dumps({"random": "numpy.random" in sys.modules, "n": len(batch["cls"]),
                  "shards": len(loader.dataset.shard_sizes)}))
'''
    out = subprocess.run([sys.executable, "-c", script, str(REPO), str(tmp_path / "ds")], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["n"] == 8 and got["shards"] > 1
    assert got["random"] is False
