"""The committed gRPC code in gdsload/v1/ is what tools/gen_proto.sh makes from proto/ (no diff),
and `gdsload serve` is wired into the command line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_generated_code_matches_regeneration(tmp_path):
    pytest.importorskip("grpc_tools")
    env = dict(os.environ, PYTHON=sys.executable)
    subprocess.run(["bash", str(REPO / "tools" / "gen_proto.sh"), str(tmp_path)], check=True, env=env,
                   capture_output=True)
    made = sorted(p.name for p in (tmp_path / "gdsload" / "v1").iterdir())
    committed = sorted(p.name for p in (REPO / "gdsload" / "v1").iterdir()
                       if p.is_file() and not p.name.endswith(".pyc"))
    assert made == committed, f"regenerate with tools/gen_proto.sh: {made} vs {committed}"
    for name in made:
        new = (tmp_path / "gdsload" / "v1" / name).read_bytes()
        old = (REPO / "gdsload" / "v1" / name).read_bytes()
        assert new == old, f"gdsload/v1/{name} differs from its regeneration: run tools/gen_proto.sh"


def test_every_proto_message_and_field_is_documented():
    """A client in another language is written from the .proto alone: every service, rpc,
    message, enum, field and enum value has a comment above it (consecutive fields may share one,
    as scale_min and scale_max do)."""
    import re

    declaration = re.compile(r"^(service|rpc|message|enum)\s|^(repeated\s+|map<[^>]+>\s+)?[\w.]+\s+\w+\s*=\s*\d+;"
                             r"|^[A-Z][A-Z0-9_]*\s*=\s*\d+;")
    lines = [line.strip() for line in (REPO / "proto" / "gdsload" / "v1" / "feed.proto").read_text().splitlines()]
    undocumented = []
    for i, line in enumerate(lines):
        if not declaration.match(line):
            continue
        j = i - 1
        while j >= 0 and declaration.match(lines[j]) and not lines[j].startswith(("message", "enum", "service")):
            j -= 1
        if j < 0 or not lines[j].startswith("//"):
            undocumented.append(line)
    assert not undocumented, f"undocumented in feed.proto: {undocumented}"


def test_serve_command_is_registered():
    """`gdsload serve` parses (a missing registration is a failure, not a skip) and runs the
    serve command."""
    from gdsload import cli

    try:
        args = cli.build_parser().parse_args(["serve", "root", "--listen", "127.0.0.1:1"])
    except SystemExit as exc:
        pytest.fail(f"`gdsload serve root --listen 127.0.0.1:1` does not parse (exit {exc.code})")
    assert args.listen == "127.0.0.1:1" and args.roots == ["root"]
    assert args.func.__module__ == "gdsload.cli.serve", args.func


def test_python_dash_m_gdsload_service_help():
    out = subprocess.run([sys.executable, "-m", "gdsload.service", "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert "--token-file" in out and "--tls-client-ca" in out and "--metrics-port" in out
