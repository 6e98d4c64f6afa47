"""GPU checks and measurements, one table row each; run through `bench/gpu_check.sh`.

Steps (each appends a row to `OUT/gpu-check.json` as soon as it ends; see bench/gpu_table.py). A
row says where its figure was measured (`on`: what the step observed: the loader's io path, ring
device and decode device, the pipeline's output kind) and where the plan expects it (`expect`);
the verdict FAILs a CPU figure in a GPU row.
  nvdec         this GPU's NVDEC capabilities (`gdsload.host.gpu.nvdec_caps`: libnvcuvid's
                cuvidGetDecoderCaps per codec and bit depth, 4:2:0), and the route each of the media
                check's clips will take (NVDEC or the CPU path); needs no DALI (part 1)
  data_npy      a raw-tensor dataset (uint8[3, 224, 224] rows, 150,528 bytes), before anything
                touches CUDA (conversion forks worker processes); part 1's steps use only this
  data_jpg      a JPEG dataset, for part 2's steps (`data` makes both)
  device_path   `DataLoader(device="cuda")` over the tensors: FAIL unless `stats()["io_path"]`
                is a KvikIO path and `ring_device` is a GPU, or if a value differs from the source;
                the figure says how KvikIO ran the reads (`io_read_modes`: cufile-async, pread)
  kvikio_rows   per-row reads as the loader issues them (one read per row into a device batch
                buffer at row offsets) vs POSIX into pinned memory + one host-to-device copy per
                batch, and vs one `pread` per row in a backend with no stream; KvikIO's
                gds_threshold, compat mode, cuFile's GDS view and the read modes reported. FAIL
                unless the three agree byte for byte and device reads were made
  raw_tier      gdsload into CUDA tensors vs torch DataLoader(pin_memory) + .cuda(): the first
                batches checked against the source files, the io path checked; the pinned
                host-to-device copy bandwidth of the same GPU reported beside it
  ring_safety   the tensors again while another thread keeps the legacy stream busy with matrix
                products and the consumer reads on a side stream and keeps GPU clones: every row
                equal to its source, and the burner proven to have run during the epoch
  dali_import   `import nvidia.dali` and one JPEG through a decode -> resize -> crop_mirror_normalize
                pipeline on `--dali-device` ("mixed"): DALI's CUDA libraries load and run
  mixed_vs_cpu  the eval transform decoded by DALI "mixed" vs the CPU decode of the same JPEGs:
                FAIL when an image's mean absolute difference exceeds `--tolerance` (0..255 units;
                nvJPEG and libjpeg-turbo round differently, so this is a tolerance, not equality)
  mixed_busy    the same with the legacy stream busy and a side-stream consumer: bit for bit equal
                to mixed_vs_cpu's GPU output (the eval transform is deterministic), within the
                tolerance of the CPU decode, and the burner proven to have run
  dali_pipeline DALI's own pipeline (`fn.readers.file` -> `decoders.image` "mixed" -> resize ->
                crop_mirror_normalize, the same eval transform, batch and threads) vs gdsload's
                "mixed" loader over the same JPEGs, images/s each after a warm-up pass: the
                decoded tier's baseline (ratio: gdsload / DALI)
  resnet50      a ResNet-50 training step (bf16 autocast, SGD) fed by gdsload "mixed" decoding:
                img/s and data stall (time in next() / step time), vs the same steps on a
                torch DataLoader over the same JPEGs (PIL decode, 16 workers)
DALI steps SKIP only when DALI was not carried (no GDSLOAD_DALI_CARRIED=1, which gpu_check.sh
--part 2 sets); a carried DALI that does not import is a FAIL. A step that raises is a FAIL row
with its traceback in the JSON. Exit status 1 on any FAIL.
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


def step_data_npy(a) -> tuple:
    from gdsload.convert.engine import ConvertOptions, convert
    from gdsload.sampledata import make_npy_folder

    work = Path(a.workdir)
    npy = work / "npy-shards"
    if not (npy / "manifest.json").exists():
        make_npy_folder(work / "npy", num_samples=a.samples, shape=ROW_SHAPE, dtype="uint8")
        convert(str(work / "npy"), npy, ConvertOptions(shard_size=64_000_000, progress=False, overwrite=True))
    return "PASS", f"{a.samples} rows", None, {"npy": str(npy)}


def step_data_jpg(a) -> tuple:
    from gdsload.convert.engine import ConvertOptions, convert
    from gdsload.sampledata import make_image_folder

    work = Path(a.workdir)
    jpg = work / "jpg-shards"
    if not (jpg / "manifest.json").exists():
        make_image_folder(work / "jpg", num_images=a.images, num_classes=4, mean_size=(320, 240))
        convert(str(work / "jpg"), jpg, ConvertOptions(shard_size=32_000_000, progress=False, overwrite=True))
    return "PASS", f"{a.images} JPEGs", None, {"jpg": str(jpg)}


def step_data(a) -> tuple:
    """Both datasets (a single run of every step)."""
    step_data_npy(a)
    step_data_jpg(a)
    return "PASS", f"{a.samples} rows, {a.images} JPEGs", None, {}


def _where(ok: bool) -> str:
    return "gpu" if ok else "cpu"


def step_nvdec(a) -> tuple:
    """NVDEC's capabilities and the media check's routes (module docstring); INFO either way: the
    hardware's answer, which part 2's video rows must then follow."""
    import ast

    from gdsload.host import gpu

    caps = gpu.nvdec_caps(a.device_id)
    consts = {}
    src = (Path(__file__).resolve().parent / "media_gpu_check.py").read_text()
    for node in ast.parse(src).body:  # the clips' codecs and size, without importing the check
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], (ast.Name, ast.Tuple)):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                continue
            t = node.targets[0]
            consts.update(zip([e.id for e in t.elts], value) if isinstance(t, ast.Tuple) else [(t.id, value)])
    routes = {c: gpu.nvdec_route(caps, c, 8, consts["W"], consts["H"]) or "nvdec" for c in consts["CODECS"]}
    return "INFO", gpu.nvdec_summary(caps), None, {"caps": caps, "media_routes": routes,
                                                     "on": _where(caps["available"])}
def _source_rows(a) -> dict[str, np.ndarray]:
    return {p.stem: p for p in (Path(a.workdir) / "npy").glob("*.npy")}


def _modes(st: dict) -> str:
    modes = st.get("io_read_modes") or {}
    return ",".join(f"{k}={v}" for k, v in sorted(modes.items())) or "no KvikIO reads"


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
    return ("PASS" if ok else "FAIL"), f"io={io} ring={ring} {_modes(st)}", None, {
        "stats": st, "wrong_keys": bad[:10], "samples": n, "tensors_on_gpu": on_gpu,
        "on": _where(ring.startswith("cuda") and on_gpu), "expect": "gpu"}


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
    dev_id = int(cupy.cuda.runtime.getDevice())  # issuing threads bind this device's context (audit 3 C1)
    kv, kvp = KvikioBackend(threads=8, device_id=dev_id), KvikioBackend(threads=8, device_id=dev_id)
    px = PosixBackend(threads=8)
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
              "pread_path_bytes": dict(kvp.path_bytes), "equal": equal, "read_modes": dict(kv.read_modes),
              "pread_read_modes": dict(kvp.read_modes)}
    kv.close(), kvp.close(), px.close()
    ratio = statistics.median(k / p for k, p in zip(rates["kvikio"], rates["posix_h2d"]))
    modes = ",".join(f"{k}={v}" for k, v in sorted(kv.read_modes.items()))
    figure = f"{statistics.median(rates['kvikio']):.2f} GB/s {modes}"
    exercised = any(k.startswith(("kvikio-gds/", "kvikio-compat/")) for k in kv.read_modes)
    return ("PASS" if equal and exercised else "FAIL"), figure, ratio, {**detail, "on": _where(exercised),
                                                                         "expect": "gpu"}


def _h2d_gbps(nbytes: int, rounds: int = 3) -> float:
    """Pinned host-to-device copy bandwidth of this GPU (one buffer of `nbytes`, best of rounds)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    best = 0.0
    for _ in range(rounds):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = max(best, nbytes / (time.perf_counter() - t) / 1e9)
    return best


def step_raw_tier(a) -> tuple:
    import torch
    import webdataset as wds

    import gdsload

    shards = Path(a.workdir) / "npy-shards"
    tars = sorted(str(p) for p in shards.glob("*.tar"))
    src = _source_rows(a)
    checked: dict = {"bad": [], "rows": 0}
    stats: dict = {}

    def ours() -> tuple[float, float]:
        dl = gdsload.DataLoader(str(shards), batch_size=a.batch_size, device="cuda", num_workers=4)
        c0, t, nbytes, i = time.process_time(), time.perf_counter(), 0, 0
        for b in dl:
            x = b["npy"]
            if i < 2:  # values: the first batches against the source files (outside no clock: cheap)
                host = x.cpu().numpy()
                checked["bad"] += [k for j, k in enumerate(b["__key__"]) if not np.array_equal(host[j], np.load(src[k]))]
                checked["rows"] += len(b["__key__"])
                checked["on_gpu"] = bool(x.is_cuda)
            nbytes += x.numel()
            i += 1
        torch.cuda.synchronize()
        el, cpu = time.perf_counter() - t, time.process_time() - c0
        stats.update(dl.stats())
        dl.close()
        return nbytes / el / 1e9, cpu / (nbytes / 1e9)

    def theirs() -> tuple[float, float]:
        ds = wds.WebDataset(tars, shardshuffle=False, empty_check=False).decode().to_tuple("npy", "cls")
        dl = torch.utils.data.DataLoader(ds, batch_size=a.batch_size, num_workers=min(16, os.cpu_count() or 16),
                                         pin_memory=True)
        c0, t, nbytes = time.process_time(), time.perf_counter(), 0
        for x, _ in dl:
            nbytes += x.cuda(non_blocking=True).numel()
        torch.cuda.synchronize()
        el, cpu = time.perf_counter() - t, time.process_time() - c0  # the main process's CPU only
        return nbytes / el / 1e9, cpu / (nbytes / 1e9)

    pairs = [(ours(), theirs()) for _ in range(a.rounds)]
    ratio = statistics.median(o[0] / t[0] for o, t in pairs)
    h2d = _h2d_gbps(a.batch_size * int(np.prod(ROW_SHAPE)))
    gbps = statistics.median(o[0] for o, _ in pairs)
    io, ring = str(stats.get("io_path")), str(stats.get("ring_device"))
    ok = (not checked["bad"] and checked["rows"] > 0 and checked.get("on_gpu") and io.startswith("kvikio")
          and ring.startswith("cuda"))
    return ("INFO" if ok else "FAIL"), f"{gbps:.2f} GB/s {io}, {gbps / h2d:.2f}x pinned H2D", ratio, {
        "gbps": [[o[0], t[0]] for o, t in pairs], "cpu_s_per_gb": [[o[1], t[1]] for o, t in pairs],
        "pinned_h2d_gbps": h2d, "rows_checked": checked["rows"], "wrong_keys": checked["bad"][:10],
        "io_read_modes": stats.get("io_read_modes"), "io_path": io, "ring_device": ring,
        "on": _where(io.startswith("kvikio") and ring.startswith("cuda") and bool(checked.get("on_gpu"))),
        "expect": "gpu"}


class _Burner:
    """Matrix products on the legacy default stream from another thread, for as long as the block
    runs; `proof()` says whether they really ran while the consumer read (audit 3 E3)."""

    def __init__(self, size: int):
        self.size, self.products, self.error = size, 0, None
        self.stop = threading.Event()
        self.seen: list[int] = []  # products done when the consumer saw its first and last batch

    def _run(self):
        import torch

        try:
            x = torch.randn(self.size, self.size, device="cuda", dtype=torch.bfloat16)
            while not self.stop.is_set():
                for _ in range(8):
                    x = torch.tanh(x @ x)
                torch.cuda.current_stream().synchronize()  # bounded queue, never empty for long
                self.products += 8
            torch.cuda.synchronize()
        except BaseException as exc:  # noqa: BLE001 - an OOM here must not pass as a busy run
            self.error = f"{type(exc).__name__}: {exc}"

    def __enter__(self):
        self.thread = threading.Thread(target=self._run, name="default-stream-burner", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while self.products == 0 and self.error is None and time.monotonic() < deadline:
            time.sleep(0.01)  # the first products done: the GPU is busy before the first batch
        return self

    def mark(self):
        self.seen.append(self.products if self.thread.is_alive() else -1)

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(timeout=60)

    def proof(self) -> tuple[bool, dict]:
        # alive (-1: dead) and with products done at the first and at the last batch, and still
        # producing after the first one
        ok = (self.error is None and bool(self.seen) and min(self.seen) > 0 and self.products > self.seen[0])
        return ok, {"burner_products": self.products, "burner_at_first_last_batch": self.seen[:1] + self.seen[-1:],
                    "burner_error": self.error}


def step_ring_safety(a) -> tuple:
    import torch

    import gdsload

    src = _source_rows(a)
    dl = gdsload.DataLoader(str(Path(a.workdir) / "npy-shards"), batch_size=a.batch_size, device="cuda",
                            num_workers=4, shuffle=True)
    kept = []
    side = torch.cuda.Stream()
    with _Burner(a.burn_size) as burner, torch.cuda.stream(side):
        for b in dl:
            burner.mark()
            kept.append((list(b["__key__"]), b["npy"].clone()))  # on the side stream, read at the end
    torch.cuda.synchronize()
    bad, n = [], 0
    for keys, x in kept:
        host = x.cpu().numpy()
        bad += [k for i, k in enumerate(keys) if not np.array_equal(host[i], np.load(src[k]))]
        n += len(keys)
    busy, proof = burner.proof()
    st = dl.stats()
    dl.close()
    ok = busy and not bad and n == a.samples
    return ("PASS" if ok else "FAIL"), f"{n - len(bad)}/{a.samples} rows equal, {_modes(st)}", None, {
        **proof, "wrong_keys": bad[:10], "rows": n, "stats": st,
        "on": _where(str(st.get("ring_device")).startswith("cuda")), "expect": "gpu"}


def _eval_transform():
    from gdsload.decode.image import ImageTransform

    return ImageTransform(train=False, size=224, resize=256, mean=None, std=None, dtype="uint8", layout="NCHW")


def _decode_all(a, device: str, busy: bool = False, burner=None) -> tuple[dict, float, dict]:
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
                if burner is not None:
                    burner.mark()
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


def _dali() -> tuple | None:
    """None when DALI imports; else the row: SKIP when it was not carried, FAIL when it was."""
    try:
        import nvidia.dali  # noqa: F401
    except Exception as exc:  # a carried DALI missing gast/astunparse/makefun: ModuleNotFoundError
        if os.environ.get("GDSLOAD_DALI_CARRIED") == "1":
            return "FAIL", f"DALI carried but does not import: {type(exc).__name__}: {exc}", None, {
                "traceback": traceback.format_exc()[-4000:]}
        return "SKIP", "DALI NOT EXERCISED: not carried (gpu_check.sh --part 2)", None, {}
    return None


def step_mixed_vs_cpu(a) -> tuple:
    if (row := _dali()) is not None:
        return row
    ref, cpu_rate, _ = _decode_all(a, "cpu")
    _REFERENCE["ref"] = ref
    got, gpu_rate, st = _decode_all(a, "cuda")
    _REFERENCE["gpu"] = got
    status, figure, detail = _compare(a, ref, got)
    on_gpu = st.get("decode_device") == "mixed" and str(st.get("ring_device")).startswith("cuda")
    if not on_gpu:
        status = "FAIL"
    return status, f"{gpu_rate:.0f} img/s mixed vs {cpu_rate:.0f} cpu, {figure}", gpu_rate / cpu_rate, {
        **detail, "stats": st, "images_per_s": [cpu_rate, gpu_rate], "on": _where(on_gpu), "expect": "gpu"}


def step_mixed_busy(a) -> tuple:
    if (row := _dali()) is not None:
        return row
    if "gpu" not in _REFERENCE:
        return "FAIL", "NOT EXERCISED: needs mixed_vs_cpu's output first", None, {}
    with _Burner(a.burn_size) as burner:
        got, rate, st = _decode_all(a, "cuda", busy=True, burner=burner)
    busy, proof = burner.proof()
    status, figure, detail = _compare(a, _REFERENCE["ref"], got)
    idle = _REFERENCE["gpu"]
    differ = sorted(k for k in idle if k not in got or not np.array_equal(got[k], idle[k]))
    if differ or not busy or len(got) != len(idle):
        status = "FAIL"
    figure = f"{len(idle) - len(differ)}/{len(idle)} bit-equal to idle; {figure}"
    on_gpu = st.get("decode_device") == "mixed" and str(st.get("ring_device")).startswith("cuda")
    return status, figure, None, {**detail, **proof, "differ_from_idle": differ[:10], "stats": st,
                                  "images_per_s": rate, "on": _where(on_gpu), "expect": "gpu"}


def _one_jpeg() -> np.ndarray:
    import io

    from PIL import Image

    y, x = np.mgrid[0:240, 0:320]
    rgb = np.stack([x * 255 // 319, y * 255 // 239, (x + y) * 255 // 558], -1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "JPEG", quality=90)
    return np.frombuffer(buf.getvalue(), np.uint8)


def step_dali_import(a) -> tuple:
    """DALI imports, and one JPEG goes through decode -> resize -> crop_mirror_normalize on
    `--dali-device`: DALI loads the CUDA libraries it links dynamically (nvJPEG, NPP, cuFFT ...)
    only when such a pipeline runs, so an import alone proves little (audit 4 R7)."""
    if (row := _dali()) is not None:
        return row
    import nvidia.dali as dali
    from nvidia.dali import fn, pipeline_def, types

    mixed = a.dali_device == "mixed"
    if mixed:
        import torch

        if not torch.cuda.is_available():
            return "FAIL", "torch.cuda.is_available() is False", None, {"on": "cpu", "expect": "gpu"}

    @pipeline_def(batch_size=1, num_threads=1, device_id=a.device_id if mixed else None)
    def smoke():
        enc = fn.external_source(name="enc", dtype=types.UINT8, ndim=1)
        img = fn.decoders.image(enc, device=a.dali_device, output_type=types.RGB)
        img = fn.resize(img, resize_shorter=64)
        return fn.crop_mirror_normalize(img, crop=(48, 48), dtype=types.FLOAT, output_layout="CHW",
                                        mean=[128.0] * 3, std=[64.0] * 3)

    p = smoke()
    p.build()
    p.feed_input("enc", [_one_jpeg()])
    (out,) = p.run()
    on_gpu = type(out).__name__ == "TensorListGPU"
    x = np.array(out.as_cpu()[0] if on_gpu else out[0])
    ok = x.shape == (3, 48, 48) and bool(np.isfinite(x).all()) and float(x.std()) > 0.1
    return ("PASS" if ok else "FAIL"), f"dali {dali.__version__}: a JPEG through decode, resize, " \
        f"crop_mirror_normalize on {a.dali_device} -> {x.shape}", None, {"on": _where(on_gpu), "expect": "gpu"}


def step_dali_pipeline(a) -> tuple:
    """DALI's own pipeline against gdsload's mixed loader (module docstring)."""
    if (row := _dali()) is not None:
        return row
    import gdsload
    from nvidia.dali import fn, pipeline_def, types

    batch, threads = 64, 4
    mixed = a.dali_device == "mixed"

    @pipeline_def(batch_size=batch, num_threads=threads, device_id=a.device_id if mixed else None)
    def own():
        jpegs, labels = fn.readers.file(file_root=str(Path(a.workdir) / "jpg"), name="r")
        img = fn.decoders.image(jpegs, device=a.dali_device, output_type=types.RGB)
        img = fn.resize(img, resize_shorter=256)
        return fn.crop_mirror_normalize(img, crop=(224, 224), dtype=types.UINT8, output_layout="CHW"), labels

    p = own()
    p.build()
    iters = -(-int(p.epoch_size("r")) // batch)
    kinds = set()

    def dali_pass() -> None:
        for _ in range(iters):
            img, _ = p.run()
            kinds.add(type(img).__name__)
        if mixed:
            import torch

            torch.cuda.synchronize()

    dali_pass()  # warm-up: nvJPEG's buffers, the first batches
    t = time.perf_counter()
    for _ in range(a.rounds):
        dali_pass()
    dali_rate = a.rounds * iters * batch / (time.perf_counter() - t)
    dl = gdsload.DataLoader(str(Path(a.workdir) / "jpg-shards"), batch_size=batch, transform=_eval_transform(),
                            device="cuda" if mixed else "cpu", num_workers=threads)

    def ours_pass() -> int:
        n = 0
        for b in dl:
            n += len(b["__key__"])
        if mixed:
            import torch

            torch.cuda.synchronize()
        return n

    ours_pass()
    t = time.perf_counter()
    n = sum(ours_pass() for _ in range(a.rounds))
    ours_rate = n / (time.perf_counter() - t)
    st = dl.stats()
    dl.close()
    on_gpu = kinds == {"TensorListGPU"} and st.get("decode_device") == "mixed"
    return "INFO", f"gdsload {ours_rate:.0f} img/s vs DALI's own pipeline {dali_rate:.0f} ({a.dali_device})", \
        ours_rate / dali_rate, {"images_per_s": {"gdsload": ours_rate, "dali": dali_rate}, "batch": batch,
                                "threads": threads, "stats": st, "on": _where(on_gpu), "expect": "gpu"}


def step_resnet50(a) -> tuple:
    """Data stall of a training step fed by gdsload (mixed decode) vs torch's DataLoader."""
    if (row := _dali()) is not None:
        return row
    import torch

    import gdsload
    from gdsload.decode.image import ImageTransform

    model = _model(a.model).cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()

    def train(batches) -> dict:
        it = iter(batches)
        wait = step = 0.0
        n = steps = 0
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        while steps < a.train_steps:
            t = time.perf_counter()
            try:
                x, y = next(it)
            except StopIteration:
                it = iter(batches)
                continue
            torch.cuda.synchronize()  # the batch is on the GPU: the wait is data, not compute
            t1 = time.perf_counter()
            wait += t1 - t
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = loss_fn(model(x.cuda(non_blocking=True).float().contiguous(memory_format=torch.channels_last)),
                               y.cuda(non_blocking=True).long() % 1000)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            torch.cuda.synchronize()
            step += time.perf_counter() - t1
            n += len(y)
            steps += 1
        el = time.perf_counter() - t0
        return {"images_per_s": n / el, "stall": wait / el, "steps": steps, "compute_s": step}

    tf = ImageTransform(train=True, size=a.image_size, dtype="float16", layout="NCHW")  # ImageNet mean/std
    dl = gdsload.DataLoader(str(Path(a.workdir) / "jpg-shards"), batch_size=a.train_batch, device="cuda",
                            transform=tf, num_workers=4, fields=["jpg", "cls"])
    ours = train(dl)
    st = dl.stats()
    dl.close()
    theirs = train(_torch_jpeg_loader(a)) if a.baseline == "torch" else None
    ok = ours["steps"] == a.train_steps and st.get("decode_device") == "mixed"
    ratio = ours["images_per_s"] / theirs["images_per_s"] if theirs else None
    return ("INFO" if ok else "FAIL"), f"stall {ours['stall']:.1%}, {ours['images_per_s']:.0f} img/s", \
        ratio, {"gdsload": ours, "torch": theirs, "stats": st,
                "on": _where(st.get("decode_device") == "mixed"), "expect": "gpu"}


def _model(name: str):
    import torch

    if name == "tiny":  # the CPU tests: the same loop, no torchvision
        return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, stride=4), torch.nn.AdaptiveAvgPool2d(1),
                                   torch.nn.Flatten(), torch.nn.Linear(8, 1000))
    import torchvision

    return torchvision.models.resnet50()


def _torch_jpeg_loader(a):
    """torch DataLoader over the same JPEG folder: PIL decode, random resized crop, 16 workers."""
    import torch

    files = sorted((Path(a.workdir) / "jpg").rglob("*.jpg"))
    classes = sorted({p.parent.name for p in files})

    class Jpegs(torch.utils.data.Dataset):
        def __len__(self):
            return len(files)

        def __getitem__(self, i):
            from PIL import Image

            img = Image.open(files[i]).convert("RGB").resize((a.image_size, a.image_size))
            x = torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1)
            return x, classes.index(files[i].parent.name)

    return torch.utils.data.DataLoader(Jpegs(), batch_size=a.train_batch, shuffle=True,
                                       num_workers=min(16, os.cpu_count() or 16), pin_memory=True,
                                       persistent_workers=True)


STEPS = {"nvdec": step_nvdec, "data": step_data, "data_npy": step_data_npy, "data_jpg": step_data_jpg,
         "device_path": step_device_path, "kvikio_rows": step_kvikio_rows, "raw_tier": step_raw_tier,
         "ring_safety": step_ring_safety, "dali_import": step_dali_import, "mixed_vs_cpu": step_mixed_vs_cpu,
         "mixed_busy": step_mixed_busy, "dali_pipeline": step_dali_pipeline, "resnet50": step_resnet50}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).parent / "results" / "tmp"))
    ap.add_argument("--workdir", default="/tmp/gdsload-gpu")
    ap.add_argument("--samples", type=int, default=2048)
    ap.add_argument("--images", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--tolerance", type=float, default=3.0, help="mean |GPU - CPU| per image, 0..255 units")
    ap.add_argument("--burn-size", type=int, default=8192, help="matrix size of the busy-GPU burner")
    ap.add_argument("--model", default="resnet50", choices=["resnet50", "tiny"])
    ap.add_argument("--train-steps", type=int, default=40)
    ap.add_argument("--train-batch", type=int, default=128)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--baseline", default="torch", choices=["torch", "none"], help="resnet50's comparison")
    ap.add_argument("--dali-device", default="mixed", choices=["mixed", "cpu"],
                    help="DALI's own pipelines (dali_import, dali_pipeline); cpu on a CPU host (tests)")
    ap.add_argument("--device-id", type=int, default=0)
    ap.add_argument("--steps", default=",".join(STEPS), help="comma-separated subset of " + ",".join(STEPS))
    a = ap.parse_args(argv)
    unknown = [n for n in a.steps.split(",") if n not in STEPS]
    if unknown:
        ap.error(f"unknown steps {unknown}; known: {','.join(STEPS)}")
    report = Report(a.out)
    for name in a.steps.split(","):
        t = time.perf_counter()
        try:
            status, figure, ratio, detail = STEPS[name](a)
        except Exception as exc:
            status, figure, ratio = "FAIL", f"{type(exc).__name__}: {exc}", None
            detail = {"traceback": traceback.format_exc()[-4000:]}
        on, expect = detail.pop("on", ""), detail.pop("expect", "")
        report.add(name, status, figure, ratio, time.perf_counter() - t, on=on, expect=expect, **detail)
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
