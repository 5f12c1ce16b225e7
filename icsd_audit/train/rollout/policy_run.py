"""``icsd train --policy expert``: the training loop's rollouts and advantages, without a gradient.

Each step runs the rollout phase of :func:`icsd_audit.train.loop.train` (the step's tasks
from the same (seed, step) draw, ``group_size`` episodes each, the same prompt builder,
reply parser, validity rule, reward shaping) with replies from a :class:`TurnPolicy`
other than the model (the environment's expert, or a script), then the advantage
estimator with the invalid-turn penalty, and logs what the loop logs for these phases.
Nothing is trained: no teacher, reference or actor pass, no dumps, no checkpoint. The
run folder follows the training loop's rules (one run per folder, locked while written).

The run folder gets ``config.json``, ``metrics.jsonl`` (one record per step: ``rollout/*``
and the estimator's metrics, as the loop writes them), ``eval.jsonl`` (with
``eval_every``) and ``turns.jsonl``: one line per turn with the student prompt the
policy answered (as the trainer renders it), the reply, the parsed action, whether the
turn is valid, its step reward, the row score the estimator normalised
(``episode return - invalid_penalty`` on an invalid turn) and its advantage. Those lines
are the warm-start data: (prompt, expert reply) pairs in the trainer's own format.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from icsd_audit.envs import TextEnv
from icsd_audit.train.config import TrainConfig

__all__ = ["PlayResult", "play"]


@dataclass
class PlayResult:
    out_dir: Path
    metrics_path: Path
    turns_path: Path
    records: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)


def _write_lines(path: Path, records: list[dict[str, Any]]) -> None:
    with path.open("a") as fh:
        fh.writelines(json.dumps(r, sort_keys=True) + "\n" for r in records)


def play(cfg: TrainConfig, *, policy: Any = None, env_factory: Callable[[str], TextEnv] | None = None,
         reporter: Any = None, overwrite: bool = False) -> PlayResult:
    """Run ``cfg.total_steps`` rollout steps with ``policy`` (default: the expert) and log them.

    The run folder follows the training loop's rules (:mod:`.rundir`): a folder holding
    another run is refused unless ``overwrite`` (which moves it aside), and it is locked
    while the steps are written.
    """
    from icsd_audit.outputs import check_not_input
    from icsd_audit.train.run.folder import check_run_folder, open_run_folder

    cfg.validate_training()
    check_not_input(cfg.out_dir, cfg.input_paths(), option="--out")
    check_run_folder(cfg.out_dir, resume=False, overwrite=overwrite)
    with open_run_folder(cfg.out_dir, resume=False, overwrite=overwrite):
        return _play(cfg, policy=policy, env_factory=env_factory, reporter=reporter)


def _play(cfg: TrainConfig, *, policy: Any, env_factory: Callable[[str], TextEnv] | None, reporter: Any) -> PlayResult:
    from icsd_audit.train.update.advantages import get_estimator
    from icsd_audit.train.eval import evaluate
    from icsd_audit.train.loop import ADV_OPTIONS, draw_tasks, seed_step
    from icsd_audit.train.setup import env_factory as make_env_factory
    from icsd_audit.train.run.metrics import MetricsLog, NullReporter
    from icsd_audit.train.rollout.policy import ExpertPolicy, policy_tokenizer
    from icsd_audit.train.rollout.collect import PromptBuilder, RolloutSettings, collect_rollouts

    reporter = reporter or NullReporter()
    out = Path(cfg.out_dir)
    tokenizer = policy_tokenizer(cfg.model, seed=cfg.seed, trust_remote_code=cfg.trust_remote_code)
    policy = policy if policy is not None else ExpertPolicy(tokenizer)
    builder = PromptBuilder.from_config(tokenizer, cfg)
    factory = env_factory or make_env_factory(cfg)
    envs = [factory(cfg.train_split) for _ in range(cfg.n_tasks * cfg.group_size)]
    settings = RolloutSettings(max_turns=cfg.max_turns, max_response_tokens=cfg.max_response_tokens,
                               temperature=cfg.temperature, batch_rows=cfg.rollout_batch_rows,
                               require_think=cfg.require_think, reward=cfg.reward, record_logp=False,
                               invalid_rule=cfg.invalid_rule)
    estimator, adv_options = get_estimator(cfg.adv_estimator), ADV_OPTIONS[cfg.adv_estimator](cfg)
    cfg.save(out / "config.json")
    log, eval_log = MetricsLog(out / "metrics.jsonl"), MetricsLog(out / "eval.jsonl")
    turns_path = out / "turns.jsonl"
    turns_path.write_text("")
    result = PlayResult(out_dir=out, metrics_path=log.path, turns_path=turns_path)
    reporter.start(total_steps=cfg.total_steps, start_step=0, out_dir=str(out))
    for step in range(cfg.total_steps):
        t0 = time.perf_counter()
        seed_step(cfg.seed, step)
        tasks = draw_tasks(cfg.seed, step, envs[0].num_tasks, cfg.n_tasks)
        reporter.phase(step, "rollout")
        batch = collect_rollouts(model=None, tokenizer=tokenizer, builder=builder, envs=envs, tasks=tasks,
                                 group_size=cfg.group_size, settings=settings, device=None, policy=policy)
        adv = estimator(batch.turn_records(), **adv_options)
        returns = {t.traj: t.ret for t in batch.trajectories}
        _write_lines(turns_path, [{
            "step": step, "task": r.task, "group": r.slot, "traj": r.traj, "rollout": r.rollout, "turn": r.turn,
            "prompt": builder.student_text(r.ctx), "reply": r.response_text, "action": r.action,
            "valid": r.action_valid, "reward": r.reward,
            "row_score": returns[r.traj] - (0.0 if r.action_valid else cfg.invalid_penalty),
            "advantage": float(a)} for r, a in zip(batch.rows, adv.advantages.tolist())])
        record: dict[str, Any] = {"step": step, "policy": getattr(policy, "name", "policy")}
        record.update({f"rollout/{k}": v for k, v in batch.metrics().items()})
        record.update(adv.metrics())
        record["time/rollout"] = record["time/step"] = time.perf_counter() - t0
        last = step == cfg.total_steps - 1
        if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or last):
            ev = evaluate(model=None, tokenizer=tokenizer, builder=builder, make_env=lambda: factory(cfg.eval_split),
                          n_tasks=cfg.eval_tasks, max_turns=cfg.max_turns, max_response_tokens=cfg.max_response_tokens,
                          temperature=cfg.eval_temperature, require_think=cfg.require_think,
                          batch_rows=cfg.rollout_batch_rows, device=None, seed=cfg.seed, split=cfg.eval_split,
                          invalid_rule=cfg.invalid_rule, policy=policy).to_dict()
            ev["step"] = step
            eval_log.write(ev)
            result.evals.append(ev)
            record.update({f"eval/{k}": v for k, v in ev.items() if k not in ("step", "split", "subsets", "subset_tasks")})
        log.write(record)
        result.records.append(record)
        reporter.step_done(step, record)
    reporter.finish()
    return result
