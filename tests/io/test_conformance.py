"""One conformance suite, run against every backend this host has (see `CASES` in conftest.py):
posix, posix with O_DIRECT, fsspec over file:// and over a real local HTTP server, and KvikIO
over NumPy and CuPy buffers on a GPU host."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gdsload.errors import FormatError, GdsloadError
from gdsload.io import Backend, Extent

PAD = 0xAB  # sentinel in the bytes of `out` that no extent covers


@st.composite
def read_requests(draw: st.DrawFn) -> tuple[list[int], list[tuple[int, int, int]]]:
    """File sizes, and a shuffled list of (file, offset, nbytes): non-overlapping within a file,
    adjacent or with small (tar header) or large gaps, some of zero length."""
    sizes = draw(st.lists(st.one_of(st.integers(0, 50_000), st.integers(0, 400_000)), min_size=1, max_size=2))
    extents = []
    for f, size in enumerate(sizes):
        pos = 0
        for _ in range(draw(st.integers(0, 12))):
            gap = draw(st.sampled_from([0, 512, 1024, 70_000, 300_000]) | st.integers(0, 300_000))
            nbytes = draw(st.just(0) | st.integers(1, 5000) | st.integers(1, 80_000))
            if pos + gap + nbytes > size:
                break
            extents.append((f, pos + gap, nbytes))
            pos += gap + nbytes
    return sizes, draw(st.permutations(extents))


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request=read_requests(), seed=st.integers(0, 2**32 - 1), lead=st.integers(0, 16),
       tail=st.integers(0, 16))
def test_random_extents_read_the_file_slices(case, backend, request, seed, lead, tail):
    sizes, picks = request
    rng = np.random.default_rng(seed)
    contents = [rng.integers(0, 256, size, dtype=np.uint8) for size in sizes]
    names = [case.write(c)[1] for c in contents]
    extents = [Extent(names[f], off, n) for f, off, n in picks]
    out_offsets = (lead + np.concatenate([[0], np.cumsum([n for _, _, n in picks])[:-1]])).astype(int).tolist()
    total = sum(n for _, _, n in picks)
    out = case.filled(lead + total + tail, PAD)

    assert backend.read(extents, out, out_offsets[: len(extents)]).result(timeout=30) == total

    got = case.to_numpy(out)
    want = np.concatenate([np.full(lead, PAD, np.uint8)] + [contents[f][off : off + n] for f, off, n in picks]
                          + [np.full(tail, PAD, np.uint8)])
    np.testing.assert_array_equal(got, want)


def test_backend_meets_the_protocol(case, backend):
    assert isinstance(backend, Backend)
    assert backend.name in ("posix", "posix-odirect", "fsspec", "kvikio-gds", "kvikio-posix", "kvikio-compat")
    assert backend.device_capable == case.id.startswith("kvikio")
    assert set(backend.stats()) >= {"reads", "bytes_read"}


def test_empty_request_reads_nothing(case, backend):
    out = case.filled(4, PAD)
    assert backend.read([], out, []).result(timeout=10) == 0
    np.testing.assert_array_equal(case.to_numpy(out), np.full(4, PAD, np.uint8))


@pytest.mark.parametrize("offset,nbytes", [(9000, 2000), (20_000, 10), (0, 10_001)])
def test_reading_past_eof_raises_format_error_naming_the_path(case, backend, offset, nbytes):
    _, name = case.write(np.arange(10_000, dtype=np.uint8))
    ok = Extent(name, 0, 100)
    out = case.alloc(100 + nbytes)
    future = backend.read([ok, Extent(name, offset, nbytes)], out, [0, 100])
    with pytest.raises(FormatError) as info:
        future.result(timeout=30)
    message = str(info.value)
    assert name in message and str(offset) in message and str(nbytes) in message
    assert "10000" in message  # the file's real size


def test_missing_file_is_a_clear_error(case, backend):
    _, name = case.write(b"x")
    missing = name.replace(".bin", "-missing.bin")
    with pytest.raises(GdsloadError, match="missing"):
        backend.read([Extent(missing, 0, 1)], case.alloc(1), [0]).result(timeout=30)


def test_bad_arguments_fail_before_any_io(case, backend):
    _, name = case.write(b"0123456789")
    with pytest.raises(GdsloadError, match="does not fit"):
        backend.read([Extent(name, 0, 8)], case.alloc(4), [0])
    with pytest.raises(GdsloadError, match="pair up"):
        backend.read([Extent(name, 0, 1)], case.alloc(4), [0, 1])
    with pytest.raises(GdsloadError, match="uint8"):
        backend.read([Extent(name, 0, 1)], np.zeros(4, np.float32), [0])
    with pytest.raises(GdsloadError, match=">= 0"):
        Extent(name, -1, 4)


def test_many_threads_read_concurrently(case, backend):
    content = np.random.default_rng(7).integers(0, 256, 1 << 20, dtype=np.uint8)
    _, name = case.write(content)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(10):
                starts = np.sort(rng.choice(len(content) - 5000, size=8, replace=False))
                picks = [(int(s), int(rng.integers(0, 5000))) for s in starts]
                offsets = np.concatenate([[0], np.cumsum([n for _, n in picks])[:-1]]).astype(int).tolist()
                out = case.alloc(sum(n for _, n in picks))
                backend.read([Extent(name, s, n) for s, n in picks], out, offsets).result(timeout=30)
                want = np.concatenate([content[s : s + n] for s, n in picks])
                np.testing.assert_array_equal(case.to_numpy(out), want)
        except BaseException as exc:  # surfaced in the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[0]


def test_adjacent_extents_are_coalesced_into_one_read(case):
    content = np.random.default_rng(3).integers(0, 256, 64 * 1024, dtype=np.uint8)
    _, name = case.write(content)
    extents = [Extent(name, i * 4096, 4096) for i in range(10)]
    with case.open() as b:
        out = case.alloc(10 * 4096)
        assert b.read(extents, out, [i * 4096 for i in range(10)]).result(timeout=30) == 40960
        stats = b.stats()
    assert stats["reads"] == 1, stats
    assert stats["bytes_read"] == 40960
    np.testing.assert_array_equal(case.to_numpy(out), content[:40960])


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _settles_to(limit: int, timeout_s: float = 5.0) -> int:
    """Open fds once at most `limit` (server-side sockets close asynchronously), else the last count."""
    deadline = time.monotonic() + timeout_s
    while (n := _open_fds()) > limit and time.monotonic() < deadline:
        time.sleep(0.02)
    return n


def test_close_releases_file_descriptors(case):
    names = [case.write(np.full(8192, i, np.uint8))[1] for i in range(3)]

    def use(b) -> None:
        out = case.alloc(3 * 100)
        b.read([Extent(n, 4000, 100) for n in names], out, [0, 100, 200]).result(timeout=30)

    with case.open() as warm:  # one-off process state (fsspec's event loop, CUDA context)
        use(warm)
    before = _settles_to(_open_fds())
    b = case.open()
    use(b)
    if case.id.startswith("posix"):
        assert _open_fds() >= before + 3  # one cached fd per file
    b.close()
    b.close()  # idempotent
    assert _settles_to(before) <= before
    with pytest.raises(GdsloadError, match="closed"):
        use(b)
