"""`DataLoader(decoder_factory=)`: the public seam through which the feed server's decode pool
(`gdsload.service.server.pool`) decodes a loader's images, instead of writing the loader's private
decoder. The factory is called once, on the first image batch, with `ImageDecoder`'s arguments;
what it returns decodes every image batch of every epoch; a loader without images never calls it."""

from __future__ import annotations

import numpy as np
import pytest

from gdsload.convert.engine import ConvertOptions, convert
from gdsload.loader.dataloader import DataLoader
from gdsload.sampledata import make_image_folder, make_npy_folder

EVAL = dict(train=False, size=32, resize=36)


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("factory")
    make_image_folder(root / "src-img", num_images=12, num_classes=2, seed=3, mean_size=(96, 72), workers=1)
    convert(str(root / "src-img"), str(root / "imgs"), ConvertOptions(workers=1, progress=False, shard_size=60_000))
    make_npy_folder(root / "src-npy", num_samples=8, shape=(2, 4), dtype="float32")
    convert(str(root / "src-npy"), str(root / "feats"), ConvertOptions(workers=1, progress=False))
    return root


class Counting:
    """A decoder factory that builds the real `ImageDecoder` and counts its calls and batches."""

    def __init__(self):
        self.calls: list[dict] = []
        self.batches = 0

    def __call__(self, **args):
        from gdsload.decode.image import ImageDecoder

        self.calls.append(args)
        inner = ImageDecoder(**args)
        outer = self

        class Wrapped:
            device = inner.device

            def decode_into(self, encoded, names, dst, *, stream=None):
                outer.batches += 1
                return inner.decode_into(encoded, names, dst, stream=stream)

        return Wrapped()


@pytest.mark.dali
def test_the_factorys_decoder_decodes_every_image_batch(datasets):
    from gdsload.decode.image import ImageTransform

    kw = dict(batch_size=4, shuffle=True, seed=1, device="cpu", output="numpy", copy=True,
              transform=ImageTransform(**EVAL), decode_threads=1)
    plain = DataLoader(str(datasets / "imgs"), **kw)
    want = [list(plain), list(plain)]  # two epochs
    plain.close()
    factory = Counting()
    dl = DataLoader(str(datasets / "imgs"), decoder_factory=factory, **kw)
    got = [list(dl), list(dl)]
    dl.close()
    assert len(factory.calls) == 1  # built once, kept across epochs
    args = factory.calls[0]
    assert args["batch_size"] == 4 and args["device"] == "cpu" and args["threads"] == 1 and args["seed"] == 1
    assert args["on_error"] == "raise" and args["transform"].size == 32
    assert factory.batches == 2 * 3  # 12 images in batches of 4, two epochs
    for a, b in zip(want, got):
        assert [list(x["__key__"]) for x in a] == [list(x["__key__"]) for x in b]
        assert all(np.array_equal(x["jpg"], y["jpg"]) for x, y in zip(a, b))


def test_a_loader_without_images_never_calls_the_factory(datasets):
    def refuse(**args):
        raise AssertionError("called for a loader that decodes no image")

    dl = DataLoader(str(datasets / "feats"), batch_size=4, device="cpu", output="numpy", decoder_factory=refuse)
    assert sum(len(b["__key__"]) for b in dl) == 8
    dl.close()
