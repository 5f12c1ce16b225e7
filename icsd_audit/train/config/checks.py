"""The training configuration's checks: every problem at once, each saying how to fix it.

Functions of the config object (a :class:`~icsd_audit.train.config.fields.TrainConfig`, which calls them from
``validate``), so that the fields read apart from the rules that tie them. The allocator's own settings are checked
by :class:`~icsd_audit.alloc.settings.AllocatorSettings`, the one place that validates them.
"""

from __future__ import annotations

import math
import re
from dataclasses import fields
from pathlib import Path
from typing import Any

from icsd_audit.alloc.settings import AllocatorSettings
from icsd_audit.threads import MAX_THREADS
from icsd_audit.train.config.errors import NO_ALLOCATOR, ConfigError
from icsd_audit.train.config.warmstarts import MODEL_ALIASES, resolve_init

__all__ = ["config_problems", "training_problems", "type_problems", "hybrid_problems", "init_problems",
           "searchqa_problems", "allocation_problems", "config_names", "REWARDS", "INVALID_RULE_NAMES",
           "PRECISIONS", "SEED_MAX", "ONE_SHOT_ENVS"]

#: Reward shaping names (see ``TrainConfig.reward``).
REWARDS = ("won10", "score")
#: Invalid-turn rules (see ``TrainConfig.invalid_rule`` and icsd_audit.train.rollout.collect.INVALID_RULES).
INVALID_RULE_NAMES = ("format", "admissible")
PRECISIONS = ("auto", "float32", "bf16-mixed")
#: the largest seed: every generator a seed reaches (NumPy's legacy seeding among them) takes 0..2**32 - 1
SEED_MAX = 2**32 - 1
#: environments whose prompts carry a one-shot example
ONE_SHOT_ENVS = ("webshop", "searchqa", "alfworld")


class _Unchecked:
    """Settings values read by ``AllocatorSettings.problems`` without building the (validating) object."""

    def __init__(self, values: dict[str, Any]):
        self.__dict__.update(values)


def config_names(problem: str, names: dict[str, str]) -> str:
    """An allocator-settings problem with the config's field names (``eps`` -> ``alloc_eps``)."""
    m = re.match(r"unknown (allocator|trust) '(.*)'; valid: (.*)$", problem)
    if m:  # the config's field = value first, as every other problem reads
        kind, value, valid = m.groups()
        extra = "none (no distillation), " if kind == "allocator" else ""
        return f"{kind}={value!r}: choose one of {extra}{valid}"
    head, sep, rest = problem.partition(" ")
    return f"{names.get(head, head)}{sep}{rest}"


def allocation_problems(cfg: Any) -> list[str]:
    """The allocator settings' problems, named as the config names its fields (``eps`` -> ``alloc_eps``)."""
    values = {dst: getattr(cfg, src) for src, dst in cfg.ALLOCATION_FIELDS.items()}
    if values["allocator"] == NO_ALLOCATOR:
        values["allocator"] = "sdar"  # 'none' is the trainer's; the allocator's other settings are still checked
    names = {dst: src for src, dst in cfg.ALLOCATION_FIELDS.items()}
    return [config_names(q, names) for q in AllocatorSettings.problems(_Unchecked(values))]


def config_problems(cfg: Any, *, env_here: bool = True) -> list[str]:
    """Every problem of the training config ``cfg`` (a :class:`~icsd_audit.train.config.fields.TrainConfig`),
    each with its fix; an empty list when it is fine.

    ``env_here=False`` skips the checks that the environment's engine is installed on this
    machine (``icsd train --engine verl --dry-run`` writes files for another machine).
    """
    p = type_problems(cfg)
    if p:  # the checks below compare values; with a wrong type they would fail with a traceback instead
        return p

    def need(cond: bool, msg: str) -> None:
        if not cond:
            p.append(msg)

    for f in fields(cfg):
        v = getattr(cfg, f.name)
        need(not isinstance(v, float) or math.isfinite(v), f"{f.name}={v!r} must be a finite number")
    for name in ("seed", "alloc_seed", "sketch_seed"):
        v = getattr(cfg, name)
        need(0 <= v <= SEED_MAX, f"{name}={v!r} must be an integer in 0..{SEED_MAX}")

    for name in ("total_steps", "max_turns", "n_tasks", "group_size", "max_prompt_tokens", "max_response_tokens",
                 "rollout_batch_rows", "ppo_epochs", "mini_batch_rows", "micro_batch_rows", "min_group"):
        v = getattr(cfg, name)
        need(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"{name}={v!r} must be an integer >= 1")
    for name in ("dump_every", "checkpoint_every", "eval_every", "history_window", "sketch_k"):
        v = getattr(cfg, name)
        need(isinstance(v, int) and v >= 0, f"{name}={v!r} must be an integer >= 0 (0 turns it off)")
    need(isinstance(cfg.lora_rank, int) and not isinstance(cfg.lora_rank, bool) and cfg.lora_rank >= 0,
         f"lora_rank={cfg.lora_rank!r} must be an integer >= 0 (0: full fine-tuning)")
    need(cfg.lora_alpha is None or cfg.lora_alpha > 0, f"lora_alpha={cfg.lora_alpha} must be > 0 (or None: 2 * rank)")
    need(bool(cfg.lora_targets.strip(" ,")),
         f"lora_targets={cfg.lora_targets!r} names no module; use 'all-linear' or e.g. 'q_proj,v_proj'")
    p.extend(init_problems(cfg))
    need(cfg.keep_checkpoints >= 1, f"keep_checkpoints={cfg.keep_checkpoints} must be >= 1")
    need(cfg.eval_tasks >= 1, f"eval_tasks={cfg.eval_tasks} must be >= 1")
    need(cfg.threads is None or 1 <= cfg.threads <= MAX_THREADS,
         f"threads={cfg.threads} must lie in 1..{MAX_THREADS} or be None")
    need(cfg.group_size >= 2 or cfg.adv_estimator not in ("grpo", "gigpo"),
         f"group_size={cfg.group_size}: group-relative advantages need at least 2 rollouts per task; set group_size >= 2")
    need(cfg.temperature > 0, f"temperature={cfg.temperature} must be > 0 for training (sampling); use e.g. 1.0")
    need(cfg.eval_temperature >= 0, f"eval_temperature={cfg.eval_temperature} must be >= 0 (0 = greedy)")
    need(cfg.lr > 0, f"lr={cfg.lr} must be > 0")
    need(0 <= cfg.lr_warmup_steps_ratio <= 1,
         f"lr_warmup_steps_ratio={cfg.lr_warmup_steps_ratio} must lie in [0, 1] (SDAR's search scripts: 0.1)")
    need(cfg.weight_decay >= 0, f"weight_decay={cfg.weight_decay} must be >= 0")
    need(cfg.grad_clip > 0, f"grad_clip={cfg.grad_clip} must be > 0")
    need(0 < cfg.clip_ratio < 1, f"clip_ratio={cfg.clip_ratio} must lie in (0, 1); the paper uses 0.2")
    need(cfg.dual_clip > 1, f"dual_clip={cfg.dual_clip} must be > 1 (verl requires clip_ratio_c > 1); the paper uses 3")
    need(cfg.kl_coef >= 0, f"kl_coef={cfg.kl_coef} must be >= 0 (0 skips the reference pass)")
    need(cfg.distill_coef >= 0, f"distill_coef={cfg.distill_coef} must be >= 0")
    need(cfg.invalid_penalty >= 0, f"invalid_penalty={cfg.invalid_penalty} must be >= 0")
    need(0 <= cfg.gamma <= 1, f"gamma={cfg.gamma} must lie in [0, 1]")
    p.extend(allocation_problems(cfg))
    need(cfg.invalid_rule in INVALID_RULE_NAMES,
         f"invalid_rule={cfg.invalid_rule!r}: choose one of {list(INVALID_RULE_NAMES)}")
    need(cfg.reward in REWARDS, f"reward={cfg.reward!r}: choose one of {list(REWARDS)}")
    need(cfg.precision in PRECISIONS, f"precision={cfg.precision!r}: choose one of {list(PRECISIONS)}")
    need(cfg.adv_estimator in ("grpo", "gigpo"), f"adv_estimator={cfg.adv_estimator!r}: choose 'grpo' or 'gigpo'")
    need(cfg.gigpo_mode in ("mean_norm", "mean_std_norm"),
         f"gigpo_mode={cfg.gigpo_mode!r}: choose 'mean_norm' or 'mean_std_norm'")
    need(cfg.skill_mode in ("match", "all", "general"), f"skill_mode={cfg.skill_mode!r}: choose match, all or general")
    need(cfg.skill_bank_mode in ("task", "general"),
         f"skill_bank_mode={cfg.skill_bank_mode!r}: choose 'task' (task-specific skills) or 'general' (SDAR's first release)")
    need(cfg.skill_match in ("sdar", "instruction"),
         f"skill_match={cfg.skill_match!r}: choose 'sdar' (SDAR's rule) or 'instruction'")
    need(cfg.student_skills in ("off", "train", "eval", "both"),
         f"student_skills={cfg.student_skills!r}: choose off, train, eval or both")
    need(cfg.student_skills in ("off", "eval") or not cfg.teacher_enabled,
         f"student_skills={cfg.student_skills!r} with allocator={cfg.allocator!r}, hybrid={cfg.hybrid!r} would "
         "show the teacher's skill to the student as well; use allocator='none' and hybrid='none' (Skill-GRPO) "
         "or student_skills='off'")
    p.extend(hybrid_problems(cfg))
    need(cfg.pg_coef >= 0, f"pg_coef={cfg.pg_coef} must be >= 0 (0: no RL loss)")
    need(cfg.pg_coef > 0 or cfg.distill_enabled,
         "pg_coef=0 with allocator='none' leaves no loss at all; pick allocator='opsd' for stand-alone OPSD")
    need(cfg.skill_placement in ("prefix", "user"), f"skill_placement={cfg.skill_placement!r}: choose 'prefix' (SDAR) or 'user'")
    need(isinstance(cfg.sketch_seed, int) and not isinstance(cfg.sketch_seed, bool),
         f"sketch_seed={cfg.sketch_seed!r} must be an integer")
    need(bool(cfg.sketch_layers.strip(" ,")),
         f"sketch_layers={cfg.sketch_layers!r} names no layer; use 'auto' or comma-separated module names")
    if isinstance(cfg.sketch_k, int) and cfg.sketch_k > 0:
        need(cfg.distill_enabled and cfg.dump_every > 0,
             f"sketch_k={cfg.sketch_k} but this run writes no dumps (allocator={cfg.allocator!r}, "
             f"dump_every={cfg.dump_every}); pick an allocator other than 'none' and dump_every >= 1, or set sketch_k=0")
    need(cfg.alloc_scope in ("mini-batch", "micro-batch"),
         f"alloc_scope={cfg.alloc_scope!r}: choose 'mini-batch' or 'micro-batch'")
    need(cfg.micro_batch_rows <= cfg.mini_batch_rows,
         f"micro_batch_rows={cfg.micro_batch_rows} exceeds mini_batch_rows={cfg.mini_batch_rows}; lower micro_batch_rows")
    from icsd_audit.envs import ENV_NAMES

    need(cfg.env in ENV_NAMES, f"env={cfg.env!r}: available environments are {list(ENV_NAMES)}")
    if cfg.env == "alfworld":
        from icsd_audit.envs.alfworld.engine import ENGINE_HINT, engine_available

        need(engine_available() or not env_here, ENGINE_HINT)
        need(not cfg.env_url, f"env_url={cfg.env_url!r}: ALFWorld runs in-process; unset env_url")
    if cfg.env == "webshop" and cfg.env_url:
        need(cfg.server_num_goals is None or cfg.server_num_goals > 500,
             f"server_num_goals={cfg.server_num_goals} must exceed the 500 held-out goals")
    need(cfg.alfworld_data is None or cfg.env == "alfworld",
         f"alfworld_data is set but env={cfg.env!r}; use --env alfworld or drop alfworld_data")
    if cfg.alfworld_data is not None:
        need(Path(cfg.alfworld_data).expanduser().is_dir(),
             f"alfworld_data={cfg.alfworld_data!r} is not a folder; point it at the folder holding json_2.1.1/")
    need(not cfg.one_shot or cfg.env in ONE_SHOT_ENVS,
         f"one_shot=True has no worked example for env {cfg.env!r}; set one_shot=False")
    if not (cfg.model in MODEL_ALIASES or Path(cfg.model).expanduser().is_dir()):
        p.append(f"model={cfg.model!r} is neither 'embedded', 'tiny-random' nor a local folder; "
                 "download the model (e.g. `huggingface-cli download ORG/NAME --local-dir DIR`) and pass DIR")
    need(cfg.policy in ("model", "expert"), f"policy={cfg.policy!r}: choose 'model' or 'expert'")
    p.extend(searchqa_problems(cfg))
    try:
        from icsd_audit.runs.trackers import parse_report_to

        parse_report_to(cfg.report_to)
    except ValueError as exc:
        p.append(f"report_to={cfg.report_to!r}: {exc}")
    return p


def hybrid_problems(cfg: Any) -> list[str]:
    from icsd_audit.train.update.hybrid import hybrid_names

    if cfg.hybrid not in hybrid_names():
        return [f"hybrid={cfg.hybrid!r}: choose one of {hybrid_names()}"]
    p = []
    if not 0 <= cfg.rlsd_lambda <= 1:
        p.append(f"rlsd_lambda={cfg.rlsd_lambda} must lie in [0, 1] (SDAR's scripts: 0.5)")
    if cfg.rlsd_warmdown_steps < 1:
        p.append(f"rlsd_warmdown_steps={cfg.rlsd_warmdown_steps} must be >= 1 (SDAR's scripts: 100)")
    if not 0 < cfg.rlsd_clip_eps < 1:
        p.append(f"rlsd_clip_eps={cfg.rlsd_clip_eps} must lie in (0, 1) (SDAR's scripts: 0.2)")
    if cfg.sdl_coef < 0:
        p.append(f"sdl_coef={cfg.sdl_coef} must be >= 0 (SDAR's scripts: 0.001)")
    if cfg.hybrid != "none":
        if cfg.distill_enabled:
            p.append(f"hybrid={cfg.hybrid!r} uses the teacher without an allocated distillation term (SDAR's "
                     f"{cfg.hybrid} trainer has none), so allocator={cfg.allocator!r} cannot join it; add "
                     "--allocator none")
        if cfg.teacher_rescore:
            p.append(f"teacher_rescore=True re-scores the teacher for an allocation; hybrid={cfg.hybrid!r} uses "
                     "the step's teacher, as SDAR does: set teacher_rescore=False")
    return p

def type_problems(cfg: Any) -> list[str]:
    """Each field whose value does not have its declared type (int, float, bool, str, or None where allowed)."""
    kinds = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,)}
    p = []
    for f in fields(cfg):
        v = getattr(cfg, f.name)
        parts = [t.strip() for t in str(f.type).split("|")]
        if v is None and "None" in parts:
            continue
        allowed = tuple(c for t in parts for c in kinds.get(t, ()))
        if allowed and (not isinstance(v, allowed) or (isinstance(v, bool) and bool not in allowed)):
            p.append(f"{f.name}={v!r} must be {' or '.join(parts)}, not {type(v).__name__}")
    return p


def init_problems(cfg: Any) -> list[str]:
    if cfg.init is None:
        return []
    from icsd_audit.train.models.lora import AdapterError, adapter_settings, is_adapter_dir, is_model_dir

    try:
        d = Path(str(resolve_init(cfg.init))).expanduser()
    except ConfigError as e:
        return e.problems
    if is_adapter_dir(d):
        try:
            rank = adapter_settings(d).rank
        except AdapterError as e:
            return [f"init={cfg.init!r}: {e}"]
        if cfg.lora_rank not in (0, rank):
            return [f"init={cfg.init!r} is a rank-{rank} adapter, which training continues; drop lora_rank="
                    f"{cfg.lora_rank} or set it to {rank}"]
        return []
    if is_model_dir(d):
        return []
    return [f"init={cfg.init!r} is neither a LoRA adapter folder (adapter_config.json) nor a model folder "
            "(config.json); pass a folder written by icsd train, icsd sft or save_pretrained"]

def searchqa_problems(cfg: Any) -> list[str]:
    p = []
    named = [k for k in ("searchqa_corpus", "searchqa_data", "retriever_url") if getattr(cfg, k)]
    if named and cfg.env != "searchqa":
        p.append(f"{', '.join(named)} only apply to env='searchqa' (env={cfg.env!r}); unset them or set env=searchqa")
    if cfg.searchqa_protocol not in ("search-r1", "verl-agent"):
        p.append(f"searchqa_protocol={cfg.searchqa_protocol!r}: choose 'search-r1' or 'verl-agent'")
    if cfg.searchqa_expert not in ("gold", "retrieval"):
        p.append(f"searchqa_expert={cfg.searchqa_expert!r}: choose 'gold' (oracle answer) or 'retrieval' "
                 "(answers only from retrieved passages)")
    if not (isinstance(cfg.retrieval_topk, int) and cfg.retrieval_topk >= 1):
        p.append(f"retrieval_topk={cfg.retrieval_topk!r} must be an integer >= 1 (Search-R1 uses 3)")
    files = [cfg.searchqa_corpus] if cfg.searchqa_corpus else []
    files += [f.strip() for f in (cfg.searchqa_data or "").split(",") if f.strip()]
    p.extend(f"Search-QA file {f} not found; check the path in searchqa_corpus / searchqa_data"
             for f in files if not Path(f).expanduser().is_file())
    if cfg.searchqa_corpus and cfg.retriever_url:
        p.append(f"searchqa_corpus={cfg.searchqa_corpus!r} and retriever_url={cfg.retriever_url!r} contradict each "
                 "other: the server would be searched and the corpus ignored; set only one")
    if cfg.searchqa_data and not (cfg.searchqa_corpus or cfg.retriever_url or cfg.env_url):
        p.append("searchqa_data is set but nothing to search: set searchqa_corpus=corpus.jsonl or "
                 "retriever_url=http://host:port")
    return p


def training_problems(cfg: Any) -> list[str]:
    """What only training (rollouts on the train split) needs beyond :func:`config_problems`; before any model loads."""
    if cfg.env == "webshop" and cfg.env_url and cfg.train_split == "train" and cfg.server_num_goals is None:
        return [
            "env_url is set but server_num_goals is not: training on a WebShop server's train split (goals 500..N-1, "
            "as verl-agent splits them) needs N, the number of goals the server loaded ('Loaded N goals.' in its "
            "start-up log); add --set server_num_goals=N"]
    return []
