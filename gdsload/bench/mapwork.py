"""The Python-heavy per-sample work of `bench/map_bench.py`, importable by spawned and forked
workers alike (the same function runs under gdsload and under torch + webdataset)."""

from __future__ import annotations

import time

import numpy as np


def busy_map(sample: dict, iters: int) -> dict:
    """Pure-Python work (`iters` steps of a rolling hash over the caption), then a small dict."""
    text = sample["txt"]
    acc = 0
    n = len(text)
    for i in range(iters):
        acc = (acc * 131 + ord(text[i % n])) % 1_000_003
    ids = np.frombuffer(text.encode()[:16].ljust(16, b" "), dtype=np.uint8).astype(np.int64)
    return {"ids": ids, "x": np.asarray(sample["npy"]) * 2, "cls": int(sample["cls"]), "h": acc}


def calibrate(ms: float) -> int:
    """How many `busy_map` steps take about `ms` milliseconds here."""
    sample = {"txt": "calibration caption of some length", "npy": np.zeros(4, np.float32), "cls": 0}
    iters = 1000
    while True:
        t0 = time.perf_counter()
        busy_map(sample, iters)
        el = time.perf_counter() - t0
        if el > 0.02:
            return max(1, int(iters * ms / 1000 / el))
        iters *= 2
