"""The clue environment's rules, its tasks and clue dial, its prompt and the word tokenizer (docs/envs.md, "Clue")."""

from __future__ import annotations

import math

import pytest

from icsd_audit.envs import make_env
from icsd_audit.envs.clue import ClueEnv, make_tasks, parse_reply
from icsd_audit.envs.clue.expert import expert_reply
from icsd_audit.envs.clue.tasks import clue_text
from icsd_audit.train.rollout.prompts import HistoryEntry, TurnContext
from icsd_audit.train.rollout.collect import PromptBuilder
from icsd_audit.train.models.tiny_word import tiny_word_causal_lm, word_tokenizer

TOK = word_tokenizer()


def _task_with_target(env: ClueEnv, target: int) -> int:
    return next(t.index for t in env.tasks if t.target == target)


def test_feedback_points_to_the_key_and_found_ends_with_reward_one():
    env = ClueEnv("eval", boxes=8, max_steps=5)
    obs = env.reset(_task_with_target(env, 6))
    assert obs.text == "start 1 to 8" and obs.instruction == "boxes 1 to 8 ." and obs.available_actions == ()
    r = env.step("open 4")
    assert (r.observation.text, r.reward, r.done, r.info["valid_action"], r.won) == ("right 5 to 8", 0.0, False, True,
                                                                                     False)
    r = env.step("OPEN   7 ")  # case and spaces do not matter
    assert (r.observation.text, r.done, r.info["valid_action"]) == ("left 5 to 6", False, True)
    r = env.step("open 2")  # outside the interval: valid, the answer and the interval as before
    assert (r.observation.text, r.done, r.info["valid_action"]) == ("right 5 to 6", False, True)
    assert env.interval == (5, 6)
    r = env.step("open 6")
    assert (r.observation.text, r.reward, r.done, r.won, r.info["score"]) == ("found", 1.0, True, True, 1.0)
    assert env.steps == 4
    with pytest.raises(RuntimeError):
        env.step("open 1")


@pytest.mark.parametrize("reply", ["", "open", "open 0", "open 9", "open 3 4", "3", "open three", "close 3",
                                   "open 3 .", "> open 3"])
def test_malformed_replies_are_invalid_and_change_nothing_but_the_turn_count(reply):
    env = ClueEnv("eval", boxes=8, max_steps=4)
    env.reset(_task_with_target(env, 2))
    env.step("open 4")
    r = env.step(reply)
    assert (r.observation.text, r.reward, r.done, r.info["valid_action"]) == ("invalid 1 to 3", 0.0, False, False)
    assert env.interval == (1, 3) and env.steps == 2
    assert not env.reply_valid(reply) and not parse_reply(reply, boxes=8).valid


def test_the_budget_ends_the_episode_unwon_and_reopening_is_valid():
    env = ClueEnv("eval", boxes=8, max_steps=3)
    env.reset(_task_with_target(env, 8))
    outs = [env.step("open 1") for _ in range(3)]
    assert [o.observation.text for o in outs] == ["right 2 to 8"] * 3 and all(o.info["valid_action"] for o in outs)
    assert [o.done for o in outs] == [False, False, True] and outs[-1].info["truncated"] and not outs[-1].won


def test_the_expert_bisects_and_wins_every_task_within_ceil_log2_turns():
    for boxes in (2, 5, 8, 12):
        turns = math.ceil(math.log2(boxes + 1))
        env = ClueEnv("eval", boxes=boxes, max_steps=turns)
        for task in range(40):
            env.reset(task)
            while True:
                r = env.step(expert_reply(env))
                assert r.info["valid_action"]
                if r.done:
                    break
            assert r.won, (boxes, task, env.task)


def test_tasks_are_fixed_per_split_and_the_clue_names_another_box_when_wrong():
    a = make_tasks("train", boxes=8, clue_accuracy=0.5, n=300)
    assert a == make_tasks("train", boxes=8, clue_accuracy=0.5)[:300]  # a longer split extends a shorter one
    assert [t.target for t in a] != [t.target for t in make_tasks("eval", boxes=8, clue_accuracy=0.5, n=300)]
    assert {t.target for t in a} == set(range(1, 9))
    assert all(1 <= t.clue <= 8 for t in a)
    exact = make_tasks("train", boxes=8, clue_accuracy=1.0, n=300)
    assert all(t.clue_right for t in exact) and [t.target for t in exact] == [t.target for t in a]
    assert not any(t.clue_right for t in make_tasks("train", boxes=8, clue_accuracy=0.0, n=300))


@pytest.mark.parametrize("acc", [0.4, 0.7, 0.9])
def test_the_realised_clue_accuracy_is_within_binomial_error_of_the_setting(acc):
    tasks = make_tasks("train", boxes=8, clue_accuracy=acc)
    n = len(tasks)
    right = sum(t.clue_right for t in tasks)
    # 4 standard errors of a Binomial(n, acc) share: fails by chance with probability < 1e-4
    assert abs(right / n - acc) <= 4 * math.sqrt(acc * (1 - acc) / n), (right, n)
    # raising the accuracy only turns wrong clues right (one uniform draw per task decides)
    lower = make_tasks("train", boxes=8, clue_accuracy=acc - 0.2)
    assert all(h.clue_right or not lo.clue_right for h, lo in zip(tasks, lower))


def test_wrong_clues_spread_over_the_other_boxes():
    tasks = [t for t in make_tasks("train", boxes=4, clue_accuracy=0.0)]
    for target in range(1, 5):
        clues = [t.clue for t in tasks if t.target == target]
        counts = [clues.count(b) for b in range(1, 5)]
        assert counts[target - 1] == 0
        share = [c / len(clues) for b, c in enumerate(counts, 1) if b != target]
        assert all(abs(s - 1 / 3) < 4 * math.sqrt(2 / 9 / len(clues)) for s in share), counts


def test_the_privileged_text_is_the_clue_and_not_in_the_student_prompt():
    env = make_env("clue", split="eval", boxes=8, clue_accuracy=0.0, max_steps=4)
    obs = env.reset(3)
    assert obs.meta["privileged"] == clue_text(env.task) == f"clue key in box {env.task.clue}"
    assert env.task.clue != env.task.target
    builder = PromptBuilder(TOK, env="clue", history_window=4, max_prompt_tokens=64)
    ctx = TurnContext(task=obs.instruction, observation=obs.text, env="clue", privileged=obs.meta["privileged"])
    student = builder.student_text(ctx)
    assert student == "boxes 1 to 8 . start 1 to 8 >"
    ids = builder.student(ctx)[0]
    teacher = builder.teacher(ctx, ids, obs.meta["privileged"])[0]
    assert TOK.decode(teacher) == f"[ privileged skill information ] clue key in box {env.task.clue} " + student
    assert teacher[len(teacher) - len(ids):] == ids


def test_prompts_of_every_turn_use_only_vocabulary_words():
    builder = PromptBuilder(TOK, env="clue", history_window=4, max_prompt_tokens=64)
    hist = [HistoryEntry("start 1 to 12", "open 4"), HistoryEntry("right 5 to 12", "open ] left 3"),
            HistoryEntry("invalid 5 to 12", "open 12")]
    ctx = TurnContext(task="boxes 1 to 12 .", observation="left 5 to 11", history=hist, env="clue")
    text = builder.student_text(ctx)
    # an invalid turn's words are not repeated back: only its observation shows
    assert text == "boxes 1 to 12 . start 1 to 12 open 4 right 5 to 12 . invalid 5 to 12 . open 12 left 5 to 11 . >"
    ids = builder.student(ctx)[0]
    assert TOK.unk_token_id not in ids and TOK.decode(ids) == text
    short = PromptBuilder(TOK, env="clue", history_window=1, max_prompt_tokens=64).student_text(ctx)
    assert short == "boxes 1 to 12 . open 12 left 5 to 11 . >"  # the window drops the oldest turns and the first observation


def test_tiny_word_model_is_small_deterministic_and_matches_the_vocabulary():
    m1, tok = tiny_word_causal_lm(seed=3)
    m2, _ = tiny_word_causal_lm(seed=3)
    n = sum(p.numel() for p in m1.parameters())
    assert 100_000 < n < 1_000_000
    assert m1.config.vocab_size == len(tok) < 64
    assert all((a == b).all() for a, b in zip(m1.parameters(), m2.parameters()))
    assert tok.decode(tok("Open 5", add_special_tokens=False).input_ids) == "open 5"
    assert tok("open banana", add_special_tokens=False).input_ids[-1] == tok.unk_token_id
