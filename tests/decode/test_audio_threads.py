"""One AudioDecoder, several reader threads at once (as a loader's `num_workers` call it).

DALI's outputs are views valid until the pipeline's next run (by any thread): each whole decode is
cut to its crop under the decoder's lock, into rows of the calling thread (`AudioDecoder._keep`),
and read from there before that thread's next batch. Two threads decoding at once must get what
one thread gets, batch for batch.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from gdsload.bench.mediagen import encode_audio
from gdsload.decode.audio import AudioDecoder, AudioTransform
from gdsload.decode.media import probe


@pytest.fixture(scope="module")
def recordings() -> list[np.ndarray]:
    """8 FLAC recordings of 1.5 s, tones of different pitches; every other one stereo."""
    return [np.frombuffer(encode_audio("flac", seconds=1.5, freq=200.0 + 97 * i, channels=1 + i % 2), np.uint8)
            for i in range(8)]


def _batch(d: AudioDecoder, encoded: list[np.ndarray], u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    dst = np.full((len(encoded),) + d.t.output_shape(), np.nan, np.float32)
    length = np.zeros(len(encoded), np.int64)
    metas = [probe(e.tobytes(), "audio") for e in encoded]
    kept = d.decode_into(encoded, [f"a{i}" for i in range(len(encoded))], metas, u, dst, length)
    assert kept == list(range(len(encoded)))
    return dst, length


@pytest.mark.parametrize("features,mono", [(None, True), (None, False), ("logmel", True)])
def test_two_threads_get_what_one_gets(recordings: list[np.ndarray], features: str | None, mono: bool) -> None:
    t = AudioTransform(seconds=1.0, crop="random", features=features, mono=mono)
    d = AudioDecoder(t, batch_size=4, threads=1)
    batches = [recordings[:4], recordings[4:]]
    draws = [np.random.default_rng(k).random((4, 6)) for k in range(2)]
    want = [_batch(d, b, u) for b, u in zip(batches, draws)]
    assert not np.array_equal(want[0][0], want[1][0])  # the batches differ
    for x, n in want:
        assert (n > 0).all() and np.isfinite(x).all()
    errors: list[str] = []

    def work(k: int) -> None:
        for rep in range(12):
            x, n = _batch(d, batches[k], draws[k])
            if not (np.array_equal(x, want[k][0]) and np.array_equal(n, want[k][1])):
                errors.append(f"thread {k}, batch {rep}: not the single thread's batch")

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not any(th.is_alive() for th in threads)
    assert not errors, errors[:3]
