"""ICSD inside verl (``pip install 'icsd-audit[verl]'``; tested: verl 0.9.1): the plug-in.

verl imports every module of the ``verl.plugins`` entry-point group in every process
(``import verl``, every Ray worker included; ``VERL_USE_EXTERNAL_PLUGINS=none`` turns
that off), so importing this module costs only the standard library: it

1. checks that verl is in the tested range (its package metadata, no import);
2. registers lazily: each verl registry module gets our names the moment it has loaded
   (an import hook on ``sys.meta_path`` that imports nothing itself), so a process that
   never loads a registry pays nothing for it:

   ================================  ==================================================
   verl module                       registered when it has loaded
   ================================  ==================================================
   ``verl.trainer.ppo.core_algos``   the ``gigpo`` advantage estimator (:mod:`.gigpo`)
   ``verl.trainer.distillation       ``icsd``, ``sdar`` and the ablations as distillation
   .losses``                         losses (:mod:`.distill`), after checking the
                                     ``ICSD_*`` variables they read (:func:`.loss.scope_from_env`)
   ``verl.trainer.ppo.v1``           the ``icsd_sync`` trainer (:mod:`.trainer`)
   ``verl.trainer.ppo.v1             the ``+icsd.record=true`` switch on every v1
   .trainer_base``                   trainer (:func:`.record.register_switch`)
   ``verl.trainer.ppo.ray_trainer``  the legacy trainer's one-line refusal of that switch
                                     (:func:`.record.refuse_legacy`)
   ================================  ==================================================

   Before each registration the signatures of the verl callables already loaded are
   checked (:func:`~.compat.check_verl` with ``loaded_only``); ``icsd_sync`` checks
   all of them when it starts.

verl logs a plug-in that fails to load only at debug level, so a failure here logs an
ERROR and a ``RuntimeWarning``: a verl outside the tested range or a changed signature
leaves verl without our names (verl itself keeps working), a bad ``ICSD_*`` value stops
the import that would register the losses, in one line naming the variable.

The worker loss :func:`icsd_ppo_loss` (both allocation scopes) lives in
:mod:`~icsd_audit.integrations.verl.loss` and is re-exported here on first use, as are
the other names of ``__all__``.  Nothing in the integration imports this module back, so
any of its modules can be imported first.
"""

from __future__ import annotations

import importlib
import logging
import sys
import warnings
from typing import Any

from icsd_audit.integrations.verl.compat import TESTED_VERL, VerlCompatError, check_version

__all__ = ["C_KEY", "TEACHER_KEY", "TESTED_VERL", "VerlCompatError", "MicroBatchScope", "icsd_ppo_loss", "check_verl",
           "EXPECTED_SIGNATURES", "REGISTRATIONS", "registered"]

log = logging.getLogger("icsd_audit.integrations.verl.plugin")

#: verl module -> (our module, its function that registers into it), run once the verl module has loaded.
REGISTRATIONS = {
    "verl.trainer.ppo.core_algos": ("icsd_audit.integrations.verl.gigpo", "register_estimator"),
    "verl.trainer.distillation.losses": ("icsd_audit.integrations.verl.distill", "register_losses"),
    "verl.trainer.ppo.v1": ("icsd_audit.integrations.verl.trainer", "register"),
    "verl.trainer.ppo.v1.trainer_base": ("icsd_audit.integrations.verl.record", "register_switch"),
    "verl.trainer.ppo.ray_trainer": ("icsd_audit.integrations.verl.record", "refuse_legacy"),
}

#: the names re-exported on first use, and the module each comes from
_LAZY = {"C_KEY": "core", "TEACHER_KEY": "core", "MicroBatchScope": "verl.loss", "icsd_ppo_loss": "verl.loss",
         "check_verl": "verl.compat", "EXPECTED_SIGNATURES": "verl.compat", "resolve_dotted": "verl.compat"}

_done: set[str] = set()


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"icsd_audit.integrations.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def registered() -> set[str]:
    """The verl modules of :data:`REGISTRATIONS` this process has registered into so far."""
    return set(_done)


def _fail(e: Exception) -> None:
    log.error("icsd verl plug-in cannot register: %s", e)
    warnings.warn(f"icsd verl plug-in cannot register: {e}", RuntimeWarning, stacklevel=3)


def _register(target: str) -> None:
    """Register our names into the verl module ``target`` (loaded); see the module docstring for failures."""
    if target in _done:
        return
    _done.add(target)
    from icsd_audit.integrations.verl.compat import check_verl

    try:
        check_verl(loaded_only=True)
    except VerlCompatError as e:
        _fail(e)
        return
    if target == "verl.trainer.distillation.losses":
        from icsd_audit.integrations.verl.loss import scope_from_env

        try:
            scope_from_env("icsd", producer="icsd.verl.plugin")  # parses and checks every ICSD_* setting
        except ValueError as e:  # the losses would fail at their first call, after a rollout: stop now
            _fail(e)
            raise ValueError(f"icsd verl plug-in: {e}") from None
    module, fn = REGISTRATIONS[target]
    try:
        getattr(importlib.import_module(module), fn)()
    except (VerlCompatError, ImportError, ValueError) as e:
        _fail(e)


class _AfterImport:
    """A ``sys.meta_path`` finder that runs :func:`_register` once a module of :data:`REGISTRATIONS` has executed.

    It finds nothing itself: it asks the finders after it for the module's spec and wraps
    that spec's loader's ``exec_module`` (the loader keeps its type, so sources, resources
    and ``inspect`` work as before).
    """

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in REGISTRATIONS or name in _done:
            return None
        for finder in sys.meta_path[sys.meta_path.index(self) + 1:]:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        run = getattr(loader, "exec_module", None)
        if run is None:
            return spec

        def exec_module(module: Any) -> None:
            run(module)
            _register(name)

        loader.exec_module = exec_module
        return spec


def _plugin_check() -> None:
    """Run at import: check the verl version and arrange the lazy registrations.

    Fails loudly (an ERROR log line and a RuntimeWarning, then the exception), not at
    verl's debug level.
    """
    try:
        check_version()
    except VerlCompatError as e:
        _fail(e)
        raise
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
    for target in REGISTRATIONS:  # loaded before the plug-in (an import order we do not control)
        if target in sys.modules:
            _register(target)


_plugin_check()
