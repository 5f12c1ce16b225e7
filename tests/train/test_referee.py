"""Each environment's validity rule through the training loop's referee, with known-good and known-bad replies.

The expert plays whole episodes through :func:`collect_rollouts` (the training loop's
prompts, parser, :class:`TurnReferee`, rewards): every turn is valid and every episode is
won. A scripted policy writes one malformed reply per episode on the first turn: each is
judged invalid, and nothing else is. Which replies count as malformed is the reference's
rule for the environment, worked out by hand:

* WebShop and ALFWorld, verl-agent's ``webshop_projection`` / ``alfworld_projection``:
  valid iff the lower-cased reply has ``<action>`` and ``</action>``, the reply has
  ``<think>`` and ``</think>``, and no CJK ideograph;
* Search-QA: Search-R1's ``postprocess_predictions`` or verl-agent's ``search_projection``
  (tests/envs/test_searchqa_protocol.py).

Two replies a reader might call malformed are *accepted* by a reference and are listed
as such, so that a change of rule cannot go unnoticed: two ``<action>`` blocks (verl-agent
takes the text between the first ``<action>`` and the first ``</action>``) and, under
Search-R1, two ``<search>`` blocks (the reply is cut after the first).
"""

from __future__ import annotations

import pytest

from icsd_audit.envs import make_env
from icsd_audit.envs.alfworld.engine import engine_available
from icsd_audit.train.rollout.collect import expert_turns
from icsd_audit.train.rollout.policy import ExpertPolicy, ScriptedPolicy, policy_tokenizer
from icsd_audit.train.rollout.collect import PromptBuilder, RolloutSettings, collect_rollouts

TOK = policy_tokenizer("tiny-random")

#: malformed under verl-agent's <action> rule (with require_think, the default)
ACTION_MALFORMED = [
    "<think>I buy it.</think><action>click[buy now]",  # missing close tag
    "<think>I buy it.</think><action>click[buy n",  # truncated
    "",  # empty
    "<think>\u6211\u4e70\u5b83</think><action>click[buy now]</action>",  # CJK
    "<action>click[buy now]</action>",  # no think block
    "<think>I buy it.</think>",  # no action block
    "click[buy now]",  # bare action
]
#: accepted by verl-agent's rule (its projection reads the first block)
ACTION_ACCEPTED = ["<think>x</think><action>click[buy now]</action><action>click[back to search]</action>"]

SEARCH_MALFORMED = {
    "search-r1": ["<think>x</think><search> capital of", "", "<think>\u5317\u4eac</think>", "<SEARCH>q</SEARCH>",
                  "<think>x</think>Paris", "<answer> x </search> </answer>"],
    "verl-agent": ["<think>x</think><search> capital of", "", "<search>a</search><search>b</search>",
                   "<answer>Paris</answer><search>b</search>", "<think>x</think>Paris"],
}
SEARCH_ACCEPTED = {"search-r1": ["<search>a</search><search>b</search>", "<search>q</search>"],
                   "verl-agent": ["<SEARCH>q</SEARCH>", "<search>q</search>"]}

ALFWORLD = pytest.mark.skipif(not engine_available(), reason="ALFWorld engine not installed")


def _settings(max_turns: int, reward: str = "score") -> RolloutSettings:
    return RolloutSettings(max_turns=max_turns, max_response_tokens=64, temperature=1.0, batch_rows=8,
                           require_think=True, reward=reward, record_logp=False)


def _envs(name: str, n: int, **kw) -> list:
    return [make_env(name, split="eval", **kw) for _ in range(n)]


def _builder(name: str, protocol: str | None = None) -> PromptBuilder:
    return PromptBuilder(TOK, env=name, history_window=2, max_prompt_tokens=4096, protocol=protocol)


CONFIGS = [("webshop", None, 15, {"max_steps": 15}), ("searchqa", "search-r1", 4, {"max_steps": 4}),
           ("searchqa", "verl-agent", 4, {"max_steps": 4, "protocol": "verl-agent"})]


@pytest.mark.parametrize("name,protocol,turns,kw", CONFIGS)
def test_expert_turns_are_all_valid_and_win(name, protocol, turns, kw):
    batch = collect_rollouts(model=None, tokenizer=TOK, builder=_builder(name, protocol), envs=_envs(name, 7, **kw),
                             tasks=list(range(7)), group_size=1, settings=_settings(turns), device=None,
                             policy=ExpertPolicy(TOK))
    assert batch.rows and all(r.action_valid for r in batch.rows), [r.response_text for r in batch.rows if not r.action_valid]
    assert all(t.won for t in batch.trajectories)
    assert batch.metrics()["invalid_rate"] == 0.0


def _malformed_first_turn(replies: list[str]):
    def script(turn) -> str:
        from icsd_audit.envs.expert import expert_reply

        return replies[turn.episode] if not turn.ctx.history else expert_reply(turn.env)

    return script


def _first_turn_validity(name: str, protocol: str | None, replies: list[str], kw: dict) -> list[bool]:
    envs = _envs(name, len(replies), **kw)
    batch = collect_rollouts(model=None, tokenizer=TOK, builder=_builder(name, protocol), envs=envs,
                             tasks=[0], group_size=len(replies), settings=_settings(1), device=None,
                             policy=ScriptedPolicy(TOK, _malformed_first_turn(replies)))
    assert [r.response_text for r in batch.rows] == replies
    return [r.action_valid for r in batch.rows]


def test_webshop_malformed_replies_are_invalid_and_only_them():
    assert _first_turn_validity("webshop", None, ACTION_MALFORMED, {}) == [False] * len(ACTION_MALFORMED)
    assert _first_turn_validity("webshop", None, ACTION_ACCEPTED, {}) == [True] * len(ACTION_ACCEPTED)


@pytest.mark.parametrize("protocol", ["search-r1", "verl-agent"])
def test_searchqa_malformed_replies_are_invalid_and_only_them(protocol):
    kw = {"protocol": protocol}
    bad, good = SEARCH_MALFORMED[protocol], SEARCH_ACCEPTED[protocol]
    assert _first_turn_validity("searchqa", protocol, bad, kw) == [False] * len(bad)
    assert _first_turn_validity("searchqa", protocol, good, kw) == [True] * len(good)
    # the earlier default (verl-agent's <action> rule for every env) judged a well-formed Search-QA reply invalid
    assert _first_turn_validity("searchqa", protocol, ["<think>x</think><search> q </search>"], kw) == [True]


@ALFWORLD
def test_alfworld_expert_valid_and_malformed_invalid_through_the_referee(tmp_path, monkeypatch):
    monkeypatch.setenv("ICSD_CACHE", str(tmp_path / "cache"))  # generated games go here, not the user's cache
    monkeypatch.delenv("ALFWORLD_DATA", raising=False)
    envs = _envs("alfworld", 2, max_steps=50, expert=True)
    batch = collect_rollouts(model=None, tokenizer=TOK, builder=_builder("alfworld"), envs=envs, tasks=[3, 5],
                             group_size=1, settings=_settings(50, reward="won10"), device=None, policy=ExpertPolicy(TOK))
    assert all(r.action_valid for r in batch.rows) and all(t.won for t in batch.trajectories)
    bad = ["<think>go</think><action>go to desk 1", "", "<think>\u53bb</think><action>look</action>", "<action>look</action>"]
    assert _first_turn_validity("alfworld", None, bad, {"max_steps": 50}) == [False] * len(bad)
    assert _first_turn_validity("alfworld", None, ["<think>x</think><action>look</action><action>inventory</action>"],
                                {"max_steps": 50}) == [True]


def test_expert_turns_are_supervised_pairs_in_the_trainers_format():
    builder = _builder("searchqa", "search-r1")
    pairs = expert_turns(tokenizer=TOK, builder=builder, envs=_envs("searchqa", 2, max_steps=4), tasks=[3, 5],
                         settings=_settings(4))
    assert pairs and all(p.valid and p.won for p in pairs)
    first = pairs[0]
    assert first.prompt_ids == TOK(first.prompt_text, add_special_tokens=False).input_ids
    assert first.reply_ids[:-1] == TOK(first.reply, add_special_tokens=False).input_ids
    assert first.reply_ids[-1] == TOK.eos_token_id and first.reply.startswith("<think>")
    # a later turn's prompt is the first one grown by the reply and the information block
    second = next(p for p in pairs if p.task == first.task and p.turn == 1)
    assert second.prompt_text.startswith(first.prompt_text + first.reply + "\n\n<information>")
