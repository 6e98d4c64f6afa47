"""PyTorch Lightning's `Trainer.fit` fed by `gdsload.DataLoader`, resumed exactly with `ckpt_path`.

    python examples/lightning_resume.py                  # a tiny dataset on the CPU: train, resume, check
    python examples/lightning_resume.py --shards DIR     # a dataset of yours with an `npy` and a `cls` field
    python examples/lightning_resume.py --feed           # the same through gdsload.RemoteLoader (a feed on loopback)

No glue: hand the loader to `fit(train_dataloaders=loader)` (or return it from your module's or
datamodule's `train_dataloader()`). Lightning stores `loader.state_dict()` in every checkpoint
(it does so for any loader with `state_dict`/`load_state_dict`) and loads it when
`fit(..., ckpt_path=...)` resumes, after its first `iter()` (gdsload stops that pass, and the
next `iter()` starts from the loaded state). The loader is not re-sharded: Lightning adds a
`DistributedSampler` only to torch DataLoaders, and gdsload takes rank and world size from
`torch.distributed`: a loader that has read nothing when DDP sets the group up takes its rank at
its first `len()` or `iter()`, so it may be built before `fit` (or in `train_dataloader()`); or
pass `rank=`/`world_size=` (not run on several processes here). Lightning takes `len(loader)`
batches per epoch; the loader moves to its next epoch with the last of them.

What this script checks: an uninterrupted run of 2 epochs saves a checkpoint every 4 steps; runs
resumed from the one in epoch 0, the one in epoch 1 and the one at the end of epoch 0 each train
on exactly the keys the uninterrupted run trained on after it, and every batch's rows are the
samples its keys name (the tiny dataset's `npy` row of sample i is i, repeated). Exit status 1
otherwise.
"""

from __future__ import annotations

import argparse
import glob
import re
import sys
import tempfile
from pathlib import Path

import lightning as L
import torch

from resume_kit import open_loader, start_feed, tiny_dataset

EPOCHS, SAVE_EVERY = 2, 4


class Classifier(L.LightningModule):
    def __init__(self, check_rows: bool):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))
        self.check_rows = check_rows
        self.seen: list[str] = []  # the keys trained on, in order (what this script compares)

    def training_step(self, batch, batch_idx):
        keys = list(batch["__key__"])
        if self.check_rows and batch["npy"][:, 0].long().tolist() != [int(k) for k in keys]:
            raise AssertionError(f"batch {batch_idx}: rows {batch['npy'][:, 0].tolist()} are not keys {keys}")
        self.seen += keys
        return torch.nn.functional.cross_entropy(self.net(batch["npy"]), batch["cls"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def train(shards: str, workdir: Path, ckpt_path: str | None = None, check_rows: bool = True) -> list[str]:
    """One `fit` over EPOCHS epochs (from `ckpt_path` when given); the keys it trained on."""
    loader = open_loader(shards, batch_size=4, shuffle=True, seed=3, device="cpu")
    model = Classifier(check_rows)
    # the same Trainer settings for a resumed run; its own checkpoints go to another folder here
    checkpoints = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=workdir / ("ckpt" if ckpt_path is None else f"ckpt-from-{Path(ckpt_path).stem}"),
        filename="{step}", every_n_train_steps=SAVE_EVERY, save_top_k=-1)
    trainer = L.Trainer(max_epochs=EPOCHS, accelerator="cpu", devices=1, callbacks=[checkpoints],
                        default_root_dir=workdir, logger=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model, train_dataloaders=loader, ckpt_path=ckpt_path)
    loader.close()
    return model.seen


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", help="a converted dataset with `npy` (8 floats) and `cls` fields (default: a tiny one)")
    p.add_argument("--workdir", help="checkpoints go here (default: a temporary folder)")
    p.add_argument("--feed", action="store_true",
                   help="feed the training with gdsload.RemoteLoader from a feed server started here on loopback")
    a = p.parse_args(argv)
    work = Path(a.workdir or tempfile.mkdtemp(prefix="gdsload-lightning-"))
    shards = a.shards
    if shards is None:
        shards = str(work / "shards")
        if not Path(shards, "manifest.json").exists():
            tiny_dataset(Path(shards))
    server = start_feed(shards) if a.feed else None
    full = train(shards, work, check_rows=a.shards is None)
    per_epoch = len(full) // EPOCHS // 4
    steps = {int(re.search(r"step=(\d+)", f).group(1)): f for f in glob.glob(str(work / "ckpt" / "*.ckpt"))}
    picks = {"in epoch 0": min(steps), "in epoch 1": min(s for s in steps if s > per_epoch)}
    if per_epoch in steps:
        picks["at the end of epoch 0"] = per_epoch
    failed = 0
    for where, step in picks.items():
        rest = train(shards, work, ckpt_path=steps[step], check_rows=a.shards is None)
        ok = full[: step * 4] + rest == full
        failed += not ok
        print(f"lightning resume {where} (step {step}): {len(rest)} keys, "
              f"{'exact' if ok else 'NOT the uninterrupted run'}", flush=True)
    print(f"uninterrupted: {len(full)} keys over {EPOCHS} epochs of {per_epoch} steps")
    if server is not None:
        server.shutdown(grace_s=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
