"""ICSD and SDAR as losses of verl's own distillation registry (``verl/trainer/distillation/losses.py``).

verl 0.9.1 distils from a teacher served beside the rollout (``distillation.enabled=true``,
``distillation.teacher_models...``): the agent loop stores the teacher's log-prob of each
sampled token as ``teacher_logprobs``, and the worker loss calls the registered loss
``distillation.distillation_loss.loss_mode`` once per micro-batch with
``(config, distillation_config, model_output, data)``; it returns per-token losses that
verl then aggregates (``agg_loss``) or, with ``use_policy_gradient=true``, negates into
advantages of a policy-gradient term.

The plug-in registers (:func:`register_losses`, at import):

=======================  ============================================================
``loss_mode``            ``c`` allocated over the micro-batch with allocator
=======================  ============================================================
``icsd``                 ``icsd`` (SPEC 4)
``sdar``                 ``sdar`` (SPEC 3's trust ``g`` alone)
``icsd_sign``            ``sign`` (SPEC 5)
``icsd_influence_only``  ``influence-only``
``icsd_gaussian``        ``gaussian``
``icsd_permuted``        ``permuted`` (the permutation control; ``ICSD_SEED``)
=======================  ============================================================

(``opsd`` would be ``c = 1``: verl's own ``k1``.  ``fisher`` needs the per-token score
norm of the student's logits, which verl's estimator losses never see.)  Each allocates
``c`` from the micro-batch: ``advantages``, ``old_log_probs``, ``response_mask``,
``teacher_logprobs``, the current ``model_output["log_probs"]`` (ratio and gap of this
very forward) and the rows' trajectories (:func:`~.verl_loss.micro_batch_trajectories`),
and returns per token, with ``k1 = logp - T`` (verl's ``kl_penalty(..., "k1")``):

* ``use_policy_gradient=true``: ``c * k1``, so verl's advantage ``-c * k1 = c * (T - logp)``
  is the teacher gap weighted by the allocation (verl's recommended mode for ``k1``);
* ``use_policy_gradient=false``: ``-c * k1 = c * (sg(T) - logp)``, the paper's sampled
  auxiliary term (Eq. sampled_aux) weighted by ``c``; verl's ``token-mean`` aggregation
  over the mini-batch's global token count and ``distillation_loss_coef = lambda`` give
  the paper's ``lambda/|B| sum c (T - logp)`` (Eq. allocation_form).  ``c * k1`` itself
  would lower the log-prob of every sampled token.

verl clamps the returned losses to ``+-loss_max_clamp`` when that is set (its yaml
default is ``null``).  Settings verl's config has no field for come from the workers'
environment (:data:`~.loss.ENV_SETTINGS`: ``ICSD_TRUST``, ``ICSD_TRUST_BETA``,
``ICSD_TRUST_ETA``, ``ICSD_INFLUENCE_ETA``, ``ICSD_MIN_GROUP``, ``ICSD_EPS``, ``ICSD_SEED``,
``ICSD_DUMP_DIR``), checked when the plug-in registers these losses.  They need verl's v1
trainer (``trainer.use_v1=true``): its agent loop stores each row's ``uid`` and
``session_id``, which name the trajectories; the legacy trainer's rows do not, and the
first call refuses them in one line.  Metrics:
``icsd/tcm_icsd``, ``icsd/tcm_sdar``, ``icsd/c_mean``, ``icsd/alloc_seconds``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from icsd_audit.integrations.verl.loss import TRAJ_KEY, scope_from_env

__all__ = ["LOSS_ALLOCATORS", "icsd_distillation_loss", "register_losses"]

#: verl ``loss_mode`` -> allocator name.
LOSS_ALLOCATORS = {"icsd": "icsd", "sdar": "sdar", "icsd_sign": "sign", "icsd_influence_only": "influence-only",
                   "icsd_gaussian": "gaussian", "icsd_permuted": "permuted"}


def icsd_distillation_loss(config: Any, distillation_config: Any, model_output: dict, data: Any
                           ) -> tuple[Tensor, dict[str, Any]]:
    """Per-token allocated distillation losses ``[B, T]`` for verl's registry (see the module docstring)."""
    from verl.trainer.ppo.core_algos import kl_penalty
    from verl.utils.metric import AggregationType, Metric
    from verl.workers.utils.padding import no_padding_2_padding

    loss_config = distillation_config.distillation_loss
    mode = loss_config.loss_mode
    if mode not in LOSS_ALLOCATORS:
        raise ValueError(f"icsd_distillation_loss serves loss_mode {', '.join(LOSS_ALLOCATORS)}, not {mode!r}")
    if "teacher_logprobs" not in data.keys():
        raise KeyError(f"distillation loss_mode={mode}: the batch has no teacher_logprobs (verl's teacher loop "
                       "stores them: distillation.enabled=true with a teacher model)")
    if "session_id" not in data.keys() and TRAJ_KEY not in data.keys():  # rows that name no trajectory
        raise ValueError(f"distillation loss_mode={mode} needs verl's v1 trainer (trainer.use_v1=true): the legacy "
                         "trainer's micro-batches carry no session_id, so no row names its trajectory")
    log_prob = no_padding_2_padding(model_output["log_probs"], data)
    teacher = no_padding_2_padding(data["teacher_logprobs"], data)
    if teacher.dim() == 3:
        if teacher.shape[-1] != 1:
            raise ValueError(f"distillation loss_mode={mode} reads the teacher's log-prob of the sampled token; "
                             f"teacher_logprobs holds {teacher.shape[-1]} per position (a top-k loss's layout)")
        teacher = teacher.squeeze(-1)
    scope = scope_from_env(LOSS_ALLOCATORS[mode], producer=f"icsd.verl.distillation.{mode}")
    ent = model_output.get("entropy")  # verl computed it in this forward (calculate_entropy): the dumps' column
    m = scope.allocate(log_prob=log_prob, teacher=teacher, data=data, teacher_key="teacher_logprobs",
                       entropy=None if ent is None or not scope.dump_dir else no_padding_2_padding(ent, data))
    c = m.alloc.c.detach().to(log_prob.dtype)
    k1 = kl_penalty(logprob=log_prob, ref_logprob=teacher.to(log_prob.dtype), kl_penalty="k1")
    losses = c * k1 if loss_config.use_policy_gradient else -c * k1
    metrics: dict[str, Any] = {k: Metric(AggregationType.MEAN, v) for k, v in scope.metrics(m).items()}
    cm = m.alloc.c[m.mask]
    metrics["icsd/c_mean"] = Metric(AggregationType.MEAN, float(cm.mean()) if cm.numel() else 0.0)
    metrics["distillation/abs_loss"] = Metric(AggregationType.MEAN,
                                              losses.detach()[m.mask].abs().mean() if cm.numel() else torch.tensor(0.0))
    return losses, metrics


def register_losses() -> None:
    """Register every :data:`LOSS_ALLOCATORS` name with verl's distillation registry (once per process)."""
    from verl.trainer.distillation.losses import (DISTILLATION_LOSS_REGISTRY, DistillationLossSettings,
                                                  register_distillation_loss)

    todo = [name for name in LOSS_ALLOCATORS if DISTILLATION_LOSS_REGISTRY.get(name) is not icsd_distillation_loss]
    if todo:
        register_distillation_loss(DistillationLossSettings(names=todo, use_estimator=True))(icsd_distillation_loss)
