"""``icsd --version``, ``icsd version [--json]`` and help pages that list only the command's own options (issue 24 item 4)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from icsd_audit.cli.main import app


def _icsd(*args: str) -> subprocess.CompletedProcess[str]:
    code = f"import sys; from icsd_audit.cli.main import entry; sys.argv = ['icsd', *{list(args)!r}]; entry()"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_version_flag_prints_the_installed_distribution_and_exits_0() -> None:
    res = _icsd("--version")
    assert res.returncode == 0, res.stderr
    assert res.stdout == f"icsd-audit {metadata.version('icsd-audit')}\n"
    assert res.stderr == ""


def test_version_json_names_torch_transformers_and_the_optional_engines() -> None:
    res = _icsd("version", "--json")
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    assert info["icsd-audit"] == metadata.version("icsd-audit")
    assert info["python"] == ".".join(map(str, sys.version_info[:3]))
    pkgs = info["packages"]
    assert pkgs["core"]["torch"] == metadata.version("torch")
    for group, name in (("train", "transformers"), ("engines", "trl"), ("engines", "verl"), ("trackers", "wandb")):
        try:
            expected: str | None = metadata.version(name)
        except metadata.PackageNotFoundError:
            expected = None
        assert pkgs[group][name] == expected, (group, name)


def test_version_text_has_one_line_per_group() -> None:
    res = _icsd("version")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == f"icsd-audit {metadata.version('icsd-audit')}"
    assert [ln.split(":")[0] for ln in lines[2:]] == ["core", "train", "engines", "trackers"]
    assert f"torch {metadata.version('torch')}" in lines[2]


def _commands(group, path=()):  # every leaf command of the click tree, with its path
    for name, cmd in sorted(group.commands.items()):
        if hasattr(cmd, "commands"):
            yield from _commands(cmd, (*path, name))
        else:
            yield (*path, name), cmd


COMMANDS = dict(_commands(get_command(app)))


def _options(path: tuple[str, ...]) -> set[str]:
    return {o for p in COMMANDS[path].params for o in p.opts if o.startswith("--")}


@pytest.mark.parametrize("path", sorted(COMMANDS), ids=" ".join)
def test_every_command_help_has_an_example(path: tuple[str, ...]) -> None:
    res = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "200", "TERM": "dumb"}, terminal_width=200)
    assert res.exit_code == 0, res.output
    assert re.search(r"Example: icsd " + re.escape(" ".join(path)), res.output), res.output


@pytest.mark.parametrize("statistic", ["tcm", "quadrants", "shift"])
def test_clip_options_belong_to_clip_only(statistic: str) -> None:
    assert {"--clip-eps", "--dual-clip"} <= _options(("audit", "clip"))
    own = _options(("audit", statistic))
    assert not own & {"--clip-eps", "--dual-clip"}, own
    res = CliRunner().invoke(app, ["audit", statistic, "--help"], env={"COLUMNS": "200"}, terminal_width=200)
    assert "--clip-eps" not in res.output and "--dual-clip" not in res.output
    bad = CliRunner().invoke(app, ["audit", statistic, "x.parquet", "--clip-eps", "0.3"])
    assert bad.exit_code == 2  # not a silently ignored option


def test_tcm_without_clip_options_runs() -> None:
    dumps = Path(__file__).resolve().parents[2] / "examples" / "cpu-demo" / "dumps"
    res = CliRunner().invoke(app, ["audit", "tcm", str(dumps), "--resamples", "50", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["n_tokens"] > 0


def _seed_help(path: tuple[str, ...]) -> str:
    (opt,) = [p for p in COMMANDS[path].params if "--seed" in p.opts]
    return opt.help


@pytest.mark.parametrize("path", [p for p in sorted(COMMANDS) if p[0] == "audit" and p[1] != "verify"], ids=" ".join)
def test_seed_help_names_only_what_the_command_draws(path: tuple[str, ...]) -> None:
    text = _seed_help(path)
    assert "permuted allocator" in text  # every audit command can recompute the permuted variant
    assert ("bootstrap" in text) == (path[1] != "coeffs"), text  # coeffs resamples nothing
    assert ("permutation controls" in text) == (path[1] in {"gradcos", "figures", "report"}), text
