"""skill_bank_mode='general' reproduces SDAR's first release: the teacher of a WebShop or ALFWorld
task sees the general skills and nothing else; 'task' (the default) keeps the task's own block."""

from __future__ import annotations

import json
from importlib import resources
from types import SimpleNamespace

import pytest

from icsd_audit.envs import make_env
from icsd_audit.train.config import ConfigError, TrainConfig


def general_block_by_hand(env: str) -> str:
    """The bank file's general skills as the teacher's block: heading, then numbered 'title: text' lines."""
    data = json.loads(resources.files("icsd_audit.skills").joinpath(f"{env}.json").read_text())
    g = data["general"]
    lines = [f"{i}. {s['title']}: {s['text']}" if s.get("title") else f"{i}. {s['text']}"
             for i, s in enumerate(g["skills"], 1)]
    return f"### {g.get('title') or 'GENERAL SKILLS'} ###\n" + "\n".join(lines)


def teacher_skill(env_name: str, ctx, cfg: TrainConfig) -> str:
    """The skill text the trainer's teacher (built as the loop builds it) puts in front of this turn."""
    from icsd_audit.train.rollout.policy import policy_tokenizer
    from icsd_audit.train.rollout.collect import PromptBuilder
    from icsd_audit.train.teacher.skills import load_skillbank
    from icsd_audit.train.teacher.self_teacher import make_teacher

    builder = PromptBuilder(policy_tokenizer("tiny-random"), env=env_name, history_window=2, max_prompt_tokens=4096)
    teacher = make_teacher(True, model=None, builder=builder, bank=load_skillbank(cfg.skillbank_name),
                           skill_mode=cfg.teacher_skill_mode, skill_match=cfg.skill_match, micro_batch_rows=1,
                           pad_id=0, device=None, temperature=1.0, precision="float32")
    return teacher.skill_for(SimpleNamespace(ctx=ctx))


def webshop_turn(index: int):
    from icsd_audit.train.rollout.collect import turn_context

    return turn_context(make_env("webshop", split="eval", max_steps=15).reset(index), "webshop")


def alfworld_turn(index: int):
    """An ALFWorld game's first turn as the environment gives it: its task, and its task type as the skill key
    (``observation.meta['skill_key']``, tests/envs/test_alfworld_expert.py), read from the shipped game list
    so that no ALFWorld engine is needed."""
    from icsd_audit.envs.alfworld.games import load_manifest
    from icsd_audit.train.rollout.prompts import TurnContext

    game = load_manifest()["splits"]["eval"][index]
    return TurnContext(task=game["task_text"], env="alfworld", key=game["task_type"], actions=["look", "inventory"],
                       observation=f"You are in the middle of a room. Your task is to: {game['task_text']}.")


@pytest.mark.parametrize("env_name, make_turn, index",
                         [("webshop", webshop_turn, 0), ("webshop", webshop_turn, 3),
                          ("alfworld", alfworld_turn, 0), ("alfworld", alfworld_turn, 1)])
def test_general_mode_gives_exactly_the_general_skills(env_name, make_turn, index):
    ctx = make_turn(index)
    general = general_block_by_hand(env_name)
    task = teacher_skill(env_name, ctx, TrainConfig(env=env_name))
    first = teacher_skill(env_name, ctx, TrainConfig(env=env_name, skill_bank_mode="general"))
    assert first == general
    # the default is the task-specific fix: the general block, then at least the task's own block
    assert task.startswith(general + "\n\n") and len(task) > len(general) + 2


def test_searchqa_keeps_its_data_source_routing_and_all_still_wins():
    c = TrainConfig(env="searchqa", skill_bank_mode="general")
    assert c.teacher_skill_mode == "match"  # SDAR's first release routed Search-QA by data source already
    assert TrainConfig(env="webshop", skill_bank_mode="general", skill_mode="all").teacher_skill_mode == "all"
    assert TrainConfig(env="alfworld", skill_bank_mode="general").teacher_skill_mode == "general"
    assert TrainConfig(env="alfworld").teacher_skill_mode == "match"


def test_bad_value_is_refused():
    with pytest.raises(ConfigError, match="skill_bank_mode='first'"):
        TrainConfig(skill_bank_mode="first").validate()


def test_the_verl_command_carries_it():
    from icsd_audit.integrations.verl.launch import verl_overrides

    cfg = TrainConfig(env="webshop", allocator="sdar", skill_bank_mode="general")
    over = verl_overrides(cfg, data_dir="/d", model_path="/m", agent_loop_config="/a.yaml")
    assert "+icsd.skill_mode=general" in over and "+icsd.skill_mode=match" not in over
