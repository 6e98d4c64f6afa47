"""GPU checks and tiers, for an H200 (or any CUDA) host; run through `bench/gpu_check.sh`.

1. doctor: CUDA driver, cuFile, KvikIO's compat mode and whether GDS is really available.
2. KvikIO reads of a shard-sized file into a CuPy buffer vs a plain POSIX read + host-to-device
   copy of the same bytes (interleaved rounds; page cache evicted before each cold read).
3. Raw-tensor tier end to end into CUDA tensors: `gdsload.DataLoader(device="cuda")` (KvikIO into
   the device ring, DLPack to torch) vs `torch.utils.data.DataLoader(num_workers=cores,
   pin_memory=True)` over webdataset `.npy` + `.cuda(non_blocking=True)`. Checks values.
4. The ring in device memory: no host round trip for raw tensors (ring device, I/O path, output
   device all reported).
5. DALI "mixed" decode (tier T) when DALI imports.

Prints a short table and writes JSON to $OUT (or bench/results/). Sized to finish in a few
minutes on an H200 host: `--samples` raw tensors of 3x224x224 uint8, `--images` JPEGs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np


def _fadvise_dontneed(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def kvikio_vs_posix(path: str, rounds: int) -> dict:
    import cupy
    import kvikio
    import kvikio.defaults

    size = os.path.getsize(path)
    dev = cupy.empty(size, dtype=cupy.uint8)
    host = np.empty(size, dtype=np.uint8)
    out: dict = {"bytes": size, "kvikio_gbps": [], "posix_h2d_gbps": []}
    try:
        out["compat_mode_preferred"] = bool(kvikio.defaults.is_compat_mode_preferred())
    except Exception as exc:  # older/newer API
        out["compat_mode_preferred"] = f"unknown ({exc})"
    try:
        import kvikio.cufile_driver

        out["gds_available"] = bool(kvikio.cufile_driver.get("is_gds_available"))
    except Exception as exc:
        out["gds_available"] = f"unknown ({exc})"
    for _ in range(rounds):
        _fadvise_dontneed(path)
        t = time.perf_counter()
        with kvikio.CuFile(path, "r") as f:
            n = f.pread(dev).get()
        cupy.cuda.runtime.deviceSynchronize()
        out["kvikio_gbps"].append(n / (time.perf_counter() - t) / 1e9)
        _fadvise_dontneed(path)
        t = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            f.readinto(memoryview(host))
        dev2 = cupy.asarray(host)
        cupy.cuda.runtime.deviceSynchronize()
        out["posix_h2d_gbps"].append(size / (time.perf_counter() - t) / 1e9)
        del dev2
    out["equal"] = bool((dev[: 1 << 20].get() == host[: 1 << 20]).all())
    out["ratio_median"] = statistics.median(a / b for a, b in zip(out["kvikio_gbps"], out["posix_h2d_gbps"]))
    return out


def raw_tier(shards: str, rounds: int, batch: int, workers: int) -> dict:
    import torch
    import webdataset as wds

    import gdsload

    m = json.loads((Path(shards) / "manifest.json").read_text())
    tars = [str(Path(shards) / s["name"]) for s in m["shards"]]
    res: dict = {"gdsload_gbps": [], "torch_gbps": [], "samples": m["num_samples"]}

    def ours() -> tuple[float, dict]:
        dl = gdsload.DataLoader(shards, batch_size=batch, device="cuda", num_workers=workers)
        t = time.perf_counter()
        nbytes = 0
        first = None
        for b in dl:
            x = b["npy"]
            if first is None:
                first = {"is_cuda": bool(x.is_cuda), "dtype": str(x.dtype), "shape": list(x.shape)}
            nbytes += x.numel() * x.element_size()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        st = dl.stats()
        info = {"io_path": st.get("io_path"), "ring_device": dl._ring.device, "first_batch": first,
                "wait_fraction": st.get("wait_fraction")}
        dl.close()
        return nbytes / dt / 1e9, info

    def baseline() -> float:
        ds = wds.WebDataset(tars, shardshuffle=False, empty_check=False).decode().to_tuple("npy", "cls")
        dl = torch.utils.data.DataLoader(ds, batch_size=batch, num_workers=workers, pin_memory=True)
        t = time.perf_counter()
        nbytes = 0
        for x, _ in dl:
            x = x.cuda(non_blocking=True)
            nbytes += x.numel() * x.element_size()
        torch.cuda.synchronize()
        return nbytes / (time.perf_counter() - t) / 1e9

    ours()  # warm-up
    baseline()
    for _ in range(rounds):
        g, info = ours()
        res["gdsload_gbps"].append(g)
        res["torch_gbps"].append(baseline())
    res["info"] = info
    res["ratio_median"] = statistics.median(a / b for a, b in zip(res["gdsload_gbps"], res["torch_gbps"]))
    # values: the first sample through the loader equals np.load of the shard bytes
    dl = gdsload.DataLoader(shards, batch_size=4, device="cuda")
    b = next(iter(dl))
    ds = gdsload.open_dataset(shards)
    import io

    ref = np.load(io.BytesIO(ds.sample(0)["npy"]))
    res["values_equal"] = bool((b["npy"][0].cpu().numpy() == ref).all())
    dl.close()
    return res


def dali_mixed(shards: str, rounds: int, batch: int) -> dict:
    import torch

    import gdsload

    rates = []
    for _ in range(rounds + 1):
        dl = gdsload.DataLoader(shards, batch_size=batch, device="cuda", num_workers=4)
        t = time.perf_counter()
        n = 0
        for b in dl:
            n += len(b["__key__"])
        torch.cuda.synchronize()
        rates.append(n / (time.perf_counter() - t))
        st = dl.stats()
        dl.close()
    return {"images_per_s": statistics.median(rates[1:]), "decode_device": st.get("decode_device"),
            "io_path": st.get("io_path")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="/tmp/gdsload-gpu")
    ap.add_argument("--samples", type=int, default=8000)
    ap.add_argument("--images", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=256)
    a = ap.parse_args()
    from gdsload import doctor

    report: dict = {"machine": {"node": platform.node(), "cpus": os.cpu_count()}, "doctor": doctor.collect()}
    if not report["doctor"].get("gpu_available"):
        print("no CUDA device on this host: nothing to measure (run this on a GPU host)")
        return 2
    from gdsload.convert.engine import ConvertOptions, convert
    from gdsload.sampledata import make_image_folder, make_npy_folder

    work = Path(a.workdir)
    npy = work / "npy-shards"
    if not (npy / "manifest.json").exists():
        make_npy_folder(work / "npy", num_samples=a.samples, shape=(3, 224, 224), dtype="uint8")
        convert(str(work / "npy"), npy, ConvertOptions(shard_size=256_000_000, progress=False, overwrite=True))
    steps = {
        "kvikio_read": lambda: kvikio_vs_posix(str(npy / json.loads((npy / "manifest.json").read_text())
                                                   ["shards"][0]["name"]), a.rounds),
        "raw_tier_cuda": lambda: raw_tier(str(npy), a.rounds, a.batch_size, os.cpu_count() or 8),
    }
    try:
        import nvidia.dali  # noqa: F401

        def dali_step() -> dict:
            jpg = work / "jpg-shards"
            if not (jpg / "manifest.json").exists():
                make_image_folder(work / "jpg", num_images=a.images, num_classes=10)
                convert(str(work / "jpg"), jpg, ConvertOptions(shard_size=128_000_000, progress=False, overwrite=True))
            return dali_mixed(str(jpg), a.rounds, a.batch_size)

        steps["dali_mixed_T"] = dali_step
    except ImportError:
        report["dali_mixed_T"] = {"skipped": "DALI is not installed on this host"}
    for name, fn in steps.items():
        t = time.perf_counter()
        try:
            report[name] = fn()
        except Exception as exc:
            report[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
        report[name]["seconds"] = round(time.perf_counter() - t, 1)
        print(f"{name}: done in {report[name]['seconds']} s", file=sys.stderr)

    d = report["doctor"]
    print(f"host: {d.get('cuda', {}).get('devices')}  io_path={d.get('io_path')}  decode={d.get('decode_device')}")
    k = report.get("kvikio_read", {})
    if "kvikio_gbps" in k:
        print(f"KvikIO cold read into CuPy: {statistics.median(k['kvikio_gbps']):.2f} GB/s vs POSIX+H2D "
              f"{statistics.median(k['posix_h2d_gbps']):.2f} GB/s (ratio {k['ratio_median']:.2f}); "
              f"compat_mode_preferred={k['compat_mode_preferred']} gds_available={k['gds_available']}")
    r = report.get("raw_tier_cuda", {})
    if "gdsload_gbps" in r:
        print(f"raw tier into CUDA tensors: gdsload {statistics.median(r['gdsload_gbps']):.2f} GB/s vs torch "
              f"DataLoader pin_memory+cuda {statistics.median(r['torch_gbps']):.2f} GB/s (ratio "
              f"{r['ratio_median']:.2f}); {r['info']}; values_equal={r['values_equal']}")
    dm = report.get("dali_mixed_T", {})
    if "images_per_s" in dm:
        print(f"DALI mixed decode, tier T: {dm['images_per_s']:.0f} images/s ({dm['decode_device']}, {dm['io_path']})")
    for name in steps:
        if "error" in report[name]:
            print(f"{name}: ERROR {report[name]['error']}")
    out = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu-check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
