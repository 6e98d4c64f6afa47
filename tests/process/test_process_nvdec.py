"""`gdsload.process(..., frames=...)` on a GPU host: NVDEC frames as a torch tensor on the device
(issue 54 item 4), on the CUDA fakes.

The pass's real mixed graph (`NvdecFrames._graph`: `decoders.video(device="mixed", frames=...)`
[-> `resize`]) runs on DALI's CPU backend with PyAV standing in for NVDEC (it decodes every
frame and hands back the asked ones by presentation-order index, after the checks DALI's
`NVDECCache` makes, `gpu_fakes.nvdec_check`), and its output comes back as a fake device list
(`gpu_fakes.FakeMixedPipeline`) whose `copy_to_external` refuses to write past a device
allocation. So the frame indices the pass computes from the demuxed timestamps must give the CPU
path's frames exactly at the native size (both are PyAV's RGB conversion here; on a GPU NVDEC's
conversion differs in the last bits, docs/preprocessing.md), and DALI's resize gives the CPU's
shapes. What the fakes do not show: NVDEC's real speed, its frame numbering on odd streams
(edit lists); the GPU plan's `pass_nvdec` step measures and checks those on a GPU.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

import gpu_fakes
import gdsload
from gdsload.errors import InputError
from gdsload.preprocess import gpu as pgpu
from gdsload.preprocess.run import _differs


class Recorder:
    def __init__(self):
        self.batches: list[dict] = []

    def __call__(self, b):
        """Keeps the batch, its frames copied to the host (a device batch's memory is the pass's
        to reuse once `fn` returns), their type in "frames_type"."""
        fr = b["frames"]
        if getattr(fr, "is_cuda", False):  # what `.cpu()` does on a GPU: wait for torch's stream
            import torch

            torch.cuda.synchronize()
        self.batches.append({**b, "frames_type": (type(fr), getattr(fr, "is_cuda", None), fr.dtype),
                             "frames": np.array(fr.numpy() if hasattr(fr, "numpy") else fr)})
        return [{"w.json": int(w)} for w in b["window"]]


def fake_nvdec(monkeypatch, table=gpu_fakes.HOPPER_NVDEC):
    """A GPU (CuPy, torch's CUDA calls), the NVDEC probe answering from `table`, and the pass's
    mixed pipeline on DALI's CPU backend; returns (gpu, a function giving the decodes so far: (key, w, h, frames asked))."""
    gpu = gpu_fakes.install(monkeypatch, devices=1, kvikio=False, torch_cuda=True)
    gpu_fakes.install_nvdec(monkeypatch, table)
    from nvidia.dali import fn

    real_video = fn.decoders.video
    mixed_video = gpu_fakes.fake_mixed_video_op(gpu, table, [])

    def build(self, resize):
        monkeypatch.setattr(fn.decoders, "video", mixed_video)
        try:
            pipe = self._graph(None, resize)
        finally:
            monkeypatch.setattr(fn.decoders, "video", real_video)
        gpu.log.append(("pass_pipeline", self.device_id, resize, threading.current_thread().name))
        return gpu_fakes.FakeMixedPipeline(gpu, pipe, self.device_id)

    monkeypatch.setattr(pgpu.NvdecFrames, "_build", build)
    def decodes() -> list[tuple]:  # (key, w, h, frames asked) of each NVDEC decode so far
        return [(e[1], e[2], e[3], e[5]) for e in gpu.log if e[0] == "nvdec"]

    return gpu, decodes


def _frames(batches) -> dict[tuple, np.ndarray]:
    out = {}
    for b in batches:
        fr = b["frames"]
        for i, (k, f, w) in enumerate(zip(b["__key__"], b["field"], b["window"])):
            out[(k, f, int(w))] = (np.array(fr[i]), b["t"][i].copy())
    return out


def test_nvdec_frames_reach_fn_on_the_device_and_equal_the_cpu_frames(media_src: Path, tmp_path: Path,
                                                                       monkeypatch) -> None:
    """device="auto" on a GPU host: every H.264 member goes to NVDEC (routes), `fn` gets a torch
    uint8 tensor on the GPU, the windows, times and (native size) frames are the CPU pass's,
    a variable frame rate video included, and the record says the frames are NVDEC's."""
    cpu = Recorder()
    want = gdsload.process(media_src, tmp_path / "cpu", cpu, frames=(2.5, 4), batch_size=3, fields=["mp4"])
    assert want["decode"] == "cpu" and cpu.batches[0]["frames_type"][0] is np.ndarray
    gpu, decodes = fake_nvdec(monkeypatch)
    rec = Recorder()
    got = gdsload.process(media_src, tmp_path / "gpu", rec, frames=(2.5, 4), batch_size=3, fields=["mp4"])
    import torch

    assert got["decode"] == "nvdec:cuda:0" and got["routes"] == {"nvdec": want["members"]}
    assert got["manifest"]["created"]["process"]["decode"] == "nvdec"
    for b in rec.batches:
        assert b["frames_type"] == (torch.Tensor, True, torch.uint8)
        assert isinstance(b["t"], np.ndarray)
    g, c = _frames(rec.batches), _frames(cpu.batches)
    assert list(g) == list(c) and len(g) == got["windows"] == want["windows"]
    for k in c:
        assert np.array_equal(g[k][1], c[k][1]), k
        assert np.array_equal(g[k][0], c[k][0]), k
    assert [b["__key__"] for b in rec.batches] == [b["__key__"] for b in cpu.batches]  # the same batch cuts
    v1 = [d for d in decodes() if d[3] and d[1] == 160][1]  # the VFR video: frames repeat by time
    assert len(set(v1[3])) < len(v1[3])
    assert any(e[0] == "dali_copy" for e in gpu.log)


def test_nvdec_resize_gives_the_cpu_shapes(media_src: Path, tmp_path: Path, monkeypatch) -> None:
    """size= resizes on the device (DALI's resize, not swscale): the same shapes, windows and
    batch cuts as the CPU pass, frames close to its frames (not equal: docs/preprocessing.md)."""
    cpu = Recorder()
    gdsload.process(media_src, tmp_path / "cpu", cpu, frames=(1.0, 3), batch_size=4, size=45, fields=["mp4"])
    fake_nvdec(monkeypatch)
    rec = Recorder()
    gdsload.process(media_src, tmp_path / "gpu", rec, frames=(1.0, 3), batch_size=4, size=45, fields=["mp4"])
    g, c = _frames(rec.batches), _frames(cpu.batches)
    assert list(g) == list(c)
    for k in c:
        assert g[k][0].shape == c[k][0].shape, k
        assert np.abs(g[k][0].astype(int) - c[k][0].astype(int)).mean() < 12, k


def test_members_nvdec_does_not_take_go_to_the_cpu_path_still_on_the_device(media_src: Path, tmp_path: Path,
                                                                           monkeypatch) -> None:
    """A GPU whose NVDEC has no H.264 (the probe's table): each member is routed to PyAV (counted,
    never sent to DALI) and its frames still reach `fn` as a device tensor, equal to the CPU's."""
    cpu = Recorder()
    gdsload.process(media_src, tmp_path / "cpu", cpu, frames=(2.5, 4), batch_size=3, fields=["mp4"])
    table = {**gpu_fakes.HOPPER_NVDEC, "h264": (False, (0, 0), (0, 0))}
    _, decodes = fake_nvdec(monkeypatch, table)
    rec = Recorder()
    got = gdsload.process(media_src, tmp_path / "gpu", rec, frames=(2.5, 4), batch_size=3, fields=["mp4"])
    assert got["routes"] == {"cpu": 6} and decodes() == []
    assert all(b["frames_type"][1] is True for b in rec.batches)
    g, c = _frames(rec.batches), _frames(cpu.batches)
    assert list(g) == list(c) and all(np.array_equal(g[k][0], c[k][0]) for k in c)


def test_device_choice_without_a_gpu_and_refusals(media_src: Path, tmp_path: Path) -> None:
    """No GPU: "auto" keeps PyAV's NumPy frames; "cuda" is refused naming why, as are NVDEC with
    speech, workers or Ray, and an unknown device."""
    rec = Recorder()
    r = gdsload.process(media_src, tmp_path / "a", rec, frames=(1.0, 2), fields=["mp4"])
    assert r["decode"] == "cpu" and rec.batches[0]["frames_type"][0] is np.ndarray
    assert "decode" not in r["manifest"]["created"]["process"]
    for kw, words in (({"device": "cuda"}, "no usable CUDA device"),
                      ({"device": "cuda", "workers": 2}, "no workers="),
                      ({"device": "cuda:0", "engine": "ray"}, "engine='local'"),
                      ({"device": "gpu"}, "'auto', 'cpu', 'cuda' or 'cuda:N'")):
        with pytest.raises(InputError, match=words):
            gdsload.process(media_src, tmp_path / "b", rec, frames=(1.0, 2), **kw)
    with pytest.raises(InputError, match="speech decodes on the CPU"):
        gdsload.process(media_src, tmp_path / "c", rec, speech=5.0, device="cuda")


def test_a_resume_across_cpu_and_nvdec_frames_is_refused() -> None:
    base = {"source": {"id": "x", "version": 1}, "options": {"mode": "frames"}, "fn": "m:f"}
    assert _differs(base, dict(base)) == ""
    assert "decode cpu (this one: nvdec" in _differs(base, {**base, "decode": "nvdec"})
    assert "decode nvdec (this one: cpu" in _differs({**base, "decode": "nvdec"}, base)


def test_sample_picks_follow_the_frame_rule() -> None:
    """Frames at 0, 0.1, 0.5, 0.6, 1.5 (ends 0.2 after each), sampled at 2.5 fps: sample k at
    k/2.5 shows the last frame at or before it; samples run while before the last end (1.7)."""
    from fractions import Fraction as F

    times = [F(0), F(1, 10), F(1, 2), F(3, 5), F(3, 2)]
    picks = pgpu.sample_picks(times, [t + F(1, 5) for t in times], 2.5)
    assert picks.tolist() == [0, 1, 3, 3, 4]  # at 0, 0.4, 0.8, 1.2, 1.6
    late = pgpu.sample_picks([F(1, 2), F(1)], [F(1), F(3, 2)], 2.0)  # before the first frame: the first
    assert late.tolist() == [0, 0, 1]


def test_the_gpu_plans_pass_nvdec_row_on_the_fakes(tmp_path: Path, monkeypatch) -> None:
    """bench/media_gpu_check.py's pass_nvdec row (the GPU plan's step: NVDEC frames/s for a pass)
    with the timestamps `make` demuxed here: every frame of the H.264 clip once, equal to PyAV's
    reference frames (PSNR 99: the fake's NVDEC is PyAV), a frames/s figure, on the GPU."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("media_gpu_check_t", Path(__file__).resolve().parents[2]
                                                  / "bench" / "media_gpu_check.py")
    mgc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mgc)
    d = tmp_path / "media"
    mgc.make(d)
    fake_nvdec(monkeypatch)
    monkeypatch.setattr(mgc, "PASS_SECONDS", 0.2)
    rows = mgc._Rows(None)
    mgc._pass_nvdec(rows, d, "mixed", np.load(d / "ref.npz"), json.loads((d / "meta.json").read_text())["h264"])
    (row,) = rows.rows
    assert (row["step"], row["status"], row["on"], row["expect"]) == ("pass_nvdec", "PASS", "gpu", "gpu"), row
    assert f"{mgc.N} frames, PSNR min 99.0 dB" in row["figure"] and "frames/s for a pass" in row["figure"]
