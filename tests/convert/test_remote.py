"""`gdsload convert` with fsspec URLs for the source and the destination, against a local S3
server (moto on loopback, the session fixture `s3` in tests/conftest.py).

Covers the fsspec side of `gdsload/convert/sources.py` (listing an image folder, a folder or brace
pattern of tars, an `.npy` folder with labels; nested folders in local walk order),
`gdsload/io/store.py` (writing shards, indexes, records and the manifest to s3://) and the
destination handling of `engine.convert` there: the same bytes as a local conversion of the same
files, refusal of an existing dataset, `--resume` after an interrupted run, `verify` and reads of
the result through fsspec, and clear errors for a missing bucket or a missing fsspec plugin.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest

from gdsload.cli import main
from gdsload.convert.engine import STATE_DIR, ConvertOptions, convert, write_shard
from gdsload.errors import GdsloadError
from gdsload.dataset.sharded import open_dataset

OPTS = ["--shard-size", "32KB", "--workers", "2", "--validate", "-q"]


def local_files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def s3_files(fs, root: str) -> dict[str, bytes]:
    fs.invalidate_cache()
    return {p[len(root) + 1:]: fs.cat_file(p) for p in sorted(fs.find(root))}


def assert_same_dataset(got: dict[str, bytes], want: dict[str, bytes], got_src: str, want_src: str) -> None:
    """Same files and bytes; the manifest and rejected.jsonl differ only by where the source was."""
    assert sorted(got) == sorted(want)
    for name in want:
        if name not in ("manifest.json", "rejected.jsonl"):
            assert got[name] == want[name], f"{name} differs"
    if "rejected.jsonl" in want:
        assert got["rejected.jsonl"].decode().replace(got_src, "SRC") == \
            want["rejected.jsonl"].decode().replace(want_src, "SRC")
    gm, wm = json.loads(got["manifest.json"]), json.loads(want["manifest.json"])
    for m in (gm, wm):
        for k in ("at", "seconds", "source", "fingerprint"):  # the fingerprint hashes input paths
            m["created"].pop(k)
    assert gm == wm


@pytest.fixture(scope="module")
def world(s3, tmp_path_factory):
    """`base/src`: an image folder (3 classes, one class with a nested sub-folder, one corrupt and
    one empty image) uploaded to s3://gdsload-test/src; `base/ref`: its local conversion."""
    from gdsload.sampledata import make_image_folder

    base = tmp_path_factory.mktemp("remote")
    src = base / "src"
    make_image_folder(src, num_images=60, num_classes=3, mean_size=(64, 48), workers=1)
    first = sorted((src / "class_000").iterdir())
    (src / "class_000" / "zz_nested").mkdir()  # os.walk order: a folder's files, then sub-folders
    for p in first[:4]:
        p.rename(src / "class_000" / "zz_nested" / p.name)
    (src / "class_001" / "broken.jpg").write_bytes(os.urandom(3000))
    (src / "class_002" / "empty.jpg").write_bytes(b"")
    assert main(["convert", str(src), str(base / "ref"), *OPTS]) == 0
    s3.mkdir("gdsload-test")
    s3.put(str(src), "gdsload-test/src", recursive=True)
    s3.pipe_file("gdsload-test/src/class_002/empty.jpg", b"")  # put() may skip empty files
    return base


def test_s3_to_s3_equals_a_local_conversion_and_verifies(s3, world, capsys):
    assert main(["convert", "s3://gdsload-test/src", "s3://gdsload-test/out", *OPTS]) == 0
    assert "2 inputs rejected" in capsys.readouterr().out
    got = s3_files(s3, "gdsload-test/out")
    assert_same_dataset(got, local_files(world / "ref"), "s3://gdsload-test/src", str(world / "src"))
    assert not any(n.startswith(".") or STATE_DIR in n for n in got)  # no temporaries, no state

    assert main(["verify", "s3://gdsload-test/out"]) == 0
    assert main(["inspect", "s3://gdsload-test/out"]) == 0
    assert "60" in capsys.readouterr().out
    ds = open_dataset("s3://gdsload-test/out")
    ref = open_dataset(world / "ref")
    assert len(ds) == len(ref) == 60
    assert ds.sample(17) == ref.sample(17)


def test_s3_source_to_local_destination(s3, world, tmp_path):
    r = convert("s3://gdsload-test/src", tmp_path / "out",
                ConvertOptions(shard_size=32_000, workers=1, validate=True, progress=False))
    assert r["samples"] == 60 and r["rejected"] == 2
    assert_same_dataset(local_files(tmp_path / "out"), local_files(world / "ref"),
                        "s3://gdsload-test/src", str(world / "src"))


def test_tars_on_s3_by_folder_and_by_brace_pattern(s3, world, tmp_path):
    tars = sorted(p.name for p in (world / "ref").glob("*.tar"))
    for name in tars:
        s3.put_file(str(world / "ref" / name), f"gdsload-test/tars/{name}")
    braces = f"shard-{{000000..{len(tars) - 1:06d}}}.tar"
    assert main(["convert", f"{world / 'ref'}/{braces}", str(tmp_path / "want"), *OPTS]) == 0
    want = local_files(tmp_path / "want")
    assert main(["convert", "s3://gdsload-test/tars", str(tmp_path / "by-folder"), *OPTS]) == 0
    assert main(["convert", f"s3://gdsload-test/tars/{braces}", "s3://gdsload-test/tars-out", *OPTS]) == 0
    assert_same_dataset(local_files(tmp_path / "by-folder"), want, "s3://gdsload-test/tars", str(world / "ref"))
    assert_same_dataset(s3_files(s3, "gdsload-test/tars-out"), want, "s3://gdsload-test/tars", str(world / "ref"))


def test_npy_folder_with_labels_on_s3(s3, tmp_path):
    src = tmp_path / "npy"
    src.mkdir()
    rng = np.random.default_rng(0)
    for i in range(12):
        np.save(src / f"x{i:02d}.npy", rng.standard_normal((i + 1, 700)).astype(np.float32))
    (src / "labels.csv").write_text("key,label\n" + "".join(f"x{i:02d},{'ab'[i % 2]}\n" for i in range(12)))
    s3.put(str(src), "gdsload-test/npy", recursive=True)
    assert main(["convert", str(src), str(tmp_path / "want"), *OPTS]) == 0
    assert main(["convert", "s3://gdsload-test/npy", "s3://gdsload-test/npy-out", *OPTS]) == 0
    got = s3_files(s3, "gdsload-test/npy-out")
    assert_same_dataset(got, local_files(tmp_path / "want"), "s3://gdsload-test/npy", str(src))
    assert json.loads(got["manifest.json"])["classes"] == ["a", "b"]


def test_existing_dataset_on_s3_is_refused_then_overwritten(s3, world, capsys):
    dst = "s3://gdsload-test/twice"
    assert main(["convert", "s3://gdsload-test/src", dst, *OPTS]) == 0
    before = s3_files(s3, "gdsload-test/twice")
    capsys.readouterr()
    assert main(["convert", "s3://gdsload-test/src", dst, *OPTS]) == 1
    assert "already holds a dataset" in capsys.readouterr().err
    assert s3_files(s3, "gdsload-test/twice") == before
    s3.pipe_file("gdsload-test/twice/shard-000099.tar", b"stale")  # ours by name: cleaned up
    assert main(["convert", "s3://gdsload-test/src", dst, *OPTS, "--overwrite"]) == 0
    after = s3_files(s3, "gdsload-test/twice")
    assert sorted(after) == sorted(before)
    assert "shard-000099.tar" not in after


def test_foreign_files_at_the_s3_destination_are_refused(s3, world, capsys):
    s3.pipe_file("gdsload-test/foreign/notes.txt", b"mine")
    assert main(["convert", "s3://gdsload-test/src", "s3://gdsload-test/foreign", *OPTS]) == 1
    assert "notes.txt" in capsys.readouterr().err
    assert s3_files(s3, "gdsload-test/foreign") == {"notes.txt": b"mine"}


def test_interrupted_run_on_s3_has_no_manifest_and_resumes_exactly(s3, world, capsys):
    """The run fails after three shards (a runner that stops, as a killed driver would); the
    prefix then has no manifest, plain convert refuses it, `--resume` keeps the three shards."""
    dst = "s3://gdsload-test/resume"
    opts = ConvertOptions(shard_size=32_000, workers=1, validate=True, progress=False)

    def three_then_die(dst, units, validate, workers, report):
        for name, samples in units[:3]:
            write_shard(dst, name, samples, validate)
            yield name
        raise GdsloadError("driver lost")

    with pytest.raises(GdsloadError, match="driver lost"):
        convert("s3://gdsload-test/src", dst, opts, runner=three_then_die)
    partial = s3_files(s3, "gdsload-test/resume")
    assert "manifest.json" not in partial
    assert len([n for n in partial if n.endswith(".tar")]) == 3
    with pytest.raises(GdsloadError, match="open_dataset|manifest"):
        open_dataset(dst)

    assert main(["convert", "s3://gdsload-test/src", dst, *OPTS]) == 1
    assert "--resume" in capsys.readouterr().err
    r = convert("s3://gdsload-test/src", dst, ConvertOptions(**{**opts.__dict__, "resume": True}))
    assert r["resumed_shards"] == 3
    assert_same_dataset(s3_files(s3, "gdsload-test/resume"), local_files(world / "ref"),
                        "s3://gdsload-test/src", str(world / "src"))


def test_missing_bucket_is_a_clear_error(s3, tmp_path, capsys):
    assert main(["convert", "s3://no-such-bucket-here/src", str(tmp_path / "out"), *OPTS]) == 1
    err = capsys.readouterr().err
    assert "s3://no-such-bucket-here/src" in err and "no such file or folder" in err
    assert not (tmp_path / "out").exists()


def test_missing_destination_bucket_is_refused_not_created(s3, world, capsys):
    assert main(["convert", str(world / "src"), "s3://no-such-bucket-here/out", *OPTS]) == 1
    err = capsys.readouterr().err
    assert "bucket 'no-such-bucket-here' does not exist" in err
    s3.invalidate_cache()
    assert not s3.exists("no-such-bucket-here")


def test_missing_fsspec_plugin_says_what_to_install(tmp_path, capsys):
    if importlib.util.find_spec("ocifs") is not None:
        pytest.skip("ocifs is installed")
    assert main(["convert", "oci://bucket@ns/src", str(tmp_path / "out"), *OPTS]) == 1
    err = capsys.readouterr().err
    assert "oci://bucket@ns/src" in err and "ocifs" in err
