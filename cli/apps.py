"""The typer apps every command registers on.

They live below the command modules (commands import this module; :mod:`.main`
imports both), so no command imports the module that imports it.
"""

from __future__ import annotations

import typer

from .help_format import install

install()  # click-style help pages (PATHS..., TEXT, no type on flags) on any typer version

app = typer.Typer(
    name="icsd",
    help="Influence Calibration for Self-Distillation: allocate, audit and train.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
audit_app = typer.Typer(
    help="Audit token dumps: coefficients, statistics with bootstrap CIs, figures, reports.",
    no_args_is_help=True,
)
app.add_typer(audit_app, name="audit")
