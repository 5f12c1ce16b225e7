"""ICSD inside verl (``pip install 'icsd-audit[verl]'``; tested: verl 0.9.1).

- :mod:`~icsd_audit.integrations.verl.plugin` -- the ``verl.plugins`` entry point: version and signature checks,
  then registration of everything below;
- :mod:`~icsd_audit.integrations.verl.compat` -- the tested version range and the signatures relied on;
- :mod:`~icsd_audit.integrations.verl.loss` -- the worker loss (``ppo_loss`` + allocated distillation) in both
  allocation scopes;
- :mod:`~icsd_audit.integrations.verl.trainer` -- ``icsd_sync``, the v1 trainer with a privileged self-teacher;
- :mod:`~icsd_audit.integrations.verl.gigpo` -- GiGPO as a verl advantage estimator;
- :mod:`~icsd_audit.integrations.verl.distill` -- ICSD and SDAR in verl's distillation-loss registry;
- :mod:`~icsd_audit.integrations.verl.record` -- ``recording(loss_fn, dump_dir)``: any verl worker loss, recorded
  without changing what it returns;
- :mod:`~icsd_audit.integrations.verl.agent_loop` and :mod:`~icsd_audit.integrations.verl.env` -- the ``icsd_env``
  agent loop and the files ``icsd train --engine verl`` writes.

The plug-in's names load on first use, so importing this package neither imports verl nor registers anything.
"""

from __future__ import annotations

from icsd_audit.lazy import lazy_getattr

_EXPORTS = {**{name: "icsd_audit.integrations.verl.plugin"
               for name in ("C_KEY", "TEACHER_KEY", "TESTED_VERL", "VerlCompatError", "MicroBatchScope", "icsd_ppo_loss",
                            "check_verl", "EXPECTED_SIGNATURES")},
            "recording": "icsd_audit.integrations.verl.record"}

__all__ = list(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
