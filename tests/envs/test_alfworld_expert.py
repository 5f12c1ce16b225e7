"""ALFWorld's expert policy and skills by task type, on the real engine (skipped without the ``alfworld`` extra).

* The expert (``AlfWorldEnv(expert=True)``, the handcoded expert on its own random
  stream seeded with the game index) plays a game exactly as the manifest's check
  recorded it, whatever else uses :mod:`random` between its turns.
* The privileged teacher's skill for a heat, a cool and a pick-two game is that task
  type's block alone: the observation's key (the game's task type) wins over keyword
  matching, as SDAR's ``get_privileged_info(gamefile)`` looks skills up by task type; the
  keyword rule on the whole prompt would add others ("put" is in every task's text).
"""

from __future__ import annotations

import random

import pytest

from icsd_audit.envs import make_env
from icsd_audit.envs.alfworld.engine import engine_available
from icsd_audit.envs.alfworld.games import load_manifest

pytestmark = pytest.mark.skipif(
    not engine_available(), reason="ALFWorld engine not installed: pip install 'icsd-audit[alfworld]'")


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("ICSD_CACHE", str(tmp_path_factory.getbasetemp() / "icsd-cache"))
    monkeypatch.delenv("ALFWORLD_DATA", raising=False)


def test_expert_plays_the_manifest_walkthrough_undisturbed_by_other_randomness():
    from icsd_audit.envs.alfworld.expert import expert_reply

    env = make_env("alfworld", split="eval", max_steps=50, expert=True)
    for index in (3, 5):  # a heat and a pick-two game
        env.reset(index)
        actions = []
        while True:
            random.random()  # other code drawing from the global stream between turns
            reply = expert_reply(env)
            assert reply.startswith("<think>") and reply.endswith("</action>")
            action = reply[reply.index("<action>") + 8: -len("</action>")]
            actions.append(action)
            res = env.step(action)
            if res.done:
                break
        assert res.won and actions == load_manifest()["splits"]["eval"][index]["walkthrough"]


def test_expert_needs_the_expert_engine():
    env = make_env("alfworld", split="eval", max_steps=5)
    env.reset(0)
    with pytest.raises(ValueError, match="expert=True"):
        env.expert_action()


@pytest.mark.parametrize("index,task_type", [(3, "pick_heat_then_place_in_recep"), (4, "pick_cool_then_place_in_recep"),
                                             (5, "pick_two_obj_and_place")])
def test_each_task_type_gets_its_own_skill_block_only(index, task_type):
    from icsd_audit.train.rollout.policy import policy_tokenizer
    from icsd_audit.train.rollout.collect import PromptBuilder, turn_context
    from icsd_audit.train.teacher.skills import load_skillbank
    from icsd_audit.train.teacher.self_teacher import skill_retriever

    env = make_env("alfworld", split="eval", max_steps=50)
    obs = env.reset(index)
    assert env.task_type(index) == task_type and obs.meta["skill_key"] == task_type
    ctx = turn_context(obs, "alfworld")
    text = PromptBuilder(policy_tokenizer("tiny-random"), env="alfworld", history_window=2,
                         max_prompt_tokens=4096).student_text(ctx)
    bank = load_skillbank("alfworld")
    got = bank.retrieve_sdar(text, key=ctx.key)
    assert got.categories == (task_type,) and got.how == "key"
    z = skill_retriever(bank, skill_mode="match", skill_match="sdar")(ctx, text)
    titles = {c.name: (c.title or f"TASK: {c.name}") for c in bank.categories}
    assert titles[task_type] in z and not [n for n, t in titles.items() if n != task_type and t in z]
    # without the key, SDAR's keyword rule on the whole prompt matches more than the task's type
    assert len(bank.retrieve_sdar(text).categories) > 1
