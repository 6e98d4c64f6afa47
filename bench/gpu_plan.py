"""The device-run plan of bench/gpu_check.sh: what each device call sends, runs and costs.

`bash bench/gpu_check.sh --dry-run` prints it (`python3 bench/gpu_plan.py`); it exits non-zero
when the plan does not fit its budget: each part <= 7 minutes including a machine start, both
together <= 12 minutes, each call <= 64 MiB sent (working tree included).

Two parts, so that part 1's results exist even when part 2 cannot run:
  part 1, one call, no DALI: install the small wheels (.whl/), import, doctor, the GPU tests
          (-m "gpu or gds"), and gpu_bench's data, device_path, kvikio_rows, raw_tier, ring_safety.
  part 2, one call per DALI part, back to back (a warm machine keeps files only ~30 s after a
          call): DALI's JPEG wheels in parts, then assemble, install, `import nvidia.dali`, and
          gpu_bench's data, mixed_vs_cpu, mixed_busy, resnet50. Its last call also carries .whl/,
          so part 2 works on a fresh machine too; an install already done is skipped (a marker in
          the site folder), so a rerun on a warm machine does not reinstall.
Only the DALI wheels JPEG decoding needs are sent (gpu_wheels.json "lazy": nvImageCodec dlopens
nvjpeg2k and nvtiff only for those formats, DALI dlopens nvCOMP only for its nvCOMP operators).

Time model (estimates, stated, not measured here): a machine start 120 s; sending at 2 MiB/s
plus 5 s per call (audit 3: 62 MiB took 20-40 s); pip install 15 s for .whl/, 40 s for DALI's;
`import` 10 s; doctor 15 s; the timed steps at their typical time, each under a hard timeout
(`timeout -k 10`) whose cap is printed beside it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPEC = Path(__file__).resolve().parent / "gpu_wheels.json"
MiB = 2**20
CALL_LIMIT_MIB = 64
PART_LIMIT_S = 7 * 60
TOTAL_LIMIT_S = 12 * 60
START_S = 120
SEND_MIB_PER_S = 2.0
CALL_OVERHEAD_S = 5
TREE_MIB = 2.0  # the working tree that travels with every call (1.8 MiB measured, audit 3 D)

# (what, typical seconds, cap seconds or None) per phase; caps are gpu_check.sh's timeouts
PYTEST_TIMEOUT_S = 75
BENCH1_TIMEOUT_S = 150
BENCH2_TIMEOUT_S = 80
MEDIA_TIMEOUT_S = 20
MEDIA_MIB = 2.0  # bench/media_gpu_check.py make .media: about 2 MB of clips and references
PART1_STEPS = "data,device_path,kvikio_rows,raw_tier,ring_safety"
PART2_STEPS = "data,mixed_vs_cpu,mixed_busy,resnet50"


def wheel_mib(spec: dict, group: str, names: list[str]) -> float:
    """MiB of the named wheels: the downloaded files where present, else the recorded sizes."""
    folder = ROOT / (".whl" if group == "carry" else ".whl-dali")
    total = 0
    for name in names:
        files = list(folder.glob(name.replace("-", "_") + "-*.whl")) + list(folder.glob(name + "-*.whl"))
        total += files[0].stat().st_size if files else spec[group]["bytes"][name]
    return total / MiB


def dali_needed(spec: dict) -> list[str]:
    return [n for n in spec["dali"]["pins"] if n not in spec["dali"].get("lazy", {})]


def dali_parts(spec: dict, part_mib: float) -> list[float]:
    total = wheel_mib(spec, "dali", dali_needed(spec))
    parts = []
    while total > 1e-9:
        parts.append(min(part_mib, total))
        total -= parts[-1]
    return parts


def plan(spec: dict) -> list[dict]:
    """The calls, in order: {part, command, carry, mib, phases: [(what, typical_s, cap_s)]}."""
    from gpu_wheels import PART_BYTES

    whl = wheel_mib(spec, "carry", list(spec["carry"]["pins"]))
    parts = dali_parts(spec, PART_BYTES / MiB)
    calls = [{
        "part": 1, "carry": [".whl"], "mib": TREE_MIB + whl,
        "command": "bash bench/gpu_check.sh --part 1",
        "phases": [("machine start", START_S, START_S), ("install .whl/ (skipped when done)", 15, 15),
                   ("import kvikio, cupy, torch", 10, 10), ("doctor", 15, 15),
                   ("pytest -m 'gpu or gds'", 45, PYTEST_TIMEOUT_S),
                   (f"gpu_bench {PART1_STEPS}", 80, BENCH1_TIMEOUT_S)],
    }]
    for i, mib in enumerate(parts, 1):
        last = i == len(parts)
        carry = [f".dali{i}"] + ([".whl", ".media"] if last else [])
        phases = [("machine start (0 when part 1's machine is still warm)", START_S, START_S)] if i == 1 else []
        command = f"python3 bench/gpu_wheels.py receive .dali{i}"
        if last:
            command += " && bash bench/gpu_check.sh --part 2"
            phases += [("assemble (sha256)", 10, 10), ("install DALI (skipped when done)", 40, 40),
                       ("import nvidia.dali", 10, 10), (f"gpu_bench {PART2_STEPS}", 75, BENCH2_TIMEOUT_S),
                       ("media_gpu_check (NVDEC clips, audio)", 15, MEDIA_TIMEOUT_S)]
        calls.append({"part": 2, "carry": carry, "command": command,
                      "mib": TREE_MIB + mib + (whl + MEDIA_MIB if last else 0), "phases": phases})
    for c in calls:
        send = c["mib"] / SEND_MIB_PER_S + CALL_OVERHEAD_S
        c["phases"].insert(1 if c["phases"] and c["phases"][0][0].startswith("machine") else 0,
                           (f"send {c['mib']:.1f} MiB", send, send))
    return calls


def check(calls: list[dict]) -> list[str]:
    problems = []
    for c in calls:
        if c["mib"] > CALL_LIMIT_MIB:
            problems.append(f"part {c['part']} call '{c['command']}' sends {c['mib']:.1f} MiB > {CALL_LIMIT_MIB}")
    for part in (1, 2):
        cap = sum(p[2] for c in calls if c["part"] == part for p in c["phases"])
        if cap > PART_LIMIT_S:
            problems.append(f"part {part}: {cap / 60:.1f} min with every step at its cap > {PART_LIMIT_S // 60}")
    typical = sum(p[1] for c in calls for p in c["phases"])
    if typical > TOTAL_LIMIT_S:
        problems.append(f"both parts: {typical / 60:.1f} min typical > {TOTAL_LIMIT_S // 60}")
    return problems


def render(spec: dict, calls: list[dict]) -> str:
    lines = ["gpu_check plan (a dry run: nothing is installed or run)",
             f"DALI wheels sent (JPEG decoding): {', '.join(dali_needed(spec))}",
             "left behind (loaded lazily, not needed for JPEG): " + "; ".join(
                 f"{n} ({why})" for n, why in spec["dali"].get("lazy", {}).items()),
             f"small wheels (.whl/): {', '.join(spec['carry']['pins'])}",
             "media clips (.media/, part 2; made here, the GPU host has no PyAV): "
             "python bench/media_gpu_check.py make .media"]
    for part in (1, 2):
        pc = [c for c in calls if c["part"] == part]
        typ = sum(p[1] for c in pc for p in c["phases"])
        cap = sum(p[2] for c in pc for p in c["phases"])
        lines.append(f"\nPART {part}: {len(pc)} call(s), {typ / 60:.1f} min typical, {cap / 60:.1f} min at every cap "
                     f"(limit {PART_LIMIT_S // 60} min incl. machine start)")
        for n, c in enumerate(pc, 1):
            lines.append(f"  call {n}: carry={','.join(c['carry'])}  sends {c['mib']:.1f} MiB (limit {CALL_LIMIT_MIB})")
            lines.append(f"    run: {c['command']}")
            for what, t, capped in c["phases"]:
                lines.append(f"      {what:<58} ~{t:5.0f} s   cap {capped:5.0f} s")
    typical = sum(p[1] for c in calls for p in c["phases"])
    lines.append(f"\nTOTAL: {typical / 60:.1f} min typical (limit {TOTAL_LIMIT_S // 60} min); part 2's calls must follow "
                 f"each other within ~30 s (warm machine); if the machine went cold, part 2 starts again at .dali1")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    spec = json.loads(SPEC.read_text())
    calls = plan(spec)
    print(render(spec, calls))
    problems = check(calls)
    for p in problems:
        print(f"OVER BUDGET: {p}")
    if "--json" in argv:
        print(json.dumps(calls))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
