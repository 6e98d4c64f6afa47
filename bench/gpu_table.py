"""The gpu_check report: one row per step, `step | status | figure | ratio | seconds`.

Kept as JSON in `OUT/gpu-check.json` and rewritten after every step (a run cut short by its
timeout still returns the steps it finished), and printed as a fixed-width table. Status is PASS,
FAIL, SKIP or INFO (a measurement with nothing to assert). Used by bench/gpu_check.sh from the
shell and by bench/gpu_bench.py:

    python3 bench/gpu_table.py add OUT STEP STATUS FIGURE [RATIO [SECONDS]]
    python3 bench/gpu_table.py print OUT [--expect a,b,c]   # exits 1 if any step FAILed
                                                          # or an expected step has no row

`--expect` names the steps that must have run: a step with no row (its process crashed before
writing it, or never reached it) gets a FAIL row "NOT EXERCISED", so a native crash after some
PASS rows cannot end in a passing table.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

STATUSES = ("PASS", "FAIL", "SKIP", "INFO")
COLUMNS = (("step", 18), ("status", 6), ("figure", 44), ("ratio", 7), ("seconds", 7))


class Report:
    def __init__(self, out: str | Path):
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
            seconds: float | None = None, **detail: Any) -> None:
        if status not in STATUSES:
            raise ValueError(f"status {status!r} is not one of {STATUSES}")
        row = {"step": step, "status": status, "figure": str(figure),
               "ratio": None if ratio is None else round(float(ratio), 3),
               "seconds": None if seconds is None else round(float(seconds), 1), "at": time.time()}
        self.data["rows"] = [r for r in self.data["rows"] if r["step"] != step] + [row]
        if detail:
            self.data["details"][step] = detail
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        tmp.replace(self.path)
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
    figure = figure if len(figure) <= 44 else figure[:41] + "..."
    cells = (row["step"], row["status"], figure, ratio, seconds)
    return " | ".join(str(c).ljust(w) for c, (_, w) in zip(cells, COLUMNS))


def main(argv: list[str]) -> int:
    if len(argv) >= 5 and argv[0] == "add":
        ratio = float(argv[5]) if len(argv) > 5 and argv[5] else None
        seconds = float(argv[6]) if len(argv) > 6 and argv[6] else None
        Report(argv[1]).add(argv[2], argv[3], argv[4], ratio, seconds)
        return 0
    if len(argv) in (2, 4) and argv[0] == "print" and (len(argv) == 2 or argv[2] == "--expect"):
        r = Report(argv[1])
        have = {row["step"] for row in r.data["rows"]}
        for step in (argv[3].split(",") if len(argv) == 4 and argv[3] else []):
            if step not in have:
                r.add(step, "FAIL", "NOT EXERCISED (crashed or never ran)")
        print(r.table())
        if r.failed:
            print(f"FAILED: {', '.join(r.failed)}")
        return 1 if r.failed else 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
