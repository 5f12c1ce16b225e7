"""The invalid-turn rules: verl-agent's format rule (default) and the stricter admissible rule.

Expected values are worked out by hand from verl-agent's ``webshop_projection`` (as
shipped in SDAR's fork): ``valids[i] = 1`` when the lower-cased reply contains both
action tags; with ``require_think`` the original reply must contain both think tags;
any character in U+4E00..U+9FFF makes the reply invalid. Admissibility is not part of it.
"""

from __future__ import annotations

import pytest

from icsd_audit.envs.base import Observation, StepResult, parse_action, step_info, well_formed
from icsd_audit.train.rollout.collect import INVALID_RULES

ITEM = ("click[back to search]", "click[buy now]", "click[6.76 fl oz]")

#: (reply, require_think, verl-agent valid, admissible-rule valid given ITEM)
CASES = [
    ("<think>ok</think><action>click[buy now]</action>", True, True, True),
    # well-formed, not admissible: verl-agent keeps it valid (the env makes it a no-op)
    ("<think>ok</think><action>click[add to cart]</action>", True, True, False),
    # empty action block: verl-agent's projection marks it valid
    ("<think>ok</think><action></action>", True, True, False),
    # tags found case-insensitively for <action>
    ("<think>ok</think><ACTION>click[buy now]</ACTION>", True, True, True),
    # ... but <think> is searched in the original string: upper-case think tags do not count
    # (this toolkit's parser matches them case-insensitively)
    ("<THINK>ok</THINK><action>click[buy now]</action>", True, False, True),
    ("<THINK>ok</THINK><action>click[buy now]</action>", False, True, True),
    # missing closing tag
    ("<think>ok</think><action>click[buy now]", True, False, False),
    ("click[buy now]", False, False, False),
    # no think block although required
    ("<action>click[buy now]</action>", True, False, False),
    ("<action>click[buy now]</action>", False, True, True),
    # CJK text anywhere: invalid under verl-agent's rule
    ("<think>\u4e70</think><action>click[buy now]</action>", True, False, True),
    # tags present but out of order: the projection only checks both are present
    ("</action><think>x</think><action>", True, True, False),
]


class _Res:
    def __init__(self, env_valid: bool):
        self.info = step_info(won=False, score=0.0, valid_action=env_valid)


@pytest.mark.parametrize("text,think,verl,strict", CASES)
def test_rules_match_hand_worked_cases(text, think, verl, strict):
    assert well_formed(text, require_think=think) is verl
    parsed = parse_action(text, ITEM, require_think=think)
    res = _Res(env_valid=parsed.valid)
    assert INVALID_RULES["format"](text, parsed, res, think) is verl
    assert INVALID_RULES["admissible"](text, parsed, res, think) is strict


def test_admissible_rule_also_honours_the_environment():
    text = "<think>x</think><action>click[buy now]</action>"
    parsed = parse_action(text, ITEM, require_think=True)
    assert parsed.valid
    assert INVALID_RULES["admissible"](text, parsed, _Res(env_valid=False), True) is False
    assert INVALID_RULES["format"](text, parsed, _Res(env_valid=False), True) is True


def test_penalty_follows_the_rule_in_a_rollout():
    """A scripted policy that names a non-admissible action: penalised only under 'admissible'."""
    import torch

    from icsd_audit.train.update.advantages import grpo_advantages
    from icsd_audit.train.config import ConfigError, TrainConfig

    with pytest.raises(ConfigError, match="invalid_rule"):
        TrainConfig(model="tiny-random", invalid_rule="nope").validate()
    assert TrainConfig().invalid_rule == "format"
    # rows: one well-formed but non-admissible turn per trajectory, two trajectories, equal reward
    texts = ["<think>a</think><action>click[nothing]</action>", "<think>a</think><action>click[buy now]</action>"]
    for rule, expect in (("format", [False, False]), ("admissible", [True, False])):
        invalid = []
        for t in texts:
            p = parse_action(t, ITEM, require_think=True)
            invalid.append(not INVALID_RULES[rule](t, p, _Res(p.valid), True))
        assert invalid == expect
        from icsd_audit.train.update.advantages import TurnRecords

        rec = TurnRecords.from_arrays(group=[0, 0], traj=[0, 1], turn=[0, 0], reward=[1.0, 1.0], anchor=[0, 0],
                                      invalid=invalid)
        a = grpo_advantages(rec, invalid_penalty=0.1, norm_adv_by_std_in_grpo=False).advantages
        # scores [1 - 0.1*inv0, 1 - 0.1*inv1], group mean subtracted
        want = torch.tensor([-0.05, 0.05]) if rule == "admissible" else torch.zeros(2)
        assert torch.allclose(a.float(), want, atol=1e-6)
