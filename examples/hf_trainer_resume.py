"""The HF `transformers.Trainer` fed by `gdsload.DataLoader`, resumed exactly from its checkpoints.

    python examples/hf_trainer_resume.py                 # a tiny dataset on the CPU: train, resume, check
    python examples/hf_trainer_resume.py --feed          # the same through gdsload.RemoteLoader (a feed on loopback)

The Trainer builds its own torch DataLoader, saves no loader state and resumes by skipping
batches. The recipe (`gdsload.integrations.hf`): a subclass that returns the gdsload loader from
`get_train_dataloader` and keeps the Trainer from skipping (`get_resumed_dataloader` returns the
loader as it is), and `GdsloadStateCallback`, which keeps `loader.state_dict()` in every
checkpoint (in its `trainer_state.json`) and loads it back on `train(resume_from_checkpoint=...)`.
Batches are dicts of tensors: the Trainer calls `model(**batch)`, so the model's `forward` takes
the dataset's field names (here `npy`, `cls` and `__key__`, the sample keys) and returns a dict
with the loss.

What this script checks: an uninterrupted run of 2 epochs saves a checkpoint every 4 steps; runs
resumed from the one in epoch 0, the one in epoch 1 and the one at the end of epoch 0 each train
on exactly the keys the uninterrupted run trained on after it and end with the same weights, bit
for bit, and every batch's rows are the samples its keys name. Exit status 1 otherwise.
`--grad-accum 5`: the same with 5 batches per optimizer step (12 batches an epoch: steps of 5, 5
and 2; a checkpoint every step), where the Trainer holds 5 batches at once and `ignore_data_skip=True` instead of the
`get_resumed_dataloader` override would lose an optimizer step.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
import transformers

from gdsload.integrations.hf import GdsloadStateCallback
from resume_kit import open_loader, start_feed, tiny_dataset

EPOCHS, SAVE_EVERY = 2, 4


class Classifier(torch.nn.Module):
    def __init__(self, check_rows: bool):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))
        self.check_rows = check_rows
        self.seen: list[str] = []  # the keys trained on, in order (what this script compares)

    def forward(self, npy, cls, __key__=(), **unused):
        if self.training:
            keys = list(__key__)
            if self.check_rows and npy[:, 0].long().tolist() != [int(k) for k in keys]:
                raise AssertionError(f"rows {npy[:, 0].tolist()} are not keys {keys}")
            self.seen += keys
        return {"loss": torch.nn.functional.cross_entropy(self.net(npy), cls)}


def train(shards: str, workdir: Path, resume: str | None = None, check_rows: bool = True,
          grad_accum: int = 1) -> tuple[list[str], list[torch.Tensor]]:
    """Train EPOCHS epochs (from the checkpoint folder `resume` when given); the keys trained on
    and the final weights."""
    name = "run" if resume is None else f"from-{Path(resume).name}"
    args = transformers.TrainingArguments(
        output_dir=str(workdir / name), num_train_epochs=EPOCHS, per_device_train_batch_size=4,
        gradient_accumulation_steps=grad_accum, save_strategy="steps", save_steps=SAVE_EVERY if grad_accum == 1 else 1,
        learning_rate=0.1, use_cpu=True, report_to=[], logging_strategy="no", disable_tqdm=True)
    # after TrainingArguments (which sets up torch.distributed on several processes): rank, world size
    loader = open_loader(shards, batch_size=4, shuffle=True, seed=3, device="cpu")

    class Trainer(transformers.Trainer):
        def get_train_dataloader(self):
            return loader

        def get_resumed_dataloader(self, dataloader, num_batches):
            return dataloader  # GdsloadStateCallback restored the loader's position: nothing to skip

    torch.manual_seed(0)  # the same initial weights in every run (a resumed run loads the checkpoint's)
    model = Classifier(check_rows)
    trainer = Trainer(model=model, args=args, callbacks=[GdsloadStateCallback(loader)])
    trainer.train(resume_from_checkpoint=resume)
    loader.close()
    return model.seen, [p.detach().clone() for p in model.parameters()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", help="a converted dataset with `npy` (8 floats) and `cls` fields (default: a tiny one)")
    p.add_argument("--workdir", help="checkpoints go here (default: a temporary folder)")
    p.add_argument("--feed", action="store_true",
                   help="feed the training with gdsload.RemoteLoader from a feed server started here on loopback")
    p.add_argument("--grad-accum", type=int, default=1, help="batches per optimizer step (gradient_accumulation_steps)")
    a = p.parse_args(argv)
    transformers.logging.set_verbosity_error()
    work = Path(a.workdir or tempfile.mkdtemp(prefix="gdsload-hf-"))
    shards = a.shards
    if shards is None:
        shards = str(work / "shards")
        if not Path(shards, "manifest.json").exists():
            tiny_dataset(Path(shards))
    ga = a.grad_accum
    server = start_feed(shards) if a.feed else None
    full, weights = train(shards, work, check_rows=a.shards is None, grad_accum=ga)
    batches = len(full) // EPOCHS // 4  # per epoch
    per_epoch = -(-batches // ga)  # optimizer steps per epoch (the last one may take fewer batches)

    def keys_before(step: int) -> int:  # keys the uninterrupted run had trained on at `step`
        return 4 * (step // per_epoch * batches + min(step % per_epoch * ga, batches))

    steps = sorted(int(d.name.split("-")[1]) for d in (work / "run").glob("checkpoint-*"))
    picks = {"in epoch 0": min(s for s in steps if s < per_epoch), "in epoch 1": min(s for s in steps if s > per_epoch)}
    if per_epoch in steps:
        picks["at the end of epoch 0"] = per_epoch
    failed = 0
    for where, step in picks.items():
        rest, last = train(shards, work, resume=str(work / "run" / f"checkpoint-{step}"),
                           check_rows=a.shards is None, grad_accum=ga)
        ok = full[: keys_before(step)] + rest == full and all(torch.equal(x, y) for x, y in zip(weights, last))
        failed += not ok
        print(f"hf trainer resume {where} (step {step}): {len(rest)} keys, "
              f"{'exact' if ok else 'NOT the uninterrupted run'}", flush=True)
    print(f"uninterrupted: {len(full)} keys over {EPOCHS} epochs of {per_epoch} steps")
    if server is not None:
        server.shutdown(grace_s=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
