"""Helpers of the feed tests: free ports, the server as a subprocess, local reference batches."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health_status(address: str, service: str = "", timeout: float = 2.0):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout).status


def spawn_server(roots: Path, port: int, log: Path, *args: str) -> subprocess.Popen:
    """`python -m gdsload.service ROOT --listen 127.0.0.1:PORT ...`, returned once SERVING."""
    from grpc_health.v1 import health_pb2

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log, "ab") as err:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            [sys.executable, "-m", "gdsload.service", str(roots), "--listen", f"127.0.0.1:{port}", "--grace", "5",
             *args],
            stdout=subprocess.DEVNULL, stderr=err, env=env,
        )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if health_status(f"127.0.0.1:{port}", timeout=0.5) == health_pb2.HealthCheckResponse.SERVING:
                return proc
        except grpc.RpcError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"server did not become SERVING: {log.read_text()[-2000:]}")


def local_batches(path: Path, **kw) -> list[dict]:
    from gdsload.loader.dataloader import DataLoader, Dataset

    dl = DataLoader(Dataset(str(path)), device="cpu", output="numpy", copy=True, **kw)
    try:
        return list(dl)
    finally:
        dl.close()


def assert_same_batches(remote: list, local: list) -> None:
    assert len(remote) == len(local), (len(remote), len(local))
    for i, (a, b) in enumerate(zip(remote, local)):
        if isinstance(a, tuple):
            a, b = dict(enumerate(a)), dict(enumerate(b))
        assert list(a) == list(b), f"batch {i}: fields {list(a)} != {list(b)}"
        for k in a:
            x, y = a[k], b[k]
            if hasattr(x, "numpy"):
                x = x.numpy()
            if isinstance(y, np.ndarray) or hasattr(y, "numpy"):
                y = y.numpy() if hasattr(y, "numpy") else y
                assert x.dtype == y.dtype and x.shape == y.shape, f"batch {i} field {k}"
                assert x.tobytes() == y.tobytes(), f"batch {i} field {k}: bytes differ"
            else:
                assert x == y, f"batch {i} field {k}"
