"""The NVDEC video path without a host round trip (audit 4 R11), on the CUDA fakes.

`VideoDecoder(device="mixed")` decodes, crops, resizes and normalises NVDEC rows in one mixed DALI
pipeline and copies them into device memory with `copy_to_external` on the caller's stream.
Here the real mixed graph (`VideoDecoder._gpu_graph`) runs on DALI's CPU backend with PyAV as
NVDEC (tests/gpu_fakes.py `dali_video_mixed_on_cpu`), so its output must equal the CPU path's
bit for bit (on a GPU only the shapes, dtypes and layouts are equal: GPU resampling rounds
differently); what the fakes record shows where the bytes went.
"""

from __future__ import annotations

import ctypes
import sys

import numpy as np
import pytest

import gpu_fakes
from gdsload.bench import mediagen as mg
from gdsload.decode import media
from gdsload.decode.video import VideoDecoder, VideoTransform


def _clip(codec: str, frames: int, w: int = 64, h: int = 48) -> np.ndarray:
    def pattern(i, hh, ww):
        grid = np.random.default_rng(i).integers(40, 220, (hh // 16 + 1, ww // 16 + 1, 3), dtype=np.uint8)
        return np.kron(grid, np.ones((16, 16, 1), np.uint8))[:hh, :ww]

    return np.frombuffer(mg.encode_video(codec, frames=frames, width=w, height=h, fps=12, gop=4, pattern=pattern),
                         np.uint8)


@pytest.fixture(scope="module")
def clips() -> dict[str, np.ndarray]:
    # 8 frames: shorter than a 4-frame clip at stride 3 (10 frames), so its clips end in padding
    return {"long": _clip("h264", 14), "short": _clip("h264", 8), "tiny_hevc": _clip("hevc", 8, 160, 96)}


def _inputs(encoded: list[np.ndarray], t: VideoTransform):
    metas = [media.probe(e.tobytes(), "video") for e in encoded]
    n = len(encoded)
    return metas, media.draws(3, 1, np.arange(n), 0x7669, k=6), (n, *t.output_shape((metas[0]["height"],
                                                                                     metas[0]["width"])))


def _cpu(encoded, t):
    metas, u, shape = _inputs(encoded, t)
    out, idx = np.zeros(shape, np.dtype(t.dtype)), np.zeros((len(encoded), *t.frames_shape()), np.int64)
    kept = VideoDecoder(t, batch_size=len(encoded)).decode_into(encoded, [f"v{i}" for i in range(len(encoded))],
                                                                metas, u, out, idx)
    return kept, out, idx


def _mixed(monkeypatch, encoded, t, *, host: bool = True):
    """The mixed path into a fake device array on a private stream; (kept, output read back,
    frame indices, gpu, stream, decoder, the video operator's arguments)."""
    gpu = gpu_fakes.install(monkeypatch, devices=1, kvikio=False)
    gpu_fakes.install_nvdec(monkeypatch)
    ops = gpu_fakes.dali_video_mixed_on_cpu(monkeypatch, gpu)
    cupy = sys.modules["cupy"]
    metas, u, shape = _inputs(encoded, t)
    dst = cupy.zeros(shape, np.dtype(t.dtype))
    np.ndarray.fill(dst, 7)  # what a slot holds from its last batch: every byte must be written
    stream = cupy.cuda.Stream(non_blocking=True)
    idx = np.zeros((len(encoded), *t.frames_shape()), np.int64)
    dec = VideoDecoder(t, batch_size=len(encoded), device="mixed")
    kept = dec.decode_into(encoded, [f"v{i}" for i in range(len(encoded))], metas, u, dst, idx,
                           host=np.zeros(shape, np.dtype(t.dtype)) if host else None,
                           stream=ctypes.c_void_p(stream.ptr))
    return kept, dst.get(stream), idx, gpu, stream, dec, ops


TRANSFORMS = {
    "train-f32-NCTHW": VideoTransform(frames=4, stride=3, clips=1, size=16, train=True, dtype="float32"),
    "train-f16-NTHWC-2clips": VideoTransform(frames=4, stride=3, clips=2, size=16, train=True, dtype="float16",
                                             layout="NTHWC", sampling="uniform"),
    "eval-u8-NCTHW-2clips": VideoTransform(frames=4, stride=3, clips=2, size=16, train=False, resize=20,
                                           dtype="uint8", mean=None, std=None),
    "raw-NCTHW-2clips": VideoTransform(frames=4, stride=3, clips=2, size=None, dtype="uint8", sampling="center"),
    "raw-NTHWC": VideoTransform(frames=4, stride=3, size=None, dtype="uint8", layout="NTHWC"),
}


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_nvdec_rows_go_to_the_device_slot_in_one_copy_with_the_cpu_paths_output(monkeypatch, clips, name):
    """R11: before, NVDEC frames came back to the host (`as_cpu()`), were cropped by a CPU pipeline
    and copied to the device again. Now: no `as_cpu`, no host-to-device copy, one
    `copy_to_external` of the whole batch (consecutive rows) on the caller's stream, blocking;
    the output (padding zeros included, from a `cudaMemsetAsync` on that stream) equals the CPU
    path's in shape, dtype, layout and, with the CPU-run graph, value; the video operator is
    built with `affine=False`."""
    t = TRANSFORMS[name]
    encoded = [clips["long"], clips["short"], clips["long"]]
    kept_cpu, want, idx_cpu = _cpu(encoded, t)
    kept, got, idx, gpu, stream, dec, ops = _mixed(monkeypatch, encoded, t)
    assert kept == kept_cpu == [0, 1, 2] and dec.routes == {"nvdec": 3}
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(idx, idx_cpu)
    assert (idx[1] < 0).any() and not (idx[0] < 0).any()  # row 1's clips end in padding
    np.testing.assert_array_equal(got, want)
    assert not gpu.log_calls("dali_as_cpu") and not gpu.log_calls("memcpyAsync")
    copies = gpu.log_calls("dali_copy")
    assert [(c[1], c[2], c[3]) for c in copies] == [(stream.ptr, want.nbytes, False)]
    assert all(c[1] == stream.ptr for c in gpu.log_calls("memsetAsync")) and gpu.log_calls("memsetAsync")
    assert ops == [{"affine": False}]  # the only argument besides `frames`
    # each video decoded once, its frames those the CPU path decodes: sorted, unique, whatever the clips
    wanted = [tuple(np.unique(r[r >= 0]).tolist()) for r in idx]
    assert [e[5] for e in gpu.log_calls("nvdec")] == wanted


def test_rows_on_the_cpu_path_cross_to_the_device_once(monkeypatch, clips):
    """A batch whose middle row NVDEC does not take (HEVC under 144x144 on Hopper): the NVDEC rows
    0 and 2 are copied one by one (not consecutive) straight from DALI; row 1 is decoded by PyAV,
    cropped on the host into `host=` and copied once, its bytes only, on the same stream."""
    t = TRANSFORMS["train-f32-NCTHW"]
    tiny = _clip("hevc", 14, 160, 96)
    encoded = [_clip("h264", 14, 160, 96), tiny, _clip("h264", 14, 160, 96)]
    _, want, _ = _cpu(encoded, t)
    kept, got, _, gpu, stream, dec, _ = _mixed(monkeypatch, encoded, t)
    assert kept == [0, 1, 2] and dec.routes == {"nvdec": 2, "pyav": 1}
    np.testing.assert_array_equal(got, want)
    row = want[0].nbytes
    assert [(c[1], c[2]) for c in gpu.log_calls("dali_copy")] == [(stream.ptr, row), (stream.ptr, row)]
    assert [(c[1], c[2], c[3]) for c in gpu.log_calls("memcpyAsync")] == [(stream.ptr, row, 1)]  # H2D, row 1
    assert not gpu.log_calls("dali_as_cpu")


def test_without_a_host_buffer_the_cpu_rows_use_a_scratch_and_wait(monkeypatch, clips):
    """`host=None`: the CPU path's rows are made in a scratch array, and the stream is synchronised
    before it goes (a deferred copy must not read freed memory)."""
    t = TRANSFORMS["raw-NTHWC"]
    encoded = [clips["tiny_hevc"], _clip("h264", 8, 160, 96)]  # size=None: one frame size
    _, want, _ = _cpu(encoded, t)
    kept, got, _, gpu, stream, dec, _ = _mixed(monkeypatch, encoded, t, host=False)
    assert kept == [0, 1] and dec.routes == {"nvdec": 1, "pyav": 1}
    np.testing.assert_array_equal(got, want)
    syncs = [e for e in gpu.log if e[0] == "stream_sync" and e[1] == stream.ptr]
    assert syncs and stream.pending == 0


def test_mixed_refuses_a_host_destination_and_a_wrong_stream(monkeypatch, clips):
    """A host `dst` with device="mixed" would be the GPU -> host round trip: refused, naming it; so is
    a device `dst` of another dtype (DALI would copy its own byte count to it). A stream DALI
    cannot read (a CuPy Stream object: copy_to_external reads only ctypes.c_void_p, anything else
    is the legacy stream) is refused too."""
    t = TRANSFORMS["raw-NTHWC"]
    gpu = gpu_fakes.install(monkeypatch, devices=1, kvikio=False)
    gpu_fakes.install_nvdec(monkeypatch)
    gpu_fakes.dali_video_mixed_on_cpu(monkeypatch, gpu)
    metas, u, shape = _inputs([clips["long"]], t)
    dec = VideoDecoder(t, batch_size=1, device="mixed")
    idx = np.zeros((1, *t.frames_shape()), np.int64)
    with pytest.raises(ValueError, match="dst is a host array"):
        dec.decode_into([clips["long"]], ["v0"], metas, u, np.zeros(shape, np.uint8), idx)
    cupy = sys.modules["cupy"]
    with pytest.raises(ValueError, match="dst is float32, the transform makes uint8"):
        dec.decode_into([clips["long"]], ["v0"], metas, u, cupy.zeros(shape, np.float32), idx)
    with pytest.raises(TypeError, match="ctypes.c_void_p"):
        dec.decode_into([clips["long"]], ["v0"], metas, u, cupy.zeros(shape, np.uint8), idx,
                        stream=cupy.cuda.Stream(non_blocking=True))
    assert not gpu.log_calls("nvdec")


def test_fake_copy_to_external_fails_where_the_real_one_would_corrupt(monkeypatch):
    """The fake's own check: DALI copies its byte count to any pointer; one past the end of its
    device allocation raises here (a silent overrun on a GPU)."""
    gpu = gpu_fakes.install(monkeypatch, devices=1, kvikio=False)
    cupy = sys.modules["cupy"]
    out = gpu_fakes.FakeTensorListGPU(gpu, np.ones((2, 8), np.uint8), 2, 0)
    small = cupy.zeros((1, 8), np.uint8)
    with pytest.raises(RuntimeError, match="past its device allocation"):
        out.copy_to_external(ctypes.c_void_p(small.data.ptr), cuda_stream=None, non_blocking=False)
    big = cupy.zeros((3, 8), np.uint8)
    out[1].copy_to_external(ctypes.c_void_p(big.data.ptr + 8), cuda_stream=None, non_blocking=False)
    assert big.get().tolist() == [[0] * 8, [1] * 8, [0] * 8]


def test_device_ring_gets_nvdec_video_without_a_host_to_device_copy(monkeypatch, tmp_path):
    """The loader (R11 "fill.py"): before, a device ring's video field was decoded into its host
    copy ("__h_") and copied host-to-device for the whole batch. Now `SlotFiller._media` hands
    the device slot and the private stream to the mixed decoder: DALI copies each batch into the
    slot on the loader's private stream, and the only host-to-device copies are the frame
    indices (int64, tiny). The batches equal the CPU loader's."""
    import gdsload
    from gdsload.convert.shards import DatasetWriter

    root = tmp_path / "ds"
    with DatasetWriter(root) as w:
        for i, n in enumerate([14, 8, 12, 14, 10]):
            w.write(f"v{i}", {"mp4": mg.encode_video("h264", frames=n, gop=4), "cls": b"%d" % i})
    t = {"mp4": VideoTransform(frames=4, stride=3, size=16, train=True, dtype="float32")}
    cpu = {k: (x, f) for b in gdsload.DataLoader(str(root), batch_size=2, output="numpy", transform=t, seed=4)
           for k, x, f in zip(b["__key__"], b["mp4"], b["mp4.frames"])}
    gpu = gpu_fakes.install(monkeypatch, devices=1, kvikio=False)
    gpu_fakes.install_nvdec(monkeypatch)
    gpu_fakes.dali_video_mixed_on_cpu(monkeypatch, gpu)
    loader = gdsload.DataLoader(str(root), batch_size=2, output="numpy", transform=t, seed=4, device="cuda")
    seen = 0
    for b in loader:
        x = b["mp4"]
        assert hasattr(x, "__cuda_array_interface__")
        for k, row, f in zip(b["__key__"], x.get(), np.asarray(b["mp4.frames"].get())):
            np.testing.assert_array_equal(row, cpu[k][0], err_msg=k)
            np.testing.assert_array_equal(f, cpu[k][1], err_msg=k)
            seen += 1
    assert seen == 5
    private = {ptr for _, ptr, _, nb in gpu.log_calls("stream_create") if nb}
    copies = gpu.log_calls("dali_copy")
    row = 3 * 4 * 16 * 16 * 4
    assert len(copies) == 3 and all(c[1] in private and not c[3] for c in copies)
    assert sorted(c[2] for c in copies) == [row, 2 * row, 2 * row]
    assert all(size <= 2 * 4 * 8 for _, _, size, _, _ in gpu.log_calls("memcpyAsync"))  # frame indices only
    assert not gpu.log_calls("dali_as_cpu") and loader.stats()["media"]["mp4"]["frames_decoded"] > 0


def test_gpu_checks_video_step_runs_the_mixed_path(monkeypatch, tmp_path):
    """bench/media_gpu_check.py `check --device mixed` (gpu_check.sh part 2's media step) decodes
    into device memory on a private stream, as the loader does: on Hopper's NVDEC table every clip
    goes through the mixed pipeline (rows on "gpu", as expected, PSNR against PyAV), with no
    `as_cpu` and no host-to-device copy. Before, it passed a host array, which the mixed decoder
    now refuses (the round trip)."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import media_gpu_check as mc

    mc.make(tmp_path / "m")
    gpu = gpu_fakes.install(monkeypatch, devices=1, kvikio=False)
    gpu_fakes.install_nvdec(monkeypatch)
    gpu_fakes.dali_video_mixed_on_cpu(monkeypatch, gpu)
    rows = {r["step"]: r for r in mc.check(tmp_path / "m", "mixed", runs=1)}
    for codec in mc.CODECS:
        row = rows[f"video_{codec}"]
        assert (row["status"], row["on"], row["expect"]) == ("PASS", "gpu", "gpu"), row
        assert row["figure"].startswith("nvdec: ") and "PSNR min 99.0" in row["figure"]
        assert "cropped and normalised: PSNR min" in row["figure"]
    private = {ptr for _, ptr, _, nb in gpu.log_calls("stream_create") if nb}
    copies = gpu.log_calls("dali_copy")
    assert all(c[1] in private for c in copies)
    raw = mc.ROWS * 2 * 6 * mc.H * mc.W * 3  # uint8 (2 clips of 6 frames), untouched
    crop = mc.ROWS * 2 * 3 * 6 * mc.H * mc.H * 4  # float32 NCTHW, the centre square
    assert sorted(c[2] for c in copies) == sorted([raw, raw, crop] * len(mc.CODECS))  # checked, 1 timed, cropped
    assert not gpu.log_calls("dali_as_cpu") and not gpu.log_calls("memcpyAsync")
