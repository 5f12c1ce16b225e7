"""ICSD inside other training engines.

- :mod:`~icsd_audit.integrations.core` -- engine-free: allocation over padded ``[B, T]``
  batches, turn ids, duplicate rows, the distillation loss, dump rows (torch/numpy only);
- :mod:`~icsd_audit.integrations.sdar` -- drop-in for verl-agent / SDAR forks
  (``compute_icsd_loss``, ``allocate_dataproto``, a dump hook);
- :mod:`~icsd_audit.integrations.trl` -- ``ICSDGRPOTrainer`` (needs ``icsd-audit[trl]``);
- :mod:`~icsd_audit.integrations.verl` -- the verl plug-in (needs ``icsd-audit[verl]``).

See docs/engines.md.
"""

from __future__ import annotations

from icsd_audit.integrations.core import (
    AllocationSettings, PaddedAllocation, allocate_padded, distillation_loss, distillation_token_loss, dump_rows, dump_writer,
    duplicate_rows, mini_batch_ids, turn_ids_from_mask, write_dump,
)

__all__ = ["AllocationSettings", "PaddedAllocation", "allocate_padded", "distillation_loss", "distillation_token_loss", "dump_rows",
           "dump_writer", "duplicate_rows", "mini_batch_ids", "turn_ids_from_mask", "write_dump"]
