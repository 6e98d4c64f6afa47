"""Train from the remote feed: the batches come from `gdsload serve` over gRPC.

On the data machine(s), serve the converted datasets below a folder:

    gdsload serve shards/ --listen 0.0.0.0:50051 --token-file token.txt --metrics-port 9400

On the training machine (no dataset on local disk; decoding runs on the servers):

    python examples/train_remote.py --address data1:50051 --dataset train --token-file token.txt

or with several GPUs, and several stateless servers (rank r starts on address r mod n and fails
over to the next one):

    torchrun --nproc_per_node 8 examples/train_remote.py --address data1:50051 data2:50051 --dataset train

`gdsload.RemoteLoader` yields the batches `gdsload.DataLoader` would with the same arguments; it
owns its cursor, so a broken stream or a restarted server costs nothing, and its `state_dict()`
is the local loader's: a checkpoint taken here resumes with a local loader and the other way round.

`--tiny` serves a small generated dataset from this process on loopback and runs a few CPU steps
(what the tests run).
"""

from __future__ import annotations

import argparse
import json
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


def tiny_server():
    """A feed server on 127.0.0.1 (any free port) over a small generated dataset named 'train'."""
    from gdsload.convert.engine import ConvertOptions, convert
    from gdsload.sampledata import make_image_folder
    from gdsload.service.server import create_server

    work = Path(tempfile.mkdtemp(prefix="gdsload-example-"))
    make_image_folder(work / "images", num_images=64, num_classes=4, mean_size=(96, 72), workers=1)
    convert(str(work / "images"), work / "shards" / "train", ConvertOptions(progress=False))
    server, port = create_server([str(work / "shards")], address="127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}", work


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address", nargs="+", help="HOST:PORT of one or more feed servers")
    p.add_argument("--dataset", default="train", help="the served dataset's name")
    p.add_argument("--token-file", help="bearer token (the server's --token-file)")
    p.add_argument("--tls-ca", help="CA bundle (PEM) when the servers serve TLS")
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: all epochs)")
    p.add_argument("--batch-size", type=int, default=256, help="per GPU")
    p.add_argument("--size", type=int, default=224, help="training crop")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--checkpoint", default="checkpoint-remote.pt")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    p.add_argument("--tiny", action="store_true", help="serve a small generated dataset here, a few CPU steps")
    a = p.parse_args()

    server = None
    if a.tiny:
        server, address, work = tiny_server()
        a.address, a.dataset = [address], "train"
        a.epochs, a.max_steps, a.batch_size, a.size = 2, a.max_steps or 6, 8, 32
        if a.checkpoint == p.get_default("checkpoint"):
            a.checkpoint = str(work / "checkpoint.pt")
    if not a.address:
        p.error("--address is required (or --tiny)")

    world = int(os.environ.get("WORLD_SIZE", "1"))   # set by torchrun
    if torch.cuda.is_available():  # the rank's GPU first: NCCL's set-up then runs on it, not on GPU 0
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0

    loader = gdsload.RemoteLoader(
        a.address, dataset=a.dataset, batch_size=a.batch_size, shuffle=True, drop_last=True,
        transform=gdsload.ImageTransform(size=a.size),   # runs in DALI on the server
        token=Path(a.token_file).read_text().strip() if a.token_file else None,
        tls_ca=a.tls_ca, device=device.type,             # rank / world size: from torch.distributed
    )
    manifest = json.loads(loader.dataset_info().manifest_json)   # the server's manifest.json
    num_classes = len(manifest.get("classes") or []) or 1000

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
        loader.load_state_dict(ck["data"])
        step = ck["step"]

    try:
        while loader.epoch < a.epochs and not (a.max_steps and step >= a.max_steps):
            epoch, t0, seen = loader.epoch, time.perf_counter(), 0
            for batch in loader:                  # the local loader's batches: {"jpg", "cls", "__key__"}
                images = batch["jpg"].to(device, non_blocking=True)
                labels = batch["cls"].to(device, non_blocking=True)
                loss = F.cross_entropy(model(images), labels)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                step += 1
                seen += len(labels)
                if a.max_steps and step >= a.max_steps:
                    break
            if rank == 0:
                s = loader.stats()
                print(f"epoch {epoch} step {step} loss {loss.item():.3f} | {seen / (time.perf_counter() - t0):.0f} "
                      f"samples/s per rank, waited {s['wait_s']:.1f} s for data, {s['reconnects']} reconnects, "
                      f"server {s['address']}")
                torch.save({"model": core.state_dict(), "optimizer": opt.state_dict(),
                            "data": loader.state_dict(), "step": step}, a.checkpoint)
    finally:
        loader.close()
        if server is not None:
            server.shutdown(5.0)
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
