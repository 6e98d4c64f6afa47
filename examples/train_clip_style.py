"""Train a tiny CLIP-style model on an image-text dataset: `jpg` + `txt` + `json` per sample.

    python examples/train_clip_style.py --shards shards/captions      # a converted dataset
    python examples/train_clip_style.py --tiny                        # generated, a few CPU steps

What it shows: `.txt` fields come back as `str` and `.json` as parsed objects; a toy tokenizer
runs per sample in `map` (in worker processes: `worker_mode="process"`, so the function is at
module level and the entry point is guarded by `if __name__ == "__main__":`); the default
collate stacks the token ids; images are decoded and augmented in DALI as usual. The dataset of
`--tiny` is generated: coloured shapes on noise, captioned "a red circle", with the colour and
shape also in the JSON.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

import gdsload  # NumPy only; torch is imported in main(): spawned map workers re-import this
                # file, and need only `prepare`

COLORS = {"red": (220, 40, 40), "green": (40, 200, 60), "blue": (50, 70, 230), "yellow": (230, 210, 40)}
SHAPES = ("circle", "square")
VOCAB, LENGTH = 256, 8


def tokenize(text: str) -> np.ndarray:
    """A toy tokenizer: one id per lower-cased word (a stable hash), padded with 0 to LENGTH."""
    ids = [sum(ord(c) * 31 ** j for j, c in enumerate(w.lower())) % (VOCAB - 1) + 1 for w in text.split()]
    return np.asarray((ids + [0] * LENGTH)[:LENGTH], dtype=np.int64)


def prepare(sample: dict) -> dict:
    """The per-sample `map`: tokens from the caption, a class id from the JSON."""
    return {"jpg": sample["jpg"], "ids": tokenize(sample["txt"]),
            "color": list(COLORS).index(sample["json"]["color"]), "__key__": sample["__key__"]}


def make_captions(dst: Path, n: int, size: int = 64, seed: int = 0) -> None:
    """`n` samples KEY.jpg / KEY.txt / KEY.json in `dst`."""
    from PIL import Image, ImageDraw

    dst.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(n):
        color, shape = list(COLORS)[i % len(COLORS)], SHAPES[(i // len(COLORS)) % len(SHAPES)]
        im = Image.fromarray(rng.integers(0, 60, (size, size, 3), dtype=np.uint8))
        d = ImageDraw.Draw(im)
        a, b = int(rng.integers(4, size // 3)), int(rng.integers(2 * size // 3, size - 4))
        (d.ellipse if shape == "circle" else d.rectangle)((a, a, b, b), fill=COLORS[color])
        key = f"{i:05d}"
        im.save(dst / f"{key}.jpg", quality=90)
        (dst / f"{key}.txt").write_text(f"a {color} {shape}")
        (dst / f"{key}.json").write_text(json.dumps({"color": color, "shape": shape, "index": i}))


def two_tower(dim: int = 32):
    """An image tower (small convnet) and a text tower (bag of token embeddings)."""
    from torch import nn

    return nn.ModuleDict({
        "image": nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1), nn.ReLU(), nn.Conv2d(16, 32, 3, 2, 1), nn.ReLU(),
                               nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, dim)),
        "text": nn.EmbeddingBag(VOCAB, dim, padding_idx=0),
    })


def clip_loss(model, images, ids, temperature: float = 0.1):
    """Symmetric contrastive loss: each image against every caption of the batch."""
    import torch
    import torch.nn.functional as F

    a = F.normalize(model["image"](images), dim=-1)
    b = F.normalize(model["text"](ids), dim=-1)
    logits = a @ b.T / temperature
    target = torch.arange(len(a), device=a.device)
    return (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", help="a converted dataset with jpg, txt and json fields")
    p.add_argument("--tiny", action="store_true", help="generate a small dataset, a few CPU steps")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--workers", type=int, default=2, help="map worker processes")
    p.add_argument("--size", type=int, default=48, help="training crop")
    args = p.parse_args(argv)
    if args.tiny:
        work = Path(tempfile.mkdtemp(prefix="gdsload-clip-"))
        make_captions(work / "src", 48)
        from gdsload.convert.engine import ConvertOptions, convert

        convert(str(work / "src"), work / "shards", ConvertOptions(workers=1, progress=False, shard_size=40_000))
        args.shards, args.batch_size, args.size = str(work / "shards"), 8, 32
    if not args.shards:
        p.error("give --shards (a converted dataset) or --tiny")
    loader = gdsload.DataLoader(
        gdsload.Dataset(args.shards, fields=["jpg", "txt", "json"]), batch_size=args.batch_size, shuffle=True,
        drop_last=True, num_workers=args.workers, transform=gdsload.ImageTransform(size=args.size),
        map=prepare, worker_mode="process",
    )
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = two_tower().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses, t0 = [], time.perf_counter()
    for epoch in range(args.epochs):
        for batch in loader:  # {"jpg": float32 NCHW, "ids": int64 (B, LENGTH), "color": int64, "__key__"}
            loss = clip_loss(model, batch["jpg"].to(device), batch["ids"].to(device))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    result = {"steps": len(losses), "first_loss": losses[0], "last_loss": losses[-1],
              "seconds": round(time.perf_counter() - t0, 2), "samples_per_s": loader.stats()["samples_per_s"]}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
