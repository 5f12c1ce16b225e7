"""``launch(cfg, engine=...)``: one validated run config, trained by the built-in loop, TRL or verl.

The library call behind ``icsd train``: the rules that tie a config to an engine are checked here, before anything
is loaded or written, and the engine runs. The built-in loop is :func:`icsd_audit.train.loop.train`; the other
engines sit above ``train/`` (in ``integrations/``) and are found by name in :data:`ENGINES`, loaded on use, so
this layer imports none of them (as verl finds its plug-ins).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from icsd_audit.train.config import TrainConfig

__all__ = ["ENGINES", "Launched", "check_launch", "launch"]

#: engine -> the function that runs a config on it (``module:function``)
ENGINES: dict[str, str] = {
    "builtin": "icsd_audit.train.loop:train",
    "trl": "icsd_audit.integrations.trl.engine:run_trl",
    "verl": "icsd_audit.integrations.verl.launch:run_verl",
}


@dataclass(frozen=True)
class Launched:
    """What a launch produced: the engine's own result (``TrainResult``, the TRL run folder, the verl command's path,
    or the expert's ``PlayResult``)."""

    engine: str
    result: Any


def check_launch(cfg: TrainConfig, *, engine: str, dry_run: bool = False, gpus: int | None = None) -> None:
    """Refuse, in one line, a config this engine cannot run (before any model, data or folder is touched)."""
    if engine not in ENGINES:
        raise ValueError(f"--engine {engine!r}: choose one of {', '.join(ENGINES)}")
    if (dry_run or gpus is not None) and engine != "verl":
        raise ValueError(f"--dry-run and --gpus are options of --engine verl, not --engine {engine}")
    if gpus is not None and gpus < 1:
        raise ValueError(f"--gpus {gpus}: must be >= 1")
    if cfg.policy != "model" and engine != "builtin":
        raise ValueError(f"--policy {cfg.policy} plays the built-in loop's rollouts; drop --engine {engine}")
    if engine != "verl" and cfg.verl_record_only:
        raise ValueError(f"verl_record_only=true writes a verl command; it needs --engine verl, not {engine}")
    if engine != "builtin" and cfg.hybrid != "none":
        raise ValueError(f"--hybrid {cfg.hybrid} runs on the builtin engine only; drop --engine {engine}")


def _engine(name: str) -> Any:
    module, _, function = ENGINES[name].partition(":")
    return getattr(importlib.import_module(module), function)


def launch(cfg: TrainConfig, *, engine: str = "builtin", resume: str | Path | bool | None = None,
           overwrite: bool = False, reporter: Any = None, dry_run: bool = False, gpus: int | None = None,
           adv_explicit: bool = False) -> Launched:
    """Run ``cfg`` on ``engine``; ``cfg.policy='expert'`` plays the expert through the built-in loop's rollouts.

    ``resume``: ``True`` (the run folder's newest checkpoint), a checkpoint folder, or ``None``; ``reporter``: the
    progress sink (a :class:`~icsd_audit.train.run.metrics.Reporter`); ``dry_run`` / ``gpus``: verl's; and
    ``adv_explicit``: whether the user chose the advantage estimator (TRL replaces a preset's GiGPO with GRPO and
    says so, but refuses an explicit one).
    """
    check_launch(cfg, engine=engine, dry_run=dry_run, gpus=gpus)
    if cfg.policy != "model":
        from icsd_audit.train.rollout.policy_run import play

        return Launched("builtin", play(cfg, reporter=reporter, overwrite=overwrite))
    if engine == "trl":  # the built-in loop probes its services itself
        from icsd_audit.train.run.resume import check_services

        check_services(cfg)
    run = _engine(engine)
    if engine == "verl":
        return Launched(engine, run(cfg, dry_run=dry_run, n_gpus=gpus, overwrite=overwrite))
    if engine == "trl":
        return Launched(engine, run(cfg, reporter=reporter, adv_explicit=adv_explicit, overwrite=overwrite,
                                    resume=resume))
    return Launched(engine, run(cfg, resume=resume, reporter=reporter, overwrite=overwrite))
