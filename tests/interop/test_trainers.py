"""gdsload loaders handed to the trainers people use, with no glue beyond what the docs show:
Lightning's `Trainer.fit`, accelerate's `prepare` + `save_state`/`load_state`, and the HF
`transformers.Trainer` with `gdsload.integrations.hf` (issue 52 item 1).

The examples (`examples/*_resume.py`) run here as users run them, on the CPU with a tiny model and
a tiny dataset: each trains without interruption, resumes from checkpoints taken mid-epoch, in
the next epoch and at an epoch's end, and exits non-zero unless every resumed run trained on
exactly the keys the uninterrupted run had left (and every batch's rows are the samples its keys
name). The tests below them check what the trainers rely on, one at a time.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gdsload.loader.dataloader import DataLoader

ROOT = Path(__file__).resolve().parents[2]
N, BATCH = 48, 4  # 12 batches per epoch


def write_tiny(path: Path, n: int = N) -> Path:
    """`n` samples whose `npy` row is `n` times its own index: a batch's rows name its keys."""
    import gdsload

    with gdsload.ShardWriter(str(path), shard_size="48KiB", classes=["a", "b", "c"]) as w:
        for i in range(n):
            w.write({"__key__": f"{i:04d}", "npy": np.full(8, i, np.float32), "cls": i % 3})
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(write_tiny(tmp_path_factory.mktemp("trainers") / "ds"))


def make(path: str, **kw) -> DataLoader:
    return DataLoader(path, **{"batch_size": BATCH, "shuffle": True, "seed": 3, "device": "cpu",
                               "output": "numpy", **kw})


def epoch_keys(path: str, epoch: int) -> list[str]:
    lo = make(path)
    lo.set_epoch(epoch)
    keys = [k for b in lo for k in b["__key__"]]
    lo.close()
    return keys


# -- what a trainer that counts batches needs -----------------------------------------------------
def test_the_last_batch_completes_the_epoch_without_stop_iteration(tiny):
    """Lightning and the HF Trainer take `len(loader)` batches and never ask for the StopIteration.
    The epoch's last batch handed out moves the loader to the next epoch: the next `iter()` runs
    it, and a checkpoint there resumes at its start. Before: the next `iter()` was an empty rest of
    the old epoch, so Lightning's second epoch trained on nothing."""
    e0, e1 = epoch_keys(tiny, 0), epoch_keys(tiny, 1)
    assert e0 != e1
    lo = make(tiny)
    it = iter(lo)
    got = [k for _ in range(len(lo)) for k in next(it)["__key__"]]
    assert got == e0
    state = lo.state_dict()
    assert (lo.epoch, state["epoch"], state["position"]) == (1, 1, 0)
    assert [k for b in lo for k in b["__key__"]] == e1  # the next iter(), the old one never drained
    other = make(tiny)
    other.load_state_dict(state)
    assert [k for b in other for k in b["__key__"]] == e1
    lo.close()
    other.close()


def test_a_discarded_pass_collected_in_its_reader_never_takes_the_next_pass_s_batches(tiny):
    """Lightning's resume: `iter(loader)` discarded (its `_check_dataloader_iterable`), then
    `load_state_dict`, then `iter()`. When a reader held the discarded pass last, the pass is
    closed in that reader (`__del__`), which close() cannot join; the reader then went on to
    `ring.acquire` its next batch number on the ring the new pass had reset, taking the new pass's
    slot: the new reader failed ("batch 1 was already acquired") and the loop waited forever
    (seen once in a handful of Lightning resumes). Made certain here: the first pass's fill is slow,
    so its reader holds the pass when the loop drops it; that reader's next acquire is delayed
    until the new pass has reset the ring, whose own first fill is slow."""
    import threading
    import time

    from gdsload.loader import fill as fill_mod

    full = epoch_keys(tiny, 0)
    lo = make(tiny, num_workers=1)
    errors: list[BaseException] = []
    old_hook = threading.excepthook
    threading.excepthook = lambda a: errors.append(a.exc_value)
    fillers: list[object] = []  # one per pass, in order
    old_reader: list[int] = []
    real_fill = fill_mod.SlotFiller.fill

    def slow_fill(self, slot, seq, batch):
        if self not in fillers:
            fillers.append(self)
            if len(fillers) == 1:  # the first pass's reader, while the loop drops the pass
                old_reader.append(threading.get_ident())
                time.sleep(0.3)
            elif len(fillers) == 2:  # the new pass's first batch: the old reader wakes meanwhile
                time.sleep(0.6)
        return real_fill(self, slot, seq, batch)

    try:
        fill_mod.SlotFiller.fill = slow_fill
        iter(lo)  # dropped at once; its reader is in slow_fill, holding the pass
        time.sleep(0.1)
        ring = lo._resources.ring
        real_acquire = ring.acquire

        def late_acquire(seq, *a, **kw):
            if threading.get_ident() in old_reader:  # the old reader, after it closed its pass
                time.sleep(0.5)
            return real_acquire(seq, *a, **kw)

        ring.acquire = late_acquire
        time.sleep(0.4)  # the old reader has closed its pass and waits in late_acquire
        lo.load_state_dict(lo.plan.state(0, 0))
        got: list[str] = []
        consumer = threading.Thread(target=lambda: got.extend(k for b in lo for k in b["__key__"]), daemon=True)
        consumer.start()
        consumer.join(20)
        assert not consumer.is_alive(), f"the loop waits forever after {len(got)} keys; reader errors: {errors}"
        assert got == full and not errors
    finally:
        fill_mod.SlotFiller.fill = real_fill
        threading.excepthook = old_hook
    lo.close()


# -- ranks from torch.distributed, as the trainers set it up ---------------------------------------
def _rank_main(rank: int, world: int, init_file: str, path: str, out) -> None:
    """One rank of a 2-process gloo group: loaders built before and after the group exists."""
    import torch.distributed as dist

    res: dict = {}
    early = make(path)  # built before the group (a script that builds it before Trainer.fit)
    used = make(path)
    next(iter(used))  # ... and one that read a batch as rank 0 of 1 before it
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        late = make(path)
        res["len"] = (len(early), len(late))
        res["ranks"] = [(lo.plan.rank, lo.plan.world_size) for lo in (early, late)]
        res["keys"] = [[k for b in lo for k in b["__key__"]] for lo in (early, late)]
        try:
            len(used)
            res["used"] = "accepted"
        except Exception as exc:
            res["used"] = f"{type(exc).__name__}: {exc}"
    finally:
        dist.destroy_process_group()
        out.put((rank, res))


def test_rank_and_world_size_come_from_a_gloo_group(tiny, tmp_path):
    """Two processes in a gloo group: a loader built after `init_process_group` reads this rank's
    slice; one built before it (what a script handing its loader to Lightning's DDP, or to the HF
    Trainer, does) takes the group's rank and world size at its first `len()`/`iter()`; one that
    read batches as rank 0 of 1 before the group existed is refused, naming what to do."""
    import multiprocessing as mp

    pytest.importorskip("torch.distributed")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, 2, str(tmp_path / "init"), tiny, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict(out.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    for rank in (0, 1):
        want = make(tiny, rank=rank, world_size=2)
        want_keys = [k for b in want for k in b["__key__"]]
        r = got[rank]
        assert r["ranks"] == [(rank, 2), (rank, 2)]
        assert r["len"] == (len(want), len(want)) == (N // BATCH // 2, N // BATCH // 2)
        assert r["keys"] == [want_keys, want_keys]
        assert "before torch.distributed was initialised" in r["used"] and "rank= and world_size=" in r["used"]
    assert sorted(got[0]["keys"][0] + got[1]["keys"][0]) == sorted(epoch_keys(tiny, 0))


# -- the examples, as users run them ---------------------------------------------------------------
def _run_example(name: str, tmp_path: Path, *args: str, timeout_s: int = 240) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    out = subprocess.run([sys.executable, str(ROOT / "examples" / name), "--workdir", str(tmp_path), *args],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    assert "Traceback" not in out.stderr and "Exception in thread" not in out.stderr, out.stderr[-6000:]
    return out.stdout


@pytest.mark.parametrize("feed", [False, True], ids=["DataLoader", "RemoteLoader"])
@pytest.mark.parametrize("name, trainer", [
    ("lightning_resume.py", "lightning"),
    ("accelerate_resume.py", "accelerate"),
    ("hf_trainer_resume.py", "hf trainer"),
])
def test_example_resumes_exactly(name, trainer, feed, tmp_path):
    """Each example trains 2 epochs of 12 steps, then resumes from its checkpoints at step 4 (epoch
    0), 16 (epoch 1) and 12 (the end of epoch 0); each resumed run trains on exactly the keys the
    uninterrupted one had left (the script exits 1 otherwise, and checks every batch's rows; the
    HF one also the final weights, bit for bit). `--feed`: the same with `RemoteLoader` over a
    feed server on loopback."""
    pytest.importorskip({"lightning": "lightning", "accelerate": "accelerate", "hf trainer": "transformers"}[trainer])
    if feed:
        pytest.importorskip("grpc")
    text = _run_example(name, tmp_path, *(["--feed"] if feed else []))
    for where, step, keys in (("in epoch 0", 4, 80), ("in epoch 1", 16, 32), ("at the end of epoch 0", 12, 48)):
        assert f"{trainer} resume {where} (step {step}): {keys} keys, exact" in text, text
    assert "uninterrupted: 96 keys over 2 epochs of 12 steps" in text


def test_hf_example_resumes_exactly_with_gradient_accumulation(tmp_path):
    """5 batches per optimizer step over 12-batch epochs (steps of 5, 5, 2; the Trainer holds 5
    batches at once): checkpoints at steps 1, 4 and 3 resume to the same keys and the same final
    weights, bit for bit (with `ignore_data_skip=True` instead of the recipe's override the
    weights differed: one optimizer step fewer)."""
    pytest.importorskip("transformers")
    text = _run_example("hf_trainer_resume.py", tmp_path, "--grad-accum", "5")
    for where, step, keys in (("in epoch 0", 1, 76), ("in epoch 1", 4, 28), ("at the end of epoch 0", 3, 48)):
        assert f"hf trainer resume {where} (step {step}): {keys} keys, exact" in text, text
    assert "uninterrupted: 96 keys over 2 epochs of 3 steps" in text


# -- what the examples rely on, one at a time ------------------------------------------------------
def test_accelerate_skip_first_batches_fails_naming_the_recipe(tiny):
    """What accelerate's `skip_first_batches` (the HF Trainer's default on resume) does with a gdsload
    loader: it reads the loader's sampler, and the error says what to do instead."""
    data_loader = pytest.importorskip("accelerate.data_loader")
    lo = make(tiny)
    with pytest.raises(AttributeError, match="get_resumed_dataloader"):
        data_loader.skip_first_batches(lo, 3)
    lo.close()


def test_hf_callback_keeps_the_state_in_trainer_state_json_and_restores_it(tiny, tmp_path):
    """The callback's state goes into the checkpoint's `trainer_state.json` (the Trainer writes the
    `stateful_callbacks`), and on a resumed run (global step > 0) it is loaded into the loader."""
    pytest.importorskip("transformers")
    from transformers.trainer_callback import TrainerState

    from gdsload.integrations.hf import GdsloadStateCallback

    lo = make(tiny)
    it = iter(lo)
    for _ in range(5):
        next(it)
    saved = lo.state_dict()
    cb = GdsloadStateCallback(lo)
    state = TrainerState(global_step=5, stateful_callbacks=[cb])  # what Trainer._save_checkpoint writes
    state.save_to_json(str(tmp_path / "trainer_state.json"))
    lo.close()

    fresh = make(tiny)
    resumed = TrainerState.load_from_json(str(tmp_path / "trainer_state.json"))
    GdsloadStateCallback(fresh).on_train_begin(None, resumed, None)
    assert fresh.state_dict() == saved and saved["position"] == 5 * BATCH
    rest = [k for b in fresh for k in b["__key__"]]
    assert rest == epoch_keys(tiny, 0)[5 * BATCH:]
    # no loader given: the Trainer's training dataloader (what get_train_dataloader returned); this
    # is also the callback restore_callback_states_from_checkpoint=True makes from the saved state
    other = make(tiny)
    rebuilt = GdsloadStateCallback(**resumed.stateful_callbacks["GdsloadStateCallback"]["args"])
    rebuilt.on_train_begin(None, resumed, None, train_dataloader=other)
    assert other.state_dict() == saved
    # a fresh run (global step 0) leaves the loader alone
    third = make(tiny)
    third.set_epoch(3)
    GdsloadStateCallback(third).on_train_begin(None, TrainerState(global_step=0), None)
    assert third.epoch == 3
    for x in (fresh, other, third):
        x.close()


def test_hf_callback_refuses_what_it_cannot_resume(tiny):
    pytest.importorskip("transformers")
    from transformers.trainer_callback import TrainerState

    from gdsload.errors import GdsloadError
    from gdsload.integrations.hf import GdsloadStateCallback

    lo = make(tiny)
    with pytest.raises(GdsloadError, match="holds no gdsload loader state"):  # saved without the callback
        GdsloadStateCallback(lo).on_train_begin(None, TrainerState(global_step=4), None)
    with pytest.raises(GdsloadError, match="override Trainer.get_train_dataloader"):
        GdsloadStateCallback().on_train_begin(None, TrainerState(global_step=4), None, train_dataloader=[1, 2])
    with pytest.raises(GdsloadError, match="must be a gdsload loader"):
        GdsloadStateCallback(object())
    lo.close()


def test_integrations_are_not_imported_by_gdsload_and_name_what_to_install():
    code = ("import sys, gdsload; assert not [m for m in sys.modules if m.startswith('gdsload.integrations')]\n"
            "sys.modules['transformers'] = None\n"
            "from gdsload.errors import MissingDependencyError\n"
            "try:\n    from gdsload.integrations.hf import GdsloadStateCallback\n"
            "except MissingDependencyError as e:\n    print('hint:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), check=False)
    assert out.returncode == 0, out.stderr
    assert "hint:" in out.stdout and "pip install transformers" in out.stdout
