"""A small multi-field dataset for the field / map / process-worker tests, and the map functions
they use (module-level, so spawned worker processes can import them: this module needs only
NumPy, Pillow and gdsload).

Each of 24 samples has: `jpg` (RGB 40x48), `depth.png` (grayscale 40x48, lossless), `txt`
(UTF-8 with non-ASCII), `json` (an object), `cls`, `tokens.npy` (int32, length 1..24: ragged),
`emb.npy` (float32[4], fixed) and `bin` (other bytes). Cut into several shards.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

N = 24
EVAL = dict(train=False, size=40, resize=40, mean=None, std=None, dtype="uint8", layout="NHWC")


def make_source(src: Path) -> dict[str, dict]:
    """Write the sample files into `src`; returns {key: {ext: value}} (images as arrays)."""
    from PIL import Image

    src.mkdir(parents=True)
    rng = np.random.default_rng(7)
    ref: dict[str, dict] = {}
    for i in range(N):
        k = f"s{i:03d}"
        # smooth images: JPEG round trips closely
        yy, xx = np.mgrid[0:40, 0:48]
        rgb = np.stack([xx * 4 + i, yy * 6, (xx + yy) * 2 + i], -1).astype(np.uint8)
        depth = rng.integers(0, 256, (40, 48), dtype=np.uint8)
        Image.fromarray(rgb).save(src / f"{k}.jpg", quality=95)
        Image.fromarray(depth).save(src / f"{k}.depth.png")
        txt = f"a caption for sample {i}: ünïcode ✓"
        meta = {"i": i, "tags": ["x"] * (i % 4), "score": i / 8}
        (src / f"{k}.txt").write_text(txt, encoding="utf-8")
        (src / f"{k}.json").write_text(json.dumps(meta), encoding="utf-8")
        (src / f"{k}.cls").write_text(str(i % 5))
        tokens = rng.integers(0, 1000, i + 1, dtype=np.int32)
        emb = rng.standard_normal(4).astype(np.float32)
        np.save(src / f"{k}.tokens.npy", tokens)
        np.save(src / f"{k}.emb.npy", emb)
        (src / f"{k}.bin").write_bytes(bytes([i, 255, 0]) * (i + 1))
        ref[k] = {"jpg": rgb, "depth.png": depth, "txt": txt, "json": meta, "cls": i % 5,
                  "tokens.npy": tokens, "emb.npy": emb, "bin": bytes([i, 255, 0]) * (i + 1)}
    return ref


def convert_source(src: Path, dst: Path) -> dict:
    from gdsload.convert.engine import ConvertOptions, convert

    return convert(str(src), dst, ConvertOptions(workers=1, progress=False, shard_size=40_000))


# -- map functions (pure Python, picklable) ------------------------------------------------------
VOCAB = 64


def tokenize(text: str, length: int = 12) -> np.ndarray:
    """A toy tokenizer: one id per word (a stable hash of it), padded / cut to `length`."""
    ids = [sum(ord(c) * 31 ** j for j, c in enumerate(w)) % (VOCAB - 1) + 1 for w in text.split()]
    ids = ids[:length] + [0] * (length - len(ids[:length]))
    return np.asarray(ids, dtype=np.int64)


def caption_map(sample: dict) -> dict:
    """Tokenise the caption, take a value from the JSON, sum the ragged tokens."""
    return {"__key__": sample["__key__"], "ids": tokenize(sample["txt"]), "score": float(sample["json"]["score"]),
            "tok_sum": int(np.asarray(sample["tokens.npy"], dtype=np.int64).sum()), "cls": int(sample["cls"]) * 10}


def pad_collate(samples: list) -> dict:
    """Pad the ragged tokens to the longest in the batch; keys as a list."""
    width = max(len(s["tokens.npy"]) for s in samples)
    out = np.zeros((len(samples), width), dtype=np.int32)
    for i, s in enumerate(samples):
        out[i, : len(s["tokens.npy"])] = s["tokens.npy"]
    return {"tokens": out, "lengths": [len(s["tokens.npy"]) for s in samples], "keys": [s["__key__"] for s in samples]}


class MapBoom(Exception):
    pass


def failing_map(sample: dict) -> dict:
    if sample["__key__"] == "s010":
        raise MapBoom("bad sample")
    return sample


def slow_map(sample: dict) -> dict:
    import time

    time.sleep(0.05)
    return sample


def identity(sample: dict) -> dict:
    return sample


def make_two_image_source(src: Path, *, bad_jpg: str, bad_png: str, n: int = 8) -> dict[str, dict]:
    """`n` samples of `jpg` + `depth.png` (+ `cls`); one sample's jpg and another's png corrupt."""
    from PIL import Image

    src.mkdir(parents=True)
    ref = {}
    for i in range(n):
        k = f"s{i:03d}"
        yy, xx = np.mgrid[0:40, 0:48]
        rgb = np.stack([xx * 4 + i, yy * 6, (xx + yy) * 2 + i], -1).astype(np.uint8)
        depth = ((xx * 3 + yy * 2 + i * 7) % 256).astype(np.uint8)
        Image.fromarray(rgb).save(src / f"{k}.jpg", quality=95)
        Image.fromarray(depth).save(src / f"{k}.depth.png")
        (src / f"{k}.cls").write_text(str(i))
        ref[k] = {"jpg": rgb, "depth.png": depth}
    for k, ext in ((bad_jpg, "jpg"), (bad_png, "depth.png")):
        p = src / f"{k}.{ext}"
        p.write_bytes(p.read_bytes()[:60])  # truncated: the header parses, the image does not
    return ref


def keep_list(samples: list) -> list:
    return samples
