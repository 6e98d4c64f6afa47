"""A pass is owned by one iterator (round 4, rows 10 and 11): `load_state_dict()` or a
`set_epoch()` while a pass is live stops that pass (its readers end and its slots are freed)
before the next `iter()`, and `state_dict()` always says what the next `iter()` will do.

Lightning resumes exactly so: `iter(loader)`, then `load_state_dict(state)`, then `iter(loader)`
again. Before the fix the detached pass's readers kept writing into the slots the new pass read:
segfaults, `RingError`, false `CorruptDataError`s, and keys lost or repeated."""

from __future__ import annotations

import numpy as np
import pytest

import fieldsample as fs
from npykit import keys, npy_dataset
from gdsload.errors import PassStopped
from gdsload.loader.dataloader import DataLoader

BATCH = 4


@pytest.fixture(scope="module")
def feats(tmp_path_factory):
    root = tmp_path_factory.mktemp("livepass")
    return str(npy_dataset(root / "src", root / "ds", num_samples=48, shape=(64,), dtype="float32", seed=5,
                           shard_size=16_384))


def make(path, **kw):
    kw = {"batch_size": BATCH, "shuffle": True, "seed": 7, "device": "cpu", "output": "numpy",
          "num_workers": 3, "prefetch_factor": 3, **kw}
    return DataLoader(path, **kw)


def reference(path, epoch=0, **kw):
    """key -> array and the epoch's key order, from a loader that copies its batches."""
    lo = make(path, copy=True, **kw)
    lo.set_epoch(epoch)
    arrays, order = {}, []
    for b in lo:
        for k, a in zip(b["__key__"], b["npy"]):
            arrays[k] = np.array(a)
            order.append(k)
    lo.close()
    return arrays, order


def check(batch, arrays):
    for k, a in zip(batch["__key__"], batch["npy"]):
        np.testing.assert_array_equal(a, arrays[k], err_msg=k)


def test_load_state_dict_after_iter_at_every_step_is_exact(feats):
    arrays, order = reference(feats)
    n = len(order) // BATCH
    states = []
    probe = make(feats)
    for _ in probe:
        states.append(probe.state_dict())
    probe.close()
    for k in range(n):  # the live pass handed out k batches ...
        target = (3 * k + 1) % n  # ... and the state loaded is that of batch `target` (back or forth)
        lo = make(feats)
        it = iter(lo)
        for _ in range(k):
            check(next(it), arrays)
        lo.load_state_dict(states[target])
        assert lo.state_dict() == states[target]
        got = []
        for b in lo:  # iter(loader) again: the new pass
            check(b, arrays)
            got += list(b["__key__"])
        assert got == order[(target + 1) * BATCH:], (k, target)
        with pytest.raises(PassStopped, match="load_state_dict"):
            next(it)
        lo.close()


def test_load_state_dict_after_iter_with_process_workers(tmp_path_factory):
    root = tmp_path_factory.mktemp("livepass_procs")
    fs.make_source(root / "src")
    fs.convert_source(root / "src", root / "ds")
    kw = dict(batch_size=3, num_workers=2, device="cpu", output="numpy", shuffle=True, seed=2,
              fields=("txt", "json", "cls", "tokens.npy", "emb.npy", "__key__"), map=fs.caption_map,
              worker_mode="process")

    def rows(b):
        return list(b["__key__"]), np.asarray(b["ids"]).tolist(), np.asarray(b["tok_sum"]).tolist()

    ref = DataLoader(str(root / "ds"), **kw)
    full = [rows(b) for b in ref]
    ref.close()
    lo = DataLoader(str(root / "ds"), **kw)
    states = []
    for _ in lo:
        states.append(lo.state_dict())
    assert (states[-1]["epoch"], states[-1]["position"]) == (1, 0)  # the last batch completes the epoch
    for k in range(len(full) - 1):  # every step of the epoch
        it = iter(lo)
        for _ in range(k):
            next(it)
        lo.load_state_dict(states[k])  # the live pass's worker processes end here
        got = [rows(b) for b in lo]
        assert got == full[k + 1:], k
    lo.close()


def test_set_epoch_during_a_live_pass_stops_it_and_state_says_what_iter_will_do(feats):
    _, order0 = reference(feats)
    arrays5, order5 = reference(feats, epoch=5)
    lo = make(feats)
    it = iter(lo)
    got = list(next(it)["__key__"]) + list(next(it)["__key__"])
    assert got == order0[:2 * BATCH]
    lo.set_epoch(5)
    state = lo.state_dict()
    assert (state["epoch"], state["position"]) == (5, 0)  # what the next iter() will do
    with pytest.raises(PassStopped, match=r"set_epoch\(5\)"):
        next(it)
    keys = []
    for b in lo:
        check(b, arrays5)
        keys += list(b["__key__"])
    assert keys == order5 and lo.epoch == 6
    lo.close()


def test_set_epoch_during_a_drained_live_pass_is_what_the_checkpoint_says(feats):
    """Row 10: the live pass is drained (every batch handed out, StopIteration not yet asked for);
    `set_epoch(5)` there: the state says epoch 5, and resuming it gives epoch 5."""
    _, order5 = reference(feats, epoch=5)
    lo = make(feats)
    it = iter(lo)
    for _ in range(len(lo)):
        next(it)
    lo.set_epoch(5)
    state = lo.state_dict()
    assert (state["epoch"], state["position"]) == (5, 0)
    other = make(feats)
    other.load_state_dict(state)
    assert keys(other) == order5
    lo.close()
    other.close()


def test_set_epoch_with_the_current_epoch_keeps_the_live_pass(feats):
    _, order = reference(feats)
    lo = make(feats)
    it = iter(lo)
    keys = list(next(it)["__key__"])
    lo.set_epoch(0)  # a trainer setting the epoch it is in: nothing changes
    keys += [k for b in it for k in b["__key__"]]
    assert keys == order and lo.epoch == 1
    lo.close()


def test_a_bad_state_leaves_the_live_pass_alone(feats):
    from gdsload.plan.plan import StateError

    _, order = reference(feats)
    lo = make(feats)
    it = iter(lo)
    keys = list(next(it)["__key__"])
    with pytest.raises(StateError):
        lo.load_state_dict({**lo.state_dict(), "seed": 99})
    keys += [k for b in it for k in b["__key__"]]
    assert keys == order
    lo.close()


@pytest.mark.parametrize("state", ["live", "stopped", "closed", "closed-live", "kept"])
def test_a_module_level_loader_exits_cleanly_whatever_its_state(feats, tmp_path, state):
    """Row 12: torch imported, a loader at module level, the script ends: nothing on stderr (was
    `Exception ignored in DataLoader.__del__ ... 'NoneType' object has no attribute
    'is_finalizing'`, module globals already cleared)."""
    import subprocess
    import sys

    script = tmp_path / "script.py"
    script.write_text(f"""
import torch
import gdsload
loader = gdsload.DataLoader({feats!r}, batch_size=4, shuffle=True, device="cpu", num_workers=2)
it = iter(loader)
first = next(it)
state = {state!r}
if state == "stopped":
    loader.load_state_dict(loader.state_dict())
    it2 = iter(loader)
    next(it2)
elif state == "closed":
    loader.close()
elif state == "closed-live":
    it2 = iter(loader)
    next(it2)
    loader.close()
elif state == "kept":
    kept = [b["npy"] for b in it]
print("ok")
""")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    assert out.stderr == ""
