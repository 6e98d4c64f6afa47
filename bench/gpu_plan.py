"""The device-run plan of bench/gpu_check.sh: the calls, what each sends and runs, its caps and time.

`bash bench/gpu_check.sh --dry-run` prints it (`python3 bench/gpu_plan.py`) and exits non-zero
when it does not fit (with `--ready`, also when .whl/, the DALI parts or .media are not made here,
so that the plan is measured, not budgeted): at most `MAX_CALLS` device calls; each call <= `CALL_LIMIT_MIB` sent, as
measured here (the working tree travels with every call: tracked files plus untracked ones git
does not ignore) and again with the tree, `.whl/` and `.media/` at their size budgets, so later
issues may grow the tree up to `TREE_BUDGET_MIB` without a new plan; <= `TYPICAL_LIMIT_S`
typical including the machine's start and the agent's turnaround before each later call and
before `give_back`; the slack left of the 15 device-minutes covers one rerun of the last call on
the warm machine; every command's caps fit its `timeout_s` and the tool's 600 s; the media clips
are >= `MIN_CLIP_SIDE` px on each side. `tests/test_gpu_check.py` asserts these figures on the CPU,
so growth fails CI, not the device run. `--caps PART` prints the caps as shell assignments, which
`gpu_check.sh` evaluates: the script, the plan and bench/README.md's quoted summary cannot drift.

The calls (the warm machine keeps files only ~30 s after a call, so calls 2.. follow at once):
  1  carry .whl + .dali1: `gpu_check.sh --part 1 --receive .dali1`: receive DALI's first part;
     install .whl/, import (CUDA asserted), the NVDEC probe (which routes part 2's videos),
     doctor, pytest -m "gpu or gds" (token shards read by KvikIO into the device ring against the
     host path among them), gpu_bench's raw-tier steps (over PART_ARGS' 1,024 rows).
  2.. carry .daliN: `gpu_wheels.py receive .daliN`.
  last carry .daliN + .media: `gpu_check.sh --part 2 --receive .daliN`: assemble, install DALI,
     import + a one-JPEG mixed smoke decode, pytest -m dali_gpu, gpu_bench's decoded-tier steps
     (DALI's own pipeline as the mixed baseline), the media check (NVDEC clips/s per codec, a
     preprocessing pass's NVDEC frames/s: pass_nvdec, capped at PASS_NVDEC_S[1] <= 60 s).
  rerun (only if needed, on the warm machine, carry nothing): `gpu_check.sh --part 2`.
A cold machine loses `.dali-parts/` and the installs: start again from call 1 (no time for it).

Time model (estimates, not measurements; a drawn session replaces them with what it saw): a first
start 180 s typical, 210 s at worst (a direct start takes 60-120 s; a refused H100 falls back to an
H200 after 90 s, and each failed try costs 1-2 min: device README); sending at 2 MiB/s (1.5 at
worst) plus 5 s a call (audit 3: 62 MiB took 20-40 s); 15 s of the agent's turnaround before each
later call and before give_back (30 s at worst: the warm window); each phase's typical time and its
cap (the hard timeout gpu_check.sh puts on it). The pytest caps come from the test selection
(`SELECTION`: files, marker, number of tests, asserted by collecting them in the CPU tests), the
gpu_bench and media caps from their steps.
"""

from __future__ import annotations

import ast
import json
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPEC = Path(__file__).resolve().parent / "gpu_wheels.json"
MiB = 2**20

DEVICE_BUDGET_S = 15 * 60
TYPICAL_LIMIT_S = 10.5 * 60
MAX_CALLS = 5
CALL_LIMIT_MIB = 62.0  # the tool refuses over 64 MiB; 2 MiB kept in hand
COMMAND_LIMIT_S = 600  # one command's limit (the run tool's timeout_s)
TIMEOUT_MARGIN_S = 30  # timeout_s = the command's caps + this
TREE_BUDGET_MIB = 5.0  # the working tree (2.75 MiB at issue 47's start, 3.3 a few hours later)
WHL_BUDGET_MIB = 4.1  # .whl/ (3.99 MiB recorded)
MEDIA_BUDGET_MIB = 0.6  # .media/ (0.37 MiB measured at issue 47)
MIN_CLIP_SIDE = 144  # NVDEC's largest minimum on Turing..Hopper (HEVC)
WARM_WINDOW_S = 30

START_S = (180, 210)  # (typical, worst)
TURNAROUND_S = (15, 30)
SEND_MIB_PER_S = (2.0, 1.5)
SEND_OVERHEAD_S = 5

# What each pytest step selects; `tests` is asserted by collecting it (tests/test_gpu_check.py).
SELECTION = {
    1: {"files": ["tests/test_gpu_path.py", "tests/ring/test_ring.py", "tests/loader/test_dataloader.py",
                  "tests/io/test_conformance.py", "tests/tokens/test_token_gpu.py"], "marker": "gpu or gds",
        "tests": 28},
    2: {"files": ["tests/test_gpu_path.py"], "marker": "dali_gpu", "tests": 1},
}
PYTEST_START_S = (10, 30)  # interpreter, torch/CuPy imports, collection
PER_TEST_S = (0.6, 2.0)
# session fixtures a selection builds once, beside its tests: the token corpus of
# tests/tokens/test_token_gpu.py::test_real_gpu_batches_equal_host_batches (token shards read by
# KvikIO into the device ring against the host path; tokkit.Corpus trains a tokenizer and converts
# the corpus twice: 4.2 CPU-s, 12.7 s wall on this 2-core VM shared with others; tokenizers is on the image)
FIXTURE_S = {1: (5, 20), 2: (0, 0)}

BENCH_START_S = (6, 20)  # interpreter and imports of one gpu_bench process
BENCH_STEPS = {  # gpu_bench step -> (typical s, cap s)
    "nvdec": (2, 15),
    # part 1 over PART_ARGS' 1,024 rows (2,048 before issue 54 item 4: 154 MB instead of 308 MB made,
    # converted and read); the parts that scale with the bytes halved, start-up (imports, 16 torch
    # workers, pipelines) kept: data_npy (10, 30) -> (5, 20), device_path (5, 20) -> (4, 18),
    # kvikio_rows (10, 30) -> (7, 24), raw_tier (18, 45) -> (13, 36)
    "data_npy": (5, 20), "device_path": (4, 18), "kvikio_rows": (7, 24), "raw_tier": (13, 36),
    "ring_safety": (8, 25),
    "data_jpg": (6, 20), "mixed_vs_cpu": (8, 25), "mixed_busy": (6, 20), "dali_pipeline": (8, 25),
    "resnet50": (22, 60),
}
PART_STEPS = {1: ["data_npy", "device_path", "kvikio_rows", "raw_tier", "ring_safety"],
              2: ["data_jpg", "mixed_vs_cpu", "mixed_busy", "dali_pipeline", "resnet50"]}
PART_ARGS = {1: "--samples 1024", 2: ""}  # gpu_bench's arguments for the part's steps
MEDIA_START_S = (6, 20)
MEDIA_STEP_S = (4, 12)  # per media row: one checked decode, --runs timed ones, one cropped normalised decode (R11)
# the pass_nvdec row (issue 54 item 4): one pipeline build, one checked pass, passes timed for
# media_gpu_check.PASS_SECONDS (4 s); its cap <= 60 s
PASS_NVDEC_S = (8, 30)

# fixed phases: name -> (typical s, cap s); gpu_check.sh puts the cap on each
FIXED = {
    "receive": (2, 10),  # copy one DALI part into .dali-parts/
    "install": (8, 30),  # pip --no-index --no-deps of .whl/ (skipped when its marker matches)
    "import": (8, 30),  # import kvikio, cupy, torch; torch.cuda.is_available() asserted
    "doctor": (8, 30),
    "assemble": (5, 20),  # join the parts, sha256, untar
    "dali_install": (15, 60),
    "dali_import": (10, 40),  # import nvidia.dali; one JPEG through decode -> resize -> crop_mirror_normalize (mixed)
}


def _bench_phase(steps: list[str]) -> tuple[str, int, int]:
    typ = BENCH_START_S[0] + sum(BENCH_STEPS[s][0] for s in steps)
    cap = BENCH_START_S[1] + sum(BENCH_STEPS[s][1] for s in steps)
    return f"gpu_bench {','.join(steps)}", typ, cap


def _pytest_phase(part: int) -> tuple[str, int, int]:
    sel = SELECTION[part]
    n = sel["tests"]
    typ = round(PYTEST_START_S[0] + n * PER_TEST_S[0] + FIXTURE_S[part][0])
    cap = round(PYTEST_START_S[1] + n * PER_TEST_S[1] + FIXTURE_S[part][1])
    extra = " (token shards by KvikIO into the device ring included)" if part == 1 else ""
    return f"pytest -m '{sel['marker']}' ({n} tests){extra}", typ, cap


def media_steps() -> list[str]:
    """bench/media_gpu_check.py's STEPS, read without importing it (it needs NumPy)."""
    return _constants(ROOT / "bench" / "media_gpu_check.py")["steps"]


def _constants(path: Path) -> dict:
    """W, H and the codecs of bench/media_gpu_check.py, from its literal assignments."""
    tree = ast.parse(path.read_text())
    found: dict = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], (ast.Name, ast.Tuple)):
            target = node.targets[0]
            names = [t.id for t in target.elts] if isinstance(target, ast.Tuple) else [target.id]
            try:
                values = ast.literal_eval(node.value)
            except ValueError:
                continue
            values = values if isinstance(target, ast.Tuple) else (values,)
            found.update(zip(names, values))
    codecs = list(found["CODECS"])
    return {"W": found["W"], "H": found["H"], "codecs": codecs,
            "steps": [f"video_{c}" for c in codecs] + ["pass_nvdec", "audio_flac", "audio_wav"]}


def clip_size() -> tuple[int, int]:
    c = _constants(ROOT / "bench" / "media_gpu_check.py")
    return c["W"], c["H"]


def _media_phase() -> tuple[str, int, int]:
    steps = media_steps()
    n = len([s for s in steps if s != "pass_nvdec"])
    return (f"media_gpu_check ({len(steps)} rows: NVDEC clips/s, a pass's NVDEC frames/s, audio)",
            MEDIA_START_S[0] + n * MEDIA_STEP_S[0] + PASS_NVDEC_S[0],
            MEDIA_START_S[1] + n * MEDIA_STEP_S[1] + PASS_NVDEC_S[1])


def part_phases(part: int, *, receive: bool = True, rerun: bool = False) -> list[tuple[str, int, int]]:
    """The phases of `gpu_check.sh --part PART` (in the command): (what, typical s, cap s)."""
    if part == 1:
        ph = [("receive .dali1", *FIXED["receive"])] if receive else []
        return ph + [("install .whl/", *FIXED["install"]), ("import kvikio, cupy, torch (+ CUDA)", *FIXED["import"]),
                     ("NVDEC probe (routes part 2's videos)", *_bench_phase(["nvdec"])[1:]),
                     ("doctor", *FIXED["doctor"]), _pytest_phase(1), _bench_phase(PART_STEPS[1])]
    ph = [("receive the last DALI part", *FIXED["receive"])] if receive else []
    if not rerun:
        ph += [("assemble DALI's parts (sha256)", *FIXED["assemble"]), ("install DALI", *FIXED["dali_install"])]
    return ph + [("import DALI + mixed smoke decode", *FIXED["dali_import"]), _pytest_phase(2),
                 _bench_phase(PART_STEPS[2]), _media_phase()]


def caps(part: int) -> dict[str, object]:
    """The caps gpu_check.sh puts on each step of PART (shell names)."""
    sel = SELECTION[part]
    out: dict[str, object] = {
        "RECEIVE_CAP_S": FIXED["receive"][1], "INSTALL_CAP_S": FIXED["install"][1],
        "PYTEST_FILES": " ".join(sel["files"]), "PYTEST_MARK": sel["marker"], "PYTEST_TESTS": sel["tests"],
        "PYTEST_CAP_S": _pytest_phase(part)[2], "BENCH_STEPS": ",".join(PART_STEPS[part]),
        "BENCH_ARGS": PART_ARGS[part],
        "BENCH_CAP_S": _bench_phase(PART_STEPS[part])[2]}
    if part == 1:
        out.update(IMPORT_CAP_S=FIXED["import"][1], NVDEC_CAP_S=_bench_phase(["nvdec"])[2],
                   DOCTOR_CAP_S=FIXED["doctor"][1])
    else:
        out.update(ASSEMBLE_CAP_S=FIXED["assemble"][1], DALI_INSTALL_CAP_S=FIXED["dali_install"][1],
                   DALI_IMPORT_CAP_S=FIXED["dali_import"][1], MEDIA_CAP_S=_media_phase()[2],
                   MEDIA_STEPS=",".join(media_steps()))
    return out


# -- sizes ---------------------------------------------------------------------------------------------
def tree_bytes(root: Path = ROOT) -> int | None:
    """Bytes of the working tree that travels: tracked files and untracked ones git does not
    ignore (what the device tool sends); None without git."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                             capture_output=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    total = 0
    for name in set(out.split(b"\0")) - {b""}:
        p = root / name.decode()
        if p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    return total


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def wheel_mib(spec: dict, group: str, names: list[str]) -> tuple[float, bool]:
    """(MiB of the named wheels, measured): the downloaded files where all are present, else the
    recorded sizes."""
    folder = ROOT / (".whl" if group == "carry" else ".whl-dali")
    total, measured = 0, True
    for name in names:
        files = list(folder.glob(name.replace("-", "_") + "-*.whl")) + list(folder.glob(name + "-*.whl"))
        if files:
            total += files[0].stat().st_size
        else:
            total += spec[group]["bytes"][name]
            measured = False
    return total / MiB, measured


def dali_needed(spec: dict) -> list[str]:
    return [n for n in spec["dali"]["pins"] if n not in spec["dali"].get("lazy", {})]


def part_limits_mib() -> tuple[float, float]:
    """(first part, later parts) in MiB: what fits a call with the tree (and, with the first, .whl)
    at their budgets. The last part shares its call with .media (checked by `check`)."""
    return CALL_LIMIT_MIB - TREE_BUDGET_MIB - WHL_BUDGET_MIB, CALL_LIMIT_MIB - TREE_BUDGET_MIB


def dali_parts(total_mib: float) -> list[float]:
    first, later = part_limits_mib()
    parts, left = [], total_mib
    while left > 1e-9:
        parts.append(min(first if not parts else later, left))
        left -= parts[-1]
    return parts


def sizes(spec: dict) -> dict:
    """Every size the plan uses, measured where the thing exists here, else recorded/budgeted."""
    tree = tree_bytes()
    whl, whl_measured = wheel_mib(spec, "carry", list(spec["carry"]["pins"]))
    dali, dali_measured = wheel_mib(spec, "dali", dali_needed(spec))
    split = sorted(ROOT.glob(".dali[0-9]*"), key=lambda p: int(p.name[5:]))
    parts = [folder_bytes(p) / MiB for p in split] if split else dali_parts(dali)
    media = ROOT / ".media"
    has_media = (media / "ref.npz").is_file()
    return {"tree": tree / MiB if tree is not None else TREE_BUDGET_MIB, "tree_measured": tree is not None,
            "whl": whl, "whl_measured": whl_measured, "dali": dali, "dali_measured": dali_measured,
            "parts": parts, "parts_measured": bool(split),
            "media": folder_bytes(media) / MiB if has_media else MEDIA_BUDGET_MIB, "media_measured": has_media}


# -- the plan -------------------------------------------------------------------------------------
def _send(mib: float) -> tuple[str, float, float]:
    return (f"send {mib:.1f} MiB", mib / SEND_MIB_PER_S[0] + SEND_OVERHEAD_S, mib / SEND_MIB_PER_S[1] + SEND_OVERHEAD_S)


def plan(spec: dict, sz: dict | None = None) -> list[dict]:
    """The calls, in order: {n, part, carry, command, mib, mib_budget, before, phases, timeout_s}.
    `before`: what the call costs before its command (a start or a turnaround, the send);
    `phases`: its command's (what, typical s, cap s)."""
    sz = sz or sizes(spec)
    parts = sz["parts"]
    calls = []
    for i, part_mib in enumerate(parts, 1):
        first, last = i == 1, i == len(parts)
        carry = [".whl"] if first else []
        carry.append(f".dali{i}")
        mib = sz["tree"] + part_mib + (sz["whl"] if first else 0)
        budget = TREE_BUDGET_MIB + part_mib + (WHL_BUDGET_MIB if first else 0)
        if last:
            carry.append(".media")
            mib += sz["media"]
            budget += MEDIA_BUDGET_MIB
        if first:
            command, phases, part = f"bash bench/gpu_check.sh --part 1 --receive .dali{i}", part_phases(1), 1
        elif last:
            command, phases, part = f"bash bench/gpu_check.sh --part 2 --receive .dali{i}", part_phases(2), 2
        else:
            command, phases, part = f"python3 bench/gpu_wheels.py receive .dali{i}", [(f"receive .dali{i}",
                                                                                        *FIXED["receive"])], 2
        before = [("machine start", *START_S) if first else ("turnaround (the warm window is 30 s)", *TURNAROUND_S),
                  _send(mib)]
        calls.append({"n": i, "part": part, "carry": carry, "command": command, "mib": mib, "mib_budget": budget,
                      "before": before, "phases": phases})
    for c in calls:
        c["timeout_s"] = min(COMMAND_LIMIT_S, sum(p[2] for p in c["phases"]) + TIMEOUT_MARGIN_S)
    return calls


def rerun(sz: dict) -> dict:
    """The last call again on the warm machine (parts, installs and .media kept there)."""
    phases = part_phases(2, receive=False, rerun=True)
    return {"carry": [], "command": "bash bench/gpu_check.sh --part 2", "mib": sz["tree"],
            "before": [("turnaround", *TURNAROUND_S), _send(sz["tree"])], "phases": phases,
            "timeout_s": min(COMMAND_LIMIT_S, sum(p[2] for p in phases) + TIMEOUT_MARGIN_S)}


def totals(calls: list[dict], sz: dict) -> dict:
    """Typical and worst seconds (every call, then give_back's turnaround), slack, the rerun's time
    and each call's MiB (as sized, and with the tree/.whl/.media at their budgets)."""
    typical = sum(p[1] for c in calls for p in c["before"] + c["phases"]) + TURNAROUND_S[0]  # + give_back
    worst = sum(p[2] for c in calls for p in c["before"] + c["phases"]) + TURNAROUND_S[1]
    r = rerun(sz)
    again = sum(p[1] for p in r["before"] + r["phases"])
    return {"calls": len(calls), "typical_s": typical, "caps_s": worst, "slack_s": DEVICE_BUDGET_S - typical,
            "rerun_s": again, "mib": [round(c["mib"], 1) for c in calls],
            "mib_budget": [round(c["mib_budget"], 1) for c in calls]}


def check(calls: list[dict], sz: dict) -> list[str]:
    problems = []
    if len(calls) > MAX_CALLS:
        problems.append(f"{len(calls)} device calls > {MAX_CALLS}")
    for c in calls:
        if c["mib"] > CALL_LIMIT_MIB:
            problems.append(f"call {c['n']} sends {c['mib']:.1f} MiB > {CALL_LIMIT_MIB:g}")
        if c["mib_budget"] > CALL_LIMIT_MIB:
            problems.append(f"call {c['n']} would send {c['mib_budget']:.1f} MiB > {CALL_LIMIT_MIB:g} with the tree, "
                            f".whl and .media at their budgets")
        caps_s = sum(p[2] for p in c["phases"])
        if caps_s + TIMEOUT_MARGIN_S > COMMAND_LIMIT_S:
            problems.append(f"call {c['n']}: its caps add up to {caps_s} s, over the {COMMAND_LIMIT_S} s command limit")
    for what, value, budget in (("the tree", sz["tree"], TREE_BUDGET_MIB), (".whl/", sz["whl"], WHL_BUDGET_MIB),
                                (".media/", sz["media"], MEDIA_BUDGET_MIB)):
        if value > budget:
            problems.append(f"{what} is {value:.2f} MiB, over its {budget:g} MiB budget")
    t = totals(calls, sz)
    if t["typical_s"] > TYPICAL_LIMIT_S:
        problems.append(f"{t['typical_s'] / 60:.1f} min typical > {TYPICAL_LIMIT_S / 60:g}")
    if t["slack_s"] < t["rerun_s"]:
        problems.append(f"slack {t['slack_s'] / 60:.1f} min < a rerun of the last call ({t['rerun_s'] / 60:.1f} min)")
    w, h = clip_size()
    if min(w, h) < MIN_CLIP_SIDE:
        problems.append(f"media clips {w}x{h}: NVDEC needs >= {MIN_CLIP_SIDE} px on each side (HEVC)")
    return problems


def at_budgets(sz: dict) -> dict:
    """`sz` with the tree, .whl and .media at their budgets and the DALI parts as split from the
    wheels: the plan that stays valid while later issues grow the tree within its budget."""
    return {**sz, "tree": TREE_BUDGET_MIB, "whl": WHL_BUDGET_MIB, "media": MEDIA_BUDGET_MIB,
            "parts": dali_parts(sz["dali"]), "tree_measured": False, "whl_measured": False, "media_measured": False}


def summary(spec: dict, sz: dict) -> list[str]:
    """The dry run's last lines. The first two are the plan at the size budgets (bench/README.md
    quotes them, and a test checks the quote); the last is the plan as measured here."""
    b = at_budgets(sz)
    tb, t = totals(plan(spec, b), b), totals(plan(spec, sz), sz)
    first, later = part_limits_mib()
    return [
        f"PLAN at the size budgets: {tb['calls']} device calls (limit {MAX_CALLS}), {tb['typical_s'] / 60:.1f} min "
        f"typical with the start and {tb['calls']} turnarounds (limit {TYPICAL_LIMIT_S / 60:g}), "
        f"{tb['caps_s'] / 60:.1f} with every step at its cap; slack {tb['slack_s'] / 60:.1f} min of "
        f"{DEVICE_BUDGET_S // 60}, a warm rerun of the last call {tb['rerun_s'] / 60:.1f}",
        f"SIZES at the budgets (tree {TREE_BUDGET_MIB:g}, .whl {WHL_BUDGET_MIB:g}, .media {MEDIA_BUDGET_MIB:g} MiB; "
        f"DALI parts {first:g} then <= {later:g} MiB): " + " / ".join(f"{m:.1f}" for m in tb["mib"])
        + f" MiB per call (limit {CALL_LIMIT_MIB:g})",
        "AS MEASURED HERE: " + " / ".join(f"{m:.1f}" for m in t["mib"]) + f" MiB per call, "
        f"{t['typical_s'] / 60:.1f} min typical, slack {t['slack_s'] / 60:.1f} (tree {sz['tree']:.2f} MiB"
        f"{'' if sz['tree_measured'] else ' (budget: no git)'}, .whl {sz['whl']:.2f}"
        f"{'' if sz['whl_measured'] else ' (recorded)'}, .media {sz['media']:.2f}"
        f"{'' if sz['media_measured'] else ' (budget: not made yet)'})",
    ]


def render(spec: dict, calls: list[dict], sz: dict) -> str:
    w, h = clip_size()
    lines = ["gpu_check plan (a dry run: nothing is installed or run)",
             f"DALI wheels sent (JPEG decoding): {', '.join(dali_needed(spec))} ({sz['dali']:.1f} MiB"
             f"{'' if sz['dali_measured'] else ', recorded'})",
             "left behind (loaded lazily, not needed for JPEG): " + "; ".join(
                 f"{n} ({why})" for n, why in spec["dali"].get("lazy", {}).items()),
             f"small wheels (.whl/): {', '.join(spec['carry']['pins'])}",
             "before the first call, here: python3 bench/gpu_wheels.py download && python3 bench/gpu_wheels.py split "
             "&& python bench/media_gpu_check.py make .media (the GPU host has no PyAV); then "
             "`bash bench/gpu_check.sh --dry-run --ready` (measured, not budgeted; non-zero if anything is missing)",
             f"media clips: {w}x{h} (>= {MIN_CLIP_SIDE} px a side: NVDEC's HEVC minimum)"]
    for c in calls:
        typ = sum(p[1] for p in c["before"] + c["phases"])
        cap = sum(p[2] for p in c["before"] + c["phases"])
        lines.append(f"\nCALL {c['n']} (part {c['part']}): ~{typ / 60:.1f} min, {cap / 60:.1f} at every cap")
        lines.append(f"  run(command={c['command']!r}, carry={json.dumps(c['carry'])}, timeout_s={c['timeout_s']})"
                     f"   sends {c['mib']:.1f} MiB")
        for what, t, capped in c["before"] + c["phases"]:
            lines.append(f"      {what:<60} ~{t:5.0f} s   cap {capped:5.0f} s")
    r = rerun(sz)
    lines.append(f"\nRERUN of the last call only, on the warm machine, if time is left (parts, installs, .media kept):")
    lines.append(f"  run(command={r['command']!r}, carry=[], timeout_s={r['timeout_s']})   sends {r['mib']:.1f} MiB, "
                 f"~{sum(p[1] for p in r['before'] + r['phases']) / 60:.1f} min")
    lines.append(f"then give_back (~{TURNAROUND_S[0]} s). Calls 2..{len(calls)} must each start within "
                 f"{WARM_WINDOW_S} s of the last reply (the warm window); a cold machine has lost .dali-parts/: "
                 f"the plan has no time to start again.\n")
    lines += summary(spec, sz)
    return "\n".join(lines)


def not_ready(spec: dict, sz: dict) -> list[str]:
    """What is not made yet here for the first call (`--ready`: run it before call 1): the plan
    must then be measured, not budgeted."""
    missing = []
    if not sz["whl_measured"]:
        missing.append(".whl/ (python3 bench/gpu_wheels.py download)")
    if not sz["parts_measured"]:
        missing.append(".dali1/.. (python3 bench/gpu_wheels.py download && python3 bench/gpu_wheels.py split)")
    if not sz["media_measured"]:
        missing.append(".media/ref.npz (python bench/media_gpu_check.py make .media)")
    return missing


def main(argv: list[str]) -> int:
    spec = json.loads(SPEC.read_text())
    if argv[:1] == ["--caps"] and len(argv) == 2 and argv[1] in ("1", "2"):
        for k, v in caps(int(argv[1])).items():
            print(f"{k}={shlex.quote(str(v))}")
        return 0
    sz = sizes(spec)
    calls = plan(spec, sz)
    problems = check(calls, sz)
    b = at_budgets(sz)
    problems += [f"at the size budgets: {p}" for p in check(plan(spec, b), b)]
    missing = not_ready(spec, sz) if "--ready" in argv else []
    if "--json" in argv:
        print(json.dumps({"calls": calls, "totals": totals(calls, sz), "sizes": sz, "problems": problems,
                          "not_ready": missing}))
        return 1 if problems or missing else 0
    print(render(spec, calls, sz))
    for p in problems:
        print(f"OVER BUDGET: {p}")
    for m in missing:
        print(f"NOT READY: not made yet: {m}")
    return 1 if problems or missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
