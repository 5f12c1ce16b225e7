"""Action parsing and admissibility (icsd_audit.envs.base), environment-agnostic."""

from __future__ import annotations

import pytest

from icsd_audit.envs.base import (
    Observation,
    StepResult,
    TextEnv,
    is_admissible,
    match_admissible,
    normalize_action,
    parse_action,
    step_info,
)

WEBSHOP_ITEM = ("click[back to search]", "click[< prev]", "click[description]", "click[buy now]", "click[6.76 fl oz]")
WEBSHOP_SEARCH = ("search[<your query>]",)
ALFWORLD = ("go to desk 1", "open drawer 2", "take pen 1 from desk 1", "look", "inventory")


def test_parse_plain_reply():
    p = parse_action("<think>the size matches</think><action>click[6.76 fl oz]</action>", WEBSHOP_ITEM)
    assert p.valid and p.reason == "" and p.action == "click[6.76 fl oz]"


def test_tags_and_action_are_case_insensitive_and_stripped():
    p = parse_action("<THINK>ok</THINK>\n<Action>  Click[Buy   Now]\n</ACTION>", WEBSHOP_ITEM)
    assert p.valid and p.action == "click[buy now]"


def test_missing_action_tag_is_invalid():
    for text in ["click[buy now]", "<think>x</think>", "<action>click[buy now]", "click[buy now]</action>"]:
        p = parse_action(text, WEBSHOP_ITEM)
        assert not p.valid and p.reason == "no_action_tag" and p.action == ""


def test_empty_action_is_invalid():
    p = parse_action("<think>x</think><action>   </action>", WEBSHOP_ITEM)
    assert not p.valid and p.reason == "empty"


def test_inadmissible_action_is_invalid_but_reported():
    p = parse_action("<action>click[features]</action>", WEBSHOP_ITEM)
    assert not p.valid and p.reason == "not_admissible" and p.action == "click[features]"


def test_first_action_block_wins():
    p = parse_action("<action>click[buy now]</action> or maybe <action>click[< prev]</action>", WEBSHOP_ITEM)
    assert p.valid and p.action == "click[buy now]"


def test_search_template_admits_any_nonempty_query():
    p = parse_action("<action>search[Long Lasting  Perfume]</action>", WEBSHOP_SEARCH)
    assert p.valid and p.action == "search[long lasting perfume]"
    assert not parse_action("<action>search[]</action>", WEBSHOP_SEARCH).valid
    assert not parse_action("<action>search[   ]</action>", WEBSHOP_SEARCH).valid
    # copying the placeholder is not a query
    assert not parse_action("<action>search[<your query>]</action>", WEBSHOP_SEARCH).valid
    # the template does not admit other verbs or a click on the search page
    assert not parse_action("<action>click[search]</action>", WEBSHOP_SEARCH).valid
    assert not parse_action("<action>find[perfume]</action>", WEBSHOP_SEARCH).valid


def test_exact_commands_for_text_games():
    assert parse_action("<action>Go to desk 1</action>", ALFWORLD).action == "go to desk 1"
    assert parse_action("<action>go to desk 1</action>", ALFWORLD).valid
    assert not parse_action("<action>go to desk 3</action>", ALFWORLD).valid
    assert is_admissible("  LOOK ", ALFWORLD)
    assert not is_admissible("", ALFWORLD)


def test_without_available_list_any_block_is_valid():
    p = parse_action("<action>anything at all</action>")
    assert p.valid and p.action == "anything at all"


def test_require_think():
    text = "<action>click[buy now]</action>"
    assert parse_action(text, WEBSHOP_ITEM).valid
    p = parse_action(text, WEBSHOP_ITEM, require_think=True)
    assert not p.valid and p.reason == "no_think_tag"
    assert parse_action("<think>ok</think>" + text, WEBSHOP_ITEM, require_think=True).valid


def test_match_admissible_and_normalize():
    assert normalize_action("  Click[ Buy\tNow ] ") == "click[ buy now ]"
    assert match_admissible("CLICK[buy now]", WEBSHOP_ITEM) == "click[buy now]"
    assert match_admissible("search[ red  shoes ]", WEBSHOP_SEARCH) == "search[red shoes]"
    assert match_admissible("click[buy now]", WEBSHOP_SEARCH) is None


def test_step_info_and_result_types():
    info = step_info(won=1, score=0.5, valid_action=0, page="item")
    assert info == {"won": True, "score": 0.5, "valid_action": False, "page": "item"}
    obs = Observation(text="Search", available_actions=WEBSHOP_SEARCH, instruction="buy a thing")
    res = StepResult(obs, 0.0, False, info)
    assert res.won is True and res.observation.instruction == "buy a thing"


def test_protocol_is_structural():
    class Dummy:
        name = "dummy"
        max_steps = 3
        num_tasks = 1

        def reset(self, task=None):
            return Observation("start", ("look",), "look around")

        def step(self, action):
            return StepResult(self.reset(), 1.0, True, step_info(won=True, score=1.0, valid_action=True))

    assert isinstance(Dummy(), TextEnv)
    assert not isinstance(object(), TextEnv)


@pytest.mark.parametrize("bad", ["<action>click[buy now]</act>", "<actions>click[buy now]</actions>"])
def test_malformed_tags(bad):
    assert not parse_action(bad, WEBSHOP_ITEM).valid
