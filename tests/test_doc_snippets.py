"""The Python blocks of README.md and docs/*.md marked runnable run as written and print what is shown.

Convention (docs/README: "Runnable examples"):

* a block fenced as ```` ```python runnable ```` is run; the other ```` ```python ```` blocks
  are illustrations (placeholders such as ``model=...``, a GPU, a server); ``requires=NAME``
  after ``runnable`` (an optional extra such as ``trl``) skips the page where NAME does not import;
* the runnable blocks of one page run in order in one namespace (a later block may use
  an earlier one's names), in a fresh interpreter whose working directory is a scratch
  folder holding a link to the repository's ``examples/`` (so ``examples/cpu-demo/dumps``
  reads as in a checkout, and files the block writes land in the scratch folder);
* a ```` ```text output ```` block right after a runnable block is what it prints: checked
  line by line, where a ``...`` line stands for any number of lines and ``...`` inside
  a line for any text (for timings and paths).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.S | re.M)

RUNNER = r"""
import contextlib, io, json, sys, traceback
blocks = json.load(open(sys.argv[1]))
ns = {"__name__": "__main__"}
out = []
for b in blocks:
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            exec(compile(b["code"], f"{b['page']}:{b['line']}", "exec"), ns)
    except BaseException:
        out.append({"stdout": buf.getvalue(), "error": traceback.format_exc()})
        break
    out.append({"stdout": buf.getvalue(), "error": None})
json.dump(out, open(sys.argv[2], "w"))
"""


def blocks(page: Path) -> list[dict]:
    """Runnable blocks of ``page``: code, line, and the output block shown beneath (None if none)."""
    text = page.read_text()
    fences = list(FENCE.finditer(text))
    out = []
    for i, m in enumerate(fences):
        info = m.group(1).split()
        if info[:2] != ["python", "runnable"]:
            continue
        shown = None
        if i + 1 < len(fences):
            nxt = fences[i + 1]
            if nxt.group(1).split() == ["text", "output"] and not text[m.end():nxt.start()].strip():
                shown = nxt.group(2)
        out.append({"page": page.name, "line": text[:m.start()].count("\n") + 2, "code": m.group(2), "shown": shown})
    return out


def matches(shown: str, printed: str) -> bool:
    """Line-by-line match; a ``...`` line is any number of lines, ``...`` in a line any text."""
    parts = []
    for line in shown.rstrip("\n").split("\n"):
        if line.strip() == "...":
            parts.append(r"(?:[^\n]*\n)*?")
        else:
            parts.append(".*?".join(re.escape(p) for p in line.rstrip().split("...")) + r"[ \t]*\n")
    return re.fullmatch("".join(parts), printed.rstrip("\n") + "\n") is not None


RUNNABLE = [p for p in PAGES if blocks(p)]


def test_readme_and_docs_have_runnable_blocks() -> None:
    names = {p.name for p in RUNNABLE}
    assert "README.md" in names and len(names) >= 5, names
    readme = blocks(ROOT / "README.md")
    assert len(readme) == sum(1 for m in FENCE.finditer((ROOT / "README.md").read_text())
                              if m.group(1).split()[:1] == ["python"]), "every README Python block runs"
    assert all(b["shown"] is not None for b in readme), "every README block shows what it prints"


def test_matcher() -> None:
    assert matches("a\nb 1.0 s\n", "a\nb 1.0 s\n")
    assert matches("a\n...\nz\n", "a\nb\nc\nz\n") and matches("a\n...\nz\n", "a\nz\n")
    assert matches("took ... ms\n", "took 3.21 ms\n")
    assert not matches("a\nb\n", "a\nc\n") and not matches("a\n", "a\nb\n")


@pytest.mark.parametrize("page", RUNNABLE, ids=lambda p: p.name)
def test_runnable_blocks_run_and_print_what_is_shown(page: Path, tmp_path: Path) -> None:
    todo = blocks(page)
    # ```python runnable requires=NAME```: the block needs an optional extra (trl, ...), skipped without it
    for m in FENCE.finditer(page.read_text()):
        for word in m.group(1).split()[2:]:
            if m.group(1).split()[:2] == ["python", "runnable"] and word.startswith("requires="):
                pytest.importorskip(word.split("=", 1)[1], reason=f"{page.name} needs {word.split('=', 1)[1]}")
    (tmp_path / "blocks.json").write_text(json.dumps(todo))
    (tmp_path / "runner.py").write_text(RUNNER)
    work = tmp_path / "work"
    work.mkdir()
    (work / "examples").symlink_to(ROOT / "examples")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ICSD_THREADS": "1", "PYTHONHASHSEED": "0"}
    res = subprocess.run([sys.executable, str(tmp_path / "runner.py"), str(tmp_path / "blocks.json"),
                          str(tmp_path / "out.json")], cwd=work, capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr
    results = json.loads((tmp_path / "out.json").read_text())
    for b, r in zip(todo, results):
        where = f"{page.name}, block at line {b['line']}"
        assert r["error"] is None, f"{where} failed:\n{r['error']}"
        if b["shown"] is not None:
            assert matches(b["shown"], r["stdout"]), f"{where} printed:\n{r['stdout']}\nbut shows:\n{b['shown']}"
    assert len(results) == len(todo)
