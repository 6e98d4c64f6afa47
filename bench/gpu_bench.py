"""GPU checks and measurements, one table row each; run through `bench/gpu_check.sh`.

Steps (each appends a row to `OUT/gpu-check.json` as soon as it ends; see bench/gpu_table.py):
  data          make a raw-tensor dataset (uint8[3, 224, 224] rows, 150,528 bytes) and a JPEG
                dataset, before anything touches CUDA (conversion forks worker processes)
  device_path   `DataLoader(device="cuda")` over the tensors: FAIL unless `stats()["io_path"]`
                is a KvikIO path and `ring_device` is a GPU, or if a value differs from the source
  kvikio_rows   per-row reads as the loader issues them (one `raw_read_async` per row on a
                private stream into a device batch buffer at row offsets) vs POSIX into pinned
                memory + one host-to-device copy per batch, and vs one `pread` per row (KvikIO's
                default, which synchronises the legacy stream first); KvikIO's gds_threshold,
                compat mode and cuFile's GDS view reported
  raw_tier      gdsload into CUDA tensors vs torch DataLoader(pin_memory) + .cuda(), values checked
  mixed_vs_cpu  the eval transform decoded by DALI "mixed" vs the CPU decode of the same JPEGs:
                FAIL when an image's mean absolute difference exceeds `--tolerance` (0..255 units)
  mixed_busy    the same while another thread keeps the default stream busy with matrix
                products and the consumer reads every batch on a side stream and keeps GPU
                clones (this is where a missing ready event or release fence shows)
A step that raises is a FAIL row with its traceback in the JSON. Exit status 1 on any FAIL.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_table import Report  # noqa: E402

ROW_SHAPE = (3, 224, 224)


def step_data(a) -> tuple:
    from gdsload.convert.engine import ConvertOptions, convert
    from gdsload.sampledata import make_image_folder, make_npy_folder

    work = Path(a.workdir)
    npy, jpg = work / "npy-shards", work / "jpg-shards"
    if not (npy / "manifest.json").exists():
        make_npy_folder(work / "npy", num_samples=a.samples, shape=ROW_SHAPE, dtype="uint8")
        convert(str(work / "npy"), npy, ConvertOptions(shard_size=64_000_000, progress=False, overwrite=True))
    if not (jpg / "manifest.json").exists():
        make_image_folder(work / "jpg", num_images=a.images, num_classes=4, mean_size=(320, 240))
        convert(str(work / "jpg"), jpg, ConvertOptions(shard_size=32_000_000, progress=False, overwrite=True))
    return "PASS", f"{a.samples} rows, {a.images} JPEGs", None, {"npy": str(npy), "jpg": str(jpg)}


def _source_rows(a) -> dict[str, np.ndarray]:
    return {p.stem: p for p in (Path(a.workdir) / "npy").glob("*.npy")}


def step_device_path(a) -> tuple:
    import gdsload

    src = _source_rows(a)
    dl = gdsload.DataLoader(str(Path(a.workdir) / "npy-shards"), batch_size=a.batch_size, device="cuda",
                            num_workers=4, shuffle=True)
    bad, n, on_gpu = [], 0, True
    for b in dl:
        x = b["npy"]
        on_gpu &= bool(getattr(x, "is_cuda", hasattr(x, "__cuda_array_interface__")))
        if n < 3 * a.batch_size:  # check the first batches against the source files
            host = x.cpu().numpy() if hasattr(x, "cpu") else x.get()
            bad += [k for i, k in enumerate(b["__key__"]) if not np.array_equal(host[i], np.load(src[k]))]
        n += len(b["__key__"])
    st = dl.stats()
    dl.close()
    io, ring = str(st.get("io_path")), str(st.get("ring_device"))
    ok = io.startswith("kvikio") and ring.startswith("cuda") and on_gpu and not bad and n == a.samples
    return ("PASS" if ok else "FAIL"), f"io={io} ring={ring}", None, {
        "stats": st, "wrong_keys": bad[:10], "samples": n, "tensors_on_gpu": on_gpu}


def _row_extents(a, limit: int):
    from gdsload.decode.raw import TensorField
    from gdsload.dataset.sharded import ShardedDataset
    from gdsload.format.tar import ALIGN
    from gdsload.io import Extent

    ds = ShardedDataset(str(Path(a.workdir) / "npy-shards"))
    ext = []
    field = None
    for gid in range(min(limit, len(ds))):
        s, j = ds.locate(gid)
        o, n = next((o, n) for e, o, n in ds.index(s).members(j) if e == "npy")
        if field is None:
            field = TensorField.probe("npy", ds.read_extent(s, o, min(n, 2 * ALIGN)))
        off, nb = field.data_extent(ds.index(s).key(j), o, n)
        ext.append(Extent(ds.shard_path(s), off, nb))
    return ext, field.nbytes


def step_kvikio_rows(a) -> tuple:
    import cupy
    import kvikio

    from gdsload.io.kvikio_backend import KvikioBackend, gds_active
    from gdsload.io.posix import PosixBackend

    ext, nb = _row_extents(a, a.samples)
    B = a.batch_size
    dev = cupy.empty(B * nb, dtype=cupy.uint8)
    dev2 = cupy.empty(B * nb, dtype=cupy.uint8)
    pinned = np.frombuffer(cupy.cuda.alloc_pinned_memory(B * nb), np.uint8, B * nb)
    stream = cupy.cuda.Stream(non_blocking=True)
    reads = cupy.cuda.Stream(non_blocking=True)
    kv, kvp, px = KvikioBackend(threads=8), KvikioBackend(threads=8), PosixBackend(threads=8)
    kv.order_on(reads.ptr)  # as the loader reads (its private copy stream)
    dev3 = cupy.empty(B * nb, dtype=cupy.uint8)
    rates: dict[str, list[float]] = {"kvikio": [], "kvikio_pread": [], "posix_h2d": []}
    equal = True
    batches = [ext[i : i + B] for i in range(0, len(ext) - B + 1, B)]

    def kvikio_pass(backend, out) -> float:
        t = time.perf_counter()
        for rows in batches:
            backend.read(rows, out, [i * nb for i in range(len(rows))]).result()
        cupy.cuda.runtime.deviceSynchronize()
        return len(batches) * B * nb / (time.perf_counter() - t) / 1e9

    def posix_pass() -> float:
        t = time.perf_counter()
        for rows in batches:
            px.read(rows, pinned, [i * nb for i in range(len(rows))]).result()
            cupy.cuda.runtime.memcpyAsync(dev2.data.ptr, pinned.ctypes.data, B * nb,
                                          cupy.cuda.runtime.memcpyHostToDevice, stream.ptr)
            stream.synchronize()
        return len(batches) * B * nb / (time.perf_counter() - t) / 1e9

    kvikio_pass(kv, dev), kvikio_pass(kvp, dev3), posix_pass()  # warm-up (page cache hot: rows just written)
    for _ in range(a.rounds):
        rates["kvikio"].append(kvikio_pass(kv, dev))
        rates["kvikio_pread"].append(kvikio_pass(kvp, dev3))
        rates["posix_h2d"].append(posix_pass())
    equal = bool((dev == dev2).all() and (dev3 == dev2).all())  # the last batch, read three ways
    detail = {"row_nbytes": nb, "batch": B, "batches": len(batches), "rates_gbps": rates,
              "kvikio": getattr(kvikio, "__version__", "?"), "gds_threshold": kv.gds_threshold,
              "compat_mode_preferred": bool(kvikio.defaults.is_compat_mode_preferred()),
              "gds_active": gds_active(kvikio), "path_bytes": dict(kv.path_bytes),
              "pread_path_bytes": dict(kvp.path_bytes), "equal": equal}
    kv.close(), kvp.close(), px.close()
    ratio = statistics.median(k / p for k, p in zip(rates["kvikio"], rates["posix_h2d"]))
    figure = f"{statistics.median(rates['kvikio']):.2f} GB/s {kv.name}"
    return ("PASS" if equal else "FAIL"), figure, ratio, detail


def step_raw_tier(a) -> tuple:
    import torch
    import webdataset as wds

    import gdsload

    shards = Path(a.workdir) / "npy-shards"
    tars = sorted(str(p) for p in shards.glob("*.tar"))

    def ours() -> float:
        dl = gdsload.DataLoader(str(shards), batch_size=a.batch_size, device="cuda", num_workers=4)
        t, nbytes = time.perf_counter(), 0
        for b in dl:
            nbytes += b["npy"].numel()
        torch.cuda.synchronize()
        dl.close()
        return nbytes / (time.perf_counter() - t) / 1e9

    def theirs() -> float:
        ds = wds.WebDataset(tars, shardshuffle=False, empty_check=False).decode().to_tuple("npy", "cls")
        dl = torch.utils.data.DataLoader(ds, batch_size=a.batch_size, num_workers=min(8, os.cpu_count() or 8),
                                         pin_memory=True)
        t, nbytes = time.perf_counter(), 0
        for x, _ in dl:
            nbytes += x.cuda(non_blocking=True).numel()
        torch.cuda.synchronize()
        return nbytes / (time.perf_counter() - t) / 1e9

    pairs = [(ours(), theirs()) for _ in range(a.rounds)]
    ratio = statistics.median(o / t for o, t in pairs)
    return "INFO", f"{statistics.median(o for o, _ in pairs):.2f} GB/s into CUDA", ratio, {"gbps": pairs}


def _eval_transform():
    from gdsload.decode.image import ImageTransform

    return ImageTransform(train=False, size=224, resize=256, mean=None, std=None, dtype="uint8", layout="NCHW")


def _decode_all(a, device: str, busy: bool = False) -> tuple[dict, float, dict]:
    import gdsload

    dl = gdsload.DataLoader(str(Path(a.workdir) / "jpg-shards"), batch_size=64, device=device,
                            transform=_eval_transform(), num_workers=4)
    out: dict[str, np.ndarray] = {}
    t = time.perf_counter()
    if device == "cpu":
        for b in dl:
            x = b["jpg"].numpy() if hasattr(b["jpg"], "numpy") else np.asarray(b["jpg"])
            out.update({k: x[i].copy() for i, k in enumerate(b["__key__"])})
    else:
        import torch

        side = torch.cuda.Stream() if busy else None
        kept = []
        with torch.cuda.stream(side) if side is not None else _null():
            for b in dl:  # GPU clones queued on the consumer's stream, read only at the end
                kept.append((list(b["__key__"]), b["jpg"].clone()))
        torch.cuda.synchronize()
        for keys, x in kept:
            host = x.cpu().numpy()
            out.update({k: host[i] for i, k in enumerate(keys)})
    rate = len(out) / (time.perf_counter() - t)
    st = dl.stats()
    dl.close()
    return out, rate, st


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _compare(a, ref: dict, got: dict) -> tuple[str, str, dict]:
    diffs = {k: float(np.abs(got[k].astype(np.int16) - ref[k].astype(np.int16)).mean()) for k in ref if k in got}
    worst = max(diffs.values()) if diffs else float("inf")
    bad = sorted((k for k, d in diffs.items() if d > a.tolerance), key=diffs.get, reverse=True)
    ok = len(diffs) == len(ref) == len(got) and not bad
    return ("PASS" if ok else "FAIL"), f"worst mean|diff| {worst:.2f} (tol {a.tolerance})", {
        "compared": len(diffs), "reference": len(ref), "got": len(got), "over_tolerance": bad[:10],
        "mean_of_means": statistics.fmean(diffs.values()) if diffs else None}


_REFERENCE: dict = {}


def step_mixed_vs_cpu(a) -> tuple:
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        return "SKIP", "DALI not installed (carry it: bench/README.md)", None, {}
    ref, cpu_rate, _ = _decode_all(a, "cpu")
    _REFERENCE["ref"] = ref
    got, gpu_rate, st = _decode_all(a, "cuda")
    status, figure, detail = _compare(a, ref, got)
    if st.get("decode_device") != "mixed" or not str(st.get("ring_device")).startswith("cuda"):
        status = "FAIL"
    return status, figure, gpu_rate / cpu_rate, {**detail, "stats": st, "images_per_s": [cpu_rate, gpu_rate]}


def step_mixed_busy(a) -> tuple:
    if "ref" not in _REFERENCE:
        return "SKIP", "needs mixed_vs_cpu", None, {}
    import torch

    stop = threading.Event()
    products = [0]

    def burn():  # matrix products on this thread's default stream, the legacy one
        x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        while not stop.is_set():
            for _ in range(8):
                x = torch.tanh(x @ x)
            products[0] += 8
            torch.cuda.current_stream().synchronize()  # keep the queue bounded, never empty for long
        torch.cuda.synchronize()

    burner = threading.Thread(target=burn, name="default-stream-burner", daemon=True)
    burner.start()
    try:
        got, rate, st = _decode_all(a, "cuda", busy=True)
    finally:
        stop.set()
        burner.join(timeout=60)
    status, figure, detail = _compare(a, _REFERENCE["ref"], got)
    return status, figure, None, {**detail, "stats": st, "matmuls": products[0], "images_per_s": rate}


STEPS = {"data": step_data, "device_path": step_device_path, "kvikio_rows": step_kvikio_rows,
         "raw_tier": step_raw_tier, "mixed_vs_cpu": step_mixed_vs_cpu, "mixed_busy": step_mixed_busy}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).parent / "results" / "tmp"))
    ap.add_argument("--workdir", default="/tmp/gdsload-gpu")
    ap.add_argument("--samples", type=int, default=2048)
    ap.add_argument("--images", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--tolerance", type=float, default=3.0, help="mean |GPU - CPU| per image, 0..255 units")
    ap.add_argument("--steps", default=",".join(STEPS), help="comma-separated subset of " + ",".join(STEPS))
    a = ap.parse_args(argv)
    report = Report(a.out)
    for name in a.steps.split(","):
        t = time.perf_counter()
        try:
            status, figure, ratio, detail = STEPS[name](a)
        except Exception as exc:
            status, figure, ratio = "FAIL", f"{type(exc).__name__}: {exc}", None
            detail = {"traceback": traceback.format_exc()[-4000:]}
        report.add(name, status, figure, ratio, time.perf_counter() - t, **detail)
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
