"""The gpu_check report: one row per step, `step | status | on | figure | ratio | seconds`.

Kept as JSON in `OUT/gpu-check.json` and rewritten after every step (a run cut short by its
timeout still returns the steps it finished), and printed as a fixed-width table. Status is PASS,
FAIL, SKIP or INFO (a measurement with nothing to assert). `on` says where the figure was measured
("gpu" or "cpu", from what the step observed: the decoder's routes, the loader's io path and
ring device), `expect` where the plan (or the NVDEC probe) says it should have been. Used by
bench/gpu_check.sh from the shell, by bench/gpu_bench.py and bench/media_gpu_check.py:

    python3 bench/gpu_table.py add OUT STEP STATUS FIGURE [RATIO [SECONDS]]
    python3 bench/gpu_table.py print OUT [--expect a,b,c] [--files x,y]   # the verdict
    python3 bench/gpu_table.py junit PYTEST.XML [TESTS]   # exit 0 only when all TESTS ran and passed

The verdict (`verdict()`, exit 1 when it fails) passes only when every expected step ran:
  - a step of `--expect` with no row (its process crashed before writing it, or never reached it)
    gets a FAIL row "NOT EXERCISED", so a native crash after some PASS rows cannot end green;
  - an expected step whose row is SKIP did not run: FAIL "NOT RUN";
  - a row whose `on` differs from its `expect` (a CPU fallback where a GPU figure was expected, or
    the reverse) FAILs: "measured on cpu, expected on gpu";
  - every file of `--files` (the pytest XML, doctor's JSON) must exist in OUT and be non-empty:
    a missing result file is a FAIL row "MISSING FILE";
  - any FAIL row fails it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

STATUSES = ("PASS", "FAIL", "SKIP", "INFO")
PLACES = ("", "gpu", "cpu")
COLUMNS = (("step", 18), ("status", 6), ("on", 3), ("figure", 60), ("ratio", 7), ("seconds", 7))


class Report:
    def __init__(self, out: str | Path, *, echo: bool = True):
        self.echo = echo  # print each row as it is added
        self.dir = Path(out)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "gpu-check.json"
        self.data: dict[str, Any] = {"rows": [], "details": {}}
        if self.path.exists():
            try:
                self.data = json.loads(self.path.read_text())
            except ValueError:  # a file cut short: start again, keep the old one aside
                self.path.rename(self.path.with_suffix(".json.broken"))

    def add(self, step: str, status: str, figure: str = "", ratio: float | None = None,
            seconds: float | None = None, *, on: str = "", expect: str = "", **detail: Any) -> None:
        if status not in STATUSES:
            raise ValueError(f"status {status!r} is not one of {STATUSES}")
        for value in (on, expect):
            if value not in PLACES:
                raise ValueError(f"where {value!r} is not one of {PLACES}")
        row = {"step": step, "status": status, "figure": str(figure), "on": on, "expect": expect,
               "ratio": None if ratio is None else round(float(ratio), 3),
               "seconds": None if seconds is None else round(float(seconds), 1), "at": time.time()}
        self.data["rows"] = [r for r in self.data["rows"] if r["step"] != step] + [row]
        if detail:
            self.data["details"][step] = detail
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        tmp.replace(self.path)
        if self.echo:
            print(format_row(row), flush=True)

    @property
    def failed(self) -> list[str]:
        return [r["step"] for r in self.data["rows"] if r["status"] == "FAIL"]

    def table(self) -> str:
        head = " | ".join(name.ljust(w) for name, w in COLUMNS)
        lines = [head, "-" * len(head)] + [format_row(r) for r in self.data["rows"]]
        return "\n".join(lines)


def format_row(row: dict) -> str:
    ratio = "" if row.get("ratio") is None else f"{row['ratio']:.2f}"
    seconds = "" if row.get("seconds") is None else f"{row['seconds']:.1f}"
    figure = row.get("figure", "")
    width = dict(COLUMNS)["figure"]
    figure = figure if len(figure) <= width else figure[: width - 3] + "..."
    cells = (row["step"], row["status"], row.get("on", ""), figure, ratio, seconds)
    return " | ".join(str(c).ljust(w) for c, (_, w) in zip(cells, COLUMNS))


def verdict(out: str | Path, expect: list[str], files: list[str] = ()) -> int:
    """Add the verdict's FAIL rows (module docstring), print the table; 0 only when it passes."""
    r = Report(out, echo=False)
    rows = {row["step"]: row for row in r.data["rows"]}
    for step in expect:
        row = rows.get(step)
        if row is None:
            r.add(step, "FAIL", "NOT EXERCISED (crashed or never ran)")
        elif row["status"] == "SKIP":
            r.add(step, "FAIL", f"NOT RUN (skipped: {row['figure']})", on=row.get("on", ""),
                  expect=row.get("expect", ""))
    for row in list(r.data["rows"]):
        on, want = row.get("on", ""), row.get("expect", "")
        if want and on != want and row["status"] != "FAIL":
            r.add(row["step"], "FAIL", f"measured on {on or 'nothing'}, expected on {want}: {row['figure']}",
                  on=on, expect=want)
    for name in files:
        f = Path(out) / name
        if not f.is_file() or f.stat().st_size == 0:
            r.add(f"file:{name}", "FAIL", f"MISSING FILE {name} (the step that writes it crashed or never ran)")
    print(r.table())
    if r.failed:
        print(f"FAILED: {', '.join(r.failed)}")
    return 1 if r.failed else 0


def junit(path: str | Path, expected: int | None = None) -> tuple[bool, str]:
    """(passed, figure) of a pytest `--junitxml` file: it passes only when it ran tests, every one
    of them passed (none failed, errored or was skipped: a skipped GPU test ran nothing on the
    GPU) and, with `expected`, exactly that many were selected (the plan's SELECTION)."""
    import xml.etree.ElementTree as ET

    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as exc:
        return False, f"no result file: {exc}"
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    figure = (f"{passed} passed, {n['failures']} failed, {n['errors']} errors, {n['skipped']} skipped of "
              f"{n['tests']}" + (f" (plan: {expected})" if expected is not None else ""))
    why = next((e.get("message", "") for e in root.iter("skipped")), "")
    if why:
        figure += f"; skipped: {why[:120]}"
    ok = passed > 0 and not (n["failures"] or n["errors"] or n["skipped"]) and (
        expected is None or n["tests"] == expected)
    return ok, figure


def main(argv: list[str]) -> int:
    if len(argv) in (2, 3) and argv[0] == "junit":
        ok, figure = junit(argv[1], int(argv[2]) if len(argv) == 3 else None)
        print(figure)
        return 0 if ok else 1
    if len(argv) >= 5 and argv[0] == "add":
        ratio = float(argv[5]) if len(argv) > 5 and argv[5] else None
        seconds = float(argv[6]) if len(argv) > 6 and argv[6] else None
        Report(argv[1], echo=False).add(argv[2], argv[3], argv[4], ratio, seconds)
        return 0
    if len(argv) >= 2 and argv[0] == "print":
        opts = dict(zip(argv[2::2], argv[3::2]))
        if len(argv) % 2 or set(opts) - {"--expect", "--files"}:
            print(__doc__)
            return 2
        split = lambda v: [x for x in (v or "").split(",") if x]  # noqa: E731
        return verdict(argv[1], split(opts.get("--expect")), split(opts.get("--files")))
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
