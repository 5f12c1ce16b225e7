"""ICSD inside verl (``pip install 'icsd-audit[verl]'``; tested: verl 0.9.1): the worker loss and the plug-in.

verl's policy-loss registry (``core_algos.register_policy_loss``) never sees the batch,
so it cannot carry ``c`` or teacher log-probs.  The hook that does is the worker loss
``verl.workers.utils.losses.ppo_loss(config, model_output, data, dp_group=None)``,
called once per micro-batch with every key of the batch (padded ``[B, T]`` tensors in
the legacy trainer, jagged nested tensors in v1); ``set_loss_fn`` on the actor /
actor-rollout worker group replaces it::

    from functools import partial
    from icsd_audit.integrations.verl import icsd_ppo_loss
    actor_rollout_wg.set_loss_fn(partial(icsd_ppo_loss, config=actor_config, distill_coef=0.01))

:func:`icsd_ppo_loss` is verl's own ``ppo_loss`` plus ``lambda * agg(c * (T - logp))`` with
verl's ``agg_loss`` normalisation (``global_batch_info``: the mini-batch's token count
over all data-parallel ranks and ``dp_size``).  For ``token-mean`` that is the paper's
``lambda/|B| * sum c (T - logp)`` over the actor mini-batch for any micro-batch split and
any data-parallel size.  ``c`` and the teacher log-probs are read from the batch keys
:data:`C_KEY` and :data:`TEACHER_KEY` (not ``teacher_logprobs``, which verl's own
distillation rewrites); the driver puts them there (see docs/engines.md).

Importing this module checks that verl is in the tested range and that every verl
function it wraps still has the signature it was written against; verl loads plug-ins
from the ``verl.plugins`` entry-point group and logs a failing one only at debug level,
so the check logs an ERROR and raises :class:`VerlCompatError` itself.
"""

from __future__ import annotations

import inspect
import logging
import warnings
from typing import Any

from icsd_audit.integrations.core import C_KEY, TEACHER_KEY, distillation_loss

__all__ = ["C_KEY", "TEACHER_KEY", "TESTED_VERL", "VerlCompatError", "icsd_ppo_loss", "check_verl", "EXPECTED_SIGNATURES"]

log = logging.getLogger("icsd_audit.integrations.verl")

#: [lowest tested, first untested) verl versions.
TESTED_VERL = ("0.9.1", "0.10")

#: The verl callables this module calls or replaces, with the parameter names it relies on.
EXPECTED_SIGNATURES: dict[str, tuple[str, ...]] = {
    "verl.workers.utils.losses:ppo_loss": ("config", "model_output", "data", "dp_group"),
    "verl.workers.utils.padding:no_padding_2_padding": ("tensor", "data"),
    "verl.trainer.ppo.core_algos:agg_loss": ("loss_mat", "loss_mask", "loss_agg_mode", "dp_size", "batch_num_tokens",
                                             "global_batch_size", "loss_scale_factor"),
    "verl.workers.engine_workers:ActorRolloutRefWorker.set_loss_fn": ("self", "loss_fn"),
    "verl.workers.engine_workers:TrainingWorker.set_loss_fn": ("self", "loss_fn"),
    "verl.workers.engine_workers:ActorRolloutRefWorker.compute_log_prob": ("self", "data"),
    "verl.trainer.ppo.v1.trainer_base:register_trainer": ("name",),
    "verl.trainer.ppo.v1.trainer_sync:PPOTrainerSync.on_init_end": ("self",),
    "verl.trainer.ppo.v1.trainer_sync:PPOTrainerSync._compute_advantage": ("self", "batch", "metrics"),
    "verl.workers.utils.padding:response_from_nested": ("tensor", "response_mask"),
    "verl.workers.utils.padding:response_to_nested": ("tensor", "response_mask"),
    "verl.trainer.ppo.core_algos:register_adv_est": ("name_or_enum",),
    "verl.trainer.ppo.core_algos:get_adv_estimator_fn": ("name_or_enum",),
    "verl.trainer.ppo.ray_trainer:apply_kl_penalty": ("data", "kl_ctrl", "kl_penalty"),
    "verl.trainer.ppo.rollout_corr_helper:compute_rollout_correction_and_add_to_batch": ("batch", "rollout_corr_config"),
    "verl.protocol:DataProto.__init__": ("self", "batch"),
    "verl.utils.config:omega_conf_to_dataclass": ("config", "dataclass_type"),
    "transfer_queue:kv_batch_get": ("keys", "partition_id", "select_fields"),
    "transfer_queue:kv_batch_put": ("keys", "partition_id", "fields", "tags"),
    "transfer_queue:kv_clear": ("keys", "partition_id"),
}


class VerlCompatError(RuntimeError):
    """verl is missing, outside the tested range, or changed a signature icsd relies on."""


def _resolve(path: str) -> Any:
    import importlib

    mod, _, attr = path.partition(":")
    obj: Any = importlib.import_module(mod)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for p in v.split("+")[0].split("."):
        digits = "".join(ch for ch in p if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def check_verl() -> str:
    """The installed verl version; raises :class:`VerlCompatError` naming what does not fit."""
    try:
        import verl
    except ImportError as e:
        raise VerlCompatError("verl is not installed: pip install 'icsd-audit[verl]'") from e
    version = getattr(verl, "__version__", "0")
    lo, hi = TESTED_VERL
    if not (_version_tuple(lo) <= _version_tuple(version) < _version_tuple(hi)):
        raise VerlCompatError(f"verl {version} is outside the tested range [{lo}, {hi}); pip install 'icsd-audit[verl]'")
    for path, params in EXPECTED_SIGNATURES.items():
        try:
            obj = _resolve(path)
        except (ImportError, AttributeError) as e:
            raise VerlCompatError(f"verl {version} has no {path}: {e}") from e
        fn = inspect.unwrap(getattr(obj, "__wrapped__", obj))
        got = tuple(inspect.signature(fn).parameters)
        if got[: len(params)] != params:
            raise VerlCompatError(f"verl {version} changed {path}: parameters {got}, icsd expects {params}")
    return version


def icsd_ppo_loss(config: Any, model_output: dict, data: Any, dp_group: Any = None, *,
                  distill_coef: float = 0.01) -> tuple[Any, dict]:
    """verl's ``ppo_loss`` + ``distill_coef * agg(sg(c) * (sg(T) - logp))`` for one micro-batch."""
    from verl.utils.metric import AggregationType, Metric
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    missing = [k for k in (C_KEY, TEACHER_KEY) if k not in data.keys()]
    if missing:
        raise KeyError(f"icsd_ppo_loss: the batch has no {', '.join(missing)}; the driver must put the allocation "
                       f"({C_KEY}) and the privileged teacher's log-probs ({TEACHER_KEY}) into it (docs/engines.md)")
    loss, metrics = ppo_loss(config, model_output, data, dp_group)
    log_prob = no_padding_2_padding(model_output["log_probs"], data)
    sel = data.select("response_mask", C_KEY, TEACHER_KEY).to_padded_tensor()
    mask = sel["response_mask"].to(bool)
    info = config.global_batch_info  # filled by ppo_loss from this micro-batch's data
    aux = distillation_loss(log_prob, sel[TEACHER_KEY], sel[C_KEY], mask, loss_agg_mode=config.loss_agg_mode,
                            batch_num_tokens=info.get("batch_num_tokens"),
                            global_batch_size=info.get("global_batch_size"), dp_size=info.get("dp_size", 1))
    summed = data["dp_size"] > 1 or data["batch_num_tokens"] is not None or data["global_batch_size"] is not None
    metrics["actor/icsd_aux_loss"] = Metric(value=aux.detach(),
                                            aggregation=AggregationType.SUM if summed else AggregationType.MEAN)
    return loss + distill_coef * aux, metrics


def _plugin_check() -> None:
    """Run at import (verl loads this module through ``verl.plugins``): check verl, register ``icsd_sync``.

    Fails loudly (an ERROR log line and a RuntimeWarning, then the exception), not at
    verl's debug level.
    """
    try:
        check_verl()
        from icsd_audit.integrations.verl_trainer import register

        register()
    except (VerlCompatError, ImportError) as e:
        log.error("icsd verl plug-in cannot register: %s", e)
        warnings.warn(f"icsd verl plug-in cannot register: {e}", RuntimeWarning, stacklevel=2)
        raise


_plugin_check()
