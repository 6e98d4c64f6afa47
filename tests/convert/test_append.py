"""Appends: `ShardWriter(append=True)` and `gdsload convert --append` add shards as a new manifest
version; old shards are never rewritten, a loader on the old version keeps reading it, a state
from the old version is a clear `StateError`, and bad appends change nothing."""

from __future__ import annotations

import io
import os
import pickle

import numpy as np
import pytest

import gdsload
from gdsload.cli import main
from gdsload.dataset.sharded import open_dataset
from gdsload.errors import DestinationError, InputError, StateError
from convertkit import die


def samples(start: int, n: int, *, dtype=np.float32, shape=(4,)):
    for i in range(start, start + n):
        yield {"__key__": f"k{i:04d}", "x.npy": np.full(shape, i, dtype), "cls": i % 2}


def make(root, n: int = 40):
    with gdsload.ShardWriter(root, shard_size="20KB", classes=["even", "odd"]) as w:
        for s in samples(0, n):
            w.write(s)
    return w.manifest


def snapshot(root) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


def test_append_while_a_loader_iterates_the_old_version(tmp_path):
    root = tmp_path / "ds"
    make(root)
    before = {p.name: p.read_bytes() for p in root.iterdir() if p.suffix in (".tar", ".idx")}
    ds = gdsload.Dataset(str(root))
    loader = gdsload.DataLoader(ds, batch_size=4, shuffle=True, seed=3, device="cpu", output="numpy")
    it = iter(loader)
    seen = [k for _ in range(3) for k in next(it)["__key__"]]
    state = loader.state_dict()
    with gdsload.ShardWriter(root, shard_size="20KB", append=True, classes=["even", "odd"]) as w:
        for s in samples(40, 24):
            w.write(s)
    m = w.manifest
    seen += [k for batch in it for k in batch["__key__"]]
    assert sorted(seen) == [f"k{i:04d}" for i in range(40)]  # exactly the old version's samples
    assert pickle.loads(pickle.dumps(ds)).shards.manifest["num_samples"] == 40  # a worker's copy too
    # existing shards were not rewritten; the new version lists them first
    assert all((root / n).read_bytes() == b for n, b in before.items())
    assert [v["num_samples"] for v in m["versions"]] == [40, 64] and m["versions"][1]["appended"] == 24
    new = gdsload.Dataset(str(root))
    assert len(new) == 64 and new.dataset_id != ds.dataset_id
    fresh = gdsload.DataLoader(new, batch_size=4, shuffle=True, seed=3, device="cpu", output="numpy")
    with pytest.raises(StateError, match="the dataset has changed: 24 samples appended since this state was saved"):
        fresh.load_state_dict(state)
    # the old epoch can be finished exactly on the old version
    old = gdsload.DataLoader(gdsload.Dataset(str(root), version=1), batch_size=4, shuffle=True, seed=3,
                             device="cpu", output="numpy")
    old.load_state_dict(state)
    assert [k for b in old for k in b["__key__"]] == seen[12:]
    assert {k for b in fresh for k in b["__key__"]} == {f"k{i:04d}" for i in range(64)}
    assert open_dataset(root).verify() == {}


def test_key_collision_across_appends_changes_nothing(tmp_path):
    root = tmp_path / "ds"
    make(root)
    before = snapshot(root)
    with pytest.raises(InputError, match=r"duplicate sample key 'k0039': shard shard-\d+\.tar of the dataset and"):
        with gdsload.ShardWriter(root, shard_size="20KB", append=True) as w:
            for s in samples(30 + 20, 20):  # k0050..: new keys, several shards written first
                w.write(s)
            w.write(next(samples(39, 1)))
    assert snapshot(root) == before


@pytest.mark.parametrize("bad, message", [
    ({"__key__": "n1", "x.npy": np.zeros(4, np.float32)}, r"fields \['x.npy'\] are not the dataset's .*missing \['cls'\]"),
    ({"__key__": "n1", "x.npy": np.zeros(4, np.float32), "cls": 1, "txt": "hi"}, r"not in the dataset \['txt'\]"),
    ({"__key__": "n1", "x.npy": np.zeros(4, np.float64), "cls": 1}, r"'x.npy' is float64 of shape \(4,\), the dataset holds float32 of shape \(4,\)"),
    ({"__key__": "n1", "x.npy": np.zeros(5, np.float32), "cls": 1}, r"is float32 of shape \(5,\), the dataset holds float32 of shape \(4,\)"),
])
def test_appended_samples_must_match_the_schema(tmp_path, bad, message):
    root = tmp_path / "ds"
    make(root, n=8)
    before = snapshot(root)
    with pytest.raises(InputError, match=message), gdsload.ShardWriter(root, append=True) as w:
        w.write(next(samples(100, 1)))
        w.write(bad)
    assert snapshot(root) == before


def test_append_to_a_url_is_refused(tmp_path):
    url = "memory://gdsload-append-test/ds"
    make(url, n=4)
    try:
        with pytest.raises(DestinationError, match="appending to a dataset at a URL is refused: no lock"):
            gdsload.ShardWriter(url, append=True)
    finally:
        import fsspec

        fsspec.filesystem("memory").rm("/gdsload-append-test", recursive=True)


def test_append_needs_a_dataset(tmp_path):
    with pytest.raises(DestinationError, match="no dataset to append to"):
        gdsload.ShardWriter(tmp_path / "none", append=True)


def image_folder(root, classes: dict[str, int], tag: str = "") -> None:
    from PIL import Image

    for name, n in classes.items():
        (root / name).mkdir(parents=True)
        for i in range(n):
            buf = io.BytesIO()
            Image.fromarray(np.full((8, 8, 3), i, np.uint8)).save(buf, "JPEG")
            (root / name / f"{tag}{name}{i}.jpg").write_bytes(buf.getvalue())


def test_cli_append_merges_class_names(tmp_path, capsys):
    image_folder(tmp_path / "a", {"cat": 2, "dog": 2})
    image_folder(tmp_path / "b", {"dog": 1, "fox": 2}, tag="new")
    assert main(["convert", str(tmp_path / "a"), str(tmp_path / "ds"), "-q"]) == 0
    assert main(["convert", str(tmp_path / "b"), str(tmp_path / "ds"), "--append", "-q"]) == 0
    assert "appended 3 samples into 1 shards" in capsys.readouterr().out
    ds = open_dataset(tmp_path / "ds")
    assert ds.classes == ["cat", "dog", "fox"]
    labels = {ds.sample(i)["__key__"]: int(ds.sample(i)["cls"]) for i in range(len(ds))}
    assert labels == {"cat/cat0": 0, "cat/cat1": 0, "dog/dog0": 1, "dog/dog1": 1,
                      "dog/newdog0": 1, "fox/newfox0": 2, "fox/newfox1": 2}
    # the same folder again: every key collides, and nothing changes
    before = snapshot(tmp_path / "ds")
    assert main(["convert", str(tmp_path / "b"), str(tmp_path / "ds"), "--append", "-q"]) == 1
    assert "duplicate sample key 'dog/newdog0': shard shard-000001.tar of the dataset and input 0 (" \
        f"{tmp_path / 'b' / 'dog' / 'newdog0.jpg'})" in capsys.readouterr().err
    assert snapshot(tmp_path / "ds") == before


def test_an_interrupted_append_is_resumed_or_dropped(tmp_path):
    root = tmp_path / "ds"
    make(root, n=10)
    w = gdsload.ShardWriter(root, shard_size="20KB", append=True)
    for s in samples(10, 30):
        w.write(s)
    die(w)  # the writer dies: some shards finished, no new manifest
    assert open_dataset(root).manifest["num_samples"] == 10  # readers still see the old version
    with gdsload.ShardWriter(root, shard_size="20KB", append=True, resume=True) as w2:
        for s in samples(10, 30):
            w2.write(s)
    assert w2._skip_at > 0  # finished shards were kept
    ds = open_dataset(root)
    assert [ds.sample(i)["__key__"] for i in range(len(ds))] == [f"k{i:04d}" for i in range(40)]
    # an interrupted append that is not resumed is dropped by the next append
    w3 = gdsload.ShardWriter(root, shard_size="20KB", append=True)
    for s in samples(40, 20):
        w3.write(s)
    die(w3)
    with gdsload.ShardWriter(root, shard_size="20KB", append=True) as w4:
        for s in samples(60, 2):
            w4.write(s)
    ds = open_dataset(root)
    assert len(ds) == 42 and ds.verify() == {}
    assert not [n for n in os.listdir(root) if n.startswith(".")]


def test_resume_of_a_finished_append_does_nothing(tmp_path):
    root = tmp_path / "ds"
    make(root, n=6)

    def fn(i):
        return {"__key__": f"new{i}", "x.npy": np.full((4,), i, np.float32), "cls": 0}

    m1 = gdsload.write(fn, range(5), root, append=True, progress=False)
    created = open_dataset(root).manifest["created"]
    m2 = gdsload.write(fn, range(5), root, append=True, resume=True, progress=False)
    assert m1 == m2 and len(m2["versions"]) == 2 and len(open_dataset(root)) == 11
    assert open_dataset(root).manifest["created"] == created  # the first version's record is kept
