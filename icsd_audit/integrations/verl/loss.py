"""The verl worker loss: verl's ``ppo_loss`` + the allocated distillation term, in two allocation scopes.

verl's policy-loss registry (``core_algos.register_policy_loss``) never sees the batch,
so it cannot carry ``c`` or teacher log-probs.  The hook that does is the worker loss
``verl.workers.utils.losses.ppo_loss(config, model_output, data, dp_group=None)``,
called once per gradient micro-batch with every key of the batch (padded ``[B, T]``
tensors, or jagged nested tensors in v1); ``set_loss_fn`` on the actor worker group
replaces it::

    from functools import partial
    from icsd_audit.integrations.verl.plugin import icsd_ppo_loss
    actor_rollout_wg.set_loss_fn(partial(icsd_ppo_loss, config=actor_config, distill_coef=0.01))

:func:`icsd_ppo_loss` is verl's own ``ppo_loss`` plus ``lambda * agg(c * (T - logp))`` with
verl's ``agg_loss`` normalisation (``global_batch_info``: the mini-batch's token count
over all data-parallel ranks and ``dp_size``).  For ``token-mean`` that is the paper's
``lambda/|B| * sum c (T - logp)`` over the actor mini-batch for any micro-batch split and
any data-parallel size.  The teacher log-probs are read from :data:`TEACHER_KEY` (not
``teacher_logprobs``, which verl's own distillation rewrites).  Where ``c`` comes from:

* **mini-batch scope** (``micro=None``): the driver allocated each global actor
  mini-batch once, before the update, with ratio 1, and put ``c`` under :data:`C_KEY`
  (the ``icsd_sync`` trainer does; :mod:`~icsd_audit.integrations.verl.trainer`);
* **micro-batch scope** (``micro=MicroBatchScope(...)``): the loss allocates the
  micro-batch it is given from that micro-batch's own forward: ``rho = exp(logp -
  old_logp)`` and ``delta = T - logp`` with ``logp`` the current (detached) log-probs of
  this very pass, so every mini-batch and every PPO epoch gets its current ratio with no
  extra forward (the paper's cost model).  Calibration groups, the batch-wide fallback
  fit and SDAR's trust fit see only the micro-batch's rows; turn mass matching is
  unchanged (verl never splits a row, so a turn is whole in its micro-batch).
  docs/engines.md says when to choose which.

The dumps' ``entropy`` column (SPEC 11) is ``model_output['entropy']``, the entropy verl's engine
computes from the logits of this very forward (temperature-scaled, as the log-probs are) when the
actor's ``calculate_entropy`` is true (or ``entropy_coeff`` is not 0); otherwise the model output has
none and the shards have no ``entropy`` column.

Trajectories in a micro-batch: ``{uid}_{session_id}`` from the row fields verl's agent
loop stores (``uid``, ``session_id``), or :data:`TRAJ_KEY` where a driver put integer ids;
each run of 1s of a row's ``response_mask`` is one turn, numbered from
:data:`TURN_OFFSET_KEY` when present (``icsd_sync`` puts the session's earlier turns
there), else on from the earlier rows of the same trajectory in the micro-batch.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from icsd_audit.alloc.settings import DEFAULTS, SETTING_NAMES, AllocatorSettings
from icsd_audit.integrations.checks import BatchInputError, TrajNames, check_values
from icsd_audit.integrations.core import (C_KEY, TEACHER_KEY, PaddedAllocation, allocate_padded, distillation_loss,
                                          dump_writer, stable_traj_id, tcm_sums, turn_ids_from_mask, write_dump)

__all__ = ["C_KEY", "TEACHER_KEY", "TRAJ_KEY", "TURN_OFFSET_KEY", "STEP_KEY", "MicroBatchScope", "MicroAllocation",
           "micro_batch_trajectories", "icsd_ppo_loss"]

#: batch key of integer trajectory ids ``[B]`` a driver may put (else ``uid``/``session_id`` name them)
TRAJ_KEY = "icsd_traj_id"
#: batch key of each row's first turn index within its trajectory ``[B]`` (``icsd_sync`` puts it)
TURN_OFFSET_KEY = "icsd_turn_offset"
#: batch key of the training step of each row ``[B]`` (``icsd_sync`` puts it; names the dumped batches)
STEP_KEY = "icsd_step"
#: ``batch_id`` of the j-th allocated micro-batch of a step on data-parallel rank r of W: step * 10**6 + j * W + r
_STEP_STRIDE = 1_000_000


def _row_values(data: Any, key: str) -> list | None:
    """A per-row field of a verl TensorDict as a list (tensor or non-tensor stack), ``None`` when absent."""
    if key not in data.keys():
        return None
    v = data[key]
    if isinstance(v, Tensor):
        return v.tolist()
    return list(v)


def _session_offsets(traj: Tensor, n_turns: Tensor) -> Tensor:
    """Per row: the turns of the earlier rows (in row order) of the same trajectory (no loop over groups)."""
    order = torch.sort(traj, stable=True).indices
    t, n = traj[order], n_turns[order]
    before = torch.cumsum(n, 0) - n
    new = torch.ones_like(t, dtype=torch.bool)
    new[1:] = t[1:] != t[:-1]
    group = torch.cumsum(new.long(), 0) - 1
    out = torch.empty_like(before)
    out[order] = before - before[new][group]
    return out


def micro_batch_trajectories(data: Any, mask: Tensor) -> tuple[Tensor, Tensor, TrajNames]:
    """``(traj_id [B], turn_id [B, T], names)`` of a micro-batch's rows (see the module docstring)."""
    B = mask.shape[0]
    uid, session = _row_values(data, "uid"), _row_values(data, "session_id")
    if uid is not None and session is not None:
        labels = [f"{u}_{s}" for u, s in zip(uid, session)]
        names = TrajNames("uid_session", labels)
        traj = torch.as_tensor([stable_traj_id(x) for x in labels], dtype=torch.long)
    elif TRAJ_KEY in data.keys():
        traj = torch.as_tensor(data[TRAJ_KEY]).long().view(-1)
        names = TrajNames(TRAJ_KEY, traj.tolist())
    else:
        raise BatchInputError(f"the micro-batch names no trajectories: it has neither the row fields uid and "
                              f"session_id (verl's agent loop stores them) nor {TRAJ_KEY}")
    if traj.shape != (B,):
        raise BatchInputError(f"trajectory ids: {traj.numel()} for a micro-batch of {B} rows")
    traj = traj.to(mask.device)
    local = turn_ids_from_mask(mask)
    if TURN_OFFSET_KEY in data.keys():
        offset = torch.as_tensor(data[TURN_OFFSET_KEY]).long().view(-1).to(mask.device)
    else:
        offset = _session_offsets(traj, (local.amax(dim=1) + 1).clamp(min=0))
    return traj, torch.where(mask, local + offset.view(-1, 1), local), names


def _dist_position(data: Any) -> tuple[int, int, bool]:
    """(data-parallel rank, data-parallel size, whether this process writes): one writer per data shard.

    Ranks that share a data shard (sequence parallelism) are taken as consecutive global ranks, the innermost
    dimension of verl's FSDP device mesh ``(dp, sp)``; the first of them writes.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return 0, 1, True
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    dp = int(data["dp_size"]) if "dp_size" in data.keys() else world
    per_shard = max(1, world // max(dp, 1))
    return rank // per_shard, max(dp, 1), rank % per_shard == 0


@dataclass(frozen=True)
class MicroAllocation:
    """One micro-batch's allocation and what entered it (padded ``[B, T]``)."""

    alloc: PaddedAllocation
    ratio: Tensor
    delta: Tensor
    mask: Tensor
    batch_id: int
    seconds: float


_WRITERS: dict[tuple[str, int], Any] = {}
_COUNTERS: dict[int, tuple[int, int]] = {}  # rank -> (step, next micro-batch index in that step)


@dataclass(frozen=True)
class MicroBatchScope(AllocatorSettings):
    """Allocate in the worker loss, per gradient micro-batch, from the micro-batch's own forward.

    The allocator settings are the inherited :class:`~icsd_audit.alloc.settings.AllocatorSettings`; with
    ``dump_dir`` each allocated micro-batch becomes one dump shard, written by the first
    rank of every data shard (shard names carry the data-parallel rank).
    """

    dump_dir: str = ""
    """folder for schema-v1 dumps; empty: none."""
    producer: str = "icsd.verl.worker-loss"
    """the producer's name in the dumps' metadata."""

    def settings(self) -> AllocatorSettings:
        """The allocator's eight settings alone."""
        return AllocatorSettings.from_mapping(self.to_dict())

    def _writer(self, rank: int, world: int) -> Any:
        key = (self.dump_dir, rank)
        if key not in _WRITERS:
            import verl

            from icsd_audit.dumps.provenance import deployed_block

            block = deployed_block(self.settings(), alloc_scope="micro-batch", ratio_source="own-forward")
            _WRITERS[key] = dump_writer(self.dump_dir, rank=rank, world_size=world, allocation=block,
                                        producer={"name": self.producer, "engine": "verl",
                                                  "engine_version": verl.__version__})
        return _WRITERS[key]

    def allocate(self, *, log_prob: Tensor, teacher: Tensor, data: Any, teacher_key: str,
                 entropy: Tensor | None = None) -> MicroAllocation:
        """Allocate this micro-batch (padded ``log_prob`` / ``teacher`` ``[B, T]``) and dump it when asked.

        ``entropy``: padded ``[B, T]`` entropies of the forward that gave ``log_prob`` (verl's
        ``model_output['entropy']``), dumped as the ``entropy`` column; None: no column.
        """
        t0 = time.perf_counter()
        padded = data.select("response_mask", "advantages", "old_log_probs").to_padded_tensor()
        mask = padded["response_mask"].bool()
        traj, turn, names = micro_batch_trajectories(data, mask)
        adv = check_values("advantages", padded["advantages"], mask, names=names)
        old = check_values("old_log_probs", padded["old_log_probs"], mask, names=names, allow_rows=False)
        teacher = check_values(teacher_key, teacher, mask, names=names, allow_rows=False)
        logp = check_values("model_output['log_probs']", log_prob.detach(), mask, names=names, allow_rows=False)
        if entropy is not None:
            entropy = check_values("model_output['entropy']", entropy.detach().float(), mask, names=names,
                                   allow_rows=False)
        # verl's PPO ratio (log-ratio clamped to [-20, 20]): the u of every token uses the ratio its surrogate sees
        ratio = torch.exp(torch.clamp(logp - old, -20.0, 20.0))
        delta = (teacher - logp).float()
        rank, world, writes = _dist_position(data)
        step = _row_values(data, STEP_KEY)
        step_now = int(step[0]) if step else -1
        last_step, j = _COUNTERS.get(rank, (step_now, 0))
        j = j if last_step == step_now else 0
        _COUNTERS[rank] = (step_now, j + 1)
        bid = max(step_now, 0) * _STEP_STRIDE + j * world + rank
        a = allocate_padded(advantage=adv, ratio=ratio, delta=delta, response_mask=mask, traj_id=traj, turn_id=turn,
                            batch_id=bid, traj_names=names, settings=self.settings())
        seconds = time.perf_counter() - t0
        if self.dump_dir and writes:
            extra = {"logp": logp, "old_logp": old, "teacher_logp": teacher, "step": torch.full((mask.shape[0],), step_now)}
            if entropy is not None:
                extra["entropy"] = entropy
            write_dump(self._writer(rank, world), a, batch_id=bid, traj_id=traj, advantage=adv, ratio=ratio,
                       delta=delta, response_mask=mask, extra=extra)
        return MicroAllocation(alloc=a, ratio=ratio, delta=delta, mask=mask, batch_id=bid, seconds=seconds)

    def metrics(self, m: MicroAllocation) -> dict[str, float]:
        """Point TCMs (ICSD and SDAR weights) and the allocation time of one micro-batch."""
        out = {"icsd/alloc_seconds": m.seconds}
        for name, w in (("icsd", m.alloc.c), ("sdar", m.alloc.g)):
            num, den = tcm_sums(w, m.alloc.u, m.delta.double(), m.mask, self.eps)
            out[f"icsd/tcm_{name}"] = num / den if den > 0 else float("nan")
        return out


def icsd_ppo_loss(config: Any, model_output: dict, data: Any, dp_group: Any = None, *, distill_coef: float = 0.01,
                  micro: MicroBatchScope | None = None) -> tuple[Any, dict]:
    """verl's ``ppo_loss`` + ``distill_coef * agg(sg(c) * (sg(T) - logp))`` for one micro-batch.

    ``micro=None``: ``c`` from the batch (:data:`C_KEY`, mini-batch scope); a
    :class:`MicroBatchScope`: ``c`` allocated here from this micro-batch's forward.
    """
    from verl.utils.metric import AggregationType, Metric
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    need = (TEACHER_KEY,) if micro is not None else (C_KEY, TEACHER_KEY)
    missing = [k for k in need if k not in data.keys()]
    if missing:
        raise KeyError(f"icsd_ppo_loss: the batch has no {', '.join(missing)}; the driver must put "
                       + ("" if micro is not None else f"the allocation ({C_KEY}) and ")
                       + f"the privileged teacher's log-probs ({TEACHER_KEY}) into it (docs/engines.md)")
    loss, metrics = ppo_loss(config, model_output, data, dp_group)
    log_prob = no_padding_2_padding(model_output["log_probs"], data)
    keys = ("response_mask", TEACHER_KEY) if micro is not None else ("response_mask", C_KEY, TEACHER_KEY)
    sel = data.select(*keys).to_padded_tensor()
    mask = sel["response_mask"].to(bool)
    if micro is not None:
        ent = model_output.get("entropy")  # present when verl computed it in this forward (calculate_entropy)
        m = micro.allocate(log_prob=log_prob, teacher=sel[TEACHER_KEY], data=data, teacher_key=TEACHER_KEY,
                           entropy=None if ent is None or not micro.dump_dir else no_padding_2_padding(ent, data))
        c = m.alloc.c
        for k, v in micro.metrics(m).items():
            metrics[k] = Metric(value=v, aggregation=AggregationType.MEAN)
    else:
        c = sel[C_KEY]
    info = config.global_batch_info  # filled by ppo_loss from this micro-batch's data
    aux = distillation_loss(log_prob, sel[TEACHER_KEY], c, mask, loss_agg_mode=config.loss_agg_mode,
                            batch_num_tokens=info.get("batch_num_tokens"),
                            global_batch_size=info.get("global_batch_size"), dp_size=info.get("dp_size", 1))
    summed = data["dp_size"] > 1 or data["batch_num_tokens"] is not None or data["global_batch_size"] is not None
    metrics["actor/icsd_aux_loss"] = Metric(value=aux.detach(),
                                            aggregation=AggregationType.SUM if summed else AggregationType.MEAN)
    return loss + distill_coef * aux, metrics


def scope_from_env(allocator: str, *, producer: str) -> MicroBatchScope:
    """A :class:`MicroBatchScope` for ``allocator`` with settings from ``ICSD_*`` environment variables.

    ``ICSD_<SETTING>`` for each allocator setting but the allocator (``ICSD_TRUST``, ``ICSD_TRUST_BETA``,
    ``ICSD_TRUST_ETA``, ``ICSD_INFLUENCE_ETA``, ``ICSD_EPS``, ``ICSD_MIN_GROUP``, ``ICSD_SEED``) and
    ``ICSD_DUMP_DIR`` (SPEC defaults where unset): the channel into verl's workers for
    settings verl's own config has no field for.  A bad value is one line naming the variable.
    """
    env = os.environ
    values: dict[str, Any] = {"allocator": allocator}
    for name in SETTING_NAMES:
        var = f"ICSD_{name.upper()}"
        raw = env.get(var)
        if name == "allocator" or raw is None or raw == "":
            continue
        cast = type(getattr(DEFAULTS, name))
        try:
            values[name] = cast(raw)
        except ValueError:
            raise ValueError(f"{var}={raw!r} is not a valid {'integer' if cast is int else 'number'}") from None
        try:
            DEFAULTS.replace(**{name: values[name]})  # validated here so that the message names the variable
        except ValueError as e:
            raise ValueError(f"{var}={raw!r}: {e}") from None
    return MicroBatchScope(**values, dump_dir=env.get("ICSD_DUMP_DIR", ""), producer=producer)
