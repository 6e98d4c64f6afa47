"""`gdsload demo`: the built-in default job, end to end on this host.

1. Generate a small ImageNet-like JPEG folder from the photographs in scikit-image's wheel
   (`gdsload.sampledata.make_image_folder`).
2. Convert it with `gdsload convert` (progress bar), then inspect and verify the shards.
3. Train a tiny conv net on random 64x64 crops fed by `gdsload.DataLoader`; save a checkpoint
   (model, optimizer, `loader.state_dict()`) in the middle of epoch 0, drop everything, build a new
   model and loader from the checkpoint, and check that the resumed loader yields exactly the
   remaining keys of that epoch (against an uninterrupted loader), then train on.
4. The same model and number of steps fed by PyTorch's `torch.utils.data.DataLoader` (2 worker
   processes) over `webdataset.WebDataset` of the same shards, Pillow decode and the same
   transform written with Pillow and NumPy (as `gdsload bench` does).
5. Start a feed server on loopback (in this process) and do step 3 again with
   `gdsload.RemoteLoader`; its epoch order must also equal the local loader's.
6. Print a report: samples/s, data-stall fraction (time the training loop waited for the next
   batch / loop time), I/O path and decode device, for the three loaders.

The PyTorch baseline runs before the server starts: its workers are forked, and gRPC's rule is not
to fork a process that runs a server. `run(tiny=True)` (`gdsload demo --tiny`) does all of it in a
few seconds, for the tests. Any failed step raises `GdsloadError`, so the command exits non-zero.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from gdsload.errors import GdsloadError, MissingDependencyError


@dataclass(frozen=True)
class DemoConfig:
    """Sizes of one demo run. The defaults take about a minute on 2 CPU cores (about 50 s measured on a
    2-core VM: 9 s to generate the images, 2 s to convert, 8 to 13 s for each loader's 100 steps)."""

    num_images: int = 800
    num_classes: int = 10
    mean_size: tuple[int, int] = (500, 375)  # (width, height) of the generated JPEGs
    shard_size: int = 8_000_000  # bytes: 11 shards at the defaults (84 MB)
    batch_size: int = 32
    steps: int = 100  # training steps per loader (3 loaders)
    crop: int = 64  # random resized crop to crop x crop
    resize: int = 72  # eval-mode shorter side (unused by the training transform, kept for symmetry)
    torch_workers: int = 2
    seed: int = 0


TINY = DemoConfig(num_images=48, num_classes=3, mean_size=(96, 72), shard_size=400_000, batch_size=8,
                  steps=8, crop=32, resize=36)


# -- the tiny model --------------------------------------------------------------------------------
def tiny_model(num_classes: int):
    """Three strided 3x3 convolutions with batch norm, global pooling, a linear head (~25k weights)."""
    from torch import nn

    def block(cin: int, cout: int):
        return [nn.Conv2d(cin, cout, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]

    return nn.Sequential(*block(3, 16), *block(16, 32), *block(32, 64), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(64, num_classes))


def _model_and_optimizer(cfg: DemoConfig, device: str):
    import torch

    torch.manual_seed(cfg.seed)
    model = tiny_model(cfg.num_classes).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, opt


def _step(model, opt, images, labels) -> float:
    import torch.nn.functional as F

    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(images), labels)
    loss.backward()
    opt.step()
    return loss.item()


def _warm_up(cfg: DemoConfig, device: str) -> None:
    """One step on random data, so torch's one-time set-up is not charged to the first loader."""
    import torch

    model, opt = _model_and_optimizer(cfg, device)
    images = torch.randn(cfg.batch_size, 3, cfg.crop, cfg.crop, device=device)
    for _ in range(2):
        _step(model, opt, images, torch.zeros(cfg.batch_size, dtype=torch.int64, device=device))


class _Meter:
    """Wall time of a training loop and the part of it spent waiting for the next batch."""

    def __init__(self) -> None:
        self.wait_s = 0.0
        self.loop_s = 0.0
        self.samples = 0
        self.steps = 0
        self.losses: list[float] = []

    @contextmanager
    def loop(self):
        """Times the body (a training loop) into `loop_s`."""
        t = time.perf_counter()
        try:
            yield
        finally:
            self.loop_s += time.perf_counter() - t

    def timed(self, iterable):
        """Iterate `iterable`, adding the time of each `next()` to `wait_s`."""
        it = iter(iterable)
        while True:
            a = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                return
            self.wait_s += time.perf_counter() - a
            yield batch

    def figures(self) -> dict[str, float]:
        loop = max(self.loop_s, 1e-9)
        return {"steps": self.steps, "samples": self.samples, "loop_s": self.loop_s, "wait_s": self.wait_s,
                "samples_per_s": self.samples / loop, "stall_fraction": self.wait_s / loop,
                "first_loss": self.losses[0] if self.losses else float("nan"),
                "last_loss": float(np.mean(self.losses[-5:])) if self.losses else float("nan")}


# -- gdsload loaders: train, checkpoint mid-epoch, resume, check the order ---------------------------
def _train_gdsload(name: str, make_loader: Callable[[], Any], reference_keys: list[str], cfg: DemoConfig,
                   ckpt: Path, device: str, log) -> dict[str, Any]:
    """`cfg.steps` training steps fed by `make_loader()`, interrupted by a checkpoint mid-epoch 0.

    Phase A trains half of epoch 0 and saves model, optimizer and `loader.state_dict()`; then the
    model and loader are dropped as if the job died. Phase B builds new ones from the checkpoint
    and trains on. The keys of epoch 0 from A + B must equal `reference_keys` (an uninterrupted
    epoch 0), and those from B exactly the ones A had not reached.
    """
    import torch

    meter = _Meter()
    model, opt = _model_and_optimizer(cfg, device)
    loader = make_loader()
    per_epoch = len(loader)
    if per_epoch < 2:
        raise GdsloadError(f"{name}: an epoch has {per_epoch} batch(es); the demo needs at least 2")
    stop_at = per_epoch // 2
    first_keys: list[str] = []
    with meter.loop():
        for batch in meter.timed(loader):
            meter.losses.append(_step(model, opt, batch["jpg"].to(device), batch["cls"].to(device)))
            meter.steps += 1
            meter.samples += len(batch["__key__"])
            first_keys.extend(batch["__key__"])
            if meter.steps == stop_at:
                break
    state = loader.state_dict()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "data": state,
                "step": meter.steps}, ckpt)
    stats: dict[str, Any] = loader.stats()
    loader.close()
    del model, opt, loader  # the job "dies" here

    ck = torch.load(ckpt, weights_only=True)
    model, opt = _model_and_optimizer(cfg, device)
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["optimizer"])
    loader = make_loader()
    loader.load_state_dict(ck["data"])
    resumed_keys: list[str] = []
    while meter.steps < cfg.steps:
        epoch, before = loader.epoch, meter.steps
        with meter.loop():
            for batch in meter.timed(loader):
                meter.losses.append(_step(model, opt, batch["jpg"].to(device), batch["cls"].to(device)))
                meter.steps += 1
                meter.samples += len(batch["__key__"])
                if epoch == 0:
                    resumed_keys.extend(batch["__key__"])
                if meter.steps == cfg.steps:
                    break
        if meter.steps == before:
            raise GdsloadError(f"{name}: epoch {epoch} yielded no batch")
        stats = loader.stats() or stats
        if epoch == 0:
            if len(first_keys) + len(resumed_keys) < len(reference_keys) and meter.steps == cfg.steps:
                raise GdsloadError(f"{name}: {cfg.steps} steps end before epoch 0 does ({per_epoch} batches); "
                                   "the resume check needs more steps")
            _check_resume(name, first_keys, resumed_keys, reference_keys)
            log(f"      resume ok: checkpoint after {stop_at} of {per_epoch} batches of epoch 0 "
                f"(position {state['position']}); the resumed loader yielded exactly the remaining "
                f"{len(resumed_keys)} keys of the epoch")
    loader.close()
    fig = meter.figures()
    fig.update(batches_per_epoch=per_epoch, checkpoint_step=stop_at, checkpoint_position=state["position"],
               epoch0_keys=first_keys + resumed_keys, stats=stats)
    return fig


def _check_resume(name: str, first: list[str], resumed: list[str], reference: list[str]) -> None:
    if first + resumed == reference:
        return
    if first != reference[: len(first)]:
        raise GdsloadError(f"{name}: the first {len(first)} keys of epoch 0 differ from an uninterrupted loader's")
    rest = reference[len(first):]
    missing = [k for k in rest if k not in set(resumed)]
    extra = [k for k in resumed if k not in set(rest)]
    raise GdsloadError(
        f"{name}: after resuming, the loader yielded {len(resumed)} keys, expected the remaining {len(rest)} "
        f"of epoch 0 in order; missing {missing[:5]}, unexpected {extra[:5]}"
    )


def _reference_keys(dst: Path, cfg: DemoConfig) -> list[str]:
    """Epoch 0's keys from an uninterrupted local loader (encoded bytes only: no decode)."""
    import gdsload

    ref = gdsload.DataLoader(gdsload.Dataset(str(dst)), batch_size=cfg.batch_size, shuffle=True, drop_last=True,
                             seed=cfg.seed, decode=False, device="cpu", output="numpy")
    keys = [k for batch in ref for k in batch["__key__"]]
    ref.close()
    return keys


# -- the PyTorch baseline ----------------------------------------------------------------------------
def pil_train_transform(size: int, seed: int):
    """The benchmark's Pillow version of the training transform (torchvision's definitions)."""
    from gdsload.bench.runners import pil_transform

    return pil_transform("T", size=size, seed=seed)


def _train_torch(dst: Path, cfg: DemoConfig, device: str) -> dict[str, Any]:
    import torch
    import webdataset as wds

    from gdsload.dataset.sharded import open_dataset

    with open_dataset(dst) as shards:
        tars = [shards.shard_path(i) for i in range(len(shards.shards))]
    ds = (wds.WebDataset(tars, shardshuffle=len(tars), seed=cfg.seed, empty_check=False)
          .shuffle(1000).decode("pil").to_tuple("jpg", "cls")
          .map_tuple(pil_train_transform(cfg.crop, cfg.seed), int))
    dl = torch.utils.data.DataLoader(ds, batch_size=cfg.batch_size, num_workers=cfg.torch_workers, drop_last=True,
                                     persistent_workers=True, pin_memory=device == "cuda")
    meter = _Meter()
    model, opt = _model_and_optimizer(cfg, device)
    while meter.steps < cfg.steps:
        before = meter.steps
        with meter.loop():
            for images, labels in meter.timed(dl):
                meter.losses.append(_step(model, opt, images.to(device, non_blocking=True),
                                          labels.to(device, non_blocking=True)))
                meter.steps += 1
                meter.samples += len(labels)
                if meter.steps == cfg.steps:
                    break
        if meter.steps == before:
            raise GdsloadError("the PyTorch DataLoader yielded no batch")
    del dl  # ends the persistent workers
    return meter.figures()


# -- the demo ----------------------------------------------------------------------------------------
def _require_demo_deps() -> None:
    missing = []
    for module, hint in (("torch", "pip install torch==2.13.0 (the CPU build on a CPU-only host)"),
                         ("webdataset", "pip install webdataset==1.0.2"),
                         ("grpc", "pip install 'gdsload[serve]'"),
                         ("nvidia.dali", "pip install 'gdsload[cpu]' (or cuda12/cuda13)"),
                         ("skimage", "pip install 'gdsload[demo]'")):
        try:
            __import__(module)
        except ImportError:
            missing.append(f"{module} ({hint})")
    if missing:
        raise MissingDependencyError("gdsload demo needs " + "; ".join(missing))


def _clear_generated(src: Path) -> None:
    """Remove an earlier run's generated images (another size would mix with this one's); refuse a
    folder that holds anything else."""
    if not src.exists():
        return
    for path in src.rglob("*"):
        rel = path.relative_to(src).parts
        ok = (re.fullmatch(r"class_\d+", rel[0]) is not None and
              (len(rel) == 1 or (len(rel) == 2 and re.fullmatch(r"img_\d+\.jpg", rel[1]) is not None)))
        if not ok:
            raise GdsloadError(f"{src} holds {path}, which the demo did not generate; use another --workdir")
    shutil.rmtree(src)


def run(workdir: str | Path = "gdsload-demo", *, tiny: bool = False, config: DemoConfig | None = None,
        log: Callable[[str], Any] = print, **overrides: Any) -> dict[str, Any]:
    """Run the demo in `workdir`; returns every figure (also what the report prints).

    `config` (default `DemoConfig()`, or `TINY` with `tiny=True`) sets the sizes; keyword
    `overrides` replace single fields (`num_images=200`, `steps=50`, ...).
    """
    cfg = replace(config or (TINY if tiny else DemoConfig()), **overrides)
    _require_demo_deps()
    import torch

    import gdsload
    from gdsload.convert.engine import ConvertOptions, convert
    from gdsload.dataset.sharded import open_dataset
    from gdsload.io import choose_backend
    from gdsload.sampledata import make_image_folder

    work = Path(workdir)
    src, served = work / "images", work / "shards"
    dst = served / "train"
    work.mkdir(parents=True, exist_ok=True)
    _clear_generated(src)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()

    log(f"[1/6] generating {cfg.num_images} ImageNet-like JPEGs (about {cfg.mean_size[0]}x{cfg.mean_size[1]}) "
        f"in {cfg.num_classes} classes under {src}")
    made = make_image_folder(src, num_images=cfg.num_images, num_classes=cfg.num_classes, seed=cfg.seed,
                             mean_size=cfg.mean_size)
    log(f"      {made['num_images']} images, {made['total_bytes'] / 1e6:.1f} MB in {time.perf_counter() - t0:.1f} s")

    log(f"[2/6] gdsload convert {src} {dst} --validate --shard-size {cfg.shard_size / 1e6:g}MB --overwrite")
    r = convert(str(src), dst, ConvertOptions(shard_size=cfg.shard_size, validate=True, overwrite=True,
                                              progress=not tiny))
    log(f"      {r['samples']} samples -> {r['shards']} shards, {r['samples_per_s']:.0f} samples/s, "
        f"{r['mb_per_s']:.1f} MB/s, {r['rejected']} rejected")
    if r["samples"] != cfg.num_images or r["rejected"]:
        raise GdsloadError(f"convert wrote {r['samples']} samples and rejected {r['rejected']}, "
                           f"expected {cfg.num_images} and 0")
    with open_dataset(dst) as ds:
        al = ds.alignment()
        bad = ds.verify()
    if bad:
        raise GdsloadError(f"verify failed: {bad}")
    if al["aligned"] != al["payloads_4k_or_more"]:
        raise GdsloadError(f"alignment broken: {al}")
    log(f"      verified: hashes and indexes ok, {al['aligned']}/{al['payloads_4k_or_more']} payloads 4096-aligned")

    reference = _reference_keys(dst, cfg)
    _warm_up(cfg, device)
    transform = gdsload.ImageTransform(size=cfg.crop, resize=cfg.resize)
    common = {"batch_size": cfg.batch_size, "shuffle": True, "drop_last": True, "seed": cfg.seed, "transform": transform}
    what = f"{cfg.steps} steps of batch {cfg.batch_size}, random {cfg.crop}x{cfg.crop} crops, on {device}"

    log(f"[3/6] training a tiny conv net fed by gdsload.DataLoader ({what})")
    local = _train_gdsload(
        "gdsload.DataLoader",
        lambda: gdsload.DataLoader(gdsload.Dataset(str(dst)), num_workers=2, **common),
        reference, cfg, work / "checkpoint-local.pt", device, log)
    log(f"      {local['samples_per_s']:.0f} samples/s, data stall {local['stall_fraction']:.0%}")

    log(f"[4/6] the same model fed by torch.utils.data.DataLoader({cfg.torch_workers} workers) over "
        "webdataset.WebDataset + Pillow")
    base = _train_torch(dst, cfg, device)
    log(f"      {base['samples_per_s']:.0f} samples/s, data stall {base['stall_fraction']:.0%}")

    from gdsload.service.server import create_server

    server, port = create_server([str(served)], address="127.0.0.1:0", grace_s=5.0)
    server.start()
    try:
        log(f"[5/6] feed server on 127.0.0.1:{port} (dataset 'train'); the same training fed by gdsload.RemoteLoader")
        remote = _train_gdsload(
            "gdsload.RemoteLoader",
            lambda: gdsload.RemoteLoader(f"127.0.0.1:{port}", dataset="train", **common),
            reference, cfg, work / "checkpoint-remote.pt", device, log)
    finally:
        server.shutdown(5.0)
    if remote["epoch0_keys"] != local["epoch0_keys"]:
        raise GdsloadError("RemoteLoader's epoch 0 order differs from DataLoader's with the same arguments")
    log(f"      {remote['samples_per_s']:.0f} samples/s, data stall {remote['stall_fraction']:.0%}; "
        "its epoch 0 order equals the local loader's")

    server_io = choose_backend(str(dst), device=False)
    rows = [
        ("gdsload.DataLoader", local, local["stats"].get("io_path") or "?",
         f"{local['stats'].get('decode_device') or '?'} (DALI)"),
        ("gdsload.RemoteLoader (loopback)", remote, f"gRPC <- server {server_io}", "cpu (DALI, on the server)"),
        (f"torch DataLoader ({cfg.torch_workers} workers)", base, "posix (webdataset tar stream)", "cpu (Pillow)"),
    ]
    total = time.perf_counter() - t0
    log(f"[6/6] report ({os.cpu_count()} CPU cores, {'GPU' if device == 'cuda' else 'no GPU'}; {what}; "
        f"{cfg.num_images} images)")
    log(format_report(rows))
    log("      data stall: share of the training loop spent waiting for the next batch" +
        ("; here decoding and the model share the same CPU cores" if device == "cpu" else ""))
    log(f"      checkpoint at batch {local['checkpoint_step']} of {local['batches_per_epoch']} (epoch 0); "
        "resumed loaders yielded exactly the remaining keys, local and remote")
    log(f"demo finished in {total:.1f} s; dataset at {dst}")
    for row in (local, remote):
        row.pop("epoch0_keys")
    return {"config": asdict(cfg), "device": device, "convert": r, "alignment": al, "local": local,
            "remote": remote, "torch": base, "seconds": total,
            "report": [{"loader": n, "samples_per_s": f["samples_per_s"], "stall_fraction": f["stall_fraction"],
                        "io_path": io, "decode": dec} for n, f, io, dec in rows]}


def format_report(rows: list[tuple[str, dict[str, Any], str, str]]) -> str:
    head = f"      {'loader':<34}{'samples/s':>10}{'data stall':>12}   {'I/O path':<32}decode"
    lines = [head]
    for name, f, io, dec in rows:
        lines.append(f"      {name:<34}{f['samples_per_s']:>10.0f}{f['stall_fraction']:>12.0%}   {io:<32}{dec}")
    return "\n".join(lines)


def write_json(result: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(result, indent=1, default=str) + "\n")
