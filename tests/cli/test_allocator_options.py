"""Every command takes the allocator settings through one decorator: the same options, the same help text."""

from __future__ import annotations

import inspect

import pytest
import typer.main

from icsd_audit.alloc.settings import SETTING_HELP
from icsd_audit.cli.main import app
from icsd_audit.cli.options import SHARED_SETTINGS

AUDIT_COMMANDS = ("coeffs", "tcm", "quadrants", "shift", "clip", "landscape", "strata", "signs", "gradcos", "figures",
                  "report")


def _command(name: str) -> typer.models.CommandInfo:
    group = next(g for g in app.registered_groups if g.name == "audit")
    return next(c for c in group.typer_instance.registered_commands if c.name == name)


@pytest.mark.parametrize("name", AUDIT_COMMANDS)
def test_each_audit_command_takes_the_shared_settings_with_their_help(name: str) -> None:
    params = inspect.signature(_command(name).callback).parameters
    for setting in SHARED_SETTINGS:
        option = params[setting].default
        assert option.param_decls == ("--" + setting.replace("_", "-"),), (name, setting)
        assert option.help.startswith(SETTING_HELP[setting]), (name, setting, option.help)


def test_the_decorated_command_receives_the_settings_given(tmp_path) -> None:
    from typer.testing import CliRunner

    seen: dict = {}
    demo = typer.Typer()

    from icsd_audit.cli.options import allocator_options

    @demo.command()
    @allocator_options()
    def run(x: int = 1, *, settings: dict) -> None:
        seen.update(settings, x=x)

    res = CliRunner().invoke(demo, ["--x", "2", "--trust-beta", "3", "--min-group", "4"])
    assert res.exit_code == 0, res.output
    assert seen == {"x": 2, "trust": None, "trust_beta": 3.0, "trust_eta": None, "influence_eta": None,
                    "min_group": 4, "eps": None}
    bad = CliRunner().invoke(demo, ["--trust-eta", "1.5"])
    assert bad.exit_code == 2 and "--trust-eta" in bad.output


def test_icsd_train_takes_the_shared_settings_with_their_help() -> None:
    cmd = next(c for c in app.registered_commands if c.name == "train")
    params = inspect.signature(cmd.callback).parameters
    for setting in SHARED_SETTINGS:
        option = params[setting].default
        assert option.help.startswith(SETTING_HELP[setting]) and "the preset's" in option.help, setting
