"""Modules that moved to another place: importing an old name says where it went, in one line.

Only modules whose old dotted name is no longer a module or package are listed (``icsd_audit.train.config`` is
still a package: its old names are importable from ``icsd_audit.train.config.fields``).
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Any, Sequence

__all__ = ["MOVED", "install"]

#: old module -> the module that holds its code now
MOVED: dict[str, str] = {
    "icsd_audit.train.presets": "icsd_audit.train.config.presets",
    "icsd_audit.train.policy": "icsd_audit.train.rollout.policy",
    "icsd_audit.train.policy_run": "icsd_audit.train.rollout.policy_run",
    "icsd_audit.train.sampling": "icsd_audit.train.rollout.sampling",
    "icsd_audit.train.prompts": "icsd_audit.train.rollout.prompts",
    "icsd_audit.train.skills": "icsd_audit.train.teacher.skills",
    "icsd_audit.train.hybrid": "icsd_audit.train.update.hybrid",
    "icsd_audit.train.actor": "icsd_audit.train.update.actor",
    "icsd_audit.train.losses": "icsd_audit.train.update.losses",
    "icsd_audit.train.advantages": "icsd_audit.train.update.advantages",
    "icsd_audit.train.logprobs": "icsd_audit.train.update.logprobs",
    "icsd_audit.train.sketching": "icsd_audit.train.update.sketching",
    "icsd_audit.train.lora": "icsd_audit.train.models.lora",
    "icsd_audit.train.memory": "icsd_audit.train.models.memory",
    "icsd_audit.train.rundir": "icsd_audit.train.run.folder",
    "icsd_audit.train.checkpoint": "icsd_audit.train.run.checkpoint",
    "icsd_audit.train.resume": "icsd_audit.train.run.resume",
    "icsd_audit.train.metrics": "icsd_audit.train.run.metrics",
    "icsd_audit.integrations.trl_rollout": "icsd_audit.integrations.trl.rollout",
    "icsd_audit.integrations.trl_run": "icsd_audit.integrations.trl.run",
    "icsd_audit.integrations.verl_agent_loop": "icsd_audit.integrations.verl.agent_loop",
    "icsd_audit.integrations.verl_compat": "icsd_audit.integrations.verl.compat",
    "icsd_audit.integrations.verl_distill": "icsd_audit.integrations.verl.distill",
    "icsd_audit.integrations.verl_env": "icsd_audit.integrations.verl.env",
    "icsd_audit.integrations.verl_gigpo": "icsd_audit.integrations.verl.gigpo",
    "icsd_audit.integrations.verl_loss": "icsd_audit.integrations.verl.loss",
    "icsd_audit.integrations.verl_trainer": "icsd_audit.integrations.verl.trainer",
    "icsd_audit.stats.run": "icsd_audit.audit.run",
    "icsd_audit.grads.cosines": "icsd_audit.audit.gradcos",
    "icsd_audit.integrations.engines": ("icsd_audit.train.launch (launch, ENGINES), icsd_audit.integrations.verl.launch "
                                        "(the verl command) and icsd_audit.integrations.trl.engine (run_trl)"),
    "icsd_audit.dumps.settings": "icsd_audit.audit.settings",
    "icsd_audit.dumps.coeffs": "icsd_audit.audit.coeffs",
    "icsd_audit.dumps.verify": "icsd_audit.audit.verify",
    "icsd_audit.stats.blas": "icsd_audit.stats.engine.forked",
    "icsd_audit.stats.resample": "icsd_audit.stats.engine.resample",
    "icsd_audit.stats.counts": "icsd_audit.stats.engine.counts",
    "icsd_audit.stats.segments": "icsd_audit.stats.engine.segments",
    "icsd_audit.stats.forked": "icsd_audit.stats.engine.forked",
}


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None, target: Any = None) -> None:
        new = MOVED.get(fullname)
        if new is not None:
            raise ModuleNotFoundError(f"{fullname} moved to {new}; import it from there", name=fullname)
        return None


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (after the regular finders: it only sees names they miss)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
