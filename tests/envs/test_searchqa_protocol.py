"""Search-QA's two reference protocols, case by case.

Expected values are worked out by hand from the references' code:

* Search-R1 (``search_r1/llm_agent/generation.py``): ``_postprocess_responses`` cuts the
  decoded reply after its first ``</search>``, else its first ``</answer>`` (lines 61-65);
  ``postprocess_predictions`` takes the first ``re.search(r'<(search|answer)>(.*?)</\\1>', ..., re.DOTALL)``
  (lines 422-430, case-sensitive); ``execute_predictions`` gives ``valid_action`` 1 to
  an answer or a search and 0 otherwise (lines 384-401).
* verl-agent (``agent_system/environments/env_package/search/projection.py``,
  ``search_projection``, as in SDAR's copy): the same cut, then the first ``<search>``
  block, else the first ``<answer>`` block, case-insensitive; invalid when neither, or
  when the uncut reply has both a ``<search>`` and an ``<answer>`` tag, or two of either.
"""

from __future__ import annotations

import json

import pytest

from icsd_audit.envs.searchqa import SearchQAEnv
from icsd_audit.envs.searchqa.protocol import INVALID_MESSAGE, cut_reply, information, parse_reply, reply_valid

# (reply, search-r1 valid, search-r1 action, verl-agent valid, verl-agent action)
CASES = [
    ("<think>a</think><search> capital of France </search>", True, "<search> capital of France </search>",
     True, "<search> capital of France </search>"),
    ("<search>q</search>", True, "<search> q </search>", True, "<search> q </search>"),  # no <think>: both accept
    ("", False, "", False, ""),
    ("<think>I will search</think><search> capital of", False, "", False, ""),  # truncated
    ("<think>x</think>the answer is Paris", False, "", False, ""),  # no tag at all
    # two searches: Search-R1 cuts after the first and acts on it; verl-agent counts two <search> tags
    ("<search>a</search><search>b</search>", True, "<search> a </search>", False, "<search> a </search>"),
    # answer then search: Search-R1's regex finds the answer first; verl-agent extracts the search
    # first and rejects the reply for holding both tags
    ("<answer>Paris</answer> <search>b</search>", True, "<answer> Paris </answer>", False, "<search> b </search>"),
    # tags are case-sensitive in Search-R1, not in verl-agent
    ("<SEARCH>q</SEARCH>", False, "", True, "<search> q </search>"),
    # the cut comes first: after the cut at </search> the answer block is unclosed
    ("<answer> x </search> </answer>", False, "", False, ""),
    # neither reference rejects CJK text
    ("<think>\u5317\u4eac</think><answer>\u5317\u4eac</answer>", True, "<answer> \u5317\u4eac </answer>",
     True, "<answer> \u5317\u4eac </answer>"),
    # an empty block is a valid (empty) search in both
    ("<search></search>", True, "<search>  </search>", True, "<search>  </search>"),
]


@pytest.mark.parametrize("text,r1,r1_action,va,va_action", CASES)
def test_reply_rules_match_the_references(text, r1, r1_action, va, va_action):
    assert reply_valid(text, protocol="search-r1") is r1
    assert reply_valid(text, protocol="verl-agent") is va
    assert parse_reply(text, protocol="search-r1").action == r1_action
    assert parse_reply(text, protocol="verl-agent").action == va_action
    env = SearchQAEnv("eval", protocol="verl-agent")
    assert env.reply_valid(text) is va and env.parse_reply(text).action == va_action


def test_cut_keeps_the_first_search_else_the_first_answer():
    assert cut_reply("<search>a</search> <information>made up</information> <answer>x</answer>") == "<search>a</search>"
    assert cut_reply("<answer>x</answer> more </answer>") == "<answer>x</answer>"
    assert cut_reply("no tags") == "no tags"


def test_observation_formats():
    docs = [{"id": "1", "contents": '"Quexville"\nQuexville lies on the river Ymm.'},
            {"id": "2", "contents": '"Ymm"\nThe Ymm is a river.'}]
    # Search-R1: _passages2string, then '<information>' + result.strip() + '</information>'
    assert information(docs, protocol="search-r1") == (
        '<information>Doc 1(Title: "Quexville") Quexville lies on the river Ymm.\n'
        'Doc 2(Title: "Ymm") The Ymm is a river.</information>')
    # verl-agent's search tool: 'Doc i: contents' lines inside json.dumps({"result": ...})
    body = 'Doc 1: "Quexville"\nQuexville lies on the river Ymm.\nDoc 2: "Ymm"\nThe Ymm is a river.\n'
    assert information(docs, protocol="verl-agent") == "<information>" + json.dumps({"result": body}) + "</information>"
    assert information([], protocol="verl-agent") == '<information>{"result": "No search results found."}</information>'


@pytest.mark.parametrize("protocol", ["search-r1", "verl-agent"])
def test_invalid_reply_observation_and_final_answer_turn(protocol):
    env = SearchQAEnv("eval", max_steps=3, protocol=protocol)
    obs = env.reset(0)
    assert obs.meta["protocol"] == protocol
    r = env.step(env.parse_reply("no tags here").action)
    assert not r.info["valid_action"] and not r.done
    assert r.observation.text == (INVALID_MESSAGE if protocol == "search-r1" else "")
    r = env.step(env.parse_reply("<search></search>").action)  # an empty query finds nothing
    assert r.info["valid_action"] and r.info["doc_ids"] == [] and not r.done
    assert r.observation.text == information([], protocol=protocol)
    r = env.step(env.parse_reply(f"<search>{env.item.hops[0][0]}</search>").action)  # turn 3 of 3: not run
    assert r.done and r.info["truncated"] and r.reward == 0.0 and r.observation.text == "" and "doc_ids" not in r.info
    env.reset(0)
    env.step("search[x]")
    env.step("search[y]")
    r = env.step(f"answer[{env.item.golden_answers[0]}]")  # an answer on the final turn is scored
    assert r.done and r.reward == 1.0 and not r.info["truncated"]
