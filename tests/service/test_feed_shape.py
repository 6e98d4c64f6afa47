"""The feed's shape, enforced (issue 48, "Must hold"), so later issues cannot grow back the tangle
the redesign removed: no module of `gdsload/service/` over 500 lines, no function over 80 lines,
and at most 5 private reaches across its modules (`x._name` where `x` is not `self`/`cls` and
`_name` is not defined by the module itself). Generated code (`gdsload/v1`) is not the feed's."""

from __future__ import annotations

import ast
from pathlib import Path

FEED = Path(__file__).resolve().parents[2] / "gdsload" / "service"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80
MAX_PRIVATE_REACHES = 5


def feed_modules() -> dict[str, Path]:
    return {str(p.relative_to(FEED)): p for p in sorted(FEED.rglob("*.py"))}


def long_functions(tree: ast.AST, limit: int) -> list[tuple[str, int]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            if n > limit:
                out.append((node.name, n))
    return out


def own_names(tree: ast.AST) -> set[str]:
    """Private names a module defines itself: its functions, classes, module globals, and the
    attributes it assigns on `self`/`cls` (or any object: an assignment `x._a = ...` in the module
    means the module owns `_a`)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name.split(".")[-1])
        elif isinstance(node, (ast.AnnAssign,)) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def private_reaches(tree: ast.AST) -> list[tuple[int, str]]:
    own = own_names(tree)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        attr = node.attr
        if not attr.startswith("_") or attr.startswith("__") or attr in own:
            continue
        base = node.value
        if isinstance(base, ast.Name) and base.id in ("self", "cls"):
            continue
        out.append((node.lineno, attr))
    return out


def measure() -> dict[str, list]:
    big, long, reach = [], [], []
    for name, path in feed_modules().items():
        text = path.read_text()
        tree = ast.parse(text, str(path))
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES:
            big.append((name, lines))
        long += [(name, f, n) for f, n in long_functions(tree, MAX_FUNCTION_LINES)]
        reach += [(name, line, attr) for line, attr in private_reaches(tree)]
    return {"modules": big, "functions": long, "reaches": reach}


def test_no_feed_module_over_500_lines():
    assert not measure()["modules"], f"feed modules over {MAX_MODULE_LINES} lines: {measure()['modules']}"


def test_no_feed_function_over_80_lines():
    assert not measure()["functions"], f"feed functions over {MAX_FUNCTION_LINES} lines: {measure()['functions']}"


def test_at_most_5_private_reaches_across_feed_modules():
    found = measure()["reaches"]
    assert len(found) <= MAX_PRIVATE_REACHES, (
        f"{len(found)} private reaches across feed modules (at most {MAX_PRIVATE_REACHES}): {found}")


def test_the_checks_see_what_they_must(tmp_path):
    """Each rule, planted, is reported (the checks are not vacuous)."""
    tree = ast.parse("def f():\n" + "    x = 1\n" * 90 + "\n"
                     "class A:\n    def g(self, other):\n        self._mine = 1\n        return other._theirs\n")
    assert long_functions(tree, MAX_FUNCTION_LINES) == [("f", 91)]
    assert private_reaches(tree) == [(96, "_theirs")]
