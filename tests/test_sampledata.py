"""The sample-data generators: layout, decodability, determinism, sizes, the .npy folder."""

from __future__ import annotations

import csv
import hashlib
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("PIL")
pytest.importorskip("skimage")

from PIL import Image  # noqa: E402

from gdsload.errors import GdsloadError  # noqa: E402
from gdsload.sampledata import (  # noqa: E402
    PHOTOS,
    available_photos,
    make_image_folder,
    make_npy_folder,
)

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"num_images": 12, "num_classes": 3, "mean_size": (160, 120)}


def _files(root: Path) -> dict[str, bytes]:
    """Relative path -> bytes of every file under root."""
    files = sorted(p for p in root.rglob("*") if p.is_file())
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in files}


@pytest.fixture(scope="module")
def small_folder(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("small") / "images"
    summary = make_image_folder(root, seed=0, workers=1, **SMALL)
    return root, summary


def test_photos_are_bundled():
    found = available_photos()
    assert len(found) >= 8
    assert all(name in PHOTOS for name in found)


def test_folder_layout_and_summary(small_folder):
    root, summary = small_folder
    classes = sorted(p.name for p in root.iterdir())
    assert classes == ["class_000", "class_001", "class_002"] == summary["classes"]
    assert summary["num_images"] == 12 and summary["num_classes"] == 3
    files = sorted(root.rglob("*"))
    images = [p for p in files if p.is_file()]
    assert len(images) == 12
    assert not any(p.name.startswith(".") or ".tmp" in p.name for p in files)  # no temp leftovers
    keys = [p.stem for p in images]
    assert len(set(keys)) == 12
    for p in images:
        assert re.fullmatch(r"img_\d{6}\.jpg", p.name), p.name
        assert "." not in p.stem
        assert p.parent.parent == root
    per_class = {c: len(list((root / c).iterdir())) for c in classes}
    assert per_class == {"class_000": 4, "class_001": 4, "class_002": 4}
    assert summary["total_bytes"] == sum(p.stat().st_size for p in images)
    assert summary["mean_bytes"] == pytest.approx(summary["total_bytes"] / 12)


def test_every_file_is_an_rgb_jpeg(small_folder):
    root, _ = small_folder
    hashes = set()
    for p in root.rglob("*.jpg"):
        with Image.open(p) as im:
            assert im.format == "JPEG"
            assert im.mode == "RGB"
            im.load()  # full decode
            w, h = im.size
            assert 40 <= w <= 400 and 40 <= h <= 400, (p, im.size)
        hashes.add(hashlib.sha256(p.read_bytes()).hexdigest())
    assert len(hashes) == 12  # all images differ


def test_same_seed_same_bytes_any_workers(small_folder, tmp_path):
    root, summary = small_folder
    again = make_image_folder(tmp_path / "w2", seed=0, workers=2, **SMALL)
    assert _files(tmp_path / "w2") == _files(root)
    assert again == {**summary, "root": str(tmp_path / "w2")}


def test_rerun_into_same_folder_is_identical(small_folder, tmp_path):
    root, _ = small_folder
    make_image_folder(tmp_path / "r", seed=0, workers=1, **SMALL)
    make_image_folder(tmp_path / "r", seed=0, workers=1, **SMALL)
    assert _files(tmp_path / "r") == _files(root)


def test_different_seed_different_bytes(small_folder, tmp_path):
    root, _ = small_folder
    make_image_folder(tmp_path / "s1", seed=1, workers=1, **SMALL)
    ours, theirs = _files(root), _files(tmp_path / "s1")
    assert ours.keys() == theirs.keys()
    assert all(ours[k] != theirs[k] for k in ours)


def test_default_size_is_imagenet_like(tmp_path):
    summary = make_image_folder(tmp_path / "d", num_images=8, num_classes=2, workers=1)
    images = sorted((tmp_path / "d").rglob("*.jpg"))
    assert len(images) == 8
    mean_kb = summary["mean_bytes"] / 1000
    assert 50 <= mean_kb <= 250, mean_kb
    sides = []
    for p in images:
        with Image.open(p) as im:
            w, h = im.size
        assert 200 <= w <= 1000 and 200 <= h <= 1000, (p, w, h)
        sides.append((w * h) ** 0.5)
    # Geometric-mean side around sqrt(500 * 375) = 433.
    assert 330 <= float(np.mean(sides)) <= 560


def test_bad_arguments_are_clear_errors(tmp_path):
    with pytest.raises(GdsloadError, match="num_images"):
        make_image_folder(tmp_path / "x", num_images=0)
    with pytest.raises(GdsloadError, match="quality"):
        make_image_folder(tmp_path / "x", num_images=1, quality=101)
    with pytest.raises(GdsloadError, match="seed"):
        make_image_folder(tmp_path / "x", num_images=1, seed=-1)
    with pytest.raises(GdsloadError, match="dtype"):
        make_npy_folder(tmp_path / "y", num_samples=1, dtype="complex64")
    with pytest.raises(GdsloadError, match="dtype"):
        make_npy_folder(tmp_path / "y", num_samples=1, dtype="no-such-type")


@pytest.mark.parametrize("dtype", ["uint8", "float16"])
def test_npy_folder(tmp_path, dtype):
    root = tmp_path / "npy"
    summary = make_npy_folder(root, num_samples=7, shape=(3, 8, 5), dtype=dtype, seed=3)
    arrays = sorted(root.glob("*.npy"))
    assert [p.stem for p in arrays] == summary["keys"] == [f"sample_{i:06d}" for i in range(7)]
    loaded = [np.load(p, allow_pickle=False) for p in arrays]
    for a in loaded:
        assert a.shape == (3, 8, 5) and a.dtype == np.dtype(dtype)
        assert np.isfinite(a.astype(np.float64)).all()
    assert len({a.tobytes() for a in loaded}) == 7  # all samples differ
    assert summary["total_bytes"] == sum(p.stat().st_size for p in arrays)

    with open(root / "labels.csv", newline="") as fh:
        rows = list(csv.reader(fh))
    assert rows[0] == ["key", "label"]
    assert [r[0] for r in rows[1:]] == summary["keys"]
    labels = [int(r[1]) for r in rows[1:]]
    assert labels == summary["labels"]
    assert all(0 <= v < 10 for v in labels)

    # Deterministic: the same seed gives the same bytes, another seed other arrays.
    make_npy_folder(tmp_path / "again", num_samples=7, shape=(3, 8, 5), dtype=dtype, seed=3)
    assert _files(tmp_path / "again") == _files(root)
    make_npy_folder(tmp_path / "other", num_samples=7, shape=(3, 8, 5), dtype=dtype, seed=4)
    assert all(
        (tmp_path / "other" / p.name).read_bytes() != p.read_bytes() for p in arrays
    )


def test_npy_folder_defaults_and_no_labels(tmp_path):
    summary = make_npy_folder(tmp_path / "n", num_samples=2, labels=False)
    assert not (tmp_path / "n" / "labels.csv").exists()
    assert summary["labels"] is None
    a = np.load(tmp_path / "n" / "sample_000000.npy")
    assert a.shape == (3, 224, 224) and a.dtype == np.uint8
    assert a.min() < 10 and a.max() > 245  # spans the uint8 range


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)


def test_import_needs_numpy_only():
    out = _run(
        "import sys, gdsload.sampledata\n"
        "print(sorted(m for m in ('PIL', 'skimage') if m in sys.modules))\n"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_missing_scikit_image_is_a_clear_error(tmp_path):
    dst = tmp_path / "never"
    out = _run(
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'skimage':\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from gdsload.errors import MissingDependencyError\n"
        "from gdsload.sampledata import make_image_folder\n"
        "try:\n"
        f"    make_image_folder({str(dst)!r}, num_images=1)\n"
        "except MissingDependencyError as exc:\n"
        "    print('ERR', exc)\n"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ERR"), out.stdout
    assert "gdsload[demo]" in out.stdout and "skimage" in out.stdout
    assert not dst.exists()
