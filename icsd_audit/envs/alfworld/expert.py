"""The ALFWorld expert: ALFWorld's handcoded expert (``HandCodedTWAgent``), as the agent would write it.

The environment must carry the expert (``AlfWorldEnv(expert=True)``, or ``make_env("alfworld",
expert=True)``); :meth:`~.env.AlfWorldEnv.expert_action` gives its next command, which
this module wraps in the reply format the agent is asked for,
``<think>...</think><action>...</action>``, with one sentence of reasoning read off the
command and the task (nothing the agent cannot see).
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["expert_reply", "reasoning"]

_RULES: tuple[tuple[re.Pattern[str], str], ...] = tuple((re.compile(p), t) for p, t in (
    (r"^go to (.+)$", "To {task}, I go to {0} to look for what I need or to use it."),
    (r"^open (.+)$", "{0} is closed; I open it to see what is inside."),
    (r"^close (.+)$", "I am done with {0}, so I close it."),
    (r"^take (.+) from (.+)$", "{0} is what the task needs, so I take it from {1}."),
    (r"^(?:put|move) (.+) (?:in/on|in|on) (.+)$", "The task wants {0} in {1}, so I put it there."),
    (r"^heat (.+) with (.+)$", "The task wants {0} hot, so I heat it with {1}."),
    (r"^cool (.+) with (.+)$", "The task wants {0} cool, so I cool it with {1}."),
    (r"^clean (.+) with (.+)$", "The task wants {0} clean, so I clean it with {1}."),
    (r"^use (.+)$", "I turn on {0} to look at the object in its light."),
    (r"^examine (.+)$", "I examine {0} to check what it is."),
    (r"^inventory$", "I check what I am carrying."),
    (r"^look$", "I look around to see where I am and what is here."),
))


def reasoning(command: str, task: str) -> str:
    """One sentence of reasoning for ``command`` towards ``task``."""
    for pattern, template in _RULES:
        m = pattern.match(command)
        if m:
            return template.format(*m.groups(), task=task.rstrip("."))
    return f"To {task.rstrip('.')}, my next step is: {command}."


def expert_reply(env: Any) -> str:
    """The handcoded expert's reply for ``env``'s current turn."""
    command = env.expert_action()
    return f"<think>{reasoning(command, env._instruction)}</think><action>{command}</action>"
