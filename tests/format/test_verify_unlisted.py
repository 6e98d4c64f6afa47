"""`verify` reports, and fails on, shard, index and temporary files in the dataset folder that the
manifest does not list (what two conversions racing on one folder, or an interrupted one, leave):
a reader that globs `*.tar` would read their samples as well."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from gdsload.cli import main
from gdsload.dataset.sharded import open_dataset
from gdsload.convert.shards import DatasetWriter


@pytest.fixture
def ds(tmp_path: Path) -> Path:
    root = tmp_path / "ds"
    with DatasetWriter(root, shard_size=20_000) as w:
        for i in range(12):
            w.write(f"k{i:03d}", {"bin": bytes([i]) * 9000, "cls": str(i % 2).encode()})
    assert len(list(root.glob("*.tar"))) >= 3
    return root


def test_stray_shard_index_and_temporary_files_fail_verify(ds: Path, capsys) -> None:
    shutil.copy(ds / "shard-000000.tar", ds / "shard-000039.tar")  # a duplicate of samples
    shutil.copy(ds / "shard-000000.idx", ds / "shard-000039.idx")
    shutil.copy(ds / "shard-000000.dali.idx", ds / "shard-000039.dali.idx")
    (ds / ".shard-000001.tar.tmp-4242").write_bytes(b"\0" * 1024)
    with open_dataset(ds) as d:
        bad = d.verify()
        n = len(d.shards)
    assert sorted(bad) == [".shard-000001.tar.tmp-4242", "shard-000039.dali.idx", "shard-000039.idx",
                           "shard-000039.tar"]
    assert "not listed in manifest.json" in bad["shard-000039.tar"][0]
    assert "temporary" in bad[".shard-000001.tar.tmp-4242"][0]

    assert main(["verify", str(ds)]) == 1
    err = capsys.readouterr().err
    assert "BAD shard-000039.tar: not listed in manifest.json" in err
    assert f"0 of {n} shards failed verification; 4 files in the folder are not listed in the manifest" in err, err


def test_other_files_are_not_shards_and_pass(ds: Path, capsys) -> None:
    (ds / "README.md").write_text("notes about this dataset\n")
    (ds / "rejected.jsonl").write_text("")
    assert main(["verify", str(ds)]) == 0
    assert "no shard files outside the manifest" in capsys.readouterr().out


def test_a_clean_dataset_has_nothing_unlisted(ds: Path) -> None:
    with open_dataset(ds) as d:
        assert d.unlisted() == {} and d.verify() == {}


def test_stray_objects_at_an_s3_url_fail_verify(ds: Path, s3, capsys) -> None:
    """At a URL there is no writer lock (see `gdsload.io.store`), so verify is what catches a
    race there: the same check through fsspec, against a local S3 server."""
    s3.mkdir("gdsload-unlisted")
    s3.put(str(ds), "gdsload-unlisted/ds", recursive=True)
    url = "s3://gdsload-unlisted/ds"
    assert main(["verify", url]) == 0
    s3.pipe_file("gdsload-unlisted/ds/shard-000007.tar", (ds / "shard-000000.tar").read_bytes())
    capsys.readouterr()
    assert main(["verify", url]) == 1
    assert "BAD shard-000007.tar: not listed in manifest.json" in capsys.readouterr().err
