"""The environment protocol the multi-turn trainer talks to, and the action parser.

An environment is anything with ``reset(task) -> Observation`` and
``step(action) -> StepResult`` (see :class:`TextEnv`). Observations carry the text the
agent sees, the admissible actions (strings) and the task instruction; a step's ``info``
always holds ``won`` (bool), ``score`` (float) and ``valid_action`` (bool), so a trainer
can penalise invalid actions as verl-agent does.

Admissible actions are plain strings. An entry of the form ``verb[<placeholder>]``
(e.g. ``search[<your query>]``) is a template: it admits ``verb[anything non-empty]``
except the placeholder itself. Every other entry admits exactly itself, compared after
:func:`normalize_action` (case-insensitive, whitespace collapsed).

:func:`parse_action` turns free-form model text into an action the verl-agent way: the
model is asked to answer ``<think>...</think><action>...</action>``; the text inside the
first ``<action>...</action>`` (tags matched case-insensitively) is the action. A reply
without that block, or whose action is not admissible, is invalid.

Two notions of an invalid turn exist and the trainer picks one (``invalid_rule``):
:func:`well_formed` is verl-agent's rule (its environment projections' ``valids``:
only a malformed reply is invalid, whatever the environment makes of the action);
:attr:`ParsedAction.valid` together with the environment's ``valid_action`` also counts a
well-formed but non-admissible action as invalid (this toolkit's stricter option).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

__all__ = [
    "Observation",
    "StepResult",
    "ParsedAction",
    "TextEnv",
    "normalize_action",
    "is_admissible",
    "match_admissible",
    "parse_action",
    "well_formed",
    "step_info",
    "HistoryEntry",
    "SKILL_HEADER",
    "skill_block",
]


@dataclass(frozen=True)
class Observation:
    """What the agent sees before choosing an action."""

    #: The page or state as text (environment-specific format).
    text: str
    #: Admissible actions; may contain templates such as ``search[<your query>]``.
    available_actions: tuple[str, ...]
    #: The task instruction (constant over an episode).
    instruction: str
    #: Environment-specific extras (e.g. the page kind, the step number); not for the prompt.
    meta: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StepResult:
    """The outcome of one ``step``: gym's (observation, reward, done, info)."""

    observation: Observation
    reward: float
    done: bool
    #: Always has ``won`` (bool), ``score`` (float), ``valid_action`` (bool).
    info: dict[str, Any]

    @property
    def won(self) -> bool:
        return bool(self.info.get("won", False))


@dataclass(frozen=True)
class ParsedAction:
    """Result of :func:`parse_action`."""

    #: The action to send to ``step`` ('' when no action block was found).
    action: str
    #: True when the block was found and the action is admissible.
    valid: bool
    #: '' when valid; otherwise ``"no_action_tag"``, ``"no_think_tag"``, ``"empty"`` or ``"not_admissible"``.
    reason: str


@runtime_checkable
class TextEnv(Protocol):
    """A text environment for multi-turn agents.

    ``reset`` takes a task index into the environment's task list (``None`` draws one
    with the environment's seeded RNG; environments may also accept a task object) and
    returns the first observation. ``step`` takes an action string; an invalid or
    inadmissible action leaves the state unchanged, counts as a step and returns
    ``info["valid_action"] = False``. An episode ends on success/purchase or when
    ``max_steps`` steps have been taken (then with reward 0).
    """

    name: str
    max_steps: int

    @property
    def num_tasks(self) -> int: ...

    def reset(self, task: Any = None) -> Observation: ...

    def step(self, action: str) -> StepResult: ...


_WS = re.compile(r"\s+")
_TEMPLATE = re.compile(r"^([^\[\]]+)\[<[^<>]*>\]$")
_CALL = re.compile(r"^([^\[\]]+)\[(.*)\]$", re.DOTALL)
_ACTION_BLOCK = re.compile(r"<action>(.*?)</action>", re.IGNORECASE | re.DOTALL)
_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.IGNORECASE | re.DOTALL)
_CJK = re.compile(r"[\u4e00-\u9fff]")


def normalize_action(action: str) -> str:
    """Lower-case, strip, collapse runs of whitespace to one space."""
    return _WS.sub(" ", action).strip().lower()


def match_admissible(action: str, available: Sequence[str]) -> str | None:
    """The normalised action if ``available`` admits it, else ``None``."""
    act = normalize_action(action)
    if not act:
        return None
    call = _CALL.match(act)
    for entry in available:
        norm = normalize_action(entry)
        if act == norm and not _TEMPLATE.match(norm):
            return act
        tmpl = _TEMPLATE.match(norm)
        if tmpl and call and call.group(1).strip() == tmpl.group(1).strip():
            arg = call.group(2).strip()
            placeholder = norm[len(tmpl.group(1)) + 1 : -1]
            if arg and arg != placeholder:
                return f"{call.group(1).strip()}[{arg}]"
    return None


def is_admissible(action: str, available: Sequence[str]) -> bool:
    """Whether ``available`` admits ``action`` (see the module docstring)."""
    return match_admissible(action, available) is not None


def parse_action(
    text: str,
    available: Sequence[str] | None = None,
    *,
    require_think: bool = False,
) -> ParsedAction:
    """Extract the action from a model reply ``<think>...</think><action>...</action>``.

    With ``available`` the action must also be admissible; without it any non-empty
    action block is valid. ``require_think`` additionally demands a ``<think>`` block, as
    verl-agent's WebShop projection does.
    """
    m = _ACTION_BLOCK.search(text)
    if m is None:
        return ParsedAction(action="", valid=False, reason="no_action_tag")
    action = normalize_action(m.group(1))
    if not action:
        return ParsedAction(action="", valid=False, reason="empty")
    if require_think and _THINK_BLOCK.search(text) is None:
        return ParsedAction(action=action, valid=False, reason="no_think_tag")
    if available is not None:
        matched = match_admissible(action, available)
        if matched is None:
            return ParsedAction(action=action, valid=False, reason="not_admissible")
        action = matched
    return ParsedAction(action=action, valid=True, reason="")


def well_formed(text: str, *, require_think: bool = False) -> bool:
    """verl-agent's validity rule for a reply (``webshop_projection`` / ``alfworld_projection``).

    Valid when the lower-cased reply contains both ``<action>`` and ``</action>`` (their
    order and the content between them are not checked: ``<action></action>`` is valid),
    with ``require_think`` also both ``<think>`` and ``</think>`` (matched case-
    sensitively, as verl-agent searches the original string), and no CJK ideograph
    (U+4E00 to U+9FFF) anywhere in the reply. Admissibility plays no part: a well-formed
    reply naming an action the page does not offer is valid here (the environment
    treats it as a no-op).
    """
    low = text.lower()
    if low.find("<action>") == -1 or low.find("</action>") == -1:
        return False
    if require_think and (text.find("<think>") == -1 or text.find("</think>") == -1):
        return False
    return _CJK.search(text) is None


def step_info(*, won: bool, score: float, valid_action: bool, **extra: Any) -> dict[str, Any]:
    """The ``info`` dict every environment returns: the three required keys, then extras."""
    info: dict[str, Any] = {"won": bool(won), "score": float(score), "valid_action": bool(valid_action)}
    info.update(extra)
    return info


#: SDAR's header for the privileged block.
SKILL_HEADER = "[Privileged Skill Information]"


@dataclass(frozen=True)
class HistoryEntry:
    """One past step: the observation the agent saw, the action it took and (for a growing
    context) its reply as the context keeps it."""

    observation: str
    action: str
    reply: str = ""


def skill_block(skill_text: str) -> str:
    """SDAR's privileged block: header, the skill text, then a blank line."""
    return f"{SKILL_HEADER}\n{skill_text}\n\n"
