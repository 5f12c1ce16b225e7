"""Drop-in ICSD for verl-agent / SDAR forks (legacy verl ``DataProto`` batches, one row per turn).

Three pieces, each replacing or following one line of those forks (docs/engines.md lists
the exact lines):

* :func:`compute_icsd_loss` -- same call shape and return as SDAR's
  ``compute_sdar_loss(student_log_probs, teacher_log_probs, response_mask, gate_beta,
  loss_agg_mode)``, with the allocated ``c`` in place of the sigmoid gate;
* :func:`allocate_dataproto` -- on the driver, after advantages and the teacher pass:
  reads ``traj_uid`` and ``turn_step`` (SDAR's turn index) from ``non_tensor_batch``,
  allocates per global actor mini-batch (verl chunks the rows contiguously over the
  ``dp_size`` ranks and each rank's ``dp_actor.update_policy`` splits its chunk into
  ``mini_batch_rows // dp_size`` consecutive rows; :func:`~.core.mini_batch_ids`) and
  stores ``c`` under :data:`C_KEY`; rows copied by ``adjust_batch`` count once (see
  :mod:`~icsd_audit.integrations.core`);
* a dump hook: pass ``writer=dump_writer(out_dir, rank=...)`` to ``allocate_dataproto``
  and each mini-batch becomes one schema-v1 shard.

Exact vs approximated: ``c`` is computed before the update with ratio 1 (old policy =
current policy), which is the paper's allocation for the first mini-batch of a step;
later mini-batches of the same step would need the current ratio, which these forks do
not have before their forward pass (our built-in actor runs a no-grad pre-pass for it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from icsd_audit.integrations.core import (C_KEY, PaddedAllocation, allocate_padded, distillation_loss, mini_batch_ids,
                                          stable_traj_id, write_dump)
from icsd_audit.integrations.core import dump_writer as core_dump_writer

__all__ = ["C_KEY", "SDAR_TEACHER_KEY", "compute_icsd_loss", "allocate_dataproto", "dump_writer", "stable_traj_id"]

#: the key SDAR's verl-agent forks store the privileged teacher's log-probs under (their own name, read as is; verl
#: v1 runs use :data:`~icsd_audit.integrations.core.TEACHER_KEY`)
SDAR_TEACHER_KEY = "teacher_log_probs"


def compute_icsd_loss(student_log_probs: Tensor, teacher_log_probs: Tensor, c: Tensor, response_mask: Tensor,
                      loss_agg_mode: str = "token-mean", *, batch_num_tokens: Any = None,
                      global_batch_size: Any = None, dp_size: int = 1) -> tuple[Tensor, dict[str, float]]:
    """``agg(sg(c) * (sg(T) - logp))`` and metrics; the caller multiplies by its coefficient (lambda).

    With the defaults this aggregates over the micro-batch exactly as SDAR's loss does
    (verl's ``agg_loss``); ``batch_num_tokens`` / ``dp_size`` give verl's global-token
    normalisation instead.
    """
    loss = distillation_loss(student_log_probs, teacher_log_probs, c, response_mask, loss_agg_mode=loss_agg_mode,
                             batch_num_tokens=batch_num_tokens, global_batch_size=global_batch_size, dp_size=dp_size)
    with torch.no_grad():
        m = response_mask.bool()
        gap = (teacher_log_probs.detach() - student_log_probs.detach())[m]
        cm = c.detach()[m]
        metrics = {"icsd/c_mean": float(cm.mean()) if cm.numel() else 0.0,
                   "icsd/c_max": float(cm.max()) if cm.numel() else 0.0,
                   "icsd/teacher_gap_mean": float(gap.mean()) if gap.numel() else 0.0,
                   "icsd/aux_loss": float(loss.detach())}
    return loss, metrics


def dump_writer(out_dir: str | Path, *, rank: int = 0, **kwargs: Any) -> Any:
    """:func:`icsd_audit.integrations.core.dump_writer` with a verl-agent producer tag.

    :func:`allocate_dataproto` writes the deployed settings into every shard it writes
    (SPEC 9 ``allocator`` block) and the data-parallel size it was given as ``world_size``.
    """
    kwargs.setdefault("producer", {"name": "icsd.verl-agent", "engine": "verl-agent", "engine_version": _verl_version()})
    return core_dump_writer(out_dir, rank=rank, **kwargs)


def _verl_version() -> str | None:
    """The installed verl's version (the forks vendor or install it), ``None`` without one."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("verl")
    except PackageNotFoundError:
        return None


def allocate_dataproto(batch: Any, *, mini_batch_rows: int | None = None, dp_size: int = 1, teacher_key: str = SDAR_TEACHER_KEY,
                       student_key: str = "old_log_probs", step: int = 0, writer: Any = None,
                       **allocator: Any) -> list[PaddedAllocation]:
    """Allocate a verl-agent ``DataProto`` in place (``batch.batch[C_KEY]``), one allocation per mini-batch.

    Reads ``advantages``, ``response_mask``, ``student_key`` and ``teacher_key`` from
    ``batch.batch`` and ``traj_uid`` / ``turn_step`` from ``batch.non_tensor_batch``.
    ``mini_batch_rows`` is the global mini-batch in rows (verl-agent: ``ppo_mini_batch_size
    * rollout.n``; ``None``: the whole batch is one mini-batch), ``dp_size`` the number of
    data-parallel ranks the actor update runs on.  ``batch_id`` of mini-batch ``k`` of
    ``step`` is ``step * 1000 + k`` (as our trainer).
    """
    td, nt = batch.batch, batch.non_tensor_batch
    for k in ("traj_uid", "turn_step"):
        if k not in nt:
            raise KeyError(f"allocate_dataproto: non_tensor_batch has no {k!r} (verl-agent sets traj_uid; SDAR adds "
                           "turn_step, the 0-based turn index of each row)")
    for k in ("advantages", "response_mask", student_key, teacher_key):
        if k not in td.keys():
            raise KeyError(f"allocate_dataproto: batch has no {k!r}")
    mask = td["response_mask"].bool()
    B = mask.shape[0]
    traj = torch.as_tensor([stable_traj_id(u) for u in np.asarray(nt["traj_uid"]).tolist()], dtype=torch.long,
                           device=mask.device)
    turn = torch.as_tensor(np.asarray(nt["turn_step"]).astype(np.int64), device=mask.device)
    adv = td["advantages"]
    delta = (td[teacher_key] - td[student_key]).float()
    size = B if mini_batch_rows is None else int(mini_batch_rows)
    if size < 1:
        raise ValueError(f"mini_batch_rows must be >= 1, got {mini_batch_rows}")
    if mini_batch_rows is None or dp_size == 1:  # consecutive chunks (the last may be short)
        mb = np.arange(B) // size
    else:
        mb = mini_batch_ids(B, mini_batch_rows=size, dp_size=dp_size)
    c = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    out = []
    provenance = None
    if writer is not None:  # before any shard: settings allocate() would refuse fail here, not mid-batch
        from icsd_audit.dumps.provenance import deployed_block

        provenance = deployed_block({k: v for k, v in allocator.items() if k != "dedupe"}, alloc_scope="mini-batch",
                                    ratio_source="fixed-1")
        if writer.metadata["producer"].get("world_size") is None:
            writer.metadata["producer"]["world_size"] = int(dp_size)
    for k in np.unique(mb):
        sl = torch.as_tensor(np.flatnonzero(mb == k), device=mask.device)
        bid = int(step) * 1000 + int(k)
        a = allocate_padded(advantage=adv[sl], ratio=1.0, delta=delta[sl], response_mask=mask[sl], traj_id=traj[sl],
                            turn_id=turn[sl], batch_id=bid, **allocator)
        c[sl] = a.c.to(c.device, torch.float32)
        out.append(a)
        if writer is not None:
            write_dump(writer, a, allocation=provenance, batch_id=bid, traj_id=traj[sl], advantage=adv[sl], ratio=1.0, delta=delta[sl],
                       response_mask=mask[sl], extra={"logp": td[student_key][sl], "teacher_logp": td[teacher_key][sl],
                                                      "step": torch.full((sl.numel(),), int(step))})
    td[C_KEY] = c
    return out
