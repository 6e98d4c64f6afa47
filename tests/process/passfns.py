"""The `fn`s of the pass tests, importable by name (`--fn passfns:NAME` with this folder as the
working directory, or `passfns.NAME` here), so a killed CLI pass and its in-process resume run the
same `module:qualname`. `$PASS_LOG`, when set, gets one line per window `fn` saw; `$PASS_SLOW`
makes each call sleep that many seconds."""

from __future__ import annotations

import os
import time

import numpy as np


def _log(b: dict) -> None:
    if os.environ.get("PASS_SLOW"):  # seconds per batch: a pass slow enough to be stopped
        time.sleep(float(os.environ["PASS_SLOW"]))
    path = os.environ.get("PASS_LOG")
    if path:
        with open(path, "a") as f:
            for k, fld, w in zip(b["__key__"], b["field"], b["window"].tolist()):
                f.write(f"{k} {fld} {w}\n")


def frame_stats(b: dict) -> list:
    """Per window: the frames' means and a 9x16 thumbnail of its first frame (deterministic)."""
    _log(b)
    out = []
    for fr, t in zip(b["frames"], b["t"]):
        h, w = fr.shape[1:3]
        thumb = fr[0, :: max(1, h // 9), :: max(1, w // 16)][:9, :16]
        out.append({"mean.npy": fr.mean(axis=(1, 2, 3)), "thumb.npy": np.ascontiguousarray(thumb),
                    "t.json": t.tolist()})
    return out


def speech_stats(b: dict) -> list:
    _log(b)
    return [{"rms.npy": np.float32(np.sqrt(np.mean(a[:n] ** 2)) if n else 0.0).reshape(1), "n.cls": int(n)}
            for a, n in zip(b["audio"], b["length"])]


class Counted:
    """A class `fn`: instantiated once per process (`instances` counts it)."""

    instances = 0

    def __init__(self) -> None:
        type(self).instances += 1
        self.pid = os.getpid()

    def __call__(self, b: dict) -> list:
        return [{"pid.json": self.pid, "n.json": type(self).instances} for _ in b["window"]]
