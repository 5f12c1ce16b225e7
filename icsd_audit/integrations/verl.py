"""ICSD inside verl (``pip install 'icsd-audit[verl]'``; tested: verl 0.9.1): the plug-in.

verl imports every module of the ``verl.plugins`` entry-point group in every process
(``import verl``; ``VERL_USE_EXTERNAL_PLUGINS=none`` turns that off).  Importing this
module

1. checks that verl is in the tested range and that every verl function the
   integration wraps still has the signature it was written against
   (:mod:`~icsd_audit.integrations.verl_compat`);
2. registers the ``icsd_sync`` trainer and the ``gigpo`` advantage estimator
   (:mod:`~icsd_audit.integrations.verl_trainer`, :mod:`~icsd_audit.integrations.verl_gigpo`);
3. registers ``icsd``, ``sdar`` and the ablations as losses of verl's distillation
   registry (:mod:`~icsd_audit.integrations.verl_distill`).

verl logs a plug-in that fails to load only at debug level, so a failure here logs an
ERROR and a ``RuntimeWarning`` and raises :class:`VerlCompatError`.  The worker loss
:func:`icsd_ppo_loss` (both allocation scopes) lives in
:mod:`~icsd_audit.integrations.verl_loss` and is re-exported here.  Nothing in the
integration imports this module back, so any of its modules can be imported first.
"""

from __future__ import annotations

import logging
import warnings

from icsd_audit.integrations.core import C_KEY, TEACHER_KEY
from icsd_audit.integrations.verl_compat import _resolve  # noqa: F401  (the signature tests use it from here)
from icsd_audit.integrations.verl_compat import EXPECTED_SIGNATURES, TESTED_VERL, VerlCompatError, check_verl
from icsd_audit.integrations.verl_loss import MicroBatchScope, icsd_ppo_loss
from icsd_audit.integrations.verl_record import recording

__all__ = ["C_KEY", "TEACHER_KEY", "recording", "TESTED_VERL", "VerlCompatError", "MicroBatchScope", "icsd_ppo_loss", "check_verl",
           "EXPECTED_SIGNATURES"]

log = logging.getLogger("icsd_audit.integrations.verl")


def _plugin_check() -> None:
    """Run at import: check verl, register the trainer, the estimator and the distillation losses.

    Fails loudly (an ERROR log line and a RuntimeWarning, then the exception), not at
    verl's debug level.
    """
    try:
        check_verl()
        from icsd_audit.integrations.verl_distill import register_losses
        from icsd_audit.integrations.verl_trainer import register

        register()
        register_losses()
    except (VerlCompatError, ImportError, ValueError) as e:
        log.error("icsd verl plug-in cannot register: %s", e)
        warnings.warn(f"icsd verl plug-in cannot register: {e}", RuntimeWarning, stacklevel=2)
        raise


_plugin_check()
