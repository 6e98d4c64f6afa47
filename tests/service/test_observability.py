"""Prometheus metrics over HTTP and JSON-lines logs."""

from __future__ import annotations

import io
import json
import logging
import urllib.request

import pytest

from gdsload.service.client import RemoteLoader
from gdsload.service.server.logs import JsonLines
from gdsload.service.server import create_server
from gdsload.service.protocol.status import RemoteError


def test_metrics_and_json_logs(roots):
    stream = io.StringIO()
    logger = logging.getLogger("gdsload.service.test-observability")
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonLines())
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    srv, port = create_server([str(roots)], metrics_port=0, metrics_address="127.0.0.1", logger=logger)
    srv.start()
    try:
        address = f"127.0.0.1:{port}"
        loader = RemoteLoader(address, dataset="feats", batch_size=32, output="numpy")
        assert sum(len(b["__key__"]) for b in loader) == 256
        with pytest.raises(RemoteError):
            len(RemoteLoader(address, dataset="missing", max_retries=0))
        text = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=5).read().decode()
        assert 'gdsload_feed_batches_total{dataset="feats",payload="decoded"} 8.0' in text
        assert 'gdsload_feed_samples_total{dataset="feats",payload="decoded"} 256.0' in text
        assert 'gdsload_feed_consumers{dataset="feats"} 0.0' in text
        assert 'gdsload_feed_errors_total{code="NOT_FOUND"} 1.0' in text
        assert "gdsload_feed_read_seconds_count" in text and "gdsload_feed_send_seconds_count" in text
        body = [line for line in text.splitlines() if line.startswith('gdsload_feed_bytes_total{dataset="feats"')]
        assert float(body[0].split()[-1]) == 256 * (32 * 64 * 4 + 8)  # float32 arrays + int64 labels
    finally:
        srv.shutdown(grace_s=1)
    records = [json.loads(line) for line in stream.getvalue().splitlines()]
    events = [r["event"] for r in records]
    assert events[0] == "server_start" and "stream_start" in events and events[-1] == "shutdown_done"
    end = next(r for r in records if r["event"] == "stream_end")
    assert end["outcome"] == "ok" and end["batches"] == 8 and end["dataset"] == "feats"
    failed = next(r for r in records if r["event"] == "call_failed")
    assert failed["code"] == "NOT_FOUND" and "missing" in failed["message"]
    assert all({"ts", "level", "logger", "event"} <= r.keys() for r in records)
