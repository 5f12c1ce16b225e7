"""``icsd_sync``: verl's v1 synchronous PPO trainer with a privileged self-teacher and ICSD.

Registered with ``verl.trainer.ppo.v1.register_trainer`` by the plug-in; select it with
``trainer.v1.trainer_mode=icsd_sync`` and configure it under ``+icsd.*`` (see
:class:`ICSDVerlConfig`; docs/engines.md has the launch command).  Per step, after
verl's own advantage computation, the driver

1. **teacher pass** (SDAR's way): each row's prompt ids get the SkillBank block's ids in
   front (``skill_block(z)``, ``z`` retrieved by keyword match on the decoded prompt), the
   response ids stay the same, and ``actor_rollout_wg.compute_log_prob`` scores the new
   rows with the current (= rollout) weights; the response log-probs go into the batch
   under ``icsd_teacher_log_probs`` (not ``teacher_logprobs``, which verl rewrites);
2. **allocation per actor mini-batch**: verl splits the step's rows contiguously over the
   data-parallel ranks, and each rank cuts its share into ``ppo_mini_batch_size * n /
   dp`` consecutive rows (``actor.shuffle=false``); global mini-batch ``k`` is the union
   of the ranks' ``k``-th local chunks (:func:`v1_mini_batch_ids`).  Each global
   mini-batch is allocated once (:func:`~icsd_audit.integrations.core.allocate_padded`),
   whatever the data-parallel size and micro-batch split, and ``c`` goes into the batch
   under ``icsd_c``;
3. writes one schema-v1 shard per mini-batch from the driver and logs TCM (ICSD and
   SDAR weights) per step; the ``entropy`` column (SPEC 11) is verl's ``entropy`` field, which
   its old-log-prob pass computes from the logits that gave ``old_log_probs`` (absent, with
   no column, where ``rollout_correction.bypass_mode`` skips that pass);
4. the workers' loss is :func:`~icsd_audit.integrations.verl.plugin.icsd_ppo_loss` (set once with
   ``set_loss_fn``), whose ``token-mean`` aggregation over verl's global token count makes
   micro-batches and ranks add up to the paper's ``lambda/|B|`` mini-batch term exactly.

With ``algorithm.adv_estimator=gigpo`` the advantages themselves are GiGPO's
(:mod:`icsd_audit.integrations.verl.gigpo`): verl's advantage step runs with verl's own
KL-in-reward and rollout-correction functions, and the registered ``gigpo`` estimator
gets the per-turn anchor states only this trainer can supply.

Exact vs approximated: the allocation uses ratio 1 (old policy = current policy), the
paper's value on a step's first mini-batch; later mini-batches (``ppo_epochs > 1`` or
several mini-batches per step) would need the current ratio before their update, which
costs an extra forward verl does not do.  A trajectory is one ``{uid}_{session}`` of
verl's keys; its rows are ordered by the key's output index and each run of 1s of a
row's ``response_mask`` is one action turn.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

from icsd_audit.integrations.checks import TrajNames, check_values
from icsd_audit.integrations.core import (C_KEY, TEACHER_KEY, AllocationSettings, allocate_padded, dump_writer,
                                          mechanism_metrics, mechanism_sums, mini_batch_ids, tcm, tcm_sums,
                                          turn_ids_from_mask, write_dump)
from icsd_audit.integrations.verl.loss import STEP_KEY, TURN_OFFSET_KEY, MicroBatchScope
from icsd_audit.integrations.verl.gigpo import Sessions, register_estimator, turn_anchors

__all__ = ["ICSDVerlConfig", "v1_mini_batch_ids", "trajectory_turns", "privileged_prompts", "logprob_rows",
           "allocate_mini_batches", "tcm", "register"]


@dataclass(frozen=True)
class ICSDVerlConfig(AllocationSettings):
    """The ``icsd`` section of a verl config (``+icsd.<field>=...`` on the command line).

    The shared allocation settings plus the teacher's SkillBank, the dump folder and,
    with ``algorithm.adv_estimator=gigpo``, GiGPO's options (``gamma`` is verl's
    ``algorithm.gamma``).
    """

    #: SkillBank name (``webshop``, ``alfworld``, ``searchqa``) or JSON path.
    skillbank: str = "webshop"
    #: retrieval mode: ``match`` (keyword match), ``all`` or ``general``.
    skill_mode: str = "match"
    #: folder for schema-v1 dumps written by the driver; empty: none.
    dump_dir: str = ""
    #: GiGPO weight of the step-level (anchor-state) advantage (verl-agent's ``step_advantage_w``).
    step_weight: float = 1.0
    #: GiGPO normalisation at both levels: ``mean_norm`` (verl-agent's default) or ``mean_std_norm``.
    gigpo_mode: str = "mean_norm"
    #: GiGPO's ``std + epsilon`` floor (used by ``mean_std_norm``).
    gigpo_epsilon: float = 1e-6
    #: where ``c`` is allocated: ``mini-batch`` (the driver, once per global actor mini-batch, ratio 1) or
    #: ``micro-batch`` (the worker loss, per gradient micro-batch, from its own forward; docs/engines.md).
    alloc_scope: str = "mini-batch"

    def __post_init__(self) -> None:
        if self.gigpo_mode not in ("mean_norm", "mean_std_norm"):
            raise ValueError(f"icsd.gigpo_mode={self.gigpo_mode!r}: choose 'mean_norm' or 'mean_std_norm'")
        if self.alloc_scope not in ("mini-batch", "micro-batch"):
            raise ValueError(f"icsd.alloc_scope={self.alloc_scope!r}: choose 'mini-batch' or 'micro-batch'")

    def micro_scope(self) -> MicroBatchScope:
        """The worker loss's allocation in ``micro-batch`` scope (dumps written by the workers)."""
        return MicroBatchScope(**self.allocator_settings().to_dict(), dump_dir=self.dump_dir, producer="icsd.verl.icsd_sync")

    @staticmethod
    def from_config(node: Any) -> "ICSDVerlConfig":
        if node is None:
            return ICSDVerlConfig()
        known = ICSDVerlConfig.__dataclass_fields__
        items = dict(node.items()) if hasattr(node, "items") else dict(node)
        bad = sorted(set(items) - set(known))
        if bad:
            raise ValueError(f"unknown icsd option(s) {bad}; valid: {sorted(known)}")
        return ICSDVerlConfig(**items)


def v1_mini_batch_ids(n_rows: int, *, mini_batch_size: int, dp_size: int) -> np.ndarray:
    """Global actor mini-batch index of every row of a v1 step (``actor.shuffle=false``); see :func:`mini_batch_ids`.

    verl's v1 workers (``train_mini_batch``) need the ranks' rows to divide into whole
    mini-batches (the trainer pads a step with empty rows so that they do); a step that
    does not is refused here as verl would refuse it, before anything is allocated.
    """
    per_rank, per_mini = -(-n_rows // max(dp_size, 1)), mini_batch_size // max(dp_size, 1)
    if n_rows % max(dp_size, 1) or mini_batch_size % max(dp_size, 1) or (per_mini and per_rank % per_mini):
        raise ValueError(f"verl's v1 actor update needs {n_rows} rows to split evenly over {dp_size} ranks into "
                         f"mini-batches of {mini_batch_size} rows")
    return mini_batch_ids(n_rows, mini_batch_rows=mini_batch_size, dp_size=dp_size)


def trajectory_turns(keys: Sequence[str], response_mask: Tensor) -> tuple[Tensor, Tensor]:
    """``(traj_id [B], turn_id [B, T])`` from verl v1 keys ``{uid}_{session}_{index}`` and the response mask.

    Rows of one ``{uid}_{session}`` are one trajectory, ordered by ``index``; each run of
    1s in a row's mask is one turn, numbered on from the turns of the earlier rows.
    """
    sessions = Sessions.from_keys(keys)
    mask = response_mask.bool()
    local = turn_ids_from_mask(mask)
    return sessions.traj, torch.where(mask, local + sessions.turn_offsets(mask).view(-1, 1), local)


def privileged_prompts(prompts: Sequence[Tensor], tokenizer: Any, bank: Any, *, mode: str = "match") -> list[Tensor]:
    """SDAR's privileged prompt ids: the skill block's ids + the student's exact prompt ids."""
    from icsd_audit.train.rollout.prompts import skill_block

    cache: dict[str, list[int]] = {}
    out = []
    for p in prompts:
        text = tokenizer.decode(p.tolist(), skip_special_tokens=True)
        z = bank.retrieve(text, mode=mode).text
        if z not in cache:
            cache[z] = list(tokenizer(skill_block(z), add_special_tokens=False).input_ids)
        out.append(torch.cat([torch.as_tensor(cache[z], dtype=p.dtype), p]))
    return out


def logprob_rows(prompts: Sequence[Tensor], responses: Sequence[Tensor], response_masks: Sequence[Tensor]) -> Any:
    """Nested rows in the layout verl's v1 agent loop stores (text-only models)."""
    from tensordict import TensorDict

    def nt(xs: Sequence[Tensor]) -> Tensor:
        return torch.nested.as_nested_tensor(list(xs), layout=torch.jagged)

    ids = [torch.cat([p, r]) for p, r in zip(prompts, responses)]
    return TensorDict({"prompts": nt(prompts), "responses": nt(responses), "response_mask": nt(response_masks),
                       "loss_mask": nt(response_masks), "input_ids": nt(ids),
                       "position_ids": nt([torch.arange(x.numel()) for x in ids])}, batch_size=[len(ids)])


def allocate_mini_batches(*, advantage: Tensor, old_log_probs: Tensor, teacher_log_probs: Tensor,
                          response_mask: Tensor, traj_id: Tensor, turn_id: Tensor, mini_batch: np.ndarray,
                          step: int, cfg: ICSDVerlConfig, writer: Any = None,
                          traj_names: TrajNames | None = None,
                          entropy: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """``c`` (float32 ``[B, T]``) allocated per global mini-batch, plus TCM metrics; dumps when ``writer``.

    ``entropy``: ``[B, T]`` entropies of the pass that gave ``old_log_probs``, dumped as the
    ``entropy`` column (None: no column).

    Every input is checked first (shapes, finite values on valid tokens), so a bad value is
    one line naming the key, the row and ``traj_names``' id before any shard is written.
    """
    mask = response_mask.bool()
    advantage = check_values("advantages", advantage, mask, names=traj_names)
    old_log_probs = check_values("old_log_probs", old_log_probs, mask, names=traj_names, allow_rows=False)
    teacher_log_probs = check_values(TEACHER_KEY, teacher_log_probs, mask, names=traj_names, allow_rows=False)
    if entropy is not None and writer is not None:
        entropy = check_values("entropy", entropy.float(), mask, names=traj_names, allow_rows=False)
    delta = (teacher_log_probs - old_log_probs).float()
    c = torch.zeros(mask.shape, dtype=torch.float32)
    n_mini = 0
    sums = {"icsd": [0.0, 0.0], "sdar": [0.0, 0.0]}  # (numerator, denominator) pooled over mini-batches
    mech: dict[str, float] = {}  # mechanism sums (TCM, sign-region mass, c/g mass, fallback), pooled likewise
    for k in np.unique(mini_batch):
        rows = torch.as_tensor(np.flatnonzero(mini_batch == k))
        bid = int(step) * 1000 + int(k)
        names = None if traj_names is None else TrajNames(traj_names.key, [traj_names.values[i] for i in rows.tolist()])
        a = allocate_padded(advantage=advantage[rows], ratio=1.0, delta=delta[rows], response_mask=mask[rows],
                            traj_id=traj_id[rows], turn_id=turn_id[rows], batch_id=bid, traj_names=names,
                            settings=cfg)
        c[rows] = a.c.float()
        for name, w in (("icsd", a.c), ("sdar", a.g)):
            num, den = tcm_sums(w, a.u, delta[rows], mask[rows], cfg.eps)
            sums[name][0] += num
            sums[name][1] += den
        for key, v in mechanism_sums(a, advantage[rows], delta[rows], mask[rows], cfg.eps).items():
            mech[key] = mech.get(key, 0.0) + v
        n_mini += 1
        if writer is not None:
            extra = {"logp": old_log_probs[rows], "teacher_logp": teacher_log_probs[rows],
                     "step": torch.full((rows.numel(),), int(step))}
            if entropy is not None:
                extra["entropy"] = entropy[rows]
            write_dump(writer, a, batch_id=bid, traj_id=traj_id[rows], advantage=advantage[rows], ratio=1.0,
                       delta=delta[rows], response_mask=mask[rows], extra=extra)
    metrics = {f"icsd/tcm_{name}": num / den if den > 0 else float("nan") for name, (num, den) in sums.items()}
    metrics["icsd/mini_batches"] = float(n_mini)
    if mech:
        metrics.update(mechanism_metrics(mech))  # verl's trainer.logger carries them (tensorboard, wandb, ...)
    return c, metrics


def register() -> type:
    """Define and register the ``icsd_sync`` trainer (imports verl's v1 trainer)."""
    from functools import partial

    import transfer_queue as tq
    from tensordict import TensorDict
    from verl.protocol import DataProto
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn
    from verl.trainer.ppo.ray_trainer import apply_kl_penalty
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY, register_trainer
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.utils.padding import response_from_nested, response_to_nested

    from icsd_audit.integrations.verl.loss import icsd_ppo_loss

    register_estimator()
    if "icsd_sync" in TRAINER_REGISTRY:
        return TRAINER_REGISTRY["icsd_sync"]

    @register_trainer("icsd_sync")
    class ICSDTrainerSync(PPOTrainerSync):
        """verl's sync trainer + privileged self-teacher + ICSD allocation + auxiliary loss + dumps."""

        def on_init_end(self) -> None:
            from icsd_audit.integrations.verl.compat import check_verl

            check_verl()  # every signature we rely on (the plug-in checked only the modules loaded as it registered)
            super().on_init_end()
            self.icsd = ICSDVerlConfig.from_config(self.config.get("icsd"))
            actor = self.config.actor_rollout_ref.actor
            if actor.get("shuffle", False):
                raise ValueError("icsd_sync allocates per actor mini-batch and needs actor_rollout_ref.actor.shuffle=false")
            micro = self.icsd.micro_scope() if self.icsd.alloc_scope == "micro-batch" else None
            self.actor_rollout_wg.set_loss_fn(partial(icsd_ppo_loss, config=omega_conf_to_dataclass(actor),
                                                      distill_coef=self.icsd.distill_coef, micro=micro))
            from icsd_audit.train.teacher.skills import load_skillbank

            self._icsd_bank = load_skillbank(self.icsd.skillbank)
            self._icsd_writer = None
            if self.icsd.dump_dir and self.icsd.alloc_scope == "mini-batch":  # micro-batch: the workers write
                import verl

                # the driver allocates and writes every rank's rows: writer rank 0, world size = the actor's dp size
                sp = int(actor.get("ulysses_sequence_parallel_size", 1) or 1)
                self._icsd_writer = dump_writer(self.icsd.dump_dir, rank=0, world_size=self.actor_rollout_wg.world_size // sp,
                                                producer={"name": "icsd.verl", "engine": "verl",
                                                          "engine_version": verl.__version__, "trainer": "icsd_sync"},
                                                allocation=self.icsd.allocator_block(alloc_scope="mini-batch",
                                                                                     ratio_source="fixed-1"))

        def _gigpo_advantage(self, batch: Any, metrics: dict) -> Any:
            """verl 0.9.1's ``_compute_advantage`` (KL in reward, rollout correction, nested write-back, with
            verl's own functions) with the ``gigpo`` estimator fed the per-turn anchors it needs."""
            alg = self.config.algorithm
            fields = ["prompts", "responses", "response_mask", "rm_scores", "rollout_log_probs", "old_log_probs",
                      "ref_log_prob"]  # TransferQueue leaves out the fields a step does not have, as verl relies on
            data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
            rmask_nested = data["response_mask"]
            prompt_len = data["prompts"].offsets().diff()
            padded = data.to_padded_tensor()
            mask = padded["response_mask"]
            sessions = Sessions.from_keys(batch.keys)
            dp = DataProto(batch=padded)
            # verl's agent loop copies a session's final score onto its earlier outputs and verl's own v1 GRPO reads
            # the final output only: the episode's reward is counted once, on the final row
            scores = padded["rm_scores"]
            dp.batch["token_level_scores"] = scores * sessions.final.view(-1, 1).to(scores.dtype)
            if alg.use_kl_in_reward:
                dp, kl_metrics = apply_kl_penalty(dp, kl_ctrl=self.kl_ctrl_in_reward, kl_penalty=alg.kl_penalty)
                metrics.update(kl_metrics)
            else:
                dp.batch["token_level_rewards"] = dp.batch["token_level_scores"]
            corr = alg.get("rollout_correction", None)
            correction = corr is not None and "rollout_log_probs" in dp.batch and not corr.get("bypass_mode", False)
            if correction:
                dp, is_metrics = compute_rollout_correction_and_add_to_batch(dp, corr)
                metrics.update(is_metrics)
            # turns and anchors from the agent loop's mask; rejection sampling (if any) then zeroes what it dropped
            adv, ret = get_adv_estimator_fn("gigpo")(
                token_level_rewards=dp.batch["token_level_rewards"], response_mask=mask, index=sessions.uid,
                config=alg, traj_id=sessions.traj, turn_offset=sessions.turn_offsets(mask),
                anchor=turn_anchors(padded["prompts"], prompt_len, padded["responses"], mask), gamma=float(alg.gamma),
                step_weight=self.icsd.step_weight, mode=self.icsd.gigpo_mode, epsilon=self.icsd.gigpo_epsilon,
                metrics=metrics)
            keep = dp.batch["response_mask"].to(adv.dtype)
            dp.batch["advantages"], dp.batch["returns"] = adv * keep, ret * keep
            out = ["advantages", "returns"] + (["token_level_rewards"] if alg.use_kl_in_reward else [])
            if correction:
                out += ["response_mask"] + (["rollout_is_weights"] if "rollout_is_weights" in dp.batch else [])
            td = TensorDict({f: response_to_nested(dp.batch[f], rmask_nested) for f in out}, batch_size=len(batch))
            return tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=td)

        def _compute_advantage(self, batch: Any, metrics: dict) -> Any:
            if self.config.algorithm.adv_estimator == "gigpo":
                batch = self._gigpo_advantage(batch, metrics)
            else:
                batch = super()._compute_advantage(batch, metrics)
            fields = ["prompts", "responses", "response_mask", "advantages", "old_log_probs", "entropy"]
            data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
            rmask_nested = data["response_mask"]
            prompts, responses = list(data["prompts"].unbind()), list(data["responses"].unbind())
            # 1. teacher pass on privileged rows under their own keys
            t_keys = [f"{k}__icsd_teacher" for k in batch.keys]
            rows = logprob_rows(privileged_prompts(prompts, self.tokenizer, self._icsd_bank, mode=self.icsd.skill_mode),
                                responses, list(rmask_nested.unbind()))
            t_meta = tq.kv_batch_put(keys=t_keys, partition_id=batch.partition_id, fields=rows)
            t_meta.extra_info.update({"calculate_entropy": False, "compute_loss": False,
                                      "temperature": self.config.actor_rollout_ref.rollout.temperature})
            self.actor_rollout_wg.compute_log_prob(t_meta)
            t_out = tq.kv_batch_get(keys=t_keys, partition_id=batch.partition_id, select_fields=["log_probs"])
            teacher_nested = response_from_nested(t_out["log_probs"], rmask_nested)
            tq.kv_clear(keys=t_keys, partition_id=batch.partition_id)
            # 2. allocation per global actor mini-batch (or, micro-batch scope, the turn offsets and step the
            #    worker loss needs to allocate each micro-batch itself)
            ent = {"entropy": data["entropy"]} if "entropy" in data.keys() else {}  # verl's old-log-prob pass
            padded = TensorDict({"advantages": data["advantages"], "old_log_probs": data["old_log_probs"],
                                 "response_mask": rmask_nested, "teacher": teacher_nested, **ent},
                                batch_size=[len(batch.keys)]).to_padded_tensor()
            traj, turn = trajectory_turns(batch.keys, padded["response_mask"])
            fields = {TEACHER_KEY: teacher_nested}
            if self.icsd.alloc_scope == "micro-batch":
                n = len(batch.keys)
                fields[TURN_OFFSET_KEY] = Sessions.from_keys(batch.keys).turn_offsets(padded["response_mask"].bool())
                fields[STEP_KEY] = torch.full((n,), int(self.global_steps), dtype=torch.long)
            else:
                actor = self.config.actor_rollout_ref.actor
                sp = int(actor.get("ulysses_sequence_parallel_size", 1) or 1)  # ranks sharing one data shard
                mb = v1_mini_batch_ids(len(batch.keys), mini_batch_size=actor.ppo_mini_batch_size *
                                       self.config.actor_rollout_ref.rollout.n,
                                       dp_size=self.actor_rollout_wg.world_size // sp)
                c, m = allocate_mini_batches(advantage=padded["advantages"], old_log_probs=padded["old_log_probs"],
                                             teacher_log_probs=padded["teacher"], response_mask=padded["response_mask"],
                                             traj_id=traj, turn_id=turn, mini_batch=mb, step=self.global_steps,
                                             cfg=self.icsd, writer=self._icsd_writer,
                                             traj_names=TrajNames("key", list(batch.keys)),
                                             entropy=padded.get("entropy", None))
                metrics.update(m)
                fields[C_KEY] = response_to_nested(c, rmask_nested)
            out = TensorDict(fields, batch_size=[len(batch.keys)])
            return tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=out)

    return ICSDTrainerSync
