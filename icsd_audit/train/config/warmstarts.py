"""Warm starts shipped with icsd: ``init=warmstart:NAME`` names an adapter folder of the package data."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from icsd_audit.train.config.errors import ConfigError

__all__ = ["MODEL_ALIASES", "WARM_START_PREFIX", "warm_starts_dir", "shipped_warm_starts", "resolve_init", "same_base"]

MODEL_ALIASES = ("embedded", "default", "smollm2", "smollm2-135m-instruct", "tiny-random")
_EMBEDDED_ALIASES = MODEL_ALIASES[:4]

#: ``init`` may name a warm start shipped with icsd: ``warmstart:NAME`` is the adapter folder
#: ``icsd_audit/warmstarts/NAME`` (written by ``icsd sft``; docs/training.md, "Warm start from the expert").
#: Configs record the name, not the install path, so runs of different machines compare.
WARM_START_PREFIX = "warmstart:"


def warm_starts_dir() -> Path:
    """Where the shipped warm starts live (package data)."""
    return Path(__file__).resolve().parents[2] / "warmstarts"


def shipped_warm_starts() -> list[str]:
    """Names of the shipped warm starts (``init=warmstart:NAME``)."""
    root = warm_starts_dir()
    return sorted(d.name for d in root.iterdir() if (d / "adapter_config.json").is_file()) if root.is_dir() else []


def resolve_init(init: str | None) -> str | None:
    """The folder ``init`` names: ``warmstart:NAME`` -> the shipped adapter's folder; any other value as it is."""
    if init is None or not init.startswith(WARM_START_PREFIX):
        return init
    name = init[len(WARM_START_PREFIX):]
    folder = warm_starts_dir() / name
    if not name or Path(name).name != name or not (folder / "adapter_config.json").is_file():
        raise ConfigError([f"init={init!r}: no shipped warm start {name!r}; shipped: "
                           f"{', '.join(WARM_START_PREFIX + n for n in shipped_warm_starts()) or 'none'}"])
    return str(folder)


def same_base(model: Any, warm_start: str) -> bool:
    """Whether ``model`` is the base a shipped warm start was trained on (read from its icsd_adapter.json)."""
    try:
        meta = json.loads((Path(str(resolve_init(warm_start))) / "icsd_adapter.json").read_text())
    except (ConfigError, OSError, ValueError):
        return True  # let validation report the warm start itself
    base = str(meta.get("base_model", ""))
    return model == base or (model in _EMBEDDED_ALIASES and base in _EMBEDDED_ALIASES)
