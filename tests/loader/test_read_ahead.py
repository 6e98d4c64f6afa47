"""Issue 55: a reader reads the next batch while the batch before it decodes, also into the slot
whose last batch is still the training loop's variable (`Ring.acquire(defer=True)`). Before, with
the default 2 slots of a decoding loader, the reader of batch k+2 waited in `acquire` until batch
k+1 was handed out (the loop variable still named batch k), so DALI waited for every batch's plan,
read and check (counted here: 0 of 10 reads started during a DALI run, against 8 of 10 at
0d29bb3). Real DALI CPU pipelines; the decoder factory only holds batch 1's decode until batch 2's
slot is taken (or 10 s pass)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from gdsload.convert.engine import ConvertOptions, convert
from gdsload.loader.dataloader import DataLoader
from gdsload.sampledata import make_image_folder

EVAL = dict(train=False, size=32, resize=36)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("read_ahead")
    make_image_folder(root / "src", num_images=16, num_classes=2, seed=5, mean_size=(64, 48), workers=1)
    convert(str(root / "src"), str(root / "ds"), ConvertOptions(workers=1, progress=False, shard_size=60_000))
    return root / "ds"


@pytest.mark.dali
@pytest.mark.parametrize("factory", [False, True])
def test_the_next_batch_is_read_while_the_one_before_decodes(images, factory, monkeypatch):
    from gdsload.decode.image import ImageDecoder, ImageTransform
    from gdsload.loader import fill

    reads = []
    real_read = fill.read_table

    def counted(*a, **k):  # the real read, counted when done
        fut = real_read(*a, **k)
        fut.result()
        reads.append(threading.current_thread().name)
        return fut

    monkeypatch.setattr(fill, "read_table", counted)
    seen = {}

    class Holding:
        """The real decoder; batch 1's decode first waits until batch 2 was read (at most 10 s)."""

        def __init__(self, **args):
            self.inner = ImageDecoder(**args)
            self.device = self.inner.device
            self.calls = 0

        def decode_into(self, encoded, names, dst, *, stream=None):
            self.calls += 1
            if self.calls == 2:  # batch 1 (decodes run in batch order): batch 0 is the loop variable
                deadline = time.monotonic() + 10
                while len(reads) < 3 and time.monotonic() < deadline:
                    time.sleep(0.01)
                seen["reads during batch 1's decode"] = len(reads)
            return self.inner.decode_into(encoded, names, dst, stream=stream)

    kw = dict(batch_size=4, shuffle=True, seed=1, device="cpu", output="numpy", num_workers=2,
              transform=ImageTransform(**EVAL), decode_threads=1)
    if factory:  # the feed server's seam: its decoder gets the field, settled first
        loader = DataLoader(str(images), decoder_factory=Holding, **kw)
    else:  # the loader's own decoder (it settles the slot after its DALI run), held the same way
        loader = DataLoader(str(images), **kw)
        real = loader._setup

        def setup():
            real()
            loader._resources._decoder = Holding(**loader._resources._decoder_args)

        loader._setup = setup
    got = []
    for batch in loader:  # the loop variable names batch k while the loader fills k+2
        got.append(np.asarray(batch["cls"]).copy())
    loader.close()
    assert seen["reads during batch 1's decode"] == 3  # batches 0, 1 and 2 (before the fix: 2, after 10 s)
    monkeypatch.undo()
    ref = DataLoader(str(images), copy=True, **kw)
    want = [np.asarray(b["cls"]) for b in ref]
    ref.close()
    assert len(got) == len(want) == 4 and all((a == b).all() for a, b in zip(got, want))
