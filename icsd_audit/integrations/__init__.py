"""ICSD inside other training engines.

- :mod:`~icsd_audit.integrations.core` -- engine-free: allocation over padded ``[B, T]``
  batches, turn ids, duplicate rows, the distillation loss, dump rows (torch/numpy only);
- :mod:`~icsd_audit.integrations.sdar` -- drop-in for verl-agent / SDAR forks
  (``compute_icsd_loss``, ``allocate_dataproto``, a dump hook, ``teacher_pass`` / ``turn_steps`` without SDAR);
- :mod:`~icsd_audit.integrations.trl` -- ``ICSDGRPOTrainer``, ``record`` (any TRL GRPO/SDPO/SDFT run, unchanged:
  :mod:`.trl.recorder`) and ``ICSDSDPOTrainer`` (:mod:`.trl.sdpo`) (needs ``icsd-audit[trl]``);
- :mod:`~icsd_audit.integrations.verl.plugin` -- the verl plug-in (needs ``icsd-audit[verl]``), ``recording``
  (:mod:`.verl.record`: any verl worker loss, unchanged); the worker loss in
  both allocation scopes (:mod:`.verl_loss`), ``icsd_sync`` (:mod:`.verl_trainer`), GiGPO (:mod:`.verl_gigpo`),
  the distillation-registry losses (:mod:`.verl_distill`), the ``icsd_env`` agent loop (:mod:`.verl_agent_loop`)
  and the files ``icsd train --engine verl`` writes (:mod:`.verl_env`);
- :mod:`~icsd_audit.integrations.checks` -- the input checks every entry point runs.

See docs/engines.md.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["AllocationSettings", "PaddedAllocation", "allocate_padded", "distillation_loss", "distillation_token_loss", "dump_rows",
           "dump_writer", "duplicate_rows", "mini_batch_ids", "turn_ids_from_mask", "write_dump"]


def __getattr__(name: str) -> Any:
    # on first use: the verl plug-in (.verl) is imported in every verl process and must not pull torch through here
    if name in __all__:
        return getattr(importlib.import_module("icsd_audit.integrations.core"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
