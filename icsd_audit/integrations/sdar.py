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
  and each mini-batch becomes one schema-v1 shard; where the batch carries verl's
  ``entropys`` (the old-log-prob pass computes them with ``old_log_probs``, from the same
  logits; verl-agent's driver pops them after its entropy metric, so a fork keeps them by
  not popping) the shards get the ``entropy`` column (SPEC 11);
* for a plain verl-agent fork (no SDAR): :func:`turn_steps` (SDAR's ``turn_step`` from the
  order of a trajectory's rows) and :func:`teacher_pass` (SDAR's privileged self-teacher:
  the SkillBank block in front of each prompt, scored by the actor).

Exact vs approximated: ``c`` is computed before the update with ratio 1 (old policy =
current policy), which is the paper's allocation for the first mini-batch of a step;
later mini-batches of the same step would need the current ratio, which these forks do
not have before their forward pass (our built-in actor runs a no-grad pre-pass for it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from icsd_audit.alloc.settings import DEFAULTS, AllocatorSettings
from icsd_audit.integrations.checks import TrajNames, check_mask, check_row_ids, check_turn_ids, check_values
from icsd_audit.integrations.core import (C_KEY, PaddedAllocation, allocate_padded, distillation_loss, mini_batch_ids,
                                          stable_traj_id, write_dump)
from icsd_audit.integrations.core import dump_writer as core_dump_writer

__all__ = ["C_KEY", "SDAR_TEACHER_KEY", "DataProtoAllocation", "compute_icsd_loss", "allocate_dataproto", "dump_writer",
           "stable_traj_id", "turn_steps", "teacher_pass"]

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


@dataclass(frozen=True)
class DataProtoAllocation:
    """What :func:`allocate_dataproto` computed (``c`` is also stored in the batch)."""

    #: ``[B, T]`` float32: ``c`` on valid tokens, 0 elsewhere (the tensor stored under :data:`C_KEY`).
    c: Tensor
    #: ``[B]`` global actor mini-batch index of every row (:func:`~.core.mini_batch_ids`).
    mini_batch: np.ndarray
    #: one allocation per mini-batch, in mini-batch order.
    parts: tuple[PaddedAllocation, ...]
    #: the dump shards written (empty without a writer).
    shards: tuple[Path, ...]


def allocate_dataproto(batch: Any, *, mini_batch_rows: int | None = None, dp_size: int = 1, step: int = 0,
                       writer: Any = None, settings: AllocatorSettings | None = None,
                       teacher_key: str = SDAR_TEACHER_KEY, student_key: str = "old_log_probs",
                       entropy_key: str = "entropys", **overrides: Any) -> DataProtoAllocation:
    """Allocate a verl-agent ``DataProto`` per global actor mini-batch and store ``c`` in it.

    **Mutates** ``batch``: sets ``batch.batch[C_KEY]`` (float32 ``[B, T]``, ``c`` on valid
    tokens and 0 elsewhere) and nothing else.  Reads ``advantages`` (``[B, T]`` or ``[B]``),
    ``response_mask``, ``student_key`` and ``teacher_key`` from ``batch.batch`` and
    ``traj_uid`` / ``turn_step`` from ``batch.non_tensor_batch``.

    ``mini_batch_rows`` is the global mini-batch in rows (verl-agent: ``ppo_mini_batch_size
    * rollout.n``; ``None``: the whole batch is one mini-batch), ``dp_size`` the number of
    data-parallel ranks the actor update runs on: any row count verl's ``split`` accepts
    per rank, a short last mini-batch included (:func:`~.core.mini_batch_ids`).  ``settings``
    (default SPEC's) fix the allocator; ``overrides`` (``allocator="sdar"``, ...) replace single settings.  ``batch_id``
    of mini-batch ``k`` of ``step`` is ``step * 1000 + k`` (as our trainer); with
    ``writer`` each mini-batch becomes one dump shard, with an ``entropy`` column where
    ``batch.batch`` has ``entropy_key`` (``[B, T]``, the entropies of the pass that gave ``student_key``).

    Everything is checked before anything is allocated or written: a missing key, a mask
    or log-prob of the wrong shape, a turn index that is not an integer, a ``traj_uid``
    list of the wrong length, or a NaN/inf advantage or log-prob on a valid token is one
    :class:`~.checks.BatchInputError` line naming the key, the row and its ``traj_uid``.
    """
    td, nt = batch.batch, batch.non_tensor_batch
    for k in ("traj_uid", "turn_step"):
        if k not in nt:
            raise KeyError(f"allocate_dataproto: non_tensor_batch has no {k!r} (verl-agent sets traj_uid; SDAR adds "
                           "turn_step, the 0-based turn index of each row)")
    for k in ("advantages", "response_mask", student_key, teacher_key):
        if k not in td.keys():
            raise KeyError(f"allocate_dataproto: batch has no {k!r}")
    mask = check_mask("response_mask", td["response_mask"])
    B = mask.shape[0]
    uids = check_row_ids("traj_uid", nt["traj_uid"], B)
    names = TrajNames("traj_uid", uids)
    turn = torch.as_tensor(check_turn_ids("turn_step", nt["turn_step"], B, names=names), device=mask.device)
    adv = check_values("advantages", td["advantages"], mask, names=names)
    student = check_values(student_key, td[student_key], mask, names=names, allow_rows=False)
    teacher = check_values(teacher_key, td[teacher_key], mask, names=names, allow_rows=False)
    entropy = (check_values(entropy_key, td[entropy_key], mask, names=names, allow_rows=False)
               if writer is not None and entropy_key in td.keys() else None)
    if mini_batch_rows is not None and int(mini_batch_rows) < 1:
        raise ValueError(f"mini_batch_rows must be >= 1, got {mini_batch_rows}")
    mb = (np.zeros(B, dtype=np.int64) if mini_batch_rows is None
          else mini_batch_ids(B, mini_batch_rows=int(mini_batch_rows), dp_size=int(dp_size)))
    traj = torch.as_tensor([stable_traj_id(u) for u in uids.tolist()], dtype=torch.long, device=mask.device)
    delta = (teacher - student).float()
    settings = (settings or DEFAULTS).replace(**overrides)
    c = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    parts, shards = [], []
    provenance = None
    if writer is not None:  # before any shard: settings allocate() would refuse fail here, not mid-batch
        from icsd_audit.dumps.provenance import deployed_block

        provenance = deployed_block(settings, alloc_scope="mini-batch", ratio_source="fixed-1")
        if writer.metadata["producer"].get("world_size") is None:
            writer.metadata["producer"]["world_size"] = int(dp_size)
    for k in np.unique(mb):
        sl = torch.as_tensor(np.flatnonzero(mb == k), device=mask.device)
        bid = int(step) * 1000 + int(k)
        a = allocate_padded(advantage=adv[sl], ratio=1.0, delta=delta[sl], response_mask=mask[sl], traj_id=traj[sl],
                            turn_id=turn[sl], batch_id=bid, traj_names=TrajNames("traj_uid", uids[sl.cpu().numpy()]),
                            settings=settings)
        c[sl] = a.c.to(c.device, torch.float32)
        parts.append(a)
        if writer is not None:
            extra = {"logp": student[sl], "teacher_logp": teacher[sl], "step": torch.full((sl.numel(),), int(step))}
            if entropy is not None:
                extra["entropy"] = entropy[sl].float()
            shards.append(write_dump(writer, a, allocation=provenance, batch_id=bid, traj_id=traj[sl],
                                     advantage=adv[sl], ratio=1.0, delta=delta[sl], response_mask=mask[sl],
                                     extra=extra))
    td[C_KEY] = c
    return DataProtoAllocation(c=c, mini_batch=mb, parts=tuple(parts), shards=tuple(shards))


# ------------------------------------------------------------------------------ plain verl-agent (no SDAR)


def turn_steps(traj_uid: Any) -> np.ndarray:
    """Each row's 0-based turn index: its rank among the earlier rows of the same ``traj_uid``.

    verl-agent's rollout (``gather_rollout_data``) lists a trajectory's turns in step order;
    call this on the gathered batch, before ``adjust_batch`` copies rows, and store the result
    as ``non_tensor_batch["turn_step"]`` (SDAR forks already carry it).
    """
    uids = check_row_ids("traj_uid", traj_uid, len(traj_uid))
    _, inv = np.unique(np.asarray([str(u) for u in uids.tolist()], dtype=object), return_inverse=True)
    order = np.argsort(inv, kind="stable")
    counts = np.bincount(inv)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    out = np.empty(len(inv), dtype=np.int64)
    out[order] = np.arange(len(inv)) - np.repeat(starts, counts)
    return out


def teacher_pass(batch: Any, actor_rollout_wg: Any, tokenizer: Any, bank: Any, *, mode: str = "match",
                 key: str = SDAR_TEACHER_KEY) -> Any:
    """SDAR's privileged teacher pass for a plain verl-agent fork; stores ``batch.batch[key]`` (``[B, R]``).

    Each row's prompt ids (``prompts``, left-padded, with ``attention_mask``) get the
    SkillBank block of the skill retrieved from the decoded prompt in front (as SDAR and
    ``icsd_sync`` build it), the response stays the same, and the actor scores the new rows
    with ``actor_rollout_wg.compute_log_prob`` (the current weights: SDAR's live
    self-teacher).  **Mutates** ``batch``: sets ``batch.batch[key]`` and nothing else.
    Returns the scored ``DataProto``.  Needs verl (the fork's own copy).
    """
    from verl import DataProto
    from verl.protocol import pad_dataproto_to_divisor, unpad_dataproto

    from icsd_audit.integrations.verl.trainer import privileged_prompts

    td = batch.batch
    prompts, responses, att = td["prompts"], td["responses"], td["attention_mask"]
    P = prompts.shape[1]
    real = [p[m.bool()] for p, m in zip(prompts, att[:, :P])]
    priv = privileged_prompts(real, tokenizer, bank, mode=mode)
    width = max(x.numel() for x in priv)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    new_prompts = torch.full((len(priv), width), pad, dtype=prompts.dtype)
    new_mask = torch.zeros((len(priv), width), dtype=att.dtype)
    for i, x in enumerate(priv):  # left padding, as verl's rollout lays prompts out
        new_prompts[i, width - x.numel():] = x
        new_mask[i, width - x.numel():] = 1
    mask = torch.cat([new_mask, att[:, P:]], dim=1)
    rows = DataProto.from_dict(
        tensors={"prompts": new_prompts, "responses": responses, "input_ids": torch.cat([new_prompts, responses], 1),
                 "attention_mask": mask, "position_ids": torch.clip(torch.cumsum(mask, dim=-1) - 1, min=0)},
        meta_info=dict(batch.meta_info))
    padded, pad_size = pad_dataproto_to_divisor(rows, actor_rollout_wg.world_size)
    out = unpad_dataproto(actor_rollout_wg.compute_log_prob(padded), pad_size=pad_size)
    td[key] = out.batch["old_log_probs"]
    return out
