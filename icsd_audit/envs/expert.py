"""Expert replies for every built-in environment, by name: the oracle the tests play and warm starts learn from.

``expert_reply(env)`` returns the reply an expert agent writes for ``env``'s current
turn, in the format the agent is asked for. Each expert reads the environment's
privileged state (WebShop's goal, ALFWorld's handcoded expert, Search-QA's oracle
chain and gold answers), so it plays only the built-in environments:

* ``webshop``: :mod:`.webshop.expert` (the goal path);
* ``alfworld``: :mod:`.alfworld.expert` (ALFWorld's handcoded expert; the environment
  needs ``expert=True``);
* ``searchqa``: :mod:`.searchqa.expert` (oracle searches, then the gold answer);
* ``clue``: :mod:`.clue.expert` (bisection on the feedback).

The trainer's :class:`icsd_audit.train.rollout.policy.ExpertPolicy` plays them through the
same prompts, parser, validity rule and rewards as a model.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["EXPERTS", "expert_reply"]

#: Environment name -> the module whose ``expert_reply(env)`` plays it.
EXPERTS = {"webshop": "icsd_audit.envs.webshop.expert", "alfworld": "icsd_audit.envs.alfworld.expert",
           "searchqa": "icsd_audit.envs.searchqa.expert", "clue": "icsd_audit.envs.clue.expert"}


def expert_reply(env: Any) -> str:
    """The expert's reply for the current turn of ``env`` (a built-in environment mid-episode)."""
    name = getattr(env, "name", None)
    if name not in EXPERTS:
        raise ValueError(f"no expert for environment {name!r}; experts exist for {', '.join(EXPERTS)}")
    return str(importlib.import_module(EXPERTS[name]).expert_reply(env))
