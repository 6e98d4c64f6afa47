"""A server's configuration is declared and checked once (`protocol.config.ServerConfig`, frozen):
each bad setting is a `GdsloadError` naming its `gdsload serve` flag (the `Limits` ones too, now
that the CLI no longer checks them itself); `create_server` takes a config, or its keyword
arguments, or both (the keywords on top); `gdsload serve` builds the config from its flags."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from gdsload.errors import GdsloadError
from gdsload.service.protocol.config import Limits, ServerConfig
from gdsload.service.server import create_server


@pytest.mark.parametrize("kw, words", [
    (dict(workers=0), "--workers must be an integer >= 1, got 0"),
    (dict(prefetch=True), "--prefetch"),
    (dict(decode_threads=0), "--decode-threads"),
    (dict(share_window=0), "--share-window"),
    (dict(decode_pool=-1), "--decode-pool must be an integer >= 0, got -1"),
    (dict(grace_s=float("nan")), "--grace"),
    (dict(share_hold_s=float("inf")), "--share-hold"),
    (dict(metrics_port=70000), "--metrics-port must be a port in 0..65535, got 70000"),
    (dict(address="127.0.0.1:5000", metrics_port=5000), "--metrics-port 5000 is the port of --listen"),
    (dict(bulk_port=-1), "--bulk-port"),
    (dict(address="127.0.0.1:5000", bulk_port=5000), "--bulk-port 5000 is the port of --listen"),
    (dict(address="unix:"), "needs a socket path"),
    (dict(address="nohost"), "--listen 'nohost' must be HOST:PORT"),
    (dict(address="127.0.0.1:65536"), "65536"),
    (dict(limits="8GB"), "limits must be a gdsload.service.config.Limits"),
])
def test_each_bad_setting_is_named(kw, words):
    with pytest.raises(GdsloadError, match=words):
        ServerConfig(**kw)


def test_limits_name_their_flags():
    with pytest.raises(GdsloadError, match="Limits.max_streams: --max-streams must be >= 1, got 0"):
        Limits(max_streams=0)
    with pytest.raises(GdsloadError, match="Limits.max_message_bytes: --max-message-bytes must be >= 4352, got 100"):
        Limits(max_message_bytes=100)
    with pytest.raises(GdsloadError, match=r"Limits.max_image_side must be >= 1, got -1"):
        Limits(max_image_side=-1)


def test_keywords_go_on_top_of_a_config():
    base = ServerConfig(workers=3, metrics_port=0)
    c = ServerConfig.build(base, prefetch=4, max_message_bytes=65536)
    assert (c.workers, c.prefetch, c.limits.max_message_bytes, c.metrics_port) == (3, 4, 65536, 0)
    assert base.prefetch == 2 and base.limits.max_message_bytes == Limits().max_message_bytes
    assert ServerConfig.build(None, limits=None, keepalive=None) == ServerConfig()
    assert ServerConfig.build(base) is base
    assert ServerConfig(address="10.1.2.3:7").metrics_host() == "10.1.2.3"  # metrics stay on the listen host
    assert ServerConfig(address="10.1.2.3:7", metrics_address="0.0.0.0").metrics_host() == "0.0.0.0"
    with pytest.raises(TypeError, match="worker"):
        ServerConfig.build(None, worker=3)
    with pytest.raises(GdsloadError, match="--workers"):
        ServerConfig.build(base, workers=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.workers = 5


def test_create_server_takes_a_config(roots):
    srv, port = create_server([str(roots)], ServerConfig(workers=1, share_window=3), grace_s=1.0)
    try:
        assert port > 0 and srv.config.workers == 1 and srv.config.grace_s == 1.0 == srv.grace_s
        assert srv.servicer.share.window == 3 and srv.servicer.loaders.settings.workers == 1
    finally:
        srv.stop(None).wait(5)


def test_the_cli_builds_the_config(roots, monkeypatch):
    import gdsload.service.server as server_pkg
    import gdsload.service.server.logs as logs
    from gdsload.cli.serve import cmd_serve, configure_serve_parser

    got = {}

    class Built(Exception):
        pass

    def capture(roots_, config=None, **kw):
        got.update(roots=roots_, config=config, kw=kw)
        raise Built

    monkeypatch.setattr(server_pkg, "create_server", capture)
    monkeypatch.setattr(logs, "configure", lambda **kw: logs.logging.getLogger("gdsload-test-cli"))
    parser = argparse.ArgumentParser()
    configure_serve_parser(parser)
    args = parser.parse_args([str(roots), "--listen", "127.0.0.1:0", "--workers", "3", "--share-window", "7",
                              "--max-streams", "5", "--max-memory", "1GiB", "--no-bulk", "--cache-dir", "none"])
    with pytest.raises(Built):
        cmd_serve(args)
    c = got["config"]
    assert isinstance(c, ServerConfig) and got["roots"] == [str(roots)]
    assert (c.workers, c.share_window, c.bulk, c.cache_dir) == (3, 7, False, False)
    assert (c.limits.max_streams, c.limits.max_memory_bytes) == (5, 1 << 30)
    args = parser.parse_args([str(roots), "--max-streams", "0"])
    with pytest.raises(GdsloadError, match="--max-streams must be >= 1, got 0"):
        cmd_serve(args)
