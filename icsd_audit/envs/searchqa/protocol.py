"""How a Search-QA reply is read and what comes back: Search-R1's rules or verl-agent's.

Two references run Search-QA episodes, and they differ in the details an agent is
trained on. The environment takes one of them by name (``protocol``):

* ``"search-r1"`` (default): Search-R1's rollout loop (``search_r1/llm_agent/generation.py``).
  A reply is cut after its first ``</search>``, else after its first ``</answer>``
  (``_postprocess_responses``, lines 61-65); the first ``<search>`` or ``<answer>``
  block of what is left is the action (``postprocess_predictions``, lines 422-430, regex
  ``<(search|answer)>(.*?)</\\1>``, case-sensitive); a reply is *valid* exactly when such
  a block exists (``execute_predictions``, lines 384-401: ``valid_action`` is 1 for an
  answer or a search, 0 otherwise). ``<think>`` plays no part and an empty block is a
  valid (empty) search or answer. Search results come back as
  ``<information>Doc 1(Title: t) text ...</information>`` (``_passages2string``, line 460),
  an invalid reply as the "My previous action is invalid ..." text (line 396).
* ``"verl-agent"``: verl-agent's search environment, which SDAR's scripts run
  (``agent_system/environments/env_package/search/projection.py``, ``search_projection``):
  the same cut, then the first ``<search>`` block, else the first ``<answer>`` block
  (case-insensitive); the reply is *invalid* when it has neither, or has both a
  ``<search>`` and an ``<answer>`` tag, or more than one of either (tags counted on the
  uncut reply). Search results come back as ``<information>{"result": "Doc 1: ..."}</information>``
  (``skyrl_gym/tools/search.py``, ``_passages2string`` and the ``json.dumps`` of ``search``),
  an invalid reply as an empty observation (the tool is not called).

Both end an episode at the turn limit on a turn whose search is not run: Search-R1's
final rollout calls ``execute_predictions(..., do_search=False)`` (generation.py line 297)
and verl-agent's environment is done once ``turns >= max_turns`` before it runs the tool.
"""

from __future__ import annotations

import json
import re
from typing import Any, Sequence

from ..base import ParsedAction
from .retriever import format_passages

__all__ = ["PROTOCOLS", "INVALID_MESSAGE", "cut_reply", "parse_reply", "reply_valid", "information",
           "invalid_observation"]

PROTOCOLS = ("search-r1", "verl-agent")

#: Search-R1's observation after an unparseable reply (generation.py, ``execute_predictions``).
INVALID_MESSAGE = ("My previous action is invalid. If I want to search, I should put the query between <search> and "
                   "</search>. If I want to give the final answer, I should put the answer between <answer> and "
                   "</answer>. Let me try again.")

_BLOCK = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
_SEARCH = re.compile(r"<search>(.*?)</search>", re.IGNORECASE | re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.IGNORECASE | re.DOTALL)
_SEARCH_TAG = re.compile(r"<search>", re.IGNORECASE)
_ANSWER_TAG = re.compile(r"<answer>", re.IGNORECASE)
_THINK = re.compile(r"<think>.*?</think>", re.IGNORECASE | re.DOTALL)


def _check(protocol: str) -> str:
    if protocol not in PROTOCOLS:
        raise ValueError(f"Search-QA protocol {protocol!r}: choose one of {list(PROTOCOLS)}")
    return protocol


def cut_reply(text: str) -> str:
    """The reply up to and including its first ``</search>``, else its first ``</answer>`` (both references)."""
    if "</search>" in text:
        return text.split("</search>", 1)[0] + "</search>"
    if "</answer>" in text:
        return text.split("</answer>", 1)[0] + "</answer>"
    return text


def _block(text: str, protocol: str) -> tuple[str, str, int] | None:
    """(tag, content, start) of the block the protocol acts on, in the cut reply."""
    cut = cut_reply(text)
    if protocol == "search-r1":
        m = _BLOCK.search(cut)
        return None if m is None else (m.group(1), m.group(2), m.start())
    m = _SEARCH.search(cut)
    if m is not None:
        return "search", m.group(1), m.start()
    m = _ANSWER.search(cut)
    return None if m is None else ("answer", m.group(1), m.start())


def parse_reply(text: str, *, require_think: bool = False, protocol: str = "search-r1") -> ParsedAction:
    """The action of a reply: ``<search> q </search>`` / ``<answer> a </answer>`` with whitespace collapsed.

    ``valid`` is the protocol's rule (:func:`reply_valid`), and with ``require_think``
    (this toolkit's stricter option, neither reference asks for it) also a ``<think>``
    block before the action. An unreadable reply gives action ``''``.
    """
    found = _block(text, _check(protocol))
    if found is None:
        return ParsedAction(action="", valid=False, reason="no_action_tag")
    tag, content, start = found
    action = f"<{tag}> {' '.join(content.split())} </{tag}>"
    if not reply_valid(text, protocol=protocol):
        return ParsedAction(action=action, valid=False, reason="several_actions")
    if require_think and _THINK.search(text[:start]) is None:
        return ParsedAction(action=action, valid=False, reason="no_think_tag")
    return ParsedAction(action=action, valid=True, reason="")


def reply_valid(text: str, *, protocol: str = "search-r1") -> bool:
    """Whether the protocol's reference counts the reply as a valid action (see the module docstring)."""
    if _block(text, _check(protocol)) is None:
        return False
    if protocol == "search-r1":
        return True
    n_search, n_answer = len(_SEARCH_TAG.findall(text)), len(_ANSWER_TAG.findall(text))
    return not (n_search and n_answer) and n_search <= 1 and n_answer <= 1


def information(docs: Sequence[dict[str, Any]], *, protocol: str = "search-r1") -> str:
    """The observation after a search that returned ``docs``."""
    if _check(protocol) == "search-r1":
        return f"<information>{format_passages(docs).strip()}</information>"
    body = "".join(f"Doc {i}: {str(d.get('contents', '')).strip()}\n" for i, d in enumerate(docs, 1))
    return "<information>" + json.dumps({"result": body if docs else "No search results found."}) + "</information>"


def invalid_observation(protocol: str = "search-r1") -> str:
    """The observation after an invalid reply: Search-R1's message, or nothing (verl-agent)."""
    return INVALID_MESSAGE if _check(protocol) == "search-r1" else ""
