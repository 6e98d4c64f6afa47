"""The documentation site (docs/, mkdocs.yml) and the README landing page.

- `mkdocs build --strict` passes: every page is in the nav, every link and anchor resolves, and the
  API pages are generated from the docstrings (mkdocstrings). Needs the `docs` extra, which the
  README's test command installs (no skip: a missing extra fails here, naming it).
- Every fenced `bash` or `python` block in docs/ is marked on the line before its fence, one way or
  the other:

      <!-- run -->                          run by this test
      <!-- no-run: needs a GPU host -->     never run; the reason is required

  The runnable blocks of one page run in order, in one fresh temporary folder (so a page can make a
  tiny dataset in one block and read it in the next), bash blocks with `bash -euo pipefail`, python
  blocks in one namespace shared by the page, with this interpreter's folder first on PATH (so
  `gdsload` and `python` are the venv's). Each page has `PAGE_CAP_S` seconds; what a page started
  in the background (a feed server) is killed with its process group when the page ends. Blocks
  for Kubernetes, Slurm, Ray and GPU hosts are marked no-run (docs/contributing.md says so too).
- The README stays a landing page: at most 400 lines, its two CI commands (one line each; the test
  command installs the docs extra), links into docs/ that exist, and the same two commands and
  install table as docs/getting-started.md.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGE_CAP_S = 90
# Fences that must carry a marker: the shells and Python. Other languages (yaml, text, proto) are
# shown, never run; a run marker on them is an error.
MARKED = {"bash": "bash", "sh": "bash", "shell": "bash", "console": "bash", "python": "python", "py": "python",
          "pycon": "python"}
RUN = "<!-- run -->"
NO_RUN = re.compile(r"<!-- no-run: (\S.*?) -->")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")


def blocks(text: str, name: str = "page") -> tuple[list[dict], list[str]]:
    """The fenced blocks of a markdown page: dicts (lang, code, line, run, where) for the bash and
    python blocks, and the problems found (an unmarked block, a run marker on another language)."""
    lines = text.splitlines()
    found: list[dict] = []
    problems: list[str] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, indent = m["fence"], len(m["indent"])
        lang = (m["info"].strip().split() or [""])[0].lower()
        j = i + 1
        while j < len(lines) and not (lines[j].strip().startswith(fence) and lines[j].strip().strip(fence[0]) == ""):
            j += 1
        code = "\n".join(ln[indent:] for ln in lines[i + 1:j])
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        marker = lines[k].strip() if k >= 0 else ""
        where = f"{name}:{i + 1}"
        run = marker == RUN
        if lang in MARKED:
            if not run and not NO_RUN.fullmatch(marker):
                problems.append(f"{where}: a ```{lang} block without {RUN} or <!-- no-run: REASON --> on the line "
                                "before its fence")
            found.append({"lang": MARKED[lang], "code": code, "line": i + 1, "run": run, "where": where})
        elif run:
            problems.append(f"{where}: {RUN} on a ```{lang or '(no language)'} block: only bash and python blocks run")
        i = j + 1
    return found, problems


def pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def test_the_block_check_finds_what_it_must():
    """The marker check fails on an unmarked block, a reasonless no-run and a run marker on YAML,
    and passes marked ones (including an indented block inside an admonition)."""
    text = ("intro\n\n```bash\nls\n```\n\n<!-- no-run: -->\n```python\nx = 1\n```\n\n<!-- run -->\n```yaml\na: 1\n```\n\n"
            "<!-- run -->\n```bash\necho ok\n```\n\n<!-- no-run: needs a cluster -->\n\n```python\nimport ray\n```\n\n"
            "!!! note\n    <!-- run -->\n    ```python\n    y = 2\n    ```\n\n```text\nplain\n```\n")
    found, problems = blocks(text, "t.md")
    assert [p.split(":")[1] for p in problems] == ["3", "8", "13"], problems
    assert [(b["line"], b["run"]) for b in found] == [(3, False), (8, False), (18, True), (24, False), (30, True)]
    assert found[-1]["code"] == "y = 2"


def test_every_shell_and_python_block_is_marked():
    problems = []
    for page in pages():
        problems += blocks(page.read_text(), str(page.relative_to(ROOT)))[1]
    assert not problems, "\n".join(problems)
    # what must never run here is marked so (a cluster, a GPU host)
    for rel in ("feed/deploying.md", "gpu.md"):
        found, _ = blocks((DOCS / rel).read_text(), rel)
        assert found and not any(b["run"] for b in found), f"docs/{rel} has a block marked to run"


def test_site_builds_strict(tmp_path):
    """`mkdocs build --strict`: no warning at all (broken link or anchor, a page outside the nav,
    a docstring mkdocstrings cannot render)."""
    try:
        import mkdocs  # noqa: F401
        import mkdocstrings  # noqa: F401
        import material  # noqa: F401
    except ImportError as exc:
        pytest.fail(f"the docs extra is not installed ({exc}): pip install -e '.[docs]'")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-6000:]
    assert "WARNING" not in log, log[-6000:]
    assert (tmp_path / "site" / "api" / "loaders" / "index.html").read_text().count("state_dict") > 0
    print(f"mkdocs build --strict: {time.monotonic() - t0:.1f} s")


RUNNER = r"""
import json, subprocess, sys, traceback
ns = {"__name__": "__main__"}
for b in json.load(open(sys.argv[1])):
    print(f"--- {b['where']} ({b['lang']})", flush=True)
    if b["lang"] == "bash":
        rc = subprocess.run(["bash", "-euo", "pipefail", "-c", b["code"]]).returncode
        if rc:
            print(f"FAILED {b['where']}: exit status {rc}", flush=True)
            sys.exit(1)
    else:
        try:
            exec(compile(b["code"], b["where"], "exec"), ns)
        except BaseException:
            traceback.print_exc()
            print(f"FAILED {b['where']}", flush=True)
            sys.exit(1)
    sys.stdout.flush()
"""


def runnable_pages() -> list[str]:
    return [str(p.relative_to(DOCS)) for p in pages()
            if any(b["run"] for b in blocks(p.read_text(), p.name)[0])]


@pytest.mark.parametrize("page", runnable_pages())
def test_runnable_blocks_run(page, tmp_path):
    found = [b for b in blocks((DOCS / page).read_text(), f"docs/{page}")[0] if b["run"]]
    (tmp_path / "blocks.json").write_text(json.dumps(found))
    work = tmp_path / "work"
    work.mkdir()
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", RUNNER, str(tmp_path / "blocks.json")], cwd=work, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=PAGE_CAP_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"docs/{page}: its blocks ran past {PAGE_CAP_S} s\n{log[-6000:]}")
    finally:
        try:  # a server a block started in the background ends with the page
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, f"docs/{page}:\n{log[-8000:]}"
    print(f"docs/{page}: {len(found)} blocks in {time.monotonic() - t0:.1f} s\n{log[-4000:]}")


def _section(text: str, heading: str) -> str:
    m = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert m, f"no '## {heading}' section"
    return m.group(1)


def _table(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("|")]


def test_readme_is_a_landing_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 400, len(readme.splitlines())
    for tag in ("demo", "test"):
        assert re.search(rf"<!-- ci:{tag} -->\n```bash\n[^\n]+\n```", readme), f"the {tag} command, one line"
    test_cmd = re.search(r"<!-- ci:test -->\n```bash\n([^\n]+)\n```", readme).group(1)
    extras = re.search(r"-e '\.\[([a-z0-9,]+)\]'", test_cmd).group(1).split(",")
    assert "docs" in extras and "test" in extras, test_cmd  # so CI builds the site
    started = (DOCS / "getting-started.md").read_text()
    for tag in ("demo", "test"):  # the site's Getting started shows the very commands CI runs
        cmd = re.search(rf"<!-- ci:{tag} -->\n```bash\n([^\n]+)\n```", readme).group(1)
        assert f"```bash\n{cmd}\n```" in started, f"docs/getting-started.md lacks the README's {tag} command"
    links = re.findall(r"\]\((docs/[^)#\s]+)(?:#[^)]*)?\)", readme)
    assert len(links) >= 10, links
    missing = [ln for ln in links if not (ROOT / ln).is_file()]
    assert not missing, missing
    # one install table, the same in both places
    install = _table(_section(readme, "Install"))
    assert install and install == _table(_section((DOCS / "getting-started.md").read_text(), "Install"))
    assert not any("pip install 'gdsload[" in row for row in install), "gdsload is not on a public index"


def test_docs_extra_is_pinned():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["docs"] and all("==" in d for d in extras["docs"]), extras["docs"]
    names = {re.split(r"[<>=!\[ ]", d, maxsplit=1)[0].lower() for d in extras["docs"]}
    assert {"mkdocs", "mkdocs-material", "mkdocstrings"} <= names
