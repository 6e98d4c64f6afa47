"""The GPU path on the CPU, one test (or more) per item of the GPU audits
(../shared/reviews/gpu_audit.md, gpu_audit_2.md), against the fakes in tests/gpu_fakes.py: a fake
`cupy`/`kvikio`/torch-CUDA surface with per-thread current devices, deferred stream work and
recorded stream/event calls, and DALI's "mixed" output emulated over a real DALI CPU pipeline.

What the fakes cannot show (real cuFile/GDS, nvJPEG, real stream races, the wheels importing on
CUDA 13) is left to the `gpu`/`gds`/`dali_gpu` tests at the end and to bench/gpu_check.sh.
"""

from __future__ import annotations

import ctypes
import itertools
import shutil
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

import gpu_fakes
from npykit import convert_folder, npy_dataset
from gdsload.errors import GdsloadError, MissingDependencyError
from gdsload.dataset.sharded import ShardedDataset
from gdsload.loader.dataloader import DataLoader
from gdsload.sampledata import make_image_folder

EVAL = dict(train=False, size=32, resize=36, mean=None, std=None, dtype="uint8", layout="NHWC")


# -- datasets --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def npy(tmp_path_factory):
    """24 uint8[4, 32, 32] rows (4 KiB: below KvikIO's 16 KiB gds_threshold) with labels. (4 KiB
    rows have page-aligned array data, so no producer parses an npy header: numpy's header
    parser (`ast.literal_eval`) can raise SystemError when threads run it at once on CPython
    3.11, a problem outside this file.)"""
    root = tmp_path_factory.mktemp("gpu_npy")
    ds = npy_dataset(root / "src", root / "ds", num_samples=24, shape=(4, 32, 32), dtype="uint8", seed=3,
                     shard_size=40_000)
    arrays = {p.stem: np.load(p) for p in (root / "src").glob("*.npy")}
    import csv

    with open(root / "src" / "labels.csv") as f:
        labels = {r["key"]: int(r["label"]) for r in csv.DictReader(f)}
    return ds, arrays, labels


@pytest.fixture(scope="module")
def npy_big(tmp_path_factory):
    """8 uint8[4, 64, 64] rows: 16 KiB each, exactly KvikIO's default gds_threshold."""
    root = tmp_path_factory.mktemp("gpu_npy_big")
    return npy_dataset(root / "src", root / "ds", num_samples=8, shape=(4, 64, 64), dtype="uint8", seed=4,
                       shard_size=80_000)


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_jpegs")
    make_image_folder(root / "src", num_images=12, num_classes=2, seed=6, mean_size=(64, 48), workers=1)
    return convert_folder(root / "src", root / "ds", shard_size=30_000)


@pytest.fixture(scope="module")
def cpu_reference(jpegs):
    """key -> (eval-decoded image, label) from the CPU path: what the GPU path must deliver."""
    ref = {}
    for b in DataLoader(str(jpegs), batch_size=4, device="cpu", transform=_eval(), output="numpy"):
        for i, k in enumerate(b["__key__"]):
            ref[k] = (np.array(b["jpg"][i]), int(b["cls"][i]))
    assert len(ref) == 12
    return ref


def _eval():
    from gdsload.decode.image import ImageTransform

    return ImageTransform(**EVAL)


def host(x) -> np.ndarray:
    """A batch field as NumPy: device arrays through `.get()` (which syncs the current stream)."""
    return x.get() if hasattr(x, "get") else np.asarray(x)


def _wait_full(it, timeout_s: float = 20.0, held: int = 0) -> None:
    """Block until the producers have filled every free slot (so later batches ran before we
    read); `held`: slots the consumer holds."""
    deadline = time.monotonic() + timeout_s
    while it.ring.stats()["occupancy"] < min(it.ring.num_slots - held, len(it.batches)):
        assert time.monotonic() < deadline, "producers did not fill the ring"
        time.sleep(0.01)


# -- audit 1 #1 / audit 2 #1: KvikIO installed but broken --------------------------------------------
def test_broken_kvikio_warns_once_says_why_in_stats_and_explicit_io_names_it(monkeypatch, tmp_path, npy):
    """Before: `kvikio_usable()` swallowed the ImportError; device="cuda" ran POSIX silently."""
    ds, arrays, _ = npy
    gpu_fakes.install(monkeypatch, devices=1, kvikio=False)
    monkeypatch.delitem(__import__("sys").modules, "kvikio")
    gpu_fakes.install_broken_kvikio(monkeypatch, tmp_path,
                                    "librapids_logger.so: cannot open shared object file: No such file or directory")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # two loaders, one warning
            loader = DataLoader(str(ds), batch_size=8, device="cuda", output="numpy")
            for b in loader:
                for i, k in enumerate(b["__key__"]):
                    np.testing.assert_array_equal(host(b["npy"])[i], arrays[k])
            loader.close()
    said = [w for w in caught if "KvikIO is installed but does not load" in str(w.message)]
    assert len(said) == 1 and "librapids_logger.so" in str(said[0].message)
    assert "rapids-logger" in str(said[0].message)
    s = loader.stats()
    assert s["io_path"] == "posix" and "librapids_logger.so" in s["kvikio_error"]
    assert s["ring_device"] == "cuda:0"  # the batch still lives on the GPU (audit 1 #10)
    with pytest.raises(MissingDependencyError, match="librapids_logger"):
        DataLoader(str(ds), batch_size=8, device="cuda", io="kvikio", output="numpy")._setup()


def test_absent_kvikio_falls_back_without_a_warning(monkeypatch, npy):
    """A guard for the test above (not an audited defect): absent is not broken."""
    ds, _, _ = npy
    gpu_fakes.install(monkeypatch, devices=1, kvikio=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader = DataLoader(str(ds), batch_size=8, device="cuda", output="numpy")
        next(iter(loader))
    assert loader.stats()["kvikio_error"] is None and loader.stats()["io_path"] == "posix"


# -- audit 1 #2: the device ring with no device fields ---------------------------------------------
@pytest.mark.parametrize("kw", [dict(decode=False), dict(fields=["__key__", "cls"])],
                         ids=["decode=False", "labels-only"])
def test_gpu_loader_with_no_decoded_or_tensor_fields(monkeypatch, jpegs, cpu_reference, kw):
    """Before: `SlotSpec(fields={})` raised RingError for `gdsload bench --tiers R` on JPEGs."""
    gpu_fakes.install(monkeypatch, devices=1)
    src = ShardedDataset(str(jpegs))
    seen = 0
    for b in DataLoader(str(jpegs), batch_size=5, device="cuda", output="numpy", **kw):
        b = b if isinstance(b, dict) else dict(zip(["__key__", "cls"], b))
        for i, k in enumerate(b["__key__"]):
            assert int(host(b["cls"])[i]) == cpu_reference[k][1]
            if "jpg" in b:
                s, j = next((s, j) for s in range(len(src.shards)) for j in range(src.index(s).num_samples)
                            if src.index(s).key(j) == k)
                o, n = next((o, n) for e, o, n in src.index(s).members(j) if e == "jpg")
                assert b["jpg"][i] == src.read_extent(s, o, n)
            seen += 1
    assert seen == 12


# -- audit 1 #3 / audit 2 #3: producer threads and DALI on the rank's GPU ---------------------------
def test_producer_threads_and_dali_run_on_the_loaders_gpu(monkeypatch, jpegs, cpu_reference):
    """The training thread made GPU 1 current (as `torch.cuda.set_device(LOCAL_RANK)` does).
    Before: DALI was built from a producer thread, whose current device is 0, and the CuPy copy
    into the cuda:1 slot raised CuPy's peer-access error."""
    gpu = gpu_fakes.install(monkeypatch, devices=2, torch_cuda=True)
    builds = gpu_fakes.dali_mixed_on_cpu(monkeypatch, gpu)
    gpu.set_current(1)
    loader = DataLoader(str(jpegs), batch_size=4, device="cuda", transform=_eval(), output="numpy")
    got = {}
    for b in loader:
        img = host(b["jpg"])
        for i, k in enumerate(b["__key__"]):
            got[k] = (img[i], int(host(b["cls"])[i]))
        assert b["jpg"]._device_id == 1 and b["cls"]._device_id == 1
    assert loader.stats()["ring_device"] == "cuda:1"
    assert [(x["device_id"], x["thread_device"]) for x in builds] == [(1, 1)]
    producers = {name for _, name, _ in gpu.log_calls("set_device") if name.startswith("gdsload-reader")}
    assert producers and all(
        dev == 1 for _, name, dev in gpu.log_calls("set_device") if name.startswith("gdsload-reader"))
    for k, (img, label) in got.items():
        np.testing.assert_array_equal(img, cpu_reference[k][0])
        assert label == cpu_reference[k][1]


def test_kvikio_issuing_threads_read_on_the_loaders_gpu(monkeypatch, npy):
    ds, arrays, _ = npy
    gpu = gpu_fakes.install(monkeypatch, devices=2, kvikio=dict(config_file=True))
    loader = DataLoader(str(ds), batch_size=8, device="cuda:1", output="numpy")
    for b in loader:
        for i, k in enumerate(b["__key__"]):
            np.testing.assert_array_equal(host(b["npy"])[i], arrays[k])
    device_reads = gpu.log_calls("kvikio_read_async")  # stream-ordered: the test below
    assert device_reads and all(buf_dev == 1 and cur == 1 and gpu.streams[stream].device_id == 1
                                for _, _, _, stream, buf_dev, cur, _ in device_reads)


@pytest.mark.parametrize("config_file", [True, False], ids=["cufile-config", "no-config"])
def test_kvikio_device_reads_wait_for_the_training_stream_only_without_a_cufile_config(monkeypatch, npy_big,
                                                                                       config_file):
    """Before (audit 1 #7, audit 2 #6): every device read was `CuFile.pread`, which synchronises
    the legacy default stream first. `raw_read_async` avoids that only where KvikIO really calls
    `cuFileReadAsync`: a cuFile config file and no compat mode. Without a config file (the H200
    machine: pip cuFile, no /etc/cufile.json) it is a synchronous read behind the legacy stream
    (audit 3 F1; the old fake made every raw_read_async stream-ordered), and
    `stats()["io_read_modes"]` says so."""
    gpu = gpu_fakes.install(monkeypatch, devices=1, kvikio=dict(gds=True, config_file=config_file))
    training: list[str] = []
    gpu.null[0].enqueue(lambda: training.append("ran"), "a training step queued on the default stream")
    loader = DataLoader(str(npy_big), batch_size=2, device="cuda", output="numpy", prefetch_factor=3)
    it = iter(loader)
    first = next(it)
    _wait_full(it, held=1)  # every read the ring has room for was issued and finished
    assert training == ([] if config_file else ["ran"])
    private = {ptr for _, ptr, _, nb in gpu.log_calls("stream_create") if nb}
    reads = gpu.log_calls("kvikio_read_async")
    device_preads = [e for e in gpu.log_calls("kvikio_pread") if e[5]]
    if config_file:
        read_streams = {stream for _, _, _, stream, _, _, _ in reads}
        # each issuing thread reads on a stream of its own, which waited for the private stream (C6a)
        assert len(reads) >= 4 and read_streams < private and len(read_streams) >= 1
        assert not device_preads  # no device read through pread
    else:  # audit 4 R10b: raw_read_async would only be KvikIO's synchronous fallback: pread instead
        assert not reads and len(device_preads) >= 4
    src = npy_big.parent / "src"
    seen = []
    for b in itertools.chain([first], it):  # each batch checked before the next is taken (slot reuse)
        for i, k in enumerate(b["__key__"]):
            np.testing.assert_array_equal(host(b["npy"])[i], np.load(src / f"{k}.npy"))
            seen.append(k)
    assert sorted(seen) == sorted(p.stem for p in src.glob("*.npy")) and len(seen) == 8
    st = loader.stats()
    assert st["io_path"] == "kvikio-gds"
    how = "cufile-async" if config_file else "pread"
    assert st["io_read_modes"] == {f"kvikio-gds/{how}": 8}  # one read per 16 KiB row


# -- audit 1 #4 / audit 2 #4: which GPU ----------------------------------------------------------------
@pytest.mark.parametrize("device,local_rank,current,torch_cuda", [
    ("cuda:1", None, 0, True), ("cuda", "1", 0, True), ("cuda", None, 1, False)],
    ids=["cuda:N", "LOCAL_RANK", "current-device-of-cupy"])
def test_rank_gpu_from_cuda_n_else_local_rank_else_current(monkeypatch, npy, device, local_rank, current,
                                                           torch_cuda):
    """Before: "cuda:1" was refused, LOCAL_RANK ignored whenever torch has CUDA, CuPy's current
    device ignored without torch CUDA (GPU 0), labels went to `.to("cuda")` (cuda:0)."""
    ds, arrays, labels = npy
    gpu = gpu_fakes.install(monkeypatch, devices=2, torch_cuda=torch_cuda)
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    gpu.set_current(current)
    loader = DataLoader(str(ds), batch_size=8, device=device, output="numpy")
    for b in loader:
        assert b["npy"]._device_id == 1 and b["cls"]._device_id == 1
        for i, k in enumerate(b["__key__"]):
            np.testing.assert_array_equal(host(b["npy"])[i], arrays[k])
            assert int(host(b["cls"])[i]) == labels[k]
    assert loader.stats()["ring_device"] == "cuda:1" and loader.device_ordinal == 1
    assert gpu.current() == current  # the training thread's device is left alone


def test_device_values_are_checked(monkeypatch, npy):
    ds, _, _ = npy
    gpu_fakes.install(monkeypatch, devices=2)
    with pytest.raises(GdsloadError, match="'tpu'.*'cpu', 'cuda' or 'cuda:N'"):
        DataLoader(str(ds), device="tpu")
    with pytest.raises(GdsloadError, match=r"cuda:5.*2 CUDA device"):
        DataLoader(str(ds), device="cuda:5", output="numpy")._setup()
    import torch

    assert DataLoader(str(ds), device=torch.device("cuda", 1)).device == "cuda"


def test_ring_cuda_means_the_current_device_and_copies_stay_there(monkeypatch):
    """Before: Ring(device="cuda") was GPU 0, and Slot.copy() copied to the current device."""
    from gdsload.ring.ring import Ring, SlotSpec

    gpu = gpu_fakes.install(monkeypatch, devices=2)
    spec = SlotSpec({"x": ((4,), "int64")})
    gpu.set_current(1)
    assert Ring(spec, 1, device="cuda").device == "cuda:1"
    gpu.set_current(0)
    ring = Ring(spec, 1, device="cuda:1")
    slot = ring.acquire(0)
    assert slot.buffers["x"]._device_id == 1
    assert slot.copy()["x"]._device_id == 1


# -- audit 1 #5 / audit 2 #9: the copy out of DALI's output buffer -------------------------------------
def test_copy_out_of_dali_is_complete_before_the_next_run(monkeypatch, jpegs, cpu_reference):
    """DALI reuses its output buffer on the next run(). Before: `dst[:n] = cupy.asarray(...)` was
    an unordered kernel on the legacy stream that read the buffer late, i.e. a later batch's
    pixels. The producers fill every slot before the consumer reads anything."""
    gpu = gpu_fakes.install(monkeypatch, devices=1)
    gpu_fakes.dali_mixed_on_cpu(monkeypatch, gpu)
    loader = DataLoader(str(jpegs), batch_size=4, device="cuda", transform=_eval(), output="numpy",
                        prefetch_factor=2, num_workers=2)
    it = iter(loader)
    _wait_full(it)
    n = 0
    for b in it:
        img = host(b["jpg"])
        for i, k in enumerate(b["__key__"]):
            np.testing.assert_array_equal(img[i], cpu_reference[k][0], err_msg=k)
            n += 1
    assert n == 12
    copies = gpu.log_calls("dali_copy")
    private = {ptr for _, ptr, _, nb in gpu.log_calls("stream_create") if nb}
    assert copies and all(stream in private and not non_blocking for _, stream, _, non_blocking, _ in copies)
    assert loader.stats()["decode_device"] == "mixed"


# -- audit 1 #6 / audit 2 #5: the release fence -------------------------------------------------------
def test_a_slot_is_not_rewritten_under_a_consumer_kernel_on_a_side_stream(monkeypatch, npy):
    """The consumer's kernels reading batch k are only queued when it asks for batch k+1. Before:
    the slot was refilled at once (KvikIO drains only the legacy stream), so the queued kernel
    read the next batch's rows."""
    ds, arrays, labels = npy
    gpu = gpu_fakes.install(monkeypatch, devices=1)
    cupy = __import__("sys").modules["cupy"]
    loader = DataLoader(str(ds), batch_size=4, device="cuda", output="numpy", prefetch_factor=1,
                        num_workers=2)
    snaps: list[tuple[list, np.ndarray, np.ndarray]] = []
    side = cupy.cuda.Stream(non_blocking=True)
    def at(a):  # what a kernel holds: an address, not the array (which would keep the batch)
        return a.__cuda_array_interface__["data"][0], a.shape, a.dtype

    def read(ptr, shape, dtype):
        buf = (ctypes.c_char * (int(np.prod(shape)) * dtype.itemsize)).from_address(ptr)
        return np.frombuffer(buf, dtype).reshape(shape).copy()

    with side:  # the consumer's current stream, as under `torch.cuda.stream(s)`
        for b in loader:
            keys, x, y = list(b["__key__"]), at(b["npy"]), at(b["cls"])
            side.enqueue(lambda keys=keys, x=x, y=y: snaps.append((keys, read(*x), read(*y))), "consumer kernel")
            time.sleep(0.02)  # the producers get every chance to run ahead
        side.synchronize()
    assert sum(len(k) for k, _, _ in snaps) == 24
    for keys, x, y in snaps:
        for i, k in enumerate(keys):
            np.testing.assert_array_equal(x[i], arrays[k], err_msg=k)
            assert y[i] == labels[k]
    fences = {e[1] for e in gpu.log_calls("record") if e[2] == side.ptr}
    waited = fences & {e[1] for e in gpu.log_calls("event_sync")}
    assert len(fences) == 6 and len(waited) == 4  # the last 2 slots are not refilled this epoch


def test_torch_consumer_stream_waits_for_the_batch_and_fences_the_slot(monkeypatch, npy):
    """torch output: the consumer's stream is torch's current stream; labels come zero-copy from
    the device ring (before: `.to("cuda")`, a blocking copy, cuda:0)."""
    import torch

    ds, arrays, labels = npy
    gpu = gpu_fakes.install(monkeypatch, devices=1, torch_cuda=True, kvikio=False)
    loader = DataLoader(str(ds), batch_size=4, device="cuda", prefetch_factor=1, num_workers=2)
    snaps = []
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for b in loader:
            assert isinstance(b["npy"], torch.Tensor)
            keys, x, y = list(b["__key__"]), b["npy"], b["cls"]
            s.stream.enqueue(lambda keys=keys, x=x, y=y: snaps.append((keys, x.clone(), y.clone())), "kernel")
            time.sleep(0.02)
        s.synchronize()
    for keys, x, y in snaps:
        for i, k in enumerate(keys):
            np.testing.assert_array_equal(x[i].numpy(), arrays[k], err_msg=k)
            assert int(y[i]) == labels[k]
    assert gpu.log_calls("torch_to_cuda") == []  # no blocking .to("cuda") per step
    waits = {e[1] for e in gpu.log_calls("wait_event")}
    assert s.cuda_stream in waits  # the consumer's stream waited for the batches' copies


# -- audit 1 #7: copies on a private stream, labels without blocking ------------------------------
def test_copies_run_on_a_private_stream_and_the_consumer_never_blocks(monkeypatch, npy):
    """Before: label copies were blocking (`.to("cuda")` = copy + synchronize; CuPy's asarray the
    same), on the legacy stream, in the training thread."""
    ds, _, _ = npy
    gpu = gpu_fakes.install(monkeypatch, devices=1, kvikio=False)  # POSIX: rows are copied too
    loader = DataLoader(str(ds), batch_size=8, device="cuda", output="numpy")
    for _ in loader:
        pass
    private = {ptr for _, ptr, _, nb in gpu.log_calls("stream_create") if nb}
    copies = gpu.log_calls("memcpyAsync")
    assert len(private) == 1 and copies
    assert all(stream in private and thread.startswith("gdsload-reader") for _, stream, _, _, thread in copies)
    label_copies = [size for _, _, size, _, _ in copies if size == 8 * 8]
    assert len(label_copies) == 3  # one per batch, int64[8]
    consumer = threading.current_thread().name
    assert not [e for e in gpu.log if e[0] in ("stream_sync", "event_sync") and consumer in e]
    assert all(e[0] != "stream_sync" for e in gpu.log)  # nobody blocks on a whole stream


# -- audit 1 #8 / audit 2 #6-7: what path the reads took ----------------------------------------------
@pytest.mark.parametrize("opts,big,name", [
    (dict(gds=True, config_file=True), False, "kvikio-gds"),  # 4 KiB rows: raw_read_async has no small-read shortcut
    (dict(gds=True), False, "kvikio-posix"),  # no cuFile config: pread, whose shortcut reads 4 KiB rows with POSIX
    (dict(gds=True), True, "kvikio-gds"),     # 16 KiB rows: cuFile
    (dict(gds=False), True, "kvikio-compat"),
    (dict(gds=True, compat=True), True, "kvikio-compat"),
])
def test_io_path_names_the_path_the_reads_took(monkeypatch, npy, npy_big, opts, big, name):
    """Before: "kvikio-gds" whenever cuFile reported GDS, also for reads below gds_threshold."""
    gpu = gpu_fakes.install(monkeypatch, devices=1, kvikio=opts)
    ds = npy_big if big else npy[0]
    loader = DataLoader(str(ds), batch_size=4, device="cuda", output="numpy")
    for _ in loader:
        pass
    s = loader.stats()
    assert s["io_path"] == name
    assert s["host_io_path"] == "posix" and s["ring_device"] == "cuda:0"  # audit 1 #9
    registered = gpu.kvikio.registered
    loader.close()
    assert not registered  # deregistered on close


def test_gds_registers_the_device_arena(monkeypatch, npy_big):
    gpu = gpu_fakes.install(monkeypatch, devices=1, kvikio=dict(gds=True))
    loader = DataLoader(str(npy_big), batch_size=4, device="cuda", output="numpy")
    next(iter(loader))
    arena = loader._resources.ring._arena
    base, nbytes, _ = gpu.allocation_of(arena.data.ptr)  # KvikIO registers the allocation holding it
    assert gpu.kvikio.registered == [(base, nbytes)] and nbytes >= arena.nbytes


def test_kvikio_backend_counts_paths_by_size_and_memory(monkeypatch, tmp_path):
    from gdsload.io import Extent
    from gdsload.io.kvikio_backend import KvikioBackend

    gpu = gpu_fakes.install(monkeypatch, devices=1, kvikio=dict(gds=True))
    cupy = __import__("sys").modules["cupy"]
    path = tmp_path / "f"
    path.write_bytes(bytes(range(256)) * 200)
    with KvikioBackend() as b:
        assert b.name == "kvikio-gds"  # expected, before any read
        b.read([Extent(str(path), 0, 4096)], cupy.empty(4096, np.uint8), [0]).result()
        assert b.name == "kvikio-posix" and b.gds_threshold == 16 * 1024
        b.read([Extent(str(path), 0, 40_000)], cupy.empty(40_000, np.uint8), [0]).result()
        assert b.name == "kvikio-gds" and b.path_bytes == {"kvikio-posix": 4096, "kvikio-gds": 40_000}
        b.read([Extent(str(path), 0, 50_000)], np.empty(50_000, np.uint8), [0]).result()
        assert b.path_bytes["kvikio-posix"] == 54_096  # host buffers: POSIX inside KvikIO
    assert gpu.log_calls("kvikio_set") == []


def test_kvikio_thread_pool_is_resized_only_when_it_differs(monkeypatch):
    """Before: every backend construction called defaults.set("num_threads"), which in KvikIO 26.x
    waits for running tasks and rebuilds the pool (stalling another loader's reads)."""
    from gdsload.io.kvikio_backend import KvikioBackend

    gpu = gpu_fakes.install(monkeypatch, devices=1)
    KvikioBackend(threads=4).close()
    KvikioBackend(threads=4).close()
    assert gpu.log_calls("kvikio_set") == [("kvikio_set", "num_threads", 4)]


# -- audit 1 #9: encoded bytes and labels not read through KvikIO member by member --------------------
def test_host_arena_reads_go_through_posix_not_kvikio(monkeypatch, jpegs, cpu_reference):
    gpu = gpu_fakes.install(monkeypatch, devices=1)
    gpu_fakes.dali_mixed_on_cpu(monkeypatch, gpu)
    loader = DataLoader(str(jpegs), batch_size=6, device="cuda", transform=_eval(), output="numpy")
    for b in loader:
        for i, k in enumerate(b["__key__"]):
            assert int(host(b["cls"])[i]) == cpu_reference[k][1]
    assert [e for e in gpu.log_calls("kvikio_pread") if not e[5]] == []  # no host-buffer KvikIO reads
    assert loader.stats()["host_io_path"] == "posix"
    assert loader._resources.host_backend.stats()["reads"] <= 12  # coalesced groups, not 24 members


# -- audit 1 #10 / audit 2 #2: no GPU -> host -> GPU bounce -----------------------------------------
def test_mixed_decode_without_kvikio_decodes_into_the_device_ring(monkeypatch, jpegs, cpu_reference):
    """Before: with a host-only backend the whole ring was on the host, DALI's GPU output went to
    a host pointer (copy_to_external is documented for GPU memory) and back with `.to("cuda")`."""
    gpu = gpu_fakes.install(monkeypatch, devices=1, kvikio=False)
    gpu_fakes.dali_mixed_on_cpu(monkeypatch, gpu)
    loader = DataLoader(str(jpegs), batch_size=4, device="cuda", transform=_eval(), output="numpy")
    it = iter(loader)
    assert it.ring.device == "cuda:0"
    for b in it:
        assert b["jpg"]._device_id == 0
        for i, k in enumerate(b["__key__"]):
            np.testing.assert_array_equal(host(b["jpg"])[i], cpu_reference[k][0])
    s = loader.stats()
    assert s["ring_device"] == "cuda:0" and s["io_path"] == "posix"
    # every DALI copy targeted the device arena; nothing image-sized went host-to-device
    assert gpu.log_calls("dali_copy")
    image_nbytes = 4 * 32 * 32 * 3
    assert all(size < image_nbytes for _, _, size, _, _ in gpu.log_calls("memcpyAsync"))


def test_image_decoder_refuses_gpu_output_into_a_host_slot(monkeypatch):
    from gdsload.decode.image import ImageDecoder

    gpu = gpu_fakes.install(monkeypatch, devices=1)
    dec = ImageDecoder(_eval(), batch_size=2, device="mixed")
    out = gpu_fakes.FakeTensorListGPU(gpu, np.zeros((2, 32, 32, 3), np.uint8), 2, 0)
    with pytest.raises(ValueError, match="host slot cannot take the output of 'mixed'"):
        dec.copy_into(out, np.zeros((2, 32, 32, 3), np.uint8))


# -- audit 1 #11 / audit 2 #8 and 16.5: doctor -------------------------------------------------------
def test_doctor_finds_the_cuda13_cufile_wheel(monkeypatch, tmp_path):
    """CUDA 13 wheels (nvidia-cufile 1.15+) install nvidia/cu13/lib/libcufile.so.0. Before: only
    nvidia/cufile/lib (the CUDA 12 layout) was looked at."""
    from gdsload import doctor

    lib = tmp_path / "site" / "nvidia" / "cu13" / "lib"
    lib.mkdir(parents=True)
    shutil.copy("/usr/lib/x86_64-linux-gnu/libm.so.6", lib / "libcufile.so.0")  # any loadable ELF
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(doctor, "_cufile_pathfinder", lambda: None, raising=False)
    try:  # this host has no system libcufile, so the wheel's copy is what must be found
        __import__("ctypes").CDLL("libcufile.so.0")
        pytest.skip("this host has a system libcufile")
    except OSError:
        pass
    assert str(lib / "libcufile.so.0") in doctor._cufile_wheel_candidates()
    info = doctor._probe_cufile_library()
    assert info["loaded"] and info["library"] == str(lib / "libcufile.so.0")


@pytest.mark.parametrize("gds,compat", [(True, False), (False, False), (True, True)])
def test_doctor_names_the_read_path_as_the_backend_calls_itself(monkeypatch, gds, compat):
    """Before: doctor said "gds" where the backend and stats() say "kvikio-gds"."""
    from gdsload import doctor
    from gdsload.io.kvikio_backend import KvikioBackend

    gpu_fakes.install(monkeypatch, devices=1, kvikio=dict(gds=gds, compat=compat))
    with KvikioBackend() as b:
        name = b.name
    assert doctor.io_path_for(kvikio_importable=True, cuda_driver=True, gpu_available=True,
                              gds_available=gds, compat_mode_preferred=compat) == name
    assert set(doctor.IO_PATHS) == {"kvikio-gds", "kvikio-compat", "posix"}


# -- audit 1 #12: "cuda" is not the default with a CPU-only torch (or without CuPy) -------------------
def test_default_device_is_cpu_when_torch_has_no_cuda(monkeypatch, npy):
    ds, _, _ = npy
    gpu_fakes.install(monkeypatch, devices=1)  # a GPU and CuPy; torch here is a CPU build
    with pytest.warns(RuntimeWarning, match="has no CUDA.*device='cpu'"):
        loader = DataLoader(str(ds), batch_size=8)
    assert loader.device == "cpu"
    assert DataLoader(str(ds), batch_size=8, output="numpy").device == "cuda"  # CuPy output is fine


def test_default_device_is_cpu_without_cupy(monkeypatch, npy):
    ds, _, _ = npy
    gpu_fakes.install(monkeypatch, devices=1, torch_cuda=True)
    monkeypatch.setitem(__import__("sys").modules, "cupy", None)
    with pytest.warns(RuntimeWarning, match="CuPy does not import"):
        assert DataLoader(str(ds), batch_size=8).device == "cpu"


# -- on a real GPU (bench/gpu_check.sh runs these by file name) -----------------------------------
@pytest.mark.gds
def test_real_gpu_npy_loader_reads_through_kvikio_into_the_device_ring(npy):
    ds, arrays, labels = npy
    loader = DataLoader(str(ds), batch_size=8, device="cuda", shuffle=True)
    n = 0
    for b in loader:
        assert b["npy"].is_cuda and b["cls"].is_cuda
        x, y = b["npy"].cpu().numpy(), b["cls"].cpu().numpy()
        for i, k in enumerate(b["__key__"]):
            np.testing.assert_array_equal(x[i], arrays[k])
            assert y[i] == labels[k]
            n += 1
    s = loader.stats()
    assert n == 24 and s["io_path"].startswith("kvikio") and s["ring_device"].startswith("cuda")


@pytest.mark.dali_gpu
def test_real_mixed_decode_matches_the_cpu_decode(jpegs, cpu_reference):
    loader = DataLoader(str(jpegs), batch_size=4, device="cuda", transform=_eval())
    n = 0
    for b in loader:
        img = b["jpg"].cpu().numpy().astype(np.int16)
        for i, k in enumerate(b["__key__"]):  # nvJPEG and libjpeg-turbo differ by rounding
            assert np.abs(img[i] - cpu_reference[k][0]).mean() < 3.0, k
            n += 1
    assert n == 12 and loader.stats()["decode_device"] == "mixed"


def test_an_early_break_then_a_new_pass_delivers_right_values(monkeypatch, npy):
    """A guard for the fences kept across passes: batches published but never consumed still have
    copies queued when the pass is dropped; the next pass must not be mixed with them."""
    ds, arrays, labels = npy
    gpu_fakes.install(monkeypatch, devices=1, kvikio=False)
    loader = DataLoader(str(ds), batch_size=4, device="cuda", output="numpy", shuffle=True, prefetch_factor=2)
    it = iter(loader)
    next(it)
    _wait_full(it, held=1)
    it.close()
    n = 0
    for b in loader:
        x, y = host(b["npy"]), host(b["cls"])
        for i, k in enumerate(b["__key__"]):
            np.testing.assert_array_equal(x[i], arrays[k], err_msg=k)
            assert y[i] == labels[k]
            n += 1
    assert n == 20  # the rest of the epoch after the first batch


# -- audit 3 (../shared/reviews/gpu_audit_3.md): fakes that fail like the real APIs, and C1-C7 ------
def _no_context_thread(fn):
    """Run `fn` in a fresh thread (no CUDA context bound, as for KvikIO's issuing threads); its
    result or exception."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join(20)
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_kvikio_backend_without_device_id_reads_from_threads_with_a_context(monkeypatch, tmp_path):
    """C1 / F2: `KvikioBackend(threads=8)` (gpu_bench's kvikio_rows did this) gave its issuing
    threads no device, so no CUDA context, and KvikIO's synchronous fallback of raw_read_async
    (no cuFile config) failed with CUDA_ERROR_INVALID_CONTEXT. The fake failed nothing: every
    thread "had device 0". Now the constructing thread's device is used."""
    from gdsload.io import Extent
    from gdsload.io.kvikio_backend import KvikioBackend

    gpu = gpu_fakes.install(monkeypatch, devices=1, kvikio=dict(gds=True, config_file=True))
    cupy = __import__("sys").modules["cupy"]
    buf = cupy.empty(8, np.uint8)
    with pytest.raises(RuntimeError, match="CUDA_ERROR_INVALID_CONTEXT"):  # the fake, as the driver
        _no_context_thread(lambda: gpu.kvikio.CuFile(__file__).raw_read_async(buf, 0, 8, 0).check_bytes_done())
    path = tmp_path / "f"
    path.write_bytes(bytes(range(256)) * 64)
    out = cupy.empty(16384, np.uint8)
    stream = cupy.cuda.Stream(non_blocking=True)
    with KvikioBackend(threads=8) as b:
        b.order_on(stream.ptr)
        b.read([Extent(str(path), 0, 8192), Extent(str(path), 8192, 8192)], out, [8192, 0]).result()
        assert b.device_id == 0 and b.read_modes == {"kvikio-gds/cufile-async": 2}
    np.testing.assert_array_equal(out.get(), np.frombuffer((bytes(range(256)) * 32) * 2, np.uint8)[
        np.r_[8192:16384, 0:8192]])


def test_kvikio_backend_reports_a_bad_size_as_a_storage_error(monkeypatch, tmp_path):
    """F4: real KvikIO raises ValueError for a size over the buffer (`_lib/arr.pyx`); the old fake
    read short, and the backend let ValueError through unnamed."""
    from gdsload.errors import StorageError
    from gdsload.io import Extent
    from gdsload.io.base import coalesce
    from gdsload.io.kvikio_backend import KvikioBackend

    gpu_fakes.install(monkeypatch, devices=1, kvikio=dict(gds=True, config_file=True))
    cupy = __import__("sys").modules["cupy"]
    path = tmp_path / "f"
    path.write_bytes(b"x" * 8192)
    stream = cupy.cuda.Stream(non_blocking=True)
    with KvikioBackend() as b:
        b.order_on(stream.ptr)
        (group,) = coalesce([Extent(str(path), 0, 8192)], [0], max_gap=0, contiguous_out=True)
        with pytest.raises(StorageError, match=r"Size is greater than the size of the buffer.*|.*'f'"):
            b._read_group(group, cupy.empty(4096, np.uint8))  # a destination 4 KiB short


def test_kvikio_backend_closes_evicted_cache_shards(monkeypatch, tmp_path, npy):
    """C2: KvikioBackend had no forget(): every shard the cache evicted stayed open through its
    CuFile (two fds and a cuFile handle), and its disk space was not freed."""
    from gdsload.dataset import Dataset

    ds, arrays, _ = npy
    gpu = gpu_fakes.install(monkeypatch, devices=1, kvikio=dict(gds=True, config_file=True))
    shards = sorted(Path(ds).glob("*.tar"))
    assert len(shards) >= 3
    limit = 2 * max(p.stat().st_size for p in shards) + 1
    import fsspec

    mem = fsspec.filesystem("memory")
    for p in Path(ds).iterdir():  # a remote dataset (the cache serves remote shards only)
        mem.pipe(f"/gpu_c2/{p.name}", p.read_bytes())
    loader = DataLoader(Dataset("memory://gpu_c2", cache_dir=tmp_path / "cache", cache_limit=limit),
                        batch_size=4, device="cuda", output="numpy", num_workers=1, prefetch_factor=1,
                        shuffle_window=1)
    seen = 0
    for b in loader:
        for i, k in enumerate(b["__key__"]):
            np.testing.assert_array_equal(host(b["npy"])[i], arrays[k])
            seen += 1
        cached_open = [p for p in gpu.kvikio.open_files if p.startswith(str(tmp_path / "cache"))]
        assert len(cached_open) <= 2, cached_open  # before: every shard read so far
    assert seen == 24 and loader.stats()["io_path"].startswith("kvikio")
    cached = list((tmp_path / "cache").rglob("*.tar"))  # the shards the cache holds now
    assert sum(p.stat().st_size for p in cached) <= limit


def test_map_on_a_gpu_loader_is_ordered_for_a_side_stream_consumer(monkeypatch, npy):
    """C3: `map`'s host copies were `.get()` on the legacy stream (each batch waited for training)
    and its outputs went `.to("cuda", non_blocking=True)` on the producer's legacy stream, after
    the ready event: a consumer on a side stream read them before they landed."""
    import torch

    ds, arrays, labels = npy
    gpu = gpu_fakes.install(monkeypatch, devices=1, torch_cuda=True, kvikio=dict(gds=True, config_file=True))
    training: list[str] = []
    gpu.null[0].enqueue(lambda: training.append("ran"), "a training step queued on the default stream")
    loader = DataLoader(str(ds), batch_size=4, device="cuda", prefetch_factor=1, num_workers=2,
                        map=_double_npy)
    snaps = []
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for b in loader:
            keys, x = list(b["__key__"]), b["npy"]
            s.stream.enqueue(lambda keys=keys, x=x: snaps.append((keys, x.clone())), "consumer kernel")
        s.synchronize()
    assert training == [], "a mapped batch waited for the training stream"
    assert sum(len(k) for k, _ in snaps) == 24
    for keys, x in snaps:
        for i, k in enumerate(keys):
            np.testing.assert_array_equal(x[i].numpy(), arrays[k].astype(np.int16) * 2, err_msg=k)
    to_cuda = gpu.log_calls("torch_to_cuda")
    private = {ptr for _, ptr, _, nb in gpu.log_calls("stream_create") if nb}
    assert to_cuda and all(e[3] in private for e in to_cuda)  # on the private stream
    assert gpu.log_calls("record_stream")  # the consumer's stream owns the mapped tensors


def _double_npy(sample: dict) -> dict:
    return {**sample, "npy": sample["npy"].astype(np.int16) * 2}


def test_two_image_fields_a_corrupt_image_and_a_side_stream_consumer(monkeypatch, tmp_path):
    """C4: with a skipped image, (a) the rows of several image fields were compacted by a CuPy
    kernel on the producer's legacy stream, after the ready event; (b) labels were gathered
    (`arr[keep]`) on the consumer thread's CuPy stream (legacy) while the ready wait went on
    torch's side stream. A side-stream consumer read both before they were written."""
    import torch

    import fieldsample as fs
    from gdsload.decode.image import ImageTransform

    ref = fs.make_two_image_source(tmp_path / "src", bad_jpg="s002", bad_png="s005")
    fs.convert_source(tmp_path / "src", tmp_path / "ds")
    gpu = gpu_fakes.install(monkeypatch, devices=1, torch_cuda=True, kvikio=False)
    gpu_fakes.dali_mixed_on_cpu(monkeypatch, gpu)
    loader = DataLoader(str(tmp_path / "ds"), batch_size=4, device="cuda", on_error="skip", num_workers=2,
                        prefetch_factor=1, transform=ImageTransform(**fs.EVAL))
    snaps = []
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for b in loader:
            keys = list(b["__key__"])
            x, d, y = b["jpg"], b["depth.png"], b["cls"]
            s.stream.enqueue(lambda keys=keys, x=x, d=d, y=y: snaps.append(
                (keys, x.clone(), d.clone(), y.clone())), "consumer kernel")
        s.synchronize()
    got = []
    for keys, x, d, y in snaps:
        for i, k in enumerate(keys):
            got.append(k)
            assert int(y[i]) == int(k[1:]), k
            assert np.array_equal(d[i].numpy()[..., 0], ref[k]["depth.png"][:, 4:44]), k
            assert np.abs(x[i].numpy().astype(int) - ref[k]["jpg"][:, 4:44].astype(int)).mean() < 3, k
    assert got == [k for k in sorted(ref) if k not in ("s002", "s005")]


def test_verify_full_on_a_device_ring_does_not_wait_for_training(monkeypatch, npy):
    """C5: verify="full" CRCs of device rows were `.get()` on the legacy stream, so every batch
    waited for the training kernels queued there."""
    from gdsload.dataset import Dataset

    ds, arrays, _ = npy
    gpu = gpu_fakes.install(monkeypatch, devices=1, kvikio=dict(gds=True, config_file=True))
    training: list[str] = []
    gpu.null[0].enqueue(lambda: training.append("ran"), "a training step queued on the default stream")
    loader = DataLoader(Dataset(str(ds), verify="full"), batch_size=4, device="cuda", output="numpy",
                        prefetch_factor=1)
    it = iter(loader)
    b = next(it)
    _wait_full(it, held=1)
    assert training == [] and loader.stats()["verify"]
    private = loader._resources.streams.stream
    for i, k in enumerate(b["__key__"]):
        np.testing.assert_array_equal(b["npy"].get(stream=private)[i], arrays[k])
    it.close()


def test_import_kvikio_wraps_a_library_not_found_error(monkeypatch, tmp_path):
    """C7: cuda.pathfinder's DynamicLibNotFoundError (a RuntimeError) from KvikIO's import escaped
    raw from `io="kvikio"`; now it is the MissingDependencyError with the hint and the reason."""
    from gdsload.io.kvikio_backend import import_kvikio

    pkg = tmp_path / "site" / "kvikio"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("class DynamicLibNotFoundError(RuntimeError):\n    pass\n"
                                     "raise DynamicLibNotFoundError('Failure finding \"libcufile.so\"')\n")
    monkeypatch.delitem(__import__("sys").modules, "kvikio", raising=False)
    monkeypatch.syspath_prepend(str(pkg.parent))
    with pytest.raises(MissingDependencyError, match=r"libcufile\.so.*pip install"):
        import_kvikio()


def test_reads_into_a_registered_arena_address_it_by_base_and_offset(monkeypatch, npy_big):
    """C6b: cuFile expects registered memory as (registered base, offset); the row's own address
    as the base made every read an unregistered one (cuFile's bounce buffers)."""
    gpu = gpu_fakes.install(monkeypatch, devices=1, kvikio=dict(gds=True, config_file=True))
    loader = DataLoader(str(npy_big), batch_size=4, device="cuda", output="numpy")
    for _ in loader:
        pass
    hows = gpu.log_calls("kvikio_read_how")
    assert hows and all(registered for _, _, _, registered in hows)
    assert len({off for _, _, off, _ in hows}) > 1  # rows at their offsets in the arena


# -- audit 4 (../shared/reviews/gpu_audit_4.md): NVDEC routing, DLPack, gathers, GDS hosts -----------------
def test_nvdec_caps_struct_matches_cuviddec_h():
    """R3: the probe reads CUVIDDECODECAPS through ctypes; a field out of place reads garbage. The
    offsets are cuviddec.h's (3 ints + 3 reserved, then the OUT fields, 10 reserved at the end)."""
    from gdsload.host.gpu import _DecodeCaps

    offsets = {name: getattr(_DecodeCaps, name).offset for name, _ in _DecodeCaps._fields_}
    assert offsets == {"eCodecType": 0, "eChromaFormat": 4, "nBitDepthMinus8": 8, "reserved1": 12,
                       "bIsSupported": 24, "nNumNVDECs": 25, "nOutputFormatMask": 26, "nMaxWidth": 28,
                       "nMaxHeight": 32, "nMaxMBCount": 36, "nMinWidth": 40, "nMinHeight": 42,
                       "bIsHistogramSupported": 44, "nCounterBitDepth": 45, "nMaxHistogramBins": 46,
                       "reserved3": 48}
    assert __import__("ctypes").sizeof(_DecodeCaps) == 88


def test_nvdec_probe_says_why_without_a_driver_and_routes_by_codec_bits_and_size(monkeypatch):
    from gdsload.host import gpu as hg

    monkeypatch.setattr(hg, "_nvdec_cache", {})
    try:
        __import__("ctypes").CDLL("libcuda.so.1")
        pytest.skip("this host has a CUDA driver")
    except OSError:
        pass
    caps = hg.nvdec_caps(0)  # the real probe, on a host without libcuda: an answer, not an exception
    assert caps["available"] is False and "libcuda.so.1" in caps["error"]
    assert hg.nvdec_route(caps, "h264", 8, 640, 480).startswith("no NVDEC here")
    gpu_fakes.install_nvdec(monkeypatch)  # Hopper's table
    caps = hg.nvdec_caps(0)
    assert hg.nvdec_route(caps, "h264", 8, 160, 96) is None
    assert hg.nvdec_route(caps, "hevc", 8, 160, 96) == "160x96 is outside NVDEC's 144x144..8192x8192 for hevc"
    assert hg.nvdec_route(caps, "hevc", 8, 192, 160) is None and hg.nvdec_route(caps, "vp9", 10, 192, 160) is None
    assert hg.nvdec_route(caps, "vp9", 8, 192, 120) is not None  # VP9 from 128x128
    assert hg.nvdec_route(caps, "av1", 8, 1920, 1080) == "this GPU's NVDEC does not decode av1"
    assert hg.nvdec_route(caps, "h264", 10, 1920, 1080) == "this GPU's NVDEC does not decode h264-10"
    assert "hevc 144x144+" in hg.nvdec_summary(caps) and "av1 no" in hg.nvdec_summary(caps)


def _clip(codec: str, w: int, h: int, frames: int = 12) -> np.ndarray:
    from gdsload.bench import mediagen as mg

    def pattern(i, hh, ww):
        grid = np.random.default_rng(i).integers(40, 220, (hh // 16 + 1, ww // 16 + 1, 3), dtype=np.uint8)
        return np.kron(grid, np.ones((16, 16, 1), np.uint8))[:hh, :ww]

    return np.frombuffer(mg.encode_video(codec, frames=frames, width=w, height=h, fps=12, gop=4,
                                         pattern=pattern), np.uint8)


def _decode(dec, clips: list[np.ndarray], t) -> tuple[list[int], np.ndarray, np.ndarray, list[dict]]:
    from gdsload.decode import media

    metas = [media.probe(c.tobytes(), "video") for c in clips]
    n = len(clips)
    shape = (n, *t.output_shape((metas[0]["height"], metas[0]["width"])))
    idx = np.zeros((n, *t.frames_shape()), np.int64)
    u = media.draws(5, 0, np.arange(n), 0x7669, k=6)
    if dec.device == "mixed":  # into device memory, as the loader's device slot (audit 4 R11)
        out = __import__("sys").modules["cupy"].zeros(shape, np.dtype(t.dtype))
        kept = dec.decode_into(clips, [f"c{i}" for i in range(n)], metas, u, out, idx)
        return kept, out.get(), idx, metas
    out = np.zeros(shape, np.dtype(t.dtype))
    kept = dec.decode_into(clips, [f"c{i}" for i in range(n)], metas, u, out, idx)
    return kept, out, idx, metas


def _pyav_frames(clip: np.ndarray) -> np.ndarray:
    import io

    import av

    from gdsload.decode.media import rgb24_scaler

    rgb24 = rgb24_scaler()
    with av.open(io.BytesIO(clip.tobytes())) as c:
        return np.stack([rgb24(f) for f in c.decode(c.streams.video[0])])


@pytest.mark.parametrize("codec,size,refusal", [
    ("hevc", (160, 96), "too small"),   # R2: under HEVC's 144x144 (the old check's clips)
    ("vp9_444", (192, 160), "config"),  # 4:4:4 VP9: the index says vp9, NVDEC refuses it at decode time
], ids=["hevc-too-small", "vp9-444"])
def test_mixed_video_sends_what_nvdec_refuses_to_the_cpu_path(monkeypatch, codec, size, refusal):
    """R3: before, every codec in NVDEC_VIDEO went to NVDEC whatever this GPU's NVDEC takes; DALI
    refused the sample ("Video is too small in at least one dimension", "Codec configuration not
    supported on this GPU") and it was counted as corrupt: a DecodeError, or skipped data. Now the
    decoder routes by the probe's capabilities and treats a refusal as "decode elsewhere": the
    frames come from the CPU path (PyAV), equal to PyAV's own, and `routes` says where each went."""
    from gdsload.decode.video import VideoDecoder, VideoTransform

    gpu = gpu_fakes.install(monkeypatch, devices=1)
    gpu_fakes.install_nvdec(monkeypatch)
    gpu_fakes.dali_video_mixed_on_cpu(monkeypatch, gpu)
    t = VideoTransform(frames=3, stride=2, clips=1, sampling="random", size=None, dtype="uint8", layout="NTHWC")
    ok_clip, bad_clip = _clip("h264", *size), _clip(codec, *size)
    dec = VideoDecoder(t, batch_size=2, device="mixed")
    kept, out, idx, _ = _decode(dec, [ok_clip, bad_clip], t)
    assert kept == [0, 1] and dec.skipped == 0
    assert dec.routes == {"nvdec": 1, "pyav": 1}
    assert {e[1] for e in gpu.log_calls("nvdec")} == {"h264"}  # NVDEC decoded only the H.264 clip
    for i, clip in enumerate([ok_clip, bad_clip]):
        np.testing.assert_array_equal(out[i], _pyav_frames(clip)[idx[i]])


def test_mixed_video_without_libnvcuvid_decodes_on_the_cpu(monkeypatch):
    """R3: a container without the driver's "video" capability has no libnvcuvid; every video then
    takes the CPU path instead of failing as corrupt."""
    from gdsload.decode.video import VideoDecoder, VideoTransform

    gpu = gpu_fakes.install(monkeypatch, devices=1)
    gpu_fakes.install_nvdec(monkeypatch, table=None)
    gpu_fakes.dali_video_mixed_on_cpu(monkeypatch, gpu, table=None)
    t = VideoTransform(frames=2, stride=1, clips=1, sampling="uniform", size=None, dtype="uint8", layout="NTHWC")
    clips = [_clip("h264", 192, 160, frames=6), _clip("vp9", 192, 160, frames=6)]
    dec = VideoDecoder(t, batch_size=2, device="mixed")
    kept, out, idx, _ = _decode(dec, clips, t)
    assert kept == [0, 1] and dec.routes == {"pyav": 2} and not gpu.log_calls("nvdec")


def test_compat_mode_off_without_a_cufile_config_still_reads(monkeypatch, npy_big):
    """R10b: `KVIKIO_COMPAT_MODE=OFF` (common advice for forcing GDS) with no cufile.json makes every
    `raw_read_async` raise "Missing cuFile configuration file." (KvikIO's
    validate_compat_mode_for_async); the loader called it for every device read, so every batch
    failed with a StorageError. It reads with `pread` unless the async read is really async."""
    gpu = gpu_fakes.install(monkeypatch, devices=1, kvikio=dict(gds=True, mode="OFF"))
    cupy = __import__("sys").modules["cupy"]
    with pytest.raises(RuntimeError, match="Missing cuFile configuration file"):  # the fake, as KvikIO
        gpu.kvikio.CuFile(__file__).raw_read_async(cupy.empty(8, np.uint8), 0, 8, 0)
    loader = DataLoader(str(npy_big), batch_size=4, device="cuda", output="numpy")
    src = npy_big.parent / "src"
    n = 0
    for b in loader:
        for i, k in enumerate(b["__key__"]):
            np.testing.assert_array_equal(host(b["npy"])[i], np.load(src / f"{k}.npy"))
            n += 1
    assert n == 8 and loader.stats()["io_read_modes"] == {"kvikio-gds/pread": 8}


def test_dlpack_handoff_does_not_tie_a_side_stream_consumer_to_the_legacy_stream(monkeypatch, npy):
    """R8, one GPU: `torch.from_dlpack` made the consumer's side stream wait for CuPy's current
    stream, the legacy one, every batch (CuPy's __dlpack__ handshake), so it waited for all the
    default-stream work (ring_safety's burner). Now the handoff runs with the consumer's stream as
    CuPy's current one: nothing to wait for, and default-stream work queued meanwhile stays queued."""
    import torch

    ds, arrays, _ = npy
    gpu = gpu_fakes.install(monkeypatch, devices=1, torch_cuda=True, kvikio=False)
    loader = DataLoader(str(ds), batch_size=4, device="cuda", prefetch_factor=1, num_workers=2)
    burned: list[int] = []
    snaps = []
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for b in loader:
            gpu.null[0].enqueue(lambda: burned.append(1), "default-stream work (a burner)")
            keys, x = list(b["__key__"]), b["npy"]
            s.stream.enqueue(lambda keys=keys, x=x: snaps.append((keys, x.clone())), "consumer kernel")
        s.synchronize()
    assert sum(len(k) for k, _ in snaps) == 24
    for keys, x in snaps:
        for i, k in enumerate(keys):
            np.testing.assert_array_equal(x[i].numpy(), arrays[k], err_msg=k)
    assert gpu.log_calls("dlpack_wait") == [] and burned == []


def test_dlpack_handoff_under_torchrun_without_set_device_stays_on_the_ranks_gpu(monkeypatch, npy):
    """R8, torchrun without `torch.cuda.set_device(LOCAL_RANK)` (which gdsload supports: LOCAL_RANK
    names the GPU): the consumer thread's current device is 0, so CuPy recorded its DLPack event on
    GPU 0 (a context there per rank) and rank 1's stream waited across devices every batch."""
    import torch

    ds, arrays, _ = npy
    gpu = gpu_fakes.install(monkeypatch, devices=2, torch_cuda=True, kvikio=False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    gpu.set_current(1)
    s = torch.cuda.Stream()  # the training stream on the rank's GPU
    gpu.set_current(0)  # the script never set its device
    loader = DataLoader(str(ds), batch_size=4, device="cuda", prefetch_factor=1, num_workers=2)
    n = 0
    with torch.cuda.stream(s):
        for b in loader:
            n += len(b["__key__"])
    assert n == 24 and loader.stats()["ring_device"] == "cuda:1"
    assert gpu.log_calls("dlpack_wait") == []  # before: ("dlpack_wait", 0, 0, s.ptr), an event on GPU 0
    assert gpu.current() == 0  # the training thread's device is left alone


def test_kept_rows_are_gathered_on_the_loaders_gpu_under_torchrun_without_set_device(monkeypatch, tmp_path):
    """R9: with a skipped image the labels are gathered (`arr[keep]`) on the consumer's side;
    `consumer_stream()` had entered the loader's device only to find the stream, so the gather
    ran on the thread's current device: GPU 0 under torchrun without `set_device`, a peer-access
    ValueError (or a label tensor on cuda:0 beside images on cuda:1). The fake was kinder: it
    gathered on the array's own device whatever the current one."""
    import fieldsample as fs
    from gdsload.decode.image import ImageTransform

    ref = fs.make_two_image_source(tmp_path / "src", bad_jpg="s002", bad_png="s005")
    fs.convert_source(tmp_path / "src", tmp_path / "ds")
    gpu = gpu_fakes.install(monkeypatch, devices=2, torch_cuda=True, kvikio=False)
    gpu_fakes.dali_mixed_on_cpu(monkeypatch, gpu)
    monkeypatch.setenv("LOCAL_RANK", "1")
    loader = DataLoader(str(tmp_path / "ds"), batch_size=4, device="cuda", on_error="skip", num_workers=2,
                        output="numpy", transform=ImageTransform(**fs.EVAL))
    got = []
    for b in loader:
        assert b["cls"]._device_id == 1 and b["jpg"]._device_id == 1
        got += [(k, int(host(b["cls"])[i])) for i, k in enumerate(b["__key__"])]
    assert got == [(k, int(k[1:])) for k in sorted(ref) if k not in ("s002", "s005")]
    assert gpu.current() == 0


def test_a_shard_kvikio_reads_in_compat_mode_is_labelled_compat(monkeypatch, tmp_path):
    """R6: under KVIKIO_COMPAT_MODE=AUTO, KvikIO reads a file whose O_DIRECT open fails in compat
    mode, silently; every device read was still counted as "kvikio-gds". Now the backend tries
    O_DIRECT as KvikIO does and labels that file's reads "kvikio-compat"."""
    from gdsload.io.kvikio_backend import direct_io_supported

    assert direct_io_supported(__file__)  # the real probe, on a real file here
    assert not direct_io_supported(str(tmp_path / "absent"))
    ds = npy_dataset(tmp_path / "src", tmp_path / "ds", num_samples=8, shape=(4, 64, 64), dtype="uint8", seed=9,
                     shard_size=40_000)
    shards = sorted(str(p) for p in ds.glob("*.tar"))
    assert len(shards) >= 2
    gpu = gpu_fakes.install(monkeypatch, devices=1, kvikio=dict(gds=True))
    gpu.kvikio.no_direct_io.add(shards[0])
    loader = DataLoader(str(ds), batch_size=4, device="cuda", output="numpy")
    n = sum(len(b["__key__"]) for b in loader)
    modes = loader.stats()["io_read_modes"]
    src = ShardedDataset(str(ds))
    assert src.shard_path(0) == shards[0]
    # one read per 16 KiB row: shard 0's rows through compat, the rest through cuFile
    assert n == 8 and modes == {"kvikio-compat/pread": src.index(0).num_samples,
                                "kvikio-gds/pread": 8 - src.index(0).num_samples}, modes


def test_arenas_register_their_allocation_once_and_reads_address_it_from_its_base(monkeypatch, tmp_path):
    """R10a (and audit 3 C6c): KvikIO's memory_register registers the whole allocation holding the
    buffer; the backend passed the arena itself as cuFile's base, an unregistered address whenever
    the arena does not start the allocation (a CuPy pool split, the 4 KiB alignment offset), so
    every read went through cuFile's bounce buffers; and a second arena in the same allocation
    failed to register (already registered) while the first one's close unregistered both. The
    fake registers by allocation and counts a read as registered only from a registered base."""
    from gdsload.io import Extent
    from gdsload.io.kvikio_backend import KvikioBackend

    gpu = gpu_fakes.install(monkeypatch, devices=1, kvikio=dict(gds=True, config_file=True))
    cupy = __import__("sys").modules["cupy"]
    raw = cupy.empty(3 * 8192 + 512, np.uint8)  # one allocation, two arenas in it (not at its start)
    a1, a2 = raw[512:8704], raw[8704:16896]
    path = tmp_path / "f"
    path.write_bytes(bytes(range(256)) * 64)
    stream = cupy.cuda.Stream(non_blocking=True)
    b1, b2 = KvikioBackend(), KvikioBackend()
    for b, arena in ((b1, a1), (b2, a2)):
        b.order_on(stream.ptr)
        assert b.register(arena)
    base = raw.data.ptr
    assert gpu.kvikio.registered == [(base, raw.nbytes)]  # once
    b2.read([Extent(str(path), 0, 4096)], a2, [4096]).result()
    (how,) = gpu.log_calls("kvikio_read_how")
    assert how[2:] == (8704 + 4096, True)  # offset from the allocation's base, registered
    np.testing.assert_array_equal(a2[4096:8192].get(), np.frombuffer(path.read_bytes()[:4096], np.uint8))
    b1.close()
    assert gpu.kvikio.registered == [(base, raw.nbytes)]  # b2 still reads into it
    b2.close()
    assert gpu.kvikio.registered == []


def test_close_waits_for_the_consumers_last_kernels(monkeypatch, npy):
    """R12: close() waited only for the private copy stream; the last batch's release fence is kept
    for a next pass that never comes, so a side-stream consumer's kernels still reading the last
    batch could run after the ring's memory went back to CuPy's pool. Now close waits for the
    consumer's stream too."""
    ds, arrays, _ = npy
    gpu = gpu_fakes.install(monkeypatch, devices=1, kvikio=False)
    cupy = __import__("sys").modules["cupy"]
    loader = DataLoader(str(ds), batch_size=4, device="cuda", output="numpy", prefetch_factor=1)
    side = cupy.cuda.Stream(non_blocking=True)
    read: list[list] = []
    with side:
        for b in loader:
            keys, x = list(b["__key__"]), b["npy"]
            side.enqueue(lambda keys=keys, x=x: read.append([np.array_equal(np.asarray(x.view(np.ndarray))[i],
                                                                             arrays[k]) for i, k in enumerate(keys)]),
                         "consumer kernel")
        assert side.pending > 0  # the consumer's last kernels are still queued when the loop ends
        loader.close()
    assert side.pending == 0 and sum(map(len, read)) == 24 and all(map(all, read))


def test_doctor_reports_what_nvdec_decodes(monkeypatch):
    """R3: `gdsload doctor` says which videos this GPU's NVDEC takes (and so which take the CPU
    path); on a host without a GPU it says there is none, without raising."""
    from gdsload import doctor
    from gdsload.host import gpu as hg

    report = doctor.collect()  # this host: no CUDA device
    assert report["nvdec"] == {"available": False, "error": "no CUDA device", "codecs": {}}
    gpu_fakes.install_nvdec(monkeypatch)
    text = doctor.render({**report, "gpu_available": True, "nvdec": hg.nvdec_caps(0)})
    line = next(ln for ln in text.splitlines() if "NVDEC (GPU 0)" in ln)
    assert "hevc 144x144+" in line and "av1 no" in line
