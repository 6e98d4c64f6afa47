"""Two gdsload trees write the same datasets and the same loader states, byte for byte.

For a refactor that must change nothing a user can see: this checkout ("head", or `--head REV`)
and a git revision ("base", extracted with `git archive`) each convert the same inputs with their
own `gdsload convert`: class folders of JPEGs, a folder of `.npy` arrays, a flat folder of
`KEY.EXT` files with text/json/label fields, and WebDataset tars re-sharded with `--shuffle`.
Every file of the two outputs is compared byte for byte; in `manifest.json` only `created.at` and
`created.seconds` (when the conversion ran, and how long it took) may differ. Then each tree's `DataLoader` (and a `Mix`)
runs a few batches over the same dataset and the `state_dict()`s are compared as JSON, at mid
epoch, after a resume, and at an epoch's end.

    python tools/compare_outputs.py --base 0d29bb3 --workdir /tmp/cmp-out

Exit 0 when everything is identical; 1 with the first difference named otherwise.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# The start of every child: `tree`'s gdsload, not the one an editable install's import hook finds.
USE_TREE = r'''
import json, sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "").lower()
                    and "editable" not in repr(f).lower()]
sys.path.insert(0, TREE)
'''

CONVERT = USE_TREE.replace("TREE", "sys.argv[1]") + "from gdsload.cli import main\nsys.exit(main(sys.argv[2:]))\n"

STATES = USE_TREE.replace("TREE", "sys.argv[1]") + r'''
import gdsload
root, other = sys.argv[2], sys.argv[3]
out = {}
kw = dict(batch_size=4, shuffle=True, seed=5, shuffle_window=2, device="cpu", output="numpy", decode=False)
def run(make, key, take):
    dl = make()
    it = iter(dl)
    keys = [k for _ in range(take) for k in next(it)["__key__"]]
    out[key + "/mid"] = dl.state_dict()
    again = make()
    again.load_state_dict(dl.state_dict())
    rest = [k for b in again for k in b["__key__"]]
    out[key + "/end"] = again.state_dict()
    out[key + "/keys"] = keys + rest
run(lambda: gdsload.DataLoader(gdsload.Dataset(root), **kw), "dataset", 3)
run(lambda: gdsload.DataLoader(gdsload.Dataset(root), rank=1, world_size=2, drop_last=True, **kw), "rank1", 2)
run(lambda: gdsload.DataLoader(gdsload.Mix([gdsload.Dataset(root), gdsload.Dataset(other)], weights=[0.7, 0.3],
                                           names=["a", "b"]), **kw), "mix", 2)
print(json.dumps(out, sort_keys=True))
'''


def extract(rev: str, where: Path) -> Path:
    if not where.exists():
        where.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True).stdout
        subprocess.run(["tar", "xf", "-", "-C", str(where)], input=archive, check=True)
    return where


def make_inputs(work: Path) -> dict[str, list[str]]:
    """The inputs and the convert arguments for each."""
    sys.path.insert(0, str(REPO))
    from gdsload.sampledata import make_image_folder, make_npy_folder

    images, rows, flat, tars = work / "images", work / "rows", work / "flat", work / "tars"
    if not images.exists():
        make_image_folder(images, num_images=120, num_classes=4, seed=2)
    if not rows.exists():
        make_npy_folder(rows, num_samples=90, shape=(3, 16, 16), dtype="float32", seed=2)
    if not flat.exists():
        flat.mkdir()
        for i in range(50):
            (flat / f"s{i:03d}.txt").write_text(f"caption {i} " * (i % 7 + 1))
            (flat / f"s{i:03d}.json").write_text(json.dumps({"i": i, "tags": list(range(i % 4))}))
            (flat / f"s{i:03d}.cls").write_text(str(i % 3))
            (flat / f"s{i:03d}.bin").write_bytes(bytes(range(256)) * (1 + i % 20))
    if not tars.exists():
        tars.mkdir()
        keys = sorted({p.stem for p in flat.iterdir()})
        for t in range(3):
            with tarfile.open(tars / f"old-{t:06d}.tar", "w") as tf:
                for key in keys[t::3]:
                    for p in sorted(flat.glob(f"{key}.*")):
                        tf.add(p, arcname=p.name)
    return {
        "images": [str(images), "--shard-size", "2MB"],
        "rows": [str(rows), "--shard-size", "64KB"],
        "flat": [str(flat), "--shard-size", "64KB"],
        "tars": [str(tars / "old-{000000..000002}.tar"), "--shuffle", "--seed", "3", "--shard-size", "64KB"],
    }


def first_difference(a: Path, b: Path) -> str | None:
    fa = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    fb = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    if fa != fb:
        return f"different files: {sorted(set(map(str, fa)) ^ set(map(str, fb)))}"
    for rel in fa:
        x, y = (a / rel).read_bytes(), (b / rel).read_bytes()
        if rel.name == "manifest.json":
            mx, my = json.loads(x), json.loads(y)
            for m in (mx, my):  # when and how long: the clock's, not the writer's
                m["created"].pop("at", None)
                m["created"].pop("seconds", None)
            if mx != my:
                return f"{rel}: {json.dumps(mx)[:300]} != {json.dumps(my)[:300]}"
        elif x != y:
            at = next(i for i, (p, q) in enumerate(zip(x, y)) if p != q) if len(x) == len(y) else min(len(x), len(y))
            return f"{rel}: {len(x)} vs {len(y)} bytes, first difference at byte {at}"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="git revision of the earlier gdsload")
    ap.add_argument("--head", default=None, help="git revision to compare (default: this checkout)")
    ap.add_argument("--workdir", default="/tmp/gdsload-compare-outputs")
    a = ap.parse_args(argv)
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    trees = {"base": extract(a.base, work / f"tree-{a.base}"),
             "head": extract(a.head, work / f"tree-{a.head}") if a.head else REPO}
    inputs = make_inputs(work)
    failures = []
    for name, args in inputs.items():
        outs = {}
        for side, tree in trees.items():
            dst = work / f"out-{side}" / name
            subprocess.run([sys.executable, "-c", CONVERT, str(tree), "convert", args[0], str(dst), *args[1:],
                            "-q", "--overwrite"], check=True)
            outs[side] = dst
        diff = first_difference(outs["base"], outs["head"])
        n = sum(1 for p in outs["head"].rglob("*") if p.is_file())
        print(f"convert {name}: {n} files, " + ("identical" if diff is None else f"DIFFERENT: {diff}"))
        if diff:
            failures.append(f"convert {name}: {diff}")
    states = {}
    for side, tree in trees.items():
        r = subprocess.run([sys.executable, "-c", STATES, str(tree), str(work / "out-head" / "rows"),
                            str(work / "out-head" / "flat")], check=True, capture_output=True, text=True)
        states[side] = json.loads(r.stdout.strip().splitlines()[-1])
    for key in sorted(states["head"]):
        same = states["base"].get(key) == states["head"][key]
        if not key.endswith("/keys"):
            print(f"state {key}: " + ("equal" if same else f"DIFFERENT: {states['base'].get(key)} != {states['head'][key]}"))
        elif not same:
            print(f"order {key}: DIFFERENT")
        if not same:
            failures.append(f"state {key}")
    if failures:
        print("FAIL: " + "; ".join(failures))
        return 1
    print("all outputs and states identical")
    return 0


if __name__ == "__main__":
    sys.exit(main())
