"""Train on an ImageNet-style folder (CLASS/IMAGE.jpg) with gdsload: convert once, then train.

One GPU (or the CPU):

    python examples/train_imagefolder.py --src imagenet/train --shards shards/train --epochs 90

Several GPUs on one machine, one process per GPU:

    torchrun --nproc_per_node 8 examples/train_imagefolder.py --src imagenet/train --shards shards/train

torchrun sets RANK, WORLD_SIZE and LOCAL_RANK; the script then initialises torch.distributed, and
`gdsload.DataLoader` takes rank and world size from it: each rank reads its own interleaved slice
of the same epoch order, and with `drop_last=True` every rank gets the same number of full
batches. Rank 0 converts (once; later runs find the dataset) while the others wait at a barrier.
Several machines: `torchrun --nnodes N --node_rank R --rdzv_endpoint HOST:PORT ...` with the
shards on a shared filesystem (or converted on every node to the same path).

A checkpoint (model, optimizer and `loader.state_dict()`) is written every `--save-every` steps
and at the end of each epoch; `--resume` continues from it at the exact batch it stopped, also on
another number of GPUs when batch size x GPUs stays the same.

`--tiny` generates a small sample folder and runs a few steps on the CPU (what the tests run).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import gdsload


def small_convnet(num_classes: int) -> nn.Module:
    """Stand-in model; use your own (e.g. torchvision.models.resnet50(num_classes=...))."""
    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]

    return nn.Sequential(*block(3, 32), *block(32, 64), *block(64, 128), *block(128, 256),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, num_classes))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--src", help="ImageNet-style folder CLASS/IMAGE (converted once into --shards)")
    p.add_argument("--shards", help="the converted dataset (made from --src when it has no manifest.json)")
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: all epochs)")
    p.add_argument("--batch-size", type=int, help="per GPU (default 256; 8 with --tiny)")
    p.add_argument("--workers", type=int, default=4, help="gdsload reader threads")
    p.add_argument("--size", type=int, default=224, help="training crop")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--checkpoint", default="checkpoint.pt")
    p.add_argument("--save-every", type=int, default=1000, help="steps between checkpoints")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    p.add_argument("--tiny", action="store_true", help="generate a small sample folder, a few CPU steps")
    a = p.parse_args()
    if a.tiny:  # under torchrun give --src, --shards and --checkpoint: the ranks must share them
        work = Path(tempfile.mkdtemp(prefix="gdsload-example-"))
        a.src = a.src or str(work / "images")
        a.shards = a.shards or str(work / "shards")
        if a.checkpoint == p.get_default("checkpoint"):
            a.checkpoint = str(work / "checkpoint.pt")
        a.epochs, a.max_steps, a.workers, a.size, a.save_every = 2, a.max_steps or 6, 2, 32, 3
    a.batch_size = a.batch_size or (8 if a.tiny else 256)
    if not a.shards:
        p.error("--shards is required (and --src the first time, to convert)")
    return a


def main() -> None:
    a = parse_args()

    # -- distributed set-up: torchrun's environment, or a single process -------------------------
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if torch.cuda.is_available():  # the rank's GPU first: NCCL's set-up then runs on it, not on GPU 0
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0

    # -- convert once (rank 0), everyone else waits ----------------------------------------------
    if not (Path(a.shards) / "manifest.json").exists():
        if rank == 0:
            if a.tiny and not Path(a.src).exists():
                from gdsload.sampledata import make_image_folder

                make_image_folder(a.src, num_images=64, num_classes=4, mean_size=(96, 72), workers=1)
            if not a.src:
                raise SystemExit(f"{a.shards} is not a converted dataset; give --src to convert it")
            from gdsload.convert.engine import ConvertOptions, convert

            # the CLI equivalent: gdsload convert SRC SHARDS --shard-size 1GiB
            convert(a.src, a.shards, ConvertOptions(shard_size=1 << 30, progress=not a.tiny))
        if dist.is_initialized():
            dist.barrier()

    # -- the loader: where torch.utils.data.DataLoader(ImageFolder(src, transform)) was ------------
    dataset = gdsload.Dataset(a.shards)
    loader = gdsload.DataLoader(
        dataset, batch_size=a.batch_size, shuffle=True, drop_last=True, num_workers=a.workers,
        transform=gdsload.ImageTransform(size=a.size),   # random resized crop + flip + normalize, in DALI
        device=device.type,                              # batches arrive on the GPU when there is one
    )                                                    # rank / world size: from torch.distributed
    num_classes = len(dataset.shards.classes or []) or 1000

    core = small_convnet(num_classes).to(device)
    model = core
    if dist.is_initialized():
        model = nn.parallel.DistributedDataParallel(core, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9, weight_decay=1e-4)

    step = 0
    if a.resume and Path(a.checkpoint).exists():
        ck = torch.load(a.checkpoint, map_location=device, weights_only=True)
        core.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        loader.load_state_dict(ck["data"])   # the exact remaining order of the interrupted epoch
        step = ck["step"]
        if rank == 0:
            print(f"resumed at epoch {loader.epoch}, step {step}")

    def save() -> None:
        if rank == 0:  # the loader state is global: the same on every rank
            torch.save({"model": core.state_dict(), "optimizer": opt.state_dict(),
                        "data": loader.state_dict(), "step": step}, a.checkpoint)

    while loader.epoch < a.epochs and not (a.max_steps and step >= a.max_steps):
        epoch = loader.epoch
        t0, seen = time.perf_counter(), 0
        for batch in loader:                      # {"jpg": float NCHW on device, "cls": int64, "__key__"}
            images, labels = batch["jpg"], batch["cls"].to(device, non_blocking=True)
            loss = F.cross_entropy(model(images), labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            seen += len(labels)
            if step % a.save_every == 0:
                save()
            if a.max_steps and step >= a.max_steps:
                break
        if rank == 0:
            s = loader.stats()
            print(f"epoch {epoch} step {step} loss {loss.item():.3f} | {seen / (time.perf_counter() - t0):.0f} "
                  f"samples/s per rank, data stall {s.get('wait_fraction', 0):.0%}, io {s.get('io_path')}, "
                  f"decode {s.get('decode_device')}")
        save()
    loader.close()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
