"""`gdsload demo`: the built-in default job, end to end on this host.

Generates a small ImageNet-like dataset from the photographs in scikit-image's wheel, converts it
with `gdsload convert`, inspects and verifies it, then decodes every image through DALI's
`readers.webdataset` with our `.dali.idx` files (device "mixed" on a GPU host, "cpu" otherwise),
checking that every sample arrives exactly once with its label. Exits non-zero if any step fails.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from gdsload.errors import GdsloadError


def decode_pass(root: str | Path, *, batch_size: int = 32, threads: int = 2, size: int = 224) -> dict[str, Any]:
    """Decode and resize every image of a converted dataset with DALI; returns counts and rate."""
    from gdsload.errors import require
    from gdsload.format.reader import open_dataset

    require("nvidia.dali", extra="cpu", purpose="decoding images")
    from nvidia.dali import fn, pipeline_def, types

    from gdsload import doctor

    ds = open_dataset(root)
    img_ext = next((e for e, k in ds.fields.items() if k == "image"), None)
    if img_ext is None:
        raise GdsloadError(f"{root}: no image field to decode (fields: {sorted(ds.fields)})")
    paths = [ds.shard_path(i) for i in range(len(ds.shards))]
    idx = [ds.shard_path(i, "dali_index") for i in range(len(ds.shards))]
    device = "mixed" if doctor.collect().get("decode_device") == "mixed" else "cpu"

    @pipeline_def(batch_size=batch_size, num_threads=threads, device_id=0 if device == "mixed" else None,
                  prefetch_queue_depth=2)
    def pipe():
        jpg, cls = fn.readers.webdataset(
            paths=paths, index_paths=idx, ext=[img_ext, "cls"], missing_component_behavior="error",
            random_shuffle=False, name="reader", dtypes=[types.UINT8, types.UINT8],
        )
        images = fn.decoders.image(jpg, device=device, output_type=types.RGB)
        images = fn.resize(images, resize_shorter=size)
        images = fn.crop(images, crop=(size, size))
        return images, cls

    p = pipe()
    p.build()
    n = len(ds)
    seen = 0
    labels: dict[int, int] = {}
    t0 = time.perf_counter()
    while seen < n:
        images, cls = p.run()
        take = min(len(images), n - seen)
        for k in range(take):
            shape = images.as_cpu().at(k).shape if device == "mixed" else images.at(k).shape
            if tuple(shape) != (size, size, 3):
                raise GdsloadError(f"decoded image {seen + k} has shape {shape}, expected {(size, size, 3)}")
            label = int(bytes(cls.at(k)).decode())
            labels[label] = labels.get(label, 0) + 1
        seen += take
    seconds = time.perf_counter() - t0
    return {"images": seen, "seconds": seconds, "images_per_s": seen / seconds, "device": device,
            "labels": dict(sorted(labels.items()))}


def run(workdir: str | Path = "gdsload-demo", *, num_images: int = 600, num_classes: int = 10,
        seed: int = 0, log=print) -> dict[str, Any]:
    from gdsload.convert.engine import ConvertOptions, convert
    from gdsload.format.reader import open_dataset
    from gdsload.sampledata import make_image_folder

    work = Path(workdir)
    src, dst = work / "images", work / "shards"
    t0 = time.perf_counter()
    log(f"[1/4] generating {num_images} ImageNet-like JPEGs in {num_classes} classes under {src}")
    made = make_image_folder(src, num_images=num_images, num_classes=num_classes, seed=seed)
    log(f"      {made['num_images']} images, {made['total_bytes'] / 1e6:.1f} MB in {time.perf_counter() - t0:.1f} s")
    log(f"[2/4] gdsload convert {src} {dst} --validate --shard-size 16MB --overwrite")
    r = convert(str(src), dst, ConvertOptions(shard_size=16_000_000, validate=True, overwrite=True))
    log(f"      {r['samples']} samples -> {r['shards']} shards, {r['samples_per_s']:.0f} samples/s, "
        f"{r['mb_per_s']:.1f} MB/s, {r['rejected']} rejected")
    log("[3/4] inspect and verify")
    with open_dataset(dst) as ds:
        al = ds.alignment()
        bad = ds.verify()
    if bad:
        raise GdsloadError(f"verify failed: {bad}")
    if al["aligned"] != al["payloads_4k_or_more"]:
        raise GdsloadError(f"alignment broken: {al}")
    log(f"      ok: {al['aligned']}/{al['payloads_4k_or_more']} payloads 4096-aligned, hashes and indexes verified")
    log("[4/4] decode every image with DALI readers.webdataset + our .dali.idx")
    d = decode_pass(dst)
    if d["images"] != r["samples"] or sum(d["labels"].values()) != r["samples"]:
        raise GdsloadError(f"decoded {d['images']} images, expected {r['samples']}")
    log(f"      {d['images']} images decoded + resized to 224 on DALI '{d['device']}' at "
        f"{d['images_per_s']:.0f} images/s; labels per class: {d['labels']}")
    log(f"demo finished in {time.perf_counter() - t0:.1f} s; dataset at {dst}")
    return {"convert": r, "decode": d, "alignment": al}
