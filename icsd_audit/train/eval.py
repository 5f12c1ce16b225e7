"""Evaluation on held-out instructions: WebShop score and success rate, Search-QA EM per subset.

The first ``n_tasks`` instructions of the held-out split (the same ones every time, so
numbers are comparable across checkpoints and runs), one rollout each, sampled at
``temperature`` (0: greedy) with a fixed seed. Reported: success rate (share of
episodes won, i.e. WebShop reward 1), mean WebShop score (the continuous purchase
reward, 0 when nothing was bought), invalid-action rate and mean episode length. For an
environment that groups its tasks (``task_group``; Search-QA's subsets) also the success
per group under the paper's column names and their mean (:func:`group_success`); on
Search-QA success is exact match.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from icsd_audit.envs import TextEnv
from icsd_audit.train.rollout.collect import PromptBuilder, RolloutSettings, collect_rollouts

__all__ = ["EvalResult", "evaluate", "evaluate_config", "group_success", "group_counts"]


@dataclass
class EvalResult:
    split: str
    n_tasks: int
    success: float
    score: float
    invalid_rate: float
    turns: float
    seconds: float
    #: Success per task group, keyed by the paper's column names, plus their unweighted mean
    #: ``Avg`` (Search-QA: exact match per subset, NQ ... Bam); empty for envs without groups.
    subsets: dict[str, float] = field(default_factory=dict)
    #: Episodes behind each entry of ``subsets``.
    subset_tasks: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["subsets"] = dict(self.subsets)
        d["subset_tasks"] = dict(self.subset_tasks)
        return d


def evaluate(*, model: Any, tokenizer: Any, builder: PromptBuilder, make_env: Callable[[], TextEnv], n_tasks: int,
             max_turns: int, max_response_tokens: int, temperature: float, require_think: bool, batch_rows: int,
             device: torch.device, seed: int = 0, split: str = "eval", precision: str = "float32",
             invalid_rule: str = "format", policy: Any = None) -> EvalResult:
    """Roll the policy out once on each of the first ``n_tasks`` held-out instructions.

    ``policy``: who writes the replies (:mod:`icsd_audit.train.rollout.policy`); None: ``model`` samples them.
    """
    t0 = time.perf_counter()
    probe = make_env()
    n = min(int(n_tasks), int(probe.num_tasks))
    envs: list[TextEnv] = [probe] + [make_env() for _ in range(n - 1)]
    settings = RolloutSettings(max_turns=max_turns, max_response_tokens=max_response_tokens, temperature=temperature,
                               batch_rows=batch_rows, require_think=require_think, reward="score", record_logp=False,
                               precision=precision, invalid_rule=invalid_rule)
    was_training = model.training if model is not None else False
    if model is not None:
        model.eval()
    with torch.random.fork_rng(devices=[device] if device is not None and device.type == "cuda" else []):
        torch.manual_seed(seed)
        batch = collect_rollouts(model=model, tokenizer=tokenizer, builder=builder, envs=envs, tasks=list(range(n)),
                                 group_size=1, settings=settings, device=device, policy=policy)
    if model is not None:
        model.train(was_training)
    m = batch.metrics()
    return EvalResult(split=split, n_tasks=n, success=m["success"], score=m["score"], invalid_rate=m["invalid_rate"],
                      turns=m["turns"], seconds=time.perf_counter() - t0, subsets=group_success(probe, batch),
                      subset_tasks=group_counts(probe, batch))


def evaluate_config(cfg: Any) -> EvalResult:
    """``icsd eval``: a :class:`~icsd_audit.train.config.fields.TrainConfig`'s policy on its held-out tasks.

    The policy is ``cfg.model`` (sampled at ``eval_temperature``) or, with
    ``cfg.policy == "expert"``, each environment's expert (no weights loaded: only the
    model's tokenizer, for the prompts). Prompts, chat-template switches
    (``enable_thinking``), validity rule and rewards are the config's; with
    ``student_skills`` 'eval' or 'both' the student's prompt holds the retrieved skill
    (the Skill-Prompt* baseline), placed as ``skill_placement`` says.
    """
    from icsd_audit.train.setup import env_factory as make_env_factory
    from icsd_audit.train.models.loading import load_policy, resolve_precision
    from icsd_audit.train.models.loading import resolve_device, set_threads
    from icsd_audit.train.rollout.policy import ExpertPolicy, policy_tokenizer

    cfg.validate()
    set_threads(cfg.threads)
    dev = resolve_device(cfg.device)
    if cfg.policy == "expert":
        model, tok = None, policy_tokenizer(cfg.model, seed=cfg.seed, trust_remote_code=cfg.trust_remote_code)
        policy: Any = ExpertPolicy(tok)
    else:
        init = cfg.init_path
        if init is not None:  # an adapter over its base (icsd eval --adapter), or a full model folder
            from icsd_audit.train.models.lora import is_adapter_dir, load_adapter

            model, tok = load_policy(cfg.model if is_adapter_dir(init) else init, device=dev, seed=cfg.seed,
                                     trust_remote_code=cfg.trust_remote_code)
            if is_adapter_dir(init):
                model = load_adapter(model, init, trainable=False).eval()
        else:
            model, tok = load_policy(cfg.model, device=dev, seed=cfg.seed, trust_remote_code=cfg.trust_remote_code)
        policy = None
    skill = None
    if cfg.student_skills in ("eval", "both"):
        from icsd_audit.train.teacher.skills import load_skillbank
        from icsd_audit.train.teacher.self_teacher import skill_retriever

        skill = skill_retriever(load_skillbank(cfg.skillbank_name), skill_mode=cfg.skill_mode,
                                skill_match=cfg.skill_match)
    builder = PromptBuilder.from_config(tok, cfg, student_skill=skill)
    factory = make_env_factory(cfg)
    return evaluate(model=model, tokenizer=tok, builder=builder, make_env=lambda: factory(cfg.eval_split),
                    n_tasks=cfg.eval_tasks, max_turns=cfg.max_turns, max_response_tokens=cfg.max_response_tokens,
                    temperature=cfg.eval_temperature, require_think=cfg.require_think,
                    batch_rows=cfg.rollout_batch_rows, device=dev, seed=cfg.seed, split=cfg.eval_split,
                    precision=resolve_precision(cfg.precision, dev), invalid_rule=cfg.invalid_rule, policy=policy)


def group_success(env: TextEnv, batch: Any) -> dict[str, float]:
    """Share of won episodes per ``env.task_group(task)`` and their unweighted mean ``Avg``.

    The paper's Search-QA ``Avg`` is the plain mean of the seven subset EMs (e.g. GRPO,
    Qwen2.5-1.5B: (16.6 + 34.1 + 15.9 + 16.1 + 24.8 + 3.4 + 58.1) / 7 = 24.1).
    An env with ``group_average = "episodes"`` (ALFWorld) gets ``Avg`` = wins / episodes
    instead, as Table 1's ALFWorld Avg is (GRPO, 1.5B: 84 / 128 = 65.6, while the mean of
    its six columns is 61.9); ``task_groups`` (a tuple of names) orders the columns.
    """
    won = _won_by_group(env, batch)
    if not won:
        return {}
    out = {g: sum(v) / len(v) for g, v in won.items()}
    if getattr(env, "group_average", "groups") == "episodes":
        out["Avg"] = sum(sum(v) for v in won.values()) / sum(len(v) for v in won.values())
    else:
        out["Avg"] = sum(out.values()) / len(out)
    return out


def group_counts(env: TextEnv, batch: Any) -> dict[str, int]:
    """Episodes per group (and in all, ``Avg``), in :func:`group_success`'s order."""
    won = _won_by_group(env, batch)
    out = {g: len(v) for g, v in won.items()}
    if out:
        out["Avg"] = sum(out.values())
    return out


def _won_by_group(env: TextEnv, batch: Any) -> dict[str, list[bool]]:
    group_of = getattr(env, "task_group", None)
    if group_of is None or not batch.trajectories:
        return {}
    won: dict[str, list[bool]] = {g: [] for g in getattr(env, "task_groups", ())}
    for t in sorted(batch.trajectories, key=lambda t: t.traj):
        won.setdefault(group_of(t.task), []).append(bool(t.won))
    return {g: v for g, v in won.items() if v}
