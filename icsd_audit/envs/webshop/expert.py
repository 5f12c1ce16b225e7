"""The WebShop expert: the generator's goal path, one page at a time.

From whatever page the episode is on, the expert takes the step that leads to buying the
goal product with the goal options: on the search page it searches with the words of
the instruction (its text up to the price clause, which is what the agent sees); on a
results page it opens the goal product when the page lists it, else the next page, else
it goes back and searches the product's title; on the goal's item page it selects the first goal option
not yet selected, then buys; on any other page it goes back. Over the 500 held-out
instructions the instruction's words put the goal on the first results page 479 times
and on the second 21 times, so an episode takes 3 to 6 steps (search, open the goal, one step
per goal option not yet selected, buy, and one more for the second page): 51, 136, 306
and 7 of those 500 episodes take 3, 4, 5 and 6 turns.

Every reply is what the agent is asked for, ``<think>...</think><action>...</action>``,
with one sentence of reasoning that names only what the agent can see (the
instruction, the page), so that the replies can serve as supervised targets.
"""

from __future__ import annotations

import re
from typing import Any

from .env import BACK, BUY, NEXT, PAGE_ITEM, PAGE_RESULTS, PAGE_SEARCH, PREV, WebShopEnv

__all__ = ["expert_reply", "expert_step", "instruction_query"]

_PRICE = re.compile(r",?\s*and price lower than .*$")


def instruction_query(instruction: str) -> str:
    """The instruction without its price clause: the words the expert searches with."""
    return _PRICE.sub("", instruction).strip()


def expert_step(env: WebShopEnv) -> tuple[str, str]:
    """(reasoning, action) of the expert's next step in ``env``'s current episode."""
    goal = env.goal
    if not isinstance(env, WebShopEnv) or goal is None:
        raise ValueError("the WebShop expert needs the built-in WebShopEnv with an episode started (its goal is "
                         "not known to a real server's adapter)")
    obs = env.available_actions()
    page = env._page
    target = goal["asin"].lower()
    if page == PAGE_SEARCH and env._steps == 0:
        q = instruction_query(goal["instruction_text"])
        return f"I search for the product with the words of the instruction: {q}.", f"search[{q}]"
    if page == PAGE_SEARCH:  # back here after a search that missed: the product's name finds it
        return f"My first search did not find it, so I search for the product's name: {goal['name']}.", \
            f"search[{goal['name']}]"
    if page == PAGE_RESULTS:
        if f"click[{target}]" in obs:
            return (f"The result {goal['asin']} is the {goal['query']} the instruction describes, so I open it.",
                    f"click[{target}]")
        if f"click[{NEXT}]" in obs:
            return "The product I need is not on this page of results, so I look at the next page.", f"click[{NEXT}]"
        return "The product I need is not among these results, so I go back and search again.", f"click[{BACK}]"
    if page == PAGE_ITEM and env._asin is not None and env._asin.lower() == target:
        chosen = env._options
        for dim, value in goal["goal_options"].items():
            if chosen.get(dim) != value:
                return f"The instruction asks for {dim} {value}, so I select it.", f"click[{value}]"
        return "This product and its options match the instruction and the price is below the limit, so I buy it.", \
            f"click[{BUY}]"
    if f"click[{PREV}]" in obs:
        return "This page is not the product I need, so I go back.", f"click[{PREV}]"
    return "I go back to the search page.", f"click[{BACK}]"


def expert_reply(env: Any) -> str:
    """The expert's reply for ``env``'s current turn, in the format the agent is asked for."""
    thought, action = expert_step(env)
    return f"<think>{thought}</think><action>{action}</action>"
