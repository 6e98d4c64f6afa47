"""HF accelerate fed by `gdsload.DataLoader`: `prepare`, `save_state`, `load_state`, resumed exactly.

    python examples/accelerate_resume.py                 # a tiny dataset on the CPU: train, resume, check
    python examples/accelerate_resume.py --feed          # the same through gdsload.RemoteLoader (a feed on loopback)

No glue beyond two lines:

    accelerator = accelerate.Accelerator()
    loader = gdsload.DataLoader(shards, ...)          # after Accelerator(): rank and world size
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)   # the loader comes back as it is
    accelerator.register_for_checkpointing(loader)    # save_state/load_state keep loader.state_dict()

`prepare` wraps only `torch.utils.data.DataLoader`s (re-sharding them and moving their batches);
a gdsload loader is returned unchanged: it is not re-sharded (it takes rank and world size from
the `torch.distributed` group that `Accelerator()` initialised, at its first `len()` or `iter()`,
or from `rank=`/`world_size=`), and its batches are on the loader's `device` (pass
`device=accelerator.device.type`; "cuda" is LOCAL_RANK's GPU). `register_for_checkpointing`
stores `loader.state_dict()` as `custom_checkpoint_N.pkl` in every `save_state` folder, and
`load_state` gives it back: the next `iter()` continues after the last batch trained on. Do not
use `accelerator.skip_first_batches` with it: that would skip the rest a second time.

What this script checks, in one process (under `accelerate launch` each rank would read its own
slice, from a dataset and a state folder all ranks share, which this script does not set up): an
uninterrupted run of 2 epochs saves its state every 4 steps; runs resumed from the state in epoch
0, the one in epoch 1 and the one at the end of epoch 0 each train on exactly the keys the
uninterrupted run trained on after it, and every batch's rows are the samples its keys name.
Exit status 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import accelerate
import torch

from resume_kit import open_loader, start_feed, tiny_dataset

EPOCHS, SAVE_EVERY = 2, 4


def train(shards: str, workdir: Path, resume: Path | None = None, check_rows: bool = True) -> list[str]:
    """Train EPOCHS epochs (from the `save_state` folder `resume` when given); the keys trained on."""
    accelerator = accelerate.Accelerator(cpu=True)
    loader = open_loader(shards, batch_size=4, shuffle=True, seed=3, device=accelerator.device.type)
    model = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, prepared = accelerator.prepare(model, optimizer, loader)
    if prepared is not loader:
        raise AssertionError(f"accelerate wrapped the loader: {type(prepared)}")
    accelerator.register_for_checkpointing(loader)
    step = 0
    if resume is not None:
        accelerator.load_state(str(resume))  # model, optimizer, RNG and loader.state_dict()
        step = int(resume.name.split("-")[1])
    seen: list[str] = []
    while loader.epoch < EPOCHS:
        for batch in loader:
            keys = list(batch["__key__"])
            if check_rows and batch["npy"][:, 0].long().tolist() != [int(k) for k in keys]:
                raise AssertionError(f"rows {batch['npy'][:, 0].tolist()} are not keys {keys}")
            seen += keys
            loss = torch.nn.functional.cross_entropy(model(batch["npy"]), batch["cls"])
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if resume is None and step % SAVE_EVERY == 0:
                accelerator.save_state(str(workdir / "state" / f"step-{step}"))
    loader.close()
    return seen


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", help="a converted dataset with `npy` (8 floats) and `cls` fields (default: a tiny one)")
    p.add_argument("--workdir", help="states go here (default: a temporary folder)")
    p.add_argument("--feed", action="store_true",
                   help="feed the training with gdsload.RemoteLoader from a feed server started here on loopback")
    a = p.parse_args(argv)
    work = Path(a.workdir or tempfile.mkdtemp(prefix="gdsload-accelerate-"))
    shards = a.shards
    if shards is None:
        shards = str(work / "shards")
        if not Path(shards, "manifest.json").exists():
            tiny_dataset(Path(shards))
    server = start_feed(shards) if a.feed else None
    full = train(shards, work, check_rows=a.shards is None)
    per_epoch = len(full) // EPOCHS // 4
    steps = sorted(int(d.name.split("-")[1]) for d in (work / "state").iterdir())
    picks = {"in epoch 0": steps[0], "in epoch 1": min(s for s in steps if s > per_epoch)}
    if per_epoch in steps:
        picks["at the end of epoch 0"] = per_epoch
    failed = 0
    for where, step in picks.items():
        rest = train(shards, work, resume=work / "state" / f"step-{step}", check_rows=a.shards is None)
        ok = full[: step * 4] + rest == full
        failed += not ok
        print(f"accelerate resume {where} (step {step}): {len(rest)} keys, "
              f"{'exact' if ok else 'NOT the uninterrupted run'}", flush=True)
    print(f"uninterrupted: {len(full)} keys over {EPOCHS} epochs of {per_epoch} steps")
    if server is not None:
        server.shutdown(grace_s=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
