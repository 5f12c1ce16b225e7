"""The clue environment in the trainer: its expert through the referee, the teacher's clue, a short GRPO run that learns."""

from __future__ import annotations

import json

import pytest

from icsd_audit.envs import make_env
from icsd_audit.train.config import ConfigError, TrainConfig, from_preset
from icsd_audit.train.rollout.policy import ExpertPolicy, ScriptedPolicy, policy_tokenizer
from icsd_audit.train.rollout.collect import PromptBuilder, RolloutSettings, collect_rollouts
from icsd_audit.train.teacher.self_teacher import SelfTeacher

TOK = policy_tokenizer("tiny-word")


def _settings(max_turns: int) -> RolloutSettings:
    return RolloutSettings(max_turns=max_turns, max_response_tokens=2, temperature=1.0, batch_rows=16,
                           require_think=False, reward="score", record_logp=False)


def _builder() -> PromptBuilder:
    return PromptBuilder(TOK, env="clue", history_window=4, max_prompt_tokens=64)


def _envs(n: int, **kw) -> list:
    return [make_env("clue", split="eval", **kw) for _ in range(n)]


def test_the_expert_through_the_referee_is_valid_and_wins_every_task():
    batch = collect_rollouts(model=None, tokenizer=TOK, builder=_builder(), envs=_envs(24, boxes=8, max_steps=4),
                             tasks=list(range(24)), group_size=1, settings=_settings(4), device=None,
                             policy=ExpertPolicy(TOK))
    assert all(r.action_valid for r in batch.rows) and all(t.won for t in batch.trajectories)
    # bisection over 8 boxes: 1 turn when the key is in box 4, at most 4 turns otherwise
    tasks = make_env("clue", split="eval", boxes=8).tasks
    for tr in batch.trajectories:
        expected = {4: 1, 2: 2, 6: 2, 1: 3, 3: 3, 5: 3, 7: 3, 8: 4}[tasks[tr.task].target]
        assert tr.n_turns == expected, (tasks[tr.task], tr.n_turns)
    assert batch.metrics()["invalid_rate"] == 0.0 and batch.metrics()["success"] == 1.0


def test_malformed_replies_are_penalised_by_the_referee_and_only_them():
    replies = ["open 4", "open", "open 9", "", "4", "open 2 open", "OPEN 1"]
    batch = collect_rollouts(model=None, tokenizer=TOK, builder=_builder(), envs=_envs(len(replies)), tasks=[0],
                             group_size=len(replies), settings=_settings(1), device=None,
                             policy=ScriptedPolicy(TOK, lambda t: replies[t.episode]))
    assert [r.action_valid for r in batch.rows] == [True, False, False, False, False, False, True]
    assert [r.anchor for r in batch.rows][0] == [r.anchor for r in batch.rows][1]  # same state: GiGPO's anchor


def test_the_teacher_sees_the_episodes_clue_without_a_skillbank():
    envs = _envs(4, boxes=8, clue_accuracy=0.0)
    batch = collect_rollouts(model=None, tokenizer=TOK, builder=_builder(), envs=envs, tasks=[0, 1, 2, 3],
                             group_size=1, settings=_settings(2), device=None, policy=ExpertPolicy(TOK))
    teacher = SelfTeacher(None, _builder(), None, skill_mode="match", micro_batch_rows=8, pad_id=0, device=None,
                          temperature=1.0, precision="float32")
    tasks = envs[0].tasks
    for row, prompt in zip(batch.rows, teacher.prompts(batch.rows)):
        clue = tasks[row.task].clue
        assert clue != tasks[row.task].target  # accuracy 0: every clue misleads
        assert TOK.decode(prompt).startswith(f"[ privileged skill information ] clue key in box {clue} boxes")
        assert prompt[len(prompt) - len(row.prompt_ids):] == row.prompt_ids


def test_config_checks_the_clue_fields():
    with pytest.raises(ConfigError, match="clue_accuracy=1.5"):
        from_preset("cpu-demo-clue", clue_accuracy=1.5).validate()
    with pytest.raises(ConfigError, match="clue_boxes=13"):
        from_preset("cpu-demo-clue", clue_boxes=13).validate()
    with pytest.raises(ConfigError, match="tiny-word"):
        from_preset("cpu-demo", model="tiny-word").validate()
    cfg = from_preset("cpu-demo-clue").validate()
    assert (cfg.env, cfg.model, cfg.clue_accuracy) == ("clue", "tiny-word", 1.0)


def test_a_short_grpo_run_from_random_init_raises_success(tmp_path):
    from icsd_audit.train.loop import train

    cfg = from_preset("cpu-demo-clue", out_dir=str(tmp_path / "run"), allocator="none", total_steps=16,
                                  n_tasks=4, eval_every=0, threads=1).validate()
    train(cfg)
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    first = sum(r["rollout/success"] for r in recs[:3]) / 3
    last = sum(r["rollout/success"] for r in recs[-3:]) / 3
    inval = [r["rollout/invalid_rate"] for r in recs]
    assert first <= 0.1 and last >= first + 0.15, [r["rollout/success"] for r in recs]
    assert inval[-1] < inval[0] - 0.3, inval


def test_the_tiny_word_model_reads_the_teachers_clue_and_nothing_else():
    """--model tiny-word: after its lesson the teacher's box follows the clue; the student's is near uniform, and
    the reply's first word is as likely to be 'open' as under the random model (the format is not taught)."""
    import torch

    from icsd_audit.train.models.tiny_word import clue_reading, tiny_word_causal_lm
    from icsd_audit.train.rollout.prompts import skill_block

    model, tok = clue_reading(seed=0)
    random_model, _ = tiny_word_causal_lm(seed=0)
    boxes = [tok.convert_tokens_to_ids(str(k)) for k in range(1, 9)]
    open_id = tok.convert_tokens_to_ids("open")

    def next_word(m, text):
        ids = torch.tensor([TOK(text, add_special_tokens=False).input_ids])
        with torch.no_grad():
            return m(input_ids=ids).logits[0, -1].softmax(-1)

    for student in ("boxes 1 to 8 . start 1 to 8 >", "boxes 1 to 8 . open 4 right 5 to 8 . >"):
        for clue in range(1, 9):
            p = next_word(model, skill_block(f"clue key in box {clue}") + student + " open")[boxes]
            assert int(p.argmax()) + 1 == clue and float(p.max()) > 0.9, (student, clue, p)
        alone = next_word(model, student + " open")[boxes]
        assert float(alone.max()) < 0.3 and float(alone.min()) > 0.05, alone  # uniform would be 0.125 each
        before, after = float(next_word(random_model, student)[open_id]), float(next_word(model, student)[open_id])
        assert 0.5 < after / before < 2.0, (before, after)
