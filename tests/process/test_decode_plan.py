"""A frames pass decodes only what its samples need (`gdsload.preprocess.media._frames`): the
windows are those of decoding every frame (`plan=False`), byte for byte, on B-frame videos with
short groups of pictures, a variable frame rate and both, at sampling rates below, near and at
the frame rate; frames were really left out (the test would pass vacuously otherwise), non-
reference ones among them; and the look-ahead limit decodes a long group whole, still exact.
Whole passes with frames left out (here with FFmpeg's decoder threads, in 2 workers with one
each) write the bytes of a pass decoding every frame, and a pass SIGKILLed mid-decode or after
`fn` and resumed writes those bytes too."""

from __future__ import annotations

import io
from fractions import Fraction
from pathlib import Path

import mediakit as mk
import numpy as np
import pytest
from mediakit import VFR_MS

from gdsload.decode import passmedia as pmedia

X264_B = "bframes=3:b-adapt=0:b-pyramid=normal:scenecut=0"  # B-frames always; non-reference ones among them


def _video(n: int, *, fps: int = 10, gop: int = 12, times_ms: list[int] | None = None,
           params: str = X264_B) -> bytes:
    """H.264 in MP4, 96x64, frame i grey at `mk.level(i)`, an IDR every `gop` frames."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        v = c.add_stream("libx264", rate=fps)
        v.width, v.height, v.pix_fmt = 96, 64, "yuv420p"
        v.options = {"preset": "veryfast", "x264-params": f"{params}:keyint={gop}:min-keyint={gop}"}
        if times_ms is not None:
            v.codec_context.time_base = Fraction(1, 1000)
        for i in range(n):
            f = av.VideoFrame.from_ndarray(np.full((64, 96, 3), mk.level(i), np.uint8), format="rgb24")
            if times_ms is not None:
                f.pts, f.time_base = times_ms[i], Fraction(1, 1000)
            for p in v.encode(f):
                c.mux(p)
        for p in v.encode():
            c.mux(p)
    return buf.getvalue()


def _windows(data: bytes, fps: float, *, plan: bool, stats: dict | None = None) -> list[tuple]:
    f = pmedia.RangeFile(lambda o, n: data[o : o + n], 0, len(data))
    return [(w.index, w.data.tobytes(), w.data.shape, w.t.tobytes())
            for w in pmedia.frame_windows(f, fps, 3, None, threads=1, plan=plan, stats=stats)]


def _nonref_packets(data: bytes) -> int:
    import av

    with av.open(io.BytesIO(data)) as c:
        s = c.streams.video[0]
        n = pmedia._avcc_nal_size(s)
        return sum(pmedia._nal_kind(p, n)[1] for p in c.demux(s) if p.size)


VFR = sorted({int(x) for x in np.cumsum(np.random.default_rng(7).integers(20, 260, 70))})


@pytest.mark.parametrize("name, make", [
    ("cfr-b", lambda: _video(90, gop=12)),
    ("vfr-b", lambda: _video(len(VFR), gop=9, times_ms=VFR)),
    ("vfr-fixture", lambda: mk.video(times_ms=VFR_MS, audio=False, seconds=2.0)),
    ("p-only", lambda: _video(90, gop=25, params="bframes=0")),
])
def test_planned_decode_gives_the_windows_of_decoding_every_frame(name, make) -> None:
    data = make()
    dropped = {}
    for fps in (0.3, 1.0, 2.5, 7.0, 10.0):
        st: dict = {}
        got = _windows(data, fps, plan=True, stats=st)
        want = _windows(data, fps, plan=False)
        assert got == want, f"{name} at {fps} fps"
        assert len(want) >= 1
        dropped[fps] = st
    if name != "vfr-fixture":  # one IDR there: the last group is always decoded whole
        assert dropped[0.3]["dropped"] > dropped[10.0]["dropped"] >= 0 and dropped[1.0]["dropped"] > 0
    if name.endswith("-b"):
        assert _nonref_packets(data) > 10
        assert dropped[2.5]["dropped_nonref"] > 0  # B-frames left out between picks, not only group tails


def test_the_frames_picked_follow_the_rule_with_frames_left_out() -> None:
    """On a variable-rate B-frame video sampled at 2 fps, frame k is the last shown at or before
    k/2 s (checked by grey level against the timestamps), with frames left out of the decode."""
    data = _video(len(VFR), gop=9, times_ms=VFR)
    st: dict = {}
    f = pmedia.RangeFile(lambda o, n: data[o : o + n], 0, len(data))
    got = [mk.frame_of(fr.mean()) for w in pmedia.frame_windows(f, 2.0, 3, None, threads=1, stats=st)
           for fr, t in zip(w.data, w.t) if t >= 0]
    rel = [ms - VFR[0] for ms in VFR]  # times count from the container's start: the first frame
    want = [max(i for i, ms in enumerate(rel) if ms <= 500 * k) % 20 for k in range(len(got))]
    assert got == want and st["dropped"] > len(VFR) // 3 and len(got) > rel[-1] // 500


def test_a_group_over_the_look_ahead_limit_is_decoded_whole(monkeypatch) -> None:
    data = _video(90, gop=30)
    want = _windows(data, 1.0, plan=False)
    st: dict = {}
    assert _windows(data, 1.0, plan=True, stats=st) == want and st["dropped"] > 0
    monkeypatch.setattr(pmedia, "GOP_LIMIT_PACKETS", 10)
    st2: dict = {}
    assert _windows(data, 1.0, plan=True, stats=st2) == want and st2["dropped"] == 0


def test_nal_headers() -> None:
    """IDR and non-reference read from the first slice's NAL header behind 4-byte lengths; a
    packet with no slice is neither (kept)."""
    def pkt(*nals: bytes) -> bytes:
        return b"".join(len(n).to_bytes(4, "big") + n for n in nals)

    sei, idr, p_ref, b_nonref = b"\x06\x05\x00", b"\x65\x88\x80", b"\x41\x9a\x00", b"\x01\x9e\x00"
    assert pmedia._nal_kind(pkt(sei, idr), 4) == (True, False)
    assert pmedia._nal_kind(pkt(p_ref), 4) == (False, False)
    assert pmedia._nal_kind(pkt(sei, b_nonref), 4) == (False, True)
    assert pmedia._nal_kind(pkt(sei), 4) == (False, False)
    assert pmedia._nal_kind(b"\x00\x00", 4) == (False, False)


@pytest.fixture(scope="module")
def bframe_src(tmp_path_factory) -> Path:
    """Three B-frame videos with short groups (one at a variable rate), in two input shards."""
    import gdsload

    root = tmp_path_factory.mktemp("plan") / "src"
    pad = bytes(12000)  # a non-media field, so the small videos span input shards
    with gdsload.ShardWriter(root, shard_size="16KiB") as w:
        w.write({"__key__": "b0", "mp4": _video(60, gop=8), "bin": pad})
        w.write({"__key__": "b1", "mp4": _video(len(VFR), gop=9, times_ms=VFR), "bin": pad})
        w.write({"__key__": "b2", "mp4": _video(45, gop=6), "bin": pad})
    assert len(gdsload.open_dataset(root).shards) >= 2
    return root


KW = dict(frames=(1.5, 2), size=32, batch_size=3, shard_size="16KiB")


def test_passes_with_frames_left_out_write_the_bytes_of_decoding_every_frame(bframe_src, tmp_path, monkeypatch):
    """Here (FFmpeg's decoder threads) and in 2 workers (one thread each), with frames left out,
    a pass writes the bytes of a pass that decodes every frame."""
    import passfns
    from mediakit import assert_same_output

    import gdsload

    drops = []
    real = pmedia._plan_gop

    def spy(gop, *a, **k):
        kept = real(gop, *a, **k)
        drops.append(len(gop) - len(kept))
        return kept

    monkeypatch.setattr(pmedia, "_plan_gop", spy)
    gdsload.process(bframe_src, tmp_path / "here", passfns.frame_stats, **KW)
    assert sum(drops) > 20
    monkeypatch.setattr(pmedia, "_avcc_nal_size", lambda s: 0)  # no plan: every frame decoded
    gdsload.process(bframe_src, tmp_path / "all", passfns.frame_stats, **KW)
    monkeypatch.undo()
    gdsload.process(bframe_src, tmp_path / "w2", passfns.frame_stats, workers=2, **KW)
    assert_same_output(tmp_path / "here", tmp_path / "all")
    assert_same_output(tmp_path / "w2", tmp_path / "all")


@pytest.mark.parametrize("point", ["decode", "fn"])
def test_sigkill_then_resume_with_frames_left_out_is_exact(point, bframe_src, tmp_path) -> None:
    import signal
    import subprocess
    import sys

    import passfns
    from mediakit import assert_same_output

    import gdsload
    from gdsload.preprocess.unit import KILL_ENV

    ref = gdsload.process(bframe_src, tmp_path / "ref", passfns.frame_stats, **KW)
    n = {"decode": ref["windows"] // 2, "fn": ref["batches"] // 2}[point]
    here = Path(__file__).parent
    env = mk.cli_env(**{KILL_ENV: f"{point}:{n}"})
    p = subprocess.run([sys.executable, "-m", "gdsload", "process", str(bframe_src), str(tmp_path / "out"), "--fn",
                        "passfns:frame_stats", "--frames", "1.5:2", "--size", "32", "--batch-size", "3",
                        "--shard-size", "16KiB", "-q"], cwd=here, env=env, capture_output=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr.decode()[-2000:]
    gdsload.process(bframe_src, tmp_path / "out", passfns.frame_stats, resume=True, **KW)
    assert_same_output(tmp_path / "out", tmp_path / "ref")


def test_timestamps_going_back_in_a_planned_group_are_refused(monkeypatch) -> None:
    """Leaving frames out assumes timestamps rise in the decoder's output order; a frame of a group
    with frames left out that comes before the frame shown ahead of it stops the member with a
    ValueError (on_error applies) naming it. Frames of groups decoded whole are not checked: a
    repeated timestamp there decodes as without the plan."""
    import av

    data = _video(30, gop=10)
    with av.open(io.BytesIO(data)) as c:
        frames = list(c.decode(video=0))

    def fake(swap: bool, plan_them: bool):
        def gen(av_, c, s, picker, stats, planned):
            out = list(frames)
            if swap:
                out[5], out[6] = out[6], out[5]
            if plan_them:
                planned.update(f.pts for f in out)
            yield from out
        return gen

    f = lambda: pmedia.RangeFile(lambda o, n: data[o : o + n], 0, len(data))  # noqa: E731
    monkeypatch.setattr(pmedia, "_frames", fake(swap=True, plan_them=True))
    with pytest.raises(ValueError, match=r"frame timestamps go back \(\d+ after \d+, time base 1/\d+\)"):
        list(pmedia.frame_windows(f(), 10.0, 3, None))
    monkeypatch.setattr(pmedia, "_frames", fake(swap=True, plan_them=False))
    assert len(list(pmedia.frame_windows(f(), 10.0, 3, None))) >= 9
