"""Helpers shared by the conversion tests (imported as `convertkit`, like `tests/service/feedkit`)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable


def convert_and_kill(argv: list[str], ready: Callable[[], bool], *, timeout: float, poll: float) -> None:
    """Run `python -m gdsload convert ARGV...` and SIGKILL it as soon as `ready()` holds (checked
    every `poll` seconds); fails the test unless it really was killed mid-run within `timeout`."""
    proc = subprocess.Popen([sys.executable, "-m", "gdsload", "convert", *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if ready():
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(poll)
    finally:
        if proc.poll() is None and time.monotonic() >= deadline:
            proc.kill()
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL, (
        f"the conversion was not killed mid-run (rc {proc.returncode}): {out.decode()[-2000:]} {err.decode()[-2000:]}"
    )
