"""The package's layer rules (docs/design.md "Modules", shared/DESIGN.md "Layout"), enforced.

Every `import` and `from ... import` of a `gdsload` module anywhere in a file counts, also the
function-local ones (that is where the heavy and the backward imports hide). Two rules:

1. A package imports only from the layers the table allows (`ALLOWED`).
2. No import cycle between modules of `gdsload/` (package `__init__` files that only re-export
   lazily are nodes like any other module).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "gdsload"

# unit -> layer; a unit is a top-level module or package of gdsload (or a module of service/)
LAYER = {
    "errors": 0, "sizes": 0, "_version": 0, "host": 0,
    "format": 1, "plan": 1, "ring": 1, "io": 1, "decode": 1,
    "dataset": 2,
    "frontend": 3,
    "loader": 4,
    "service": 5, "convert": 5, "preprocess": 5,
    "cli": 6, "doctor": 6, "demo": 6, "sampledata": 6, "bench": 6, "__main__": 6,
    "integrations": 6,  # glue for trainers (transformers.Trainer), imported only by the user's script
    "v1": 5,  # generated gRPC code, part of the service
}
# what each layer-1 package may import beside layer 0 (they are peers, not a stack)
PEERS = {
    "format": set(),
    "plan": set(),
    "ring": set(),
    "io": {"format"},          # the store reads and writes the manifest's bytes
    "decode": {"format"},      # the .npy header
    "convert": {"format", "io", "decode"},
    "preprocess": {"format", "io", "decode", "dataset", "convert"},  # a pass reads a dataset, writes with convert's writer
}
# packages only some others may import
ONLY_BY = {"v1": {"service"}}
# the feed's packages (DESIGN.md "Service"): the protocol is shared and imports neither end; the
# client (RemoteLoader) never imports the server, nor the server the client
FEED_NEVER = {
    "service.protocol": {"service.client", "service.server"},
    "service.client": {"service.server"},
    "service.server": {"service.client"},
}
# What the client may import, directly or through any module it imports (prefixes of module
# names): no local pipeline (`loader`), no I/O backends (`io`), no DALI pipeline builder, no ring
# but its staging pool: a RemoteLoader process needs grpc and NumPy, not what a server reads with.
CLIENT_MAY = (
    "gdsload.errors", "gdsload.sizes", "gdsload._version", "gdsload.host", "gdsload.format",
    "gdsload.plan", "gdsload.dataset.mix", "gdsload.dataset.concat", "gdsload.frontend",
    "gdsload.ring.staging", "gdsload.v1", "gdsload.service.protocol", "gdsload.service.client",
    # the transform specs (a transform is sent as its spec; nothing is decoded on the client)
    "gdsload.decode.image", "gdsload.decode.imagesize", "gdsload.decode.audio", "gdsload.decode.video",
    "gdsload.decode.media",
)
CLIENT_SIDE = {"service.client"}
# files exempt by name: the package's public face (lazy), and `python -m gdsload.service`, a shim
EXEMPT = {"gdsload", "gdsload.service.__main__"}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in ROOT.rglob("*.py")}


def imports_of(path: Path, known: set[str]) -> set[str]:
    """Every gdsload module `path` imports, at any depth of its code."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from gdsload.x import y`: y may be a module of package x
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                     for a in node.names]
        else:
            continue
        out.update(n for n in names if n == "gdsload" or n.startswith("gdsload."))
    return out


def unit(mod: str) -> str:
    parts = mod.split(".")
    if len(parts) == 1:
        return ""
    if parts[1] == "service" and len(parts) > 2:  # a package of the feed, or a top-level shim
        return f"service.{parts[2]}"
    return parts[1]


def package(u: str) -> str:
    return u.split(".")[0]


def violation(src: str, dst: str) -> str | None:
    """Why `src` may not import `dst` (None: it may)."""
    a, b = package(unit(src)), package(unit(dst))
    if src in EXEMPT or (dst == "gdsload" and LAYER[a] == 6):
        return None
    if dst == "gdsload":
        return f"{src} imports the package root (import the module itself)"
    if b in ONLY_BY:
        return None if a in ONLY_BY[b] or a == b else f"{src} imports {dst}: only {sorted(ONLY_BY[b])} may"
    if a == b:
        if unit(dst) in FEED_NEVER.get(unit(src), ()):
            return f"{src} ({unit(src)}) imports {dst} ({unit(dst)})"
        return None
    la, lb = LAYER[a], LAYER[b]
    if unit(src) in CLIENT_SIDE and b in ("loader", "io", "convert"):
        return f"{src} (RemoteLoader side) imports {dst}: the client needs no local pipeline or I/O"
    if lb == 0:
        return None if b != "host" or a != "errors" else f"{src} imports {dst}"
    if a in PEERS:
        return None if b in PEERS[a] else f"{src} (layer {la}, {a}) imports {dst} ({b}); allowed: layer 0 and {sorted(PEERS[a])}"
    if lb > la or (lb == la and la < 6):
        return f"{src} (layer {la}, {a}) imports {dst} (layer {lb}, {b})"
    return None


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {m: {d for d in imports_of(p, known) if d in known and d != m} for m, p in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(g):
        if root in index:
            continue
        work = [(root, iter(sorted(g[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(g[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_every_unit_has_a_layer():
    missing = sorted({package(unit(m)) for m in modules()} - set(LAYER) - {""})
    assert not missing, f"add {missing} to the layer table (tests/test_layers.py and the module map in docs/design.md)"


def test_no_forbidden_import():
    bad = [why for src, dsts in sorted(graph().items()) for dst in sorted(dsts) if (why := violation(src, dst))]
    assert not bad, "imports the layer table forbids:\n" + "\n".join(bad)


def reached_from(g: dict[str, set[str]], prefix: str) -> set[str]:
    """Every module the modules under `prefix` import, directly or through others."""
    seen: set[str] = set()
    stack = [m for m in g if m.startswith(prefix)]
    while stack:
        for d in g[stack.pop()]:
            if d not in seen:
                seen.add(d)
                stack.append(d)
    return seen


def client_outside(g: dict[str, set[str]]) -> list[str]:
    return sorted(m for m in reached_from(g, "gdsload.service.client")
                  if not any(m == p or m.startswith(p + ".") for p in CLIENT_MAY))


def test_the_client_reaches_only_what_it_may():
    bad = client_outside(graph())
    assert not bad, f"the feed client reaches {bad}, outside CLIENT_MAY (tests/test_layers.py)"


def test_a_planted_client_import_of_the_server_fails():
    """Directly (the layer rule) and through a module the client imports (the reach rule)."""
    assert violation("gdsload.service.client.loader", "gdsload.service.server.servicer") is not None
    assert violation("gdsload.service.protocol.wire", "gdsload.service.client.loader") is not None
    g = graph()
    g["gdsload.frontend.output"] = set(g["gdsload.frontend.output"]) | {"gdsload.loader.dataloader"}
    assert "gdsload.loader.dataloader" in client_outside(g)


def test_no_import_cycle():
    found = cycles(graph())
    assert not found, "import cycles inside gdsload/:\n" + "\n".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize("src, dst", [
    ("gdsload.format.tar", "gdsload.io.store"),          # format knows no storage
    ("gdsload.plan.plan", "gdsload.dataset.dataset"),     # the plan is pure
    ("gdsload.service.server", "gdsload.cli.serve"),      # the service never imports the CLI
    ("gdsload.service.client.loader", "gdsload.loader.dataloader"),
    ("gdsload.dataset.dataset", "gdsload.loader.fill"),
    ("gdsload.ring.ring", "gdsload.frontend.fields"),
])
def test_a_planted_forbidden_import_fails(tmp_path, src, dst):
    """The checker is not vacuous: each of these imports, planted, is reported."""
    assert violation(src, dst) is not None
    # and end to end: the same import written into a copy of the source file is found
    path = modules()[src]
    planted = tmp_path / path.name
    planted.write_text(path.read_text() + f"\n\ndef _planted():\n    import {dst}  # noqa\n")
    assert dst in imports_of(planted, set(modules()))


def test_a_planted_cycle_is_found():
    g = graph()
    g["gdsload.format.tar"] = set(g["gdsload.format.tar"]) | {"gdsload.format.index"}
    g["gdsload.format.index"] = set(g["gdsload.format.index"]) | {"gdsload.format.tar"}
    assert ["gdsload.format.index", "gdsload.format.tar"] in cycles(g)
