"""Every help page reads like a well-kept CLI's (issue 15): these fail on the old typer renderings."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from icsd_audit.cli.help_format import reflow, type_label
from icsd_audit.cli.main import app

PAGES = [[], ["audit"], ["synth"], ["train"], ["eval"], *[["audit", c] for c in (
    "coeffs", "verify", "tcm", "quadrants", "shift", "clip", "strata", "signs", "landscape", "gradcos", "figures",
    "report")]]


def help_text(args: list[str], width: int) -> str:
    res = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": str(width), "TERM": "dumb"}, terminal_width=width)
    assert res.exit_code == 0, res.output
    return res.output


@pytest.mark.parametrize("args", PAGES, ids=lambda a: " ".join(a) or "icsd")
def test_help_page_has_click_style_usage_and_types(args: list[str]) -> None:
    text = help_text(args, 100)
    usage = next(line for line in text.splitlines() if "Usage:" in line)
    assert "{" not in usage and "}" not in usage, usage  # was: {paths}...
    if args and args[0] == "audit" and len(args) == 2:
        assert re.search(r"\[OPTIONS\] PATHS\.\.\.\s*$", usage), usage
    assert not re.search(r"<(bool|str|int|float|Path|list\[[^\]]*\])>", text), text  # was: --help <bool>, <str>
    help_line = next(line for line in text.splitlines() if "--help" in line)
    assert re.search(r"--help\s+Show this message and exit\.", help_line), help_line  # a flag has no type


@pytest.mark.parametrize("group", [[], ["audit"]], ids=["icsd", "audit"])
def test_command_lists_have_no_mid_sentence_breaks(group: list[str]) -> None:
    # wide enough for every one-line summary: each command must take exactly one row
    text = help_text(group, 400)
    body = text.split("Commands")[1]
    rows = [line.strip("│ ").rstrip() for line in body.splitlines() if line.startswith("│")]
    assert rows and all(re.match(r"^[a-z][a-z-]*\s{2,}\S", r) for r in rows), rows


def test_reflow_joins_lines_inside_paragraphs_only() -> None:
    doc = """Compute every statistic and write a
    self-contained report.

    Example: icsd audit report runs/dumps
    """
    assert reflow(doc) == "Compute every statistic and write a self-contained report.\n\nExample: icsd audit report runs/dumps"
    assert reflow("One.\n\n- a\n- b") == "One.\n\n- a\n- b"


def test_type_labels() -> None:
    assert [type_label(t) for t in ("<int>", "<float>", "<str>", "<list[Path]>", "<bool>")] == [
        "INTEGER", "FLOAT", "TEXT", "PATH", "BOOLEAN"]


def test_train_without_the_train_extra_says_which_extra_in_one_line(tmp_path) -> None:
    # simulate an install without [train]: importing transformers fails as if it were absent
    code = ("import sys; sys.modules['transformers'] = None; sys.argv = ['icsd', 'train', '--steps', '1', '--out', "
            f"{str(tmp_path / 'run')!r}]; from icsd_audit.cli.main import app; app()")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert "[train] extra" in lines[0] and "transformers" in lines[0] and "pip install 'icsd-audit[train]'" in lines[0]
    assert not (tmp_path / "run").exists()  # nothing written
