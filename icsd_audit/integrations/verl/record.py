"""Record verl's own worker losses unchanged: ``recording(loss_fn, dump_dir)``.

``recording(ppo_loss, dump_dir)`` or ``recording(distillation_ppo_loss, dump_dir)`` returns a function with
the wrapped loss's signature that returns exactly what it returns (the same ``(loss, metrics)`` objects:
values, gradients and metric keys untouched) and writes the micro-batch's response tokens as one
schema-v1 shard per call (``alloc_scope: micro-batch``, shard names carry the data-parallel rank). It
works on the bare function called with keywords or positionally and on the worker's
``functools.partial(loss_fn, config=..., distillation_config=...)`` called as
``(model_output=..., data=..., dp_group=None)``.

Columns, read from what the loss had (no forward pass): ``logp`` (``model_output['log_probs']`` at the
response positions), ``old_logp`` (``old_log_probs``), ``ratio = exp(clamp(logp - old_logp, -20, 20))`` as
verl's PPO forms it, ``advantage`` (``advantages``; 0 and ``no_advantage`` in the provenance when the batch
has none), ``teacher_logp`` (``teacher_logprobs``: the sampled token's where the teacher stored one
log-prob per position; with a top-k teacher, the sampled token's entry of ``teacher_ids`` or null outside
it), ``delta`` (0 where ``teacher_logp`` is null), ``distill_term`` (the per-token distillation loss verl's
registered loss gives: the single-sample estimator of ``loss_mode`` on the same log-probs, or the top-k
losses the logits processor left in ``model_output``; clamped as verl clamps it), ``c = 1`` (verl's
weighting is uniform), ``entropy`` (``model_output['entropy']``, the entropy verl's engine computes from
this forward's temperature-scaled logits when the actor's ``calculate_entropy`` is true or its
``entropy_coeff`` is not 0; no column otherwise), ``valid`` = ``response_mask`` (environment tokens inside a response are 0 there and
are not written), ``token_id``, ``step`` and ``batch_id = step * 10**6 + j * W + r`` (the j-th call of the
step on data-parallel rank r of W; ``step`` from ``icsd_step`` when the batch has it, else 0).
Trajectories: ``uid``/``session_id`` as :mod:`.verl_loss` names them, else one per row.

Which verl trainers: the loss functions of verl's worker (``verl.workers.utils.losses``, v1's engine
workers and the legacy ``dp_actor`` path that calls the same ``ppo_loss``/``distillation_ppo_loss`` through
``set_loss_fn``); a function whose signature has no ``model_output``/``data`` is refused in one line.
"""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import Tensor

from icsd_audit.integrations.checks import check_values
from icsd_audit.integrations.core import dump_writer, turn_ids_from_mask
from icsd_audit.integrations.verl.loss import STEP_KEY, TRAJ_KEY, micro_batch_trajectories

__all__ = ["recording", "SWITCH_OPTIONS", "switch_settings", "worker_loss", "register_switch", "refuse_legacy"]

_STEP_STRIDE = 1_000_000


def _dp_position(data: Any) -> tuple[int, int, bool]:
    """(data-parallel rank, data-parallel size, whether this process writes): one writer per data shard.

    Ranks sharing a data shard (sequence parallelism) are consecutive global ranks, the inner dimension of
    verl's ``(dp, sp)`` mesh; the first of them writes (as :mod:`.verl_loss` does).
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return 0, 1, True
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    dp = int(data["dp_size"]) if "dp_size" in data.keys() else world
    per_shard = max(1, world // max(dp, 1))
    return rank // per_shard, max(dp, 1), rank % per_shard == 0


def _padded(x: Any, data: Any) -> Tensor:
    from verl.workers.utils.padding import no_padding_2_padding

    return no_padding_2_padding(x, data)


def _field(data: Any, key: str, fill: float) -> Tensor | None:
    if key not in data.keys():
        return None
    v = data[key]
    return v.to_padded_tensor(fill) if getattr(v, "is_nested", False) else v


class _Recorder:
    def __init__(self, dump_dir: str | Path, loss_name: str, producer: Mapping[str, Any] | None):
        self.dump_dir, self.loss_name, self.extra = Path(dump_dir), loss_name, dict(producer or {})
        self.writer: Any = None
        self.counter = (-1, 0)

    def _writer(self, rank: int, world: int, producer: dict[str, Any]) -> Any:
        if self.writer is None:
            import verl

            from icsd_audit.dumps.provenance import deployed_block

            block = deployed_block({"allocator": "opsd", "trust": "uniform"}, alloc_scope="micro-batch",
                                   ratio_source="own-forward")
            self.writer = dump_writer(self.dump_dir, rank=rank, world_size=world, allocation=block,
                                      producer={"name": "icsd.verl.record", "engine": "verl",
                                                "engine_version": verl.__version__, **producer, **self.extra},
                                      null_nan=("teacher_logp",))
        return self.writer

    def write(self, model_output: Mapping[str, Any], data: Any, distillation_config: Any) -> None:
        from verl.trainer.ppo.core_algos import kl_penalty

        mask = _field(data, "response_mask", 0).bool()
        B, T = mask.shape
        where = f"{self.loss_name} (record)"
        logp = _padded(model_output["log_probs"], data).detach().float()
        check_values(f"{where}: model_output['log_probs']", logp, mask, allow_rows=False)
        old = _field(data, "old_log_probs", 0.0)
        old = logp if old is None else old.detach().float()
        producer: dict[str, Any] = {"loss": self.loss_name}
        adv = _field(data, "advantages", 0.0)
        if adv is None:
            adv = torch.zeros(B, T)
            producer["no_advantage"] = f"{self.loss_name}'s batch has no advantages: advantage is 0 and ratio 1"
            ratio = torch.ones(B, T)
        else:
            adv = check_values(f"{where}: data['advantages']", adv.detach().float(), mask)
            ratio = torch.exp(torch.clamp(logp - old, -20.0, 20.0))
        teacher = None if "teacher_logprobs" not in data.keys() else _padded(data["teacher_logprobs"], data).float()
        ids = _field(data, "responses", 0).long()
        term = torch.zeros(B, T)
        if teacher is None:
            teacher = torch.full((B, T), float("nan"))
            producer["no_teacher"] = (f"{self.loss_name}'s batch has no teacher_logprobs: teacher_logp is null and "
                                      "delta 0 on every token")
        elif teacher.dim() == 3 and teacher.shape[-1] > 1:  # a top-k teacher: its log-prob of the sampled token
            tid = _padded(data["teacher_ids"], data).long()
            hit = tid == ids.unsqueeze(-1)
            teacher = torch.where(hit.any(-1), (teacher * hit).sum(-1), torch.full((B, T), float("nan")))
        else:
            teacher = teacher.squeeze(-1) if teacher.dim() == 3 else teacher
        if distillation_config is not None:
            lc = distillation_config.distillation_loss
            producer.update(loss_mode=lc.loss_mode, use_task_rewards=lc.use_task_rewards,
                            use_policy_gradient=lc.use_policy_gradient,
                            distillation_loss_coef=lc.distillation_loss_coef)
            if "distillation_losses" in model_output:  # top-k losses from verl's logits processor
                term = _padded(model_output["distillation_losses"], data).detach().float().clamp_min(0.0)
            elif not torch.isnan(teacher).all():
                term = kl_penalty(logprob=logp, ref_logprob=torch.nan_to_num(teacher), kl_penalty=lc.loss_mode)
            if lc.loss_max_clamp is not None:
                term = term.clamp(min=-lc.loss_max_clamp, max=lc.loss_max_clamp)
        known = ~torch.isnan(teacher)
        check_values(f"{where}: data['teacher_logprobs']", torch.where(known, teacher, torch.zeros_like(teacher)),
                     mask, allow_rows=False)
        delta = torch.where(known, teacher - logp, torch.zeros_like(logp))
        rank, world, writes = _dp_position(data)
        if not writes:  # another rank of this data shard writes its rows
            return
        step_v = _field(data, STEP_KEY, 0)
        step = int(step_v.view(-1)[0]) if step_v is not None else 0
        last, j = self.counter
        j = j if last == step else 0
        self.counter = (step, j + 1)
        bid = step * _STEP_STRIDE + j * world + rank
        if {"uid", "session_id"} <= set(data.keys()) or TRAJ_KEY in data.keys():
            traj, turn, _ = micro_batch_trajectories(data, mask)  # a session's later row continues its turns
        else:
            traj, turn = torch.arange(B, dtype=torch.long) + ((bid & 0xFFFFFFFF) << 20), turn_ids_from_mask(mask)
        cols = dict(batch_id=torch.full((B,), bid), traj_id=traj, turn_id=turn, advantage=adv, ratio=ratio,
                    delta=delta, logp=logp, old_logp=old, teacher_logp=teacher, distill_term=term.detach().float(),
                    c=torch.ones(B, T), token_id=ids, step=torch.full((B,), step), valid=torch.ones(B, T, dtype=torch.bool))
        ent = model_output.get("entropy")
        if ent is not None:
            cols["entropy"] = check_values(f"{where}: model_output['entropy']", _padded(ent, data).detach().float(),
                                           mask, allow_rows=False)
        self._writer(rank, world, producer).write(mask=mask, **cols)


def recording(loss_fn: Callable[..., Any], dump_dir: str | Path, *,
              producer: Mapping[str, Any] | None = None) -> Callable[..., Any]:
    """``loss_fn`` (verl's ``ppo_loss``, ``distillation_ppo_loss`` or a partial of one) that also records (module doc)."""
    sig = inspect.signature(loss_fn)
    missing = [k for k in ("model_output", "data") if k not in sig.parameters]
    name = getattr(getattr(loss_fn, "func", loss_fn), "__name__", type(loss_fn).__name__)
    if missing:
        raise TypeError(f"recording: {name} takes no {', '.join(missing)}: not a verl worker loss "
                        "(ppo_loss, distillation_ppo_loss)")
    rec = _Recorder(dump_dir, name, producer)

    def recorded(*args: Any, **kwargs: Any) -> Any:
        out = loss_fn(*args, **kwargs)
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        if a.get("student_logits") is None:  # distillation_ppo_loss as the logits processor returns a tensor
            with torch.no_grad():
                rec.write(a["model_output"], a["data"], a.get("distillation_config"))
        return out

    functools.update_wrapper(recorded, getattr(loss_fn, "func", loss_fn))
    recorded.__signature__ = sig  # type: ignore[attr-defined]
    return recorded


# ---------------------------------------------------------------------------------------- +icsd.record=true

#: the ``icsd`` options the switch reads (``+icsd.record=true``, optionally ``+icsd.dump_dir=...``)
SWITCH_OPTIONS = ("record", "dump_dir")
#: where the switch writes without ``+icsd.dump_dir``: under verl's ``trainer.default_local_dir``
DEFAULT_DUMP_SUBDIR = "icsd_dumps"


def switch_settings(config: Any) -> tuple[bool, str]:
    """``(record?, dump_dir)`` from a verl config's ``icsd`` section; ``ValueError`` naming a bad option.

    ``record`` must be a boolean; with it, any other ``icsd`` option than :data:`SWITCH_OPTIONS` is
    refused (they configure ``icsd_sync``, which the switch does not run).
    """
    node = config.get("icsd") if hasattr(config, "get") else None
    if node is None or not node.get("record", False):
        return False, ""
    rec = node.get("record")
    if not isinstance(rec, bool):
        raise ValueError(f"icsd.record={rec!r}: give true or false")
    other = sorted(set(node.keys()) - set(SWITCH_OPTIONS))
    if other:
        raise ValueError(f"icsd.record=true records verl's own loss and takes only +icsd.dump_dir; "
                         f"icsd option(s) {other} configure trainer_mode=icsd_sync")
    mode = config.trainer.get("v1", {}).get("trainer_mode", "sync") if config.trainer.get("use_v1", False) else None
    if mode is None:
        raise ValueError("icsd.record=true needs verl's v1 trainer (trainer.use_v1=true); the legacy trainer is "
                         "not supported")
    if mode == "icsd_sync":
        raise ValueError("icsd.record=true records verl's own loss; trainer_mode=icsd_sync writes its own dumps "
                         "(+icsd.dump_dir) and is not recorded")
    dump_dir = str(node.get("dump_dir") or f"{config.trainer.default_local_dir}/{DEFAULT_DUMP_SUBDIR}")
    return True, dump_dir


def worker_loss(config: Any) -> Callable[..., Any]:
    """The actor loss verl's v1 worker builds from ``config`` (``engine_workers.ActorRolloutRefWorker``):
    ``partial(distillation_ppo_loss, config=..., distillation_config=...)`` with distillation enabled, else
    ``partial(ppo_loss, config=...)``."""
    from verl.trainer.distillation import distillation_ppo_loss, is_distillation_enabled
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.utils.losses import ppo_loss

    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    dist = config.get("distillation")
    if is_distillation_enabled(dist):
        return functools.partial(distillation_ppo_loss, config=actor, distillation_config=omega_conf_to_dataclass(dist))
    return functools.partial(ppo_loss, config=actor)


def register_switch() -> None:
    """Make ``+icsd.record=true`` work on verl's v1 trainers (once per process; the plug-in calls it).

    verl's ``PPOTrainer.init`` gets a pass-through wrapper: it checks the ``icsd`` section first
    (:func:`switch_settings`: a bad option stops before any worker starts) and, with
    ``icsd.record=true``, after verl's own init hands the actor workers :func:`recording` of the loss
    they built (:func:`worker_loss`) through ``actor_rollout_wg.set_loss_fn``.  Without the option
    nothing changes.
    """
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    orig = PPOTrainer.init
    if getattr(orig, "__icsd_record__", False):
        return

    def init(self: Any) -> None:
        on, dump_dir = switch_settings(self.config)
        orig(self)
        if on:
            mode = self.config.trainer.v1.trainer_mode
            self.actor_rollout_wg.set_loss_fn(recording(worker_loss(self.config), dump_dir,
                                                        producer={"trainer": f"verl v1 {mode}"}))

    functools.update_wrapper(init, orig)
    init.__icsd_record__ = True  # type: ignore[attr-defined]
    PPOTrainer.init = init


def refuse_legacy() -> None:
    """``+icsd.record=true`` on verl's legacy trainer (``RayPPOTrainer``) stops in one line at ``init_workers``."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    orig = RayPPOTrainer.init_workers
    if getattr(orig, "__icsd_record__", False):
        return

    def init_workers(self: Any, *args: Any, **kwargs: Any) -> Any:
        node = self.config.get("icsd")
        if node is not None and node.get("record", False):
            raise ValueError("icsd.record=true needs verl's v1 trainer (trainer.use_v1=true); the legacy trainer is "
                             "not supported")
        return orig(self, *args, **kwargs)

    functools.update_wrapper(init_workers, orig)
    init_workers.__icsd_record__ = True  # type: ignore[attr-defined]
    RayPPOTrainer.init_workers = init_workers
