"""examples/preprocess_ocr_asr.py --tiny runs: both passes write their datasets, the stand-in OCR
finds each caption at 1.0 s and the stand-in ASR the speech from 1 s to 3 s."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "preprocess_ocr_asr.py"


def test_example_runs(tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--out", str(tmp_path)], capture_output=True,
                       text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.splitlines()
    assert sum("text: [{'t': 1.0, 'box'" in ln for ln in lines) == 3
    assert sum("speech: [[1.0, 2.0]]" in ln for ln in lines) == 3 and sum("speech: [[2.0, 3.0]]" in ln for ln in lines) == 3
    assert (tmp_path / "ocr" / "manifest.json").is_file() and (tmp_path / "asr" / "manifest.json").is_file()
