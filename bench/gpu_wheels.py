"""The wheels carried to the GPU host for bench/gpu_check.sh, and how DALI's travel in parts.

The device image has PyTorch, CuPy for CUDA 13, cuda-pathfinder, cuda-toolkit and nvidia-cufile,
but no KvikIO, webdataset or DALI, and nothing can be fetched there (../.library/device/KINDS.md
lists the image's packages). `bench/gpu_wheels.json` records what is carried: the pinned wheels
and each wheel's own `Requires-Dist` (non-extra, read from its METADATA by `record`), plus the
image's packages that satisfy the rest. `tests/test_gpu_check.py` checks that the set is closed.
Recorded from the wheels, not from source: rapidsai/kvikio's python/libkvikio/pyproject.toml at
the release/26.08 merge (VERSION 26.10.00) says `rapids-logger==0.2.*`, but the released
libkvikio-cu13 26.10.0 wheel's METADATA says `Requires-Dist: rapids-logger==0.3.*` (the two GPU
audits disagreed on this; the wheel is what gets installed).

    python3 bench/gpu_wheels.py download   # pip download the pins into .whl/ and .whl-dali/
    python3 bench/gpu_wheels.py record     # rewrite bench/gpu_wheels.json from those wheels
    python3 bench/gpu_wheels.py check      # every requirement carried or on the image?
    python3 bench/gpu_wheels.py split      # DALI's JPEG wheels -> .dali1/ .dali2/ ... (53.4 MiB, then
                                           # <= 57.5 MiB: gpu_plan's budgets; the "lazy" ones stay behind)
    python3 bench/gpu_wheels.py receive .daliN   # on the device: append part N to .dali-parts/
    python3 bench/gpu_wheels.py assemble   # on the device: join, check sha256, unpack /tmp/dali-whl

One device call carries at most 64 MiB (working tree included), so the ~260 MB of DALI, nvImageCodec,
nvCOMP and nvJPEG wheels go as parts over back-to-back calls, the first with part 1 of the check:
files left on a warm machine stay only if the next call comes within ~30 s (`gpu_plan.py` prints
the sequence).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPEC = Path(__file__).resolve().parent / "gpu_wheels.json"
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_plan  # noqa: E402

# (first part, later parts): the first shares call 1 with .whl/, every call carries the tree; the
# sizes come from the plan's budgets (gpu_plan.part_limits_mib), so each call stays <= 62 MiB
PART_BYTES = tuple(int(m * 2**20) for m in gpu_plan.part_limits_mib())
# git-ignored, in the tree: kept between calls on a warm machine (GDSLOAD_DALI_PARTS: the tests)
PARTS_DIR = Path(os.environ.get("GDSLOAD_DALI_PARTS") or ROOT / ".dali-parts")
DALI_WHEELS = Path("/tmp/dali-whl")
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64"]


def normalise(name: str) -> str:
    """PEP 503 name: lowercase, runs of -_. as one dash."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(req: str) -> str:
    return normalise(re.split(r"[\s\[<>=!~;(]", req.strip(), maxsplit=1)[0])


def wheel_metadata(path: Path) -> tuple[str, str, list[str]]:
    """(name, version, every Requires-Dist line, markers included) from a wheel's METADATA."""
    from email.parser import HeaderParser

    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        headers = HeaderParser().parsestr(z.read(meta).decode())
    requires = [r.strip() for r in headers.get_all("Requires-Dist") or []]
    return normalise(headers["Name"]), headers["Version"].strip(), requires


def closure_problems(spec: dict, groups: tuple[str, ...] = ("carry", "dali"),
                     python: str = "3.12") -> list[str]:
    """What the carried set lacks: for every carried wheel, each requirement that applies on the
    image's Python (markers evaluated, extras followed as asked) must be a carried pin whose
    version satisfies it, or a package of the image."""
    from packaging.requirements import Requirement

    pins = {n: v for g in groups for n, v in spec[g]["pins"].items()}
    lazy = {n for g in groups for n in spec[g].get("lazy", {})}  # left behind on purpose
    requires = {n: r for g in groups for n, r in spec[g]["requires"].items()}
    image = {normalise(n) for n in spec["image"]}
    problems = []
    todo = [(n, "") for n in pins]
    seen = set()
    while todo:
        name, extra = todo.pop()
        if (name, extra) in seen or name not in requires:
            continue
        seen.add((name, extra))
        for line in requires[name]:
            req = Requirement(line)
            env = {"python_version": python, "python_full_version": f"{python}.3", "extra": extra}
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            if req.marker is None and extra:
                continue  # already checked without the extra
            target = normalise(req.name)
            if target in lazy:
                continue
            if target in pins:
                if not req.specifier.contains(pins[target], prereleases=True):
                    problems.append(f"{name} needs {line}, carried: {target}=={pins[target]}")
                todo += [(target, e) for e in req.extras]
            elif target not in image:
                problems.append(f"{name} needs {line}: neither carried nor on the image")
    return problems


def wheel_name(path: Path) -> str:
    """The normalised project name of a wheel file (`nvidia_nvjpeg-13.3...whl` -> nvidia-nvjpeg)."""
    return normalise(path.name.split("-")[0])


def load_spec() -> dict:
    return json.loads(SPEC.read_text())


def cmd_download() -> None:
    spec = load_spec()
    for group, dest in (("carry", ".whl"), ("dali", ".whl-dali")):
        pins = [f"{n}=={v}" for n, v in spec[group]["pins"].items()]
        args = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                "--python-version", "3.12", "--implementation", "cp", "-d", str(ROOT / dest)]
        for p in PLATFORMS:
            args += ["--platform", p]
        subprocess.run(args + pins, check=True)


def cmd_record() -> None:
    spec = load_spec()
    for group, dest in (("carry", ".whl"), ("dali", ".whl-dali")):
        pins, requires = {}, {}
        for whl in sorted((ROOT / dest).glob("*.whl")):
            name, version, reqs = wheel_metadata(whl)
            pins[name], requires[name] = version, reqs
        spec[group]["pins"], spec[group]["requires"] = pins, requires
    SPEC.write_text(json.dumps(spec, indent=1) + "\n")
    print(f"wrote {SPEC}")


def cmd_split() -> None:
    """Tar DALI's wheels (stored, no compression: wheels are zips) and cut it into .daliN/ parts."""
    lazy = set(load_spec()["dali"].get("lazy", {}))
    src = sorted(p for p in (ROOT / ".whl-dali").glob("*.whl") if wheel_name(p) not in lazy)
    if not src:
        raise SystemExit("no wheels in .whl-dali/ (run: python3 bench/gpu_wheels.py download)")
    for old in ROOT.glob(".dali[0-9]*"):
        shutil.rmtree(old)
    tar = ROOT / ".whl-dali" / "dali.tar"
    subprocess.run(["tar", "-cf", str(tar), "-C", str(ROOT / ".whl-dali"), *[p.name for p in src]], check=True)
    digest = hashlib.sha256(tar.read_bytes()).hexdigest()
    n = 0
    first, later = (PART_BYTES, PART_BYTES) if isinstance(PART_BYTES, int) else PART_BYTES
    with open(tar, "rb") as f:
        while chunk := f.read(first if n == 0 else later):
            n += 1
            d = ROOT / f".dali{n}"
            d.mkdir()
            (d / f"part{n:02d}").write_bytes(chunk)
    for i in range(1, n + 1):
        (ROOT / f".dali{i}" / "MANIFEST").write_text(json.dumps({"parts": n, "sha256": digest, "part": i}) + "\n")
    tar.unlink()
    print(f"{n} parts ({first / 2**20:.1f} MiB, then <= {later / 2**20:.1f} MiB) in .dali1 .. .dali{n} "
          f"(sha256 {digest[:12]}...)")


def cmd_receive(folder: str) -> None:
    PARTS_DIR.mkdir(parents=True, exist_ok=True)
    d = Path(folder)
    for f in d.iterdir():
        if f.name.startswith("part"):
            shutil.copyfile(f, PARTS_DIR / f.name)
    shutil.copyfile(d / "MANIFEST", PARTS_DIR / "MANIFEST")
    have = sorted(p.name for p in PARTS_DIR.glob("part*"))
    print(f"received {d.name}: {len(have)} part(s) in {PARTS_DIR}: {' '.join(have)}")


def cmd_assemble() -> None:
    manifest = json.loads((PARTS_DIR / "MANIFEST").read_text())
    parts = [PARTS_DIR / f"part{i:02d}" for i in range(1, manifest["parts"] + 1)]
    missing = [p.name for p in parts if not p.exists()]
    if missing:
        raise SystemExit(f"FAIL: DALI parts missing in {PARTS_DIR}: {missing} (the machine went cold "
                         f"between calls? start again from .dali1)")
    h = hashlib.sha256()
    tar = PARTS_DIR / "dali.tar"
    with open(tar, "wb") as out:
        for p in parts:
            data = p.read_bytes()
            h.update(data)
            out.write(data)
    if h.hexdigest() != manifest["sha256"]:
        raise SystemExit(f"FAIL: DALI parts do not match their sha256 ({h.hexdigest()} != {manifest['sha256']})")
    DALI_WHEELS.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-xf", str(tar), "-C", str(DALI_WHEELS)], check=True)
    tar.unlink()
    print(f"DALI wheels ready in {DALI_WHEELS}: {len(list(DALI_WHEELS.glob('*.whl')))} wheels")


def main(argv: list[str]) -> int:
    if argv[:1] == ["check"]:
        problems = closure_problems(load_spec())
        print("\n".join(problems) or "closed: every requirement is carried or on the image")
        return 1 if problems else 0
    if not argv or argv[0] not in ("download", "record", "split", "receive", "assemble"):
        print(__doc__)
        return 2
    if argv[0] == "receive":
        cmd_receive(argv[1])
    else:
        globals()[f"cmd_{argv[0]}"]()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
