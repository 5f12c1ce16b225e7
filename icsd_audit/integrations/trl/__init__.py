"""ICSD on TRL (``pip install 'icsd-audit[trl]'``; tested: trl 1.16).

- :mod:`~icsd_audit.integrations.trl.trainer` -- ``ICSDGRPOTrainer``, a ``trl.GRPOTrainer`` with a privileged
  self-teacher, and its ``ICSDConfig``;
- :mod:`~icsd_audit.integrations.trl.rollout` -- whole episodes of the built-in environments as a ``rollout_func``;
- :mod:`~icsd_audit.integrations.trl.run` -- the run folder of ``icsd train --engine trl``;
- :mod:`~icsd_audit.integrations.trl.recorder` -- ``record(trainer, dump_dir)``: any GRPO, SDPO or SDFT run
  recorded without changing its training;
- :mod:`~icsd_audit.integrations.trl.sdpo` -- ``ICSDSDPOTrainer``: SDPO's distillation term weighted by ``c``.

The trainer's names load on first use, so importing this package does not import TRL.
"""

from __future__ import annotations

from icsd_audit.lazy import lazy_getattr

_EXPORTS = {**{name: "icsd_audit.integrations.trl.trainer"
               for name in ("ICSDConfig", "ICSDGRPOTrainer", "skill_teacher_prompt", "tcm")},
            "record": "icsd_audit.integrations.trl.recorder", "ICSDSDPOTrainer": "icsd_audit.integrations.trl.sdpo"}

__all__ = list(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
