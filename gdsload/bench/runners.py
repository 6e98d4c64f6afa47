"""One benchmark run of one contestant, in its own process (`python -m gdsload.bench.runners`).

Contestants, all over the same shards and the same work:

- `gdsload`: `gdsload.DataLoader` (threads, DALI decode, prefetch ring).
- `torch`: `torch.utils.data.DataLoader(num_workers=cores)` over `webdataset.WebDataset` with
  Pillow decode and the same transforms written with Pillow and NumPy (torchvision is not
  installable beside the CPU torch wheel here; the transforms follow torchvision's definitions).
- `dali`: DALI's own `fn.readers.webdataset` pipeline (with the `.dali.idx` index files) and the
  same DALI operators gdsload uses; the consumer takes DALI's output buffers as they are.
- `dali_torch` (tiers D and T): the same pipeline through DALI's PyTorch iterator
  (`DALIGenericIterator`), which copies each batch into torch tensors the job keeps: what a
  PyTorch job gets from DALI, and what gdsload hands out (tensors in its own ring).
- `spdl`: SPDL's thread-based `spdl.pipeline` (`spdl` 0.8, the fastest Python-side peer): shards
  parsed by `spdl.io.iter_tarfile` (a shard per thread, its samples held as a list), images decoded by FFmpeg (`spdl.io`, crop + resize + flip as
  one FFmpeg filter, the crop drawn as torchvision draws it), normalized with NumPy, batched by
  `aggregate`; `workers` threads. Needs `pip install spdl` and FFmpeg's shared libraries
  (libavutil etc.); without them the harness skips it, saying why.
- `gdsload_noverify`: gdsload with `Dataset(verify=None)`, which shows what the default CRC32
  checks of staged members cost.
- `read`: the raw limit, a plain sequential read of the shard files (hot page cache, or cold:
  evicted with `posix_fadvise(DONTNEED)` and read with O_DIRECT).
- `decode1`: the single-core Pillow decode (+ transform) rate on a sample of the images; the
  harness multiplies it by the core count.

Tiers: `R` raw bytes (no decode; `.npy` datasets always run R, as tensors), `D` decode + resize to
224x224 uint8 (a fixed shape is needed to batch), `T` decode + random resized crop 224 + flip +
normalize to float32 NCHW.

Each run reports samples, a label histogram (the harness checks all contestants agree), wall and
CPU seconds, time to first batch (from constructing the loader; imports excluded), and, with a
synthetic step (`step_ms`, a sleep standing in for a GPU-bound training step), the fraction of
wall time the consumer waited for data.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import threading
import time
from collections import Counter
from typing import Any

import numpy as np

MEAN = np.array([0.485, 0.456, 0.406], np.float32) * 255
STD = np.array([0.229, 0.224, 0.225], np.float32) * 255
SIZE = 224


def _cpu_s() -> float:
    s = resource.getrusage(resource.RUSAGE_SELF)
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def shard_paths(dataset: str) -> tuple[list[str], list[str], dict]:
    """(tar paths, DALI index paths, manifest) of a converted dataset, in manifest order."""
    m = json.load(open(os.path.join(dataset, "manifest.json")))
    tars = [os.path.join(dataset, s["name"]) for s in m["shards"]]
    idx = [os.path.join(dataset, s["dali_index"]) for s in m["shards"]]
    return tars, idx, m


# -- Pillow transforms for the torch baseline (torchvision's definitions) ------------------------
def rrc_box(w: int, h: int, rng: np.random.Generator, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
    """torchvision.transforms.RandomResizedCrop's box (width, height, x, y) for a w x h image: ten
    tries at a random area and aspect ratio, else the whole image."""
    area = w * h
    for _ in range(10):
        target = area * rng.uniform(*scale)
        ar = np.exp(rng.uniform(np.log(ratio[0]), np.log(ratio[1])))
        cw, ch = int(round(np.sqrt(target * ar))), int(round(np.sqrt(target / ar)))
        if 0 < cw <= w and 0 < ch <= h:
            return cw, ch, int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
    return w, h, 0, 0


def pil_random_resized_crop(img, rng, size: int = SIZE, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
    """torchvision.transforms.RandomResizedCrop(size) semantics, bilinear."""
    from PIL import Image

    cw, ch, x, y = rrc_box(*img.size, rng, scale, ratio)
    return img.resize((size, size), Image.BILINEAR, box=(x, y, x + cw, y + ch))


def pil_transform(tier: str, *, size: int = SIZE, seed: int = 0):
    """The tier's transform with Pillow and NumPy (D: resize; T: random resized crop + flip +
    normalize, float32 CHW). One random generator per worker process, seeded by (seed, pid), so
    forked DataLoader workers do not repeat each other's crops."""
    from PIL import Image

    state: dict[int, np.random.Generator] = {}

    def fn(img):
        img = img.convert("RGB")
        if tier == "D":
            return np.asarray(img.resize((size, size), Image.BILINEAR))
        rng = state.get(os.getpid())
        if rng is None:
            rng = state[os.getpid()] = np.random.default_rng([seed, os.getpid()])
        img = pil_random_resized_crop(img, rng, size)
        if rng.random() < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        a = (np.asarray(img, np.float32) - MEAN) / STD
        return np.ascontiguousarray(a.transpose(2, 0, 1))

    return fn


# -- contestants -----------------------------------------------------------------------------------
def _consume(it, step_ms: float, label_of) -> dict[str, Any]:
    """Iterate, timing the wait for each batch; returns counts, labels and timings."""
    labels: Counter = Counter()
    n = 0
    wait = 0.0
    first = None
    t0 = time.perf_counter()
    while True:
        a = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            break
        b = time.perf_counter()
        wait += b - a
        if first is None:
            first = b - t0
        ls = label_of(batch)
        n += len(ls)
        labels.update(int(x) for x in ls)
        if step_ms:
            time.sleep(step_ms / 1000)
    wall = time.perf_counter() - t0
    return {"samples": n, "labels": dict(sorted(labels.items())), "wall_s": wall, "wait_s": wait,
            "first_batch_s": first}


def run_gdsload(a: dict) -> dict:
    import gdsload
    from gdsload.decode.image import ImageTransform

    t0 = time.perf_counter()
    kind = a["kind"]
    kw: dict[str, Any] = {}
    if kind == "image":
        if a["tier"] == "R":
            kw["decode"] = False
        elif a["tier"] == "D":
            kw["transform"] = ImageTransform(train=False, size=SIZE, resize=SIZE, mean=None, std=None,
                                             dtype="uint8", layout="NHWC")
        else:
            kw["transform"] = ImageTransform()
    if a.get("prefetch") is not None:
        kw["prefetch_factor"] = a["prefetch"]
    verify = None if a["contestant"] == "gdsload_noverify" else "fast"
    # the CPU path, as every other contestant here decodes on the CPU: on a GPU host the default
    # ("cuda": mixed decode, device tensors) would set GPU gdsload against CPU baselines (audit 4
    # R6); bench/gpu_check.sh measures the GPU path against GPU baselines
    dl = gdsload.DataLoader(gdsload.Dataset(a["dataset"], verify=verify), batch_size=a["batch_size"],
                            num_workers=a["workers"], shuffle=False, device=a.get("device", "cpu"), **kw)
    it = iter(dl)
    construct = time.perf_counter() - t0
    r = _consume(it, a["step_ms"], lambda b: b["cls"].tolist())
    r["first_batch_s"] += construct
    r["stats"] = {k: v for k, v in dl.stats().items() if isinstance(v, (int, float, str))}
    dl.close()
    return r


def run_torch(a: dict) -> dict:
    import torch
    import webdataset as wds

    tars, _, _ = shard_paths(a["dataset"])
    t0 = time.perf_counter()
    if a["kind"] == "tensor":
        ds = wds.WebDataset(tars, shardshuffle=False, empty_check=False).decode().to_tuple("npy", "cls")
    elif a["tier"] == "R":
        ds = wds.WebDataset(tars, shardshuffle=False, empty_check=False).to_tuple(a["image_field"], "cls").map_tuple(
            lambda b: b, lambda c: int(c))
    else:
        ds = (wds.WebDataset(tars, shardshuffle=False, empty_check=False).decode("pil")
              .to_tuple(a["image_field"], "cls").map_tuple(pil_transform(a["tier"]), int))
    collate = None
    if a["kind"] == "image" and a["tier"] == "R":
        def collate(items):  # encoded bytes cannot be stacked
            return [x for x, _ in items], torch.tensor([c for _, c in items])
    dl = torch.utils.data.DataLoader(ds, batch_size=a["batch_size"], num_workers=a["workers"],
                                     collate_fn=collate, persistent_workers=False)
    construct = time.perf_counter() - t0
    r = _consume(iter(dl), a["step_ms"], lambda b: b[1].tolist())
    r["first_batch_s"] += construct
    return r


def dali_train_transform(img):
    """Tier T in a DALI graph: decode with a random crop, resize to SIZE, flip at random,
    normalize to float32 CHW (what gdsload's default `ImageTransform` runs)."""
    from nvidia.dali import fn, types

    out = fn.decoders.image_random_crop(img, device="cpu", output_type=types.RGB)
    out = fn.resize(out, size=(SIZE, SIZE))
    return fn.crop_mirror_normalize(out, dtype=types.FLOAT, output_layout="CHW", crop=(SIZE, SIZE),
                                    mean=MEAN.tolist(), std=STD.tolist(),
                                    mirror=fn.random.coin_flip(probability=0.5))


def run_dali(a: dict) -> dict:
    from nvidia.dali import fn, pipeline_def, types

    tars, idx, m = shard_paths(a["dataset"])
    n_total = m["num_samples"]
    bs = a["batch_size"]
    t0 = time.perf_counter()

    @pipeline_def(batch_size=bs, num_threads=a["workers"], device_id=None)
    def pipe():
        img, cls = fn.readers.webdataset(paths=tars, index_paths=idx, ext=[a["image_field"], "cls"], name="r",
                                         dtypes=[types.UINT8, types.UINT8], pad_last_batch=True)
        if a["tier"] == "R":
            return img, cls
        if a["tier"] == "D":
            out = fn.decoders.image(img, device="cpu", output_type=types.RGB)
            out = fn.resize(out, size=(SIZE, SIZE))
            return out, cls
        return dali_train_transform(img), cls

    p = pipe()
    p.build()
    if a["contestant"] == "dali_torch" and a["tier"] != "R":
        # What a PyTorch job gets from DALI: its iterator copies each output into torch tensors
        # (the tensors stay the job's; DALI's buffers go back to the pipeline)
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

        it = DALIGenericIterator([p], ["image", "cls"], reader_name="r",
                                 last_batch_policy=LastBatchPolicy.PARTIAL, auto_reset=False)
        construct = time.perf_counter() - t0
        r = _consume(iter(it), a["step_ms"],
                     lambda b: [int(bytes(c).decode()) for c in b[0]["cls"].numpy()])
        r["first_batch_s"] += construct
        return r
    construct = time.perf_counter() - t0
    seen = [0]

    def gen():
        while seen[0] < n_total:
            out, cls = p.run()
            take = min(len(cls), n_total - seen[0])
            seen[0] += take
            yield [int(bytes(cls.at(k)).decode()) for k in range(take)]

    r = _consume(gen(), a["step_ms"], lambda b: b)
    r["first_batch_s"] += construct
    return r


def spdl_missing() -> str | None:
    """Why the `spdl` contestant cannot run here, or None."""
    try:
        import spdl.io  # noqa: F401
        from spdl.io import lib

        # `lib._libspdl` is imported lazily (touching the name loads nothing); this loads the
        # extension and FFmpeg's shared libraries, or raises naming the missing libavutil
        lib._import_libspdl()
    except Exception as exc:  # ImportError, or RuntimeError naming the missing libavutil
        return f"{type(exc).__name__}: {str(exc)[:300]}"
    return None


def run_spdl(a: dict) -> dict:
    import spdl.io
    from spdl.pipeline import PipelineBuilder

    tars, _, _ = shard_paths(a["dataset"])
    tier, kind = a["tier"], a["kind"]
    field = "npy" if kind == "tensor" else a["image_field"]
    t0 = time.perf_counter()

    def samples(tar: str):
        """One shard's (payload, label) pairs in order; members of a sample are adjacent."""
        cur: dict[str, Any] = {}
        key = None
        with open(tar, "rb") as f:
            for name, data in spdl.io.iter_tarfile(f):
                dot = name.find(".", name.rfind("/") + 1)  # KEY.EXT splits at the base name's first dot
                k, ext = name[:dot], name[dot + 1 :]
                if k != key:
                    cur, key = {}, k
                cur[ext] = data
                if field in cur and "cls" in cur:
                    yield cur[field], int(bytes(cur["cls"]))
                    cur = {}

    rng = np.random.default_rng(0)
    lock = threading.Lock()

    def decode(item):
        payload, label = item
        if kind == "tensor":
            return spdl.io.load_npy(payload), label
        if tier == "R":
            return payload, label
        packets = spdl.io.demux_image(payload)
        if tier == "D":
            chain = f"scale={SIZE}:{SIZE}"
        else:
            with lock:
                cw, ch, x, y = rrc_box(packets.width, packets.height, rng)
                flip = rng.random() < 0.5
            chain = f"crop={cw}:{ch}:{x}:{y},scale={SIZE}:{SIZE}" + (",hflip" if flip else "")
        frames = spdl.io.decode_packets(packets, filter_desc=chain + ",format=rgb24")
        img = spdl.io.to_numpy(spdl.io.convert_frames(frames))
        if tier == "T":
            img = np.ascontiguousarray(((img.astype(np.float32) - MEAN) / STD).transpose(2, 0, 1))
        return img, label

    def collate(items):
        xs = [x for x, _ in items]
        labels = np.array([c for _, c in items])
        return (xs if tier == "R" and kind == "image" else np.stack(xs)), labels

    w = a["workers"]
    pipeline = (PipelineBuilder().add_source(tars)
                # a generator stage runs one at a time; a shard as a list lets `w` threads parse
                .pipe(lambda tar: list(samples(tar)), concurrency=w, output_order="input")
                .disaggregate()
                .pipe(decode, concurrency=w, output_order="input")
                .aggregate(a["batch_size"])
                .pipe(collate)
                .add_sink(3)
                .build(num_threads=w))
    construct = time.perf_counter() - t0
    with pipeline.auto_stop():
        r = _consume(iter(pipeline), a["step_ms"], lambda b: b[1].tolist())
    r["first_batch_s"] += construct
    return r


def _read_file(path: str, views: list[memoryview], at: int, *, direct: bool) -> tuple[int, int]:
    """Read a whole file sequentially, one view of `views` per read, starting with `views[at]`
    and wrapping around; O_DIRECT when asked and allowed. Returns (bytes, the next view's number)."""
    def loop(read) -> tuple[int, int]:
        n, i = 0, at
        while (k := read(views[i])) > 0:
            n, i = n + k, (i + 1) % len(views)
        return n, i

    if direct and hasattr(os, "O_DIRECT"):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            try:
                return loop(lambda v: os.readv(fd, [v]))
            finally:
                os.close(fd)
        except OSError:  # the filesystem refuses O_DIRECT: read it buffered below
            pass
    with open(path, "rb", buffering=0) as f:
        return loop(f.readinto)


READ_CHUNK = 4 << 20  # the raw-read reference: sequential 4 MiB reads ...
READ_BUFFER = 64 << 20  # ... cycling through a 64 MiB buffer (issue 15's definition): like a
# loader's output it does not stay in the CPU caches, which an 8 MiB buffer read over and over does.
# "read" allocates the buffer inside the clock, as issue 15 measured it (~5.5-6 GB/s): its first
# pass pays the kernel's first-touch page faults, ~1.6 GB/s on the 2-core VM, and a fresh 64 MiB
# NumPy buffer's transparent huge pages made it vary up to 17x between rounds. "read_warm" (tier
# R) touches the buffer before the clock: the storage's own speed, the stricter reference.


def run_read(a: dict) -> dict:
    tars, _, m = shard_paths(a["dataset"])
    cold = a.get("cold", False)
    warm = a["contestant"] == "read_warm"
    if warm:  # the buffer's pages are touched before the clock (see READ_BUFFER)
        buf = np.ones(READ_BUFFER + 4096, np.uint8)
    t0 = time.perf_counter()
    nbytes = 0
    if not warm:
        buf = np.empty(READ_BUFFER + 4096, np.uint8)
    base = (-buf.ctypes.data) % 4096  # page-aligned pieces (O_DIRECT needs them)
    views = [memoryview(buf[base + p : base + p + READ_CHUNK]) for p in range(0, READ_BUFFER, READ_CHUNK)]
    at = 0
    for t in tars:
        if cold:
            fd = os.open(t, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        n, at = _read_file(t, views, at, direct=cold)
        nbytes += n
    wall = time.perf_counter() - t0
    return {"samples": m["num_samples"], "labels": None, "wall_s": wall, "wait_s": 0.0,
            "first_batch_s": None, "bytes": nbytes}


def run_decode1(a: dict) -> dict:
    """Single-core Pillow decode (+ the tier's transform) over the first `limit` images."""
    import io

    from PIL import Image

    import gdsload

    ds = gdsload.open_dataset(a["dataset"])
    n = min(a.get("limit", 200), len(ds))
    payloads = [ds.sample(i)[a["image_field"]] for i in range(n)]
    tf = pil_transform(a["tier"] if a["tier"] != "R" else "D")
    t0 = time.perf_counter()
    for p in payloads:
        tf(Image.open(io.BytesIO(p)))
    wall = time.perf_counter() - t0
    return {"samples": n, "labels": None, "wall_s": wall, "wait_s": 0.0, "first_batch_s": None}


RUNNERS = {"gdsload": run_gdsload, "gdsload_noverify": run_gdsload, "torch": run_torch,
           "dali": run_dali, "dali_torch": run_dali, "spdl": run_spdl, "read": run_read,
           "read_warm": run_read, "decode1": run_decode1}


# Imports each contestant needs, done before the clock and the CPU counter start: the benchmark
# compares loading, not library import times (which a training job pays once).
PRELOAD = {"gdsload": ["torch", "nvidia.dali", "gdsload.loader.dataloader", "gdsload.decode.image", "gdsload.ring.ring",
                       "gdsload.io.posix", "gdsload.plan.plan"],
           "gdsload_noverify": ["torch", "nvidia.dali", "gdsload.loader.dataloader", "gdsload.ring.ring",
                                "gdsload.io.posix", "gdsload.plan.plan"],
           "torch": ["torch", "webdataset", "PIL.Image"],
           "spdl": ["spdl.io", "spdl.pipeline", "spdl.io.lib._libspdl"],
           "dali": ["nvidia.dali"], "dali_torch": ["torch", "nvidia.dali", "nvidia.dali.plugin.pytorch"],
           "read": [], "read_warm": [], "decode1": ["PIL.Image", "gdsload"]}


def main() -> None:
    import importlib

    a = json.loads(sys.argv[1])
    for mod in PRELOAD[a["contestant"]]:
        try:
            importlib.import_module(mod)
        except ImportError:
            pass
    cpu0 = _cpu_s()
    r = RUNNERS[a["contestant"]](a)
    r["cpu_s"] = _cpu_s() - cpu0
    print("RESULT " + json.dumps(r))


if __name__ == "__main__":
    main()
