"""Prompt assembly for one action turn: student prompt, privileged teacher prompt, reply format.

A turn's prompt is built from the task instruction, the current observation, the
admissible actions and a window of the last ``H`` (observation, action) history entries,
in verl-agent's layout (one user message; the model first reasons inside
``<think>...</think>`` and then gives exactly one action inside ``<action>...</action>``;
``icsd_audit.envs.base.parse_action`` reads the reply).

Search-QA follows its environment's protocol (``TurnContext.protocol``, set from the
observation): ``"search-r1"`` is Search-R1's one growing context per episode, the
question in Search-R1's prompt (its ``make_prefix``) followed by every reply (cut after
its first ``</search>``/``</answer>``) and every ``<information>`` block
(:func:`growing_pieces`, which the prompt builder tokenizes piece by piece as
Search-R1 concatenates ids); ``"verl-agent"`` is verl-agent's search prompt, rebuilt each
turn with the last ``history_window`` steps (SDAR's scripts: 4).

The privileged teacher sees the same prompt with the retrieved skill text ``z``
prepended, as SDAR does: SDAR (``build_teacher_batch`` in its trainer) puts
``"[Privileged Skill Information]\\n" + z + "\\n\\n"`` in front of the student's fully
rendered chat prompt. :func:`teacher_prompt_text` reproduces that exactly
(``placement="prefix"``, the default), so the teacher text is the student text with one
block in front of it; ``placement="user"`` instead puts the block at the start of the
user message, inside the chat template, for models that react badly to text before the
first chat header. Either way the response tokens are the same, so the teacher can score
the student's sampled tokens position by position.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

# defined in the env layer, so the tiny word model's lesson (train/models, below rollout/) builds the same prompts
from icsd_audit.envs.base import SKILL_HEADER, HistoryEntry, skill_block

__all__ = [
    "ENV_INTROS",
    "HistoryEntry",
    "REPLY_FORMAT",
    "REPLY_FORMATS",
    "SKILL_HEADER",
    "TurnContext",
    "build_messages",
    "growing_pieces",
    "is_growing",
    "observation_content",
    "render_history",
    "student_messages",
    "student_prompt_text",
    "teacher_messages",
    "teacher_prompt_text",
    "skill_block",
]


#: One line describing the agent's role, per environment; unknown names get a generic one.
ENV_INTROS: dict[str, str] = {
    "webshop": "You are an expert autonomous agent shopping in the WebShop e-commerce environment.",
    "alfworld": "You are an expert agent operating in the ALFRED Embodied Environment.",  # verl-agent's wording
    "searchqa": "You are an expert agent answering questions with the help of a search engine.",
}
_GENERIC_INTRO = "You are an expert autonomous agent acting in a text environment."

#: The reply format asked of the model (verl-agent style).
REPLY_FORMAT = (
    "Now it is your turn to take one action for the current step.\n"
    "First reason step by step about the current situation and which admissible action best "
    "advances the task; this reasoning MUST be enclosed within <think> </think> tags.\n"
    "Then give exactly one admissible action for the current step, enclosed within "
    "<action> </action> tags."
)

#: Environments whose replies use other tags than ``<action>`` (Search-R1's ``<search>``/``<answer>``).
REPLY_FORMATS: dict[str, str] = {
    "searchqa": (
        "Now it is your turn to respond for the current step.\n"
        "First reason step by step about what you know and what is missing; this reasoning MUST be enclosed "
        "within <think> </think> tags.\n"
        "Then do exactly one of the following. If some knowledge is missing, search for it: "
        "<search> your query </search>; the top results come back between <information> and </information>. "
        "If you can answer, give only the short answer, without explanation, between <answer> and </answer>, "
        "for example <answer> Beijing </answer>."
    ),
}


#: verl-agent's Search prompts (``agent_system/environments/prompts/search.py``), for
#: ``protocol="verl-agent"``: the first turn, and every later one with the history.
VERL_AGENT_SEARCH_FIRST = """
You are an expert agent tasked with answering the given question step-by-step.
Your question: {task_description}

Now it's your turn to respond for the current step.
You should first conduct reasoning process. This process MUST be enclosed within <think> </think> tags. 
After completing your reasoning, choose only one of the following actions (do not perform both):
(1) If you find you lack some knowledge, you can call a search engine to get more external information using format: <search> your query </search>.
(2) If you have enough knowledge to answer the question confidently, provide your final answer within <answer> </answer> tags, without detailed illustrations. For example, <answer>Beijing</answer>.
"""
VERL_AGENT_SEARCH = """
You are an expert agent tasked with answering the given question step-by-step.
Your question: {task_description}

Prior to this step, you have already taken {step_count} step(s). Below is the interaction history where <search> </search> wrapped your past search queries and <information> </information> wrapped the corresponding search results returned by the external search engine. History:
{memory_context}

Now it's your turn to respond for the current step.
You should first conduct reasoning process. This process MUST be enclosed within <think> </think> tags. 
After completing your reasoning, choose only one of the following actions (do not perform both):
(1) If you find you lack some knowledge, you can call a search engine to get more external information using format: <search> your query </search>.
(2) If you have enough knowledge to answer the question confidently, provide your final answer within <answer> </answer> tags, without detailed illustrations. For example, <answer>Beijing</answer>.
"""


@dataclass(frozen=True)
class TurnContext:
    """Everything a turn's prompt is built from.

    Attributes:
        task: the task instruction.
        observation: the current observation text.
        actions: the admissible actions; ``None`` when the environment takes free-form
            actions (Search-QA), which omits the list from the prompt.
        history: all previous steps of this trajectory, oldest first; the prompt shows
            the last ``history_window`` of them but counts all of them.
        env: environment name, for the opening line (see :data:`ENV_INTROS`).
    """

    task: str
    observation: str
    actions: Sequence[str] | None = None
    history: Sequence[HistoryEntry] = field(default_factory=tuple)
    env: str = "webshop"
    #: Exact SkillBank key of the task (a Search-QA data source, an ALFWorld task type), or None: keyword matching decides.
    key: str | None = None
    #: The environment's reply protocol where it has several (Search-QA: "search-r1" or "verl-agent").
    protocol: str | None = None
    #: Privileged text the environment itself gives for this episode (the clue env's clue): the teacher
    #: shows it in place of a retrieved skill; the student never sees it.
    privileged: str | None = None

    @property
    def step(self) -> int:
        """1-based number of the current step."""
        return len(self.history) + 1


def render_history(history: Sequence[HistoryEntry | tuple[str, str]], window: int) -> str:
    """The last ``window`` entries as ``[Observation k: '...', Action k: '...']`` lines.

    ``k`` is the absolute step number, so the model can tell how far back an entry is.
    Entries may be :class:`HistoryEntry` objects or ``(observation, action)`` pairs.
    """
    if window < 0:
        raise ValueError(f"history window must be >= 0, got {window}")
    if window == 0 or not history:
        return ""
    start = max(0, len(history) - window)
    lines = []
    for i, h in enumerate(history[start:], start):
        obs, act = (h.observation, h.action) if isinstance(h, HistoryEntry) else h
        lines.append(f"[Observation {i + 1}: '{obs}', Action {i + 1}: '{act}']")
    return "\n".join(lines)


def is_growing(ctx: TurnContext) -> bool:
    """Whether the turn's prompt is one growing context (Search-QA under Search-R1's protocol)."""
    return ctx.env.lower() == "searchqa" and ctx.protocol == "search-r1"


def _wrap_observation(text: str) -> str:
    """An observation as Search-R1 appends it to the context (generation.py, ``execute_predictions``)."""
    if not text:
        return ""
    return f"\n\n{text}\n\n" if text.startswith("<information>") else f"\n{text}\n"


def growing_pieces(ctx: TurnContext) -> list[str]:
    """The growing context after the first prompt: reply 1, observation after it, reply 2, ...

    Replies as the context keeps them (``HistoryEntry.reply``: cut after the first
    ``</search>``/``</answer>``), observations wrapped as Search-R1 wraps them
    (``\\n\\n<information>...</information>\\n\\n``; the invalid-reply message between single
    newlines). The observation after the last reply is the current one.
    """
    out: list[str] = []
    hist = list(ctx.history)
    for k, h in enumerate(hist):
        after = hist[k + 1].observation if k + 1 < len(hist) else ctx.observation
        out += [h.reply, _wrap_observation(after)]
    return [p for p in out if p]


def observation_content(ctx: TurnContext, history_window: int) -> str:
    """What a growing conversation adds after a reply: the new observation (Search-QA, whose
    prompts state the question once), or the whole turn prompt without its history block."""
    if ctx.env.lower() == "searchqa" and ctx.protocol is not None:
        return ctx.observation
    return _user_content(TurnContext(task=ctx.task, observation=ctx.observation, actions=ctx.actions, env=ctx.env,
                                     key=ctx.key, protocol=ctx.protocol), history_window)


def _verl_agent_search(ctx: TurnContext, history_window: int) -> str:
    """verl-agent's search prompt: its template and ``SearchMemory.fetch`` lines ``Step k:<action> <information>``."""
    hist = list(ctx.history)
    if not hist or history_window <= 0:
        return VERL_AGENT_SEARCH_FIRST.format(task_description=ctx.task)
    start = max(0, len(hist) - history_window)
    lines = []
    for k in range(start, len(hist)):
        after = hist[k + 1].observation if k + 1 < len(hist) else ctx.observation
        action = re.sub(r"<(search|answer)> (.*?) </\1>", r"<\1>\2</\1>", hist[k].action, flags=re.DOTALL)
        lines.append(f"Step {k + 1}:{action} {after}\n")
    return VERL_AGENT_SEARCH.format(task_description=ctx.task, memory_context="\n".join(lines), step_count=len(hist))


def _user_content(ctx: TurnContext, history_window: int) -> str:
    if ctx.env.lower() == "searchqa" and ctx.protocol == "search-r1":
        from icsd_audit.envs.searchqa.data import SEARCH_R1_PREFIX

        return SEARCH_R1_PREFIX.format(question=ctx.task)
    if ctx.env.lower() == "searchqa" and ctx.protocol == "verl-agent":
        return _verl_agent_search(ctx, history_window)
    if ctx.env.lower() == "clue":  # only the tiny word model's vocabulary: no intro, no reply instructions
        from icsd_audit.envs.clue.prompt import clue_prompt

        return clue_prompt(ctx.task, ctx.observation, ctx.history, history_window)
    intro = ENV_INTROS.get(ctx.env.lower(), _GENERIC_INTRO)
    parts = [intro, f"Your task is to: {ctx.task}"]
    shown = render_history(ctx.history, history_window)
    if shown:
        n_shown = min(len(ctx.history), history_window)
        parts.append(
            f"Prior to this step, you have already taken {len(ctx.history)} step(s). Below are the most recent "
            f"{n_shown} observation(s) and the action(s) you took:\n{shown}"
        )
        parts.append(f"You are now at step {ctx.step} and your current observation is: {ctx.observation}")
    else:
        parts.append(f"Your current observation is: {ctx.observation}")
    if ctx.actions is not None:
        listed = "\n".join(f"'{a}'," for a in ctx.actions)
        parts.append(f"Your admissible actions of the current situation are:\n[\n{listed}\n]")
    parts.append(REPLY_FORMATS.get(ctx.env.lower(), REPLY_FORMAT))
    return "\n".join(parts)




def build_messages(
    ctx: TurnContext,
    *,
    history_window: int = 2,
    system: str | None = None,
    skill_text: str | None = None,
) -> list[dict[str, str]]:
    """Chat messages for one turn; with ``skill_text`` the user message starts with it."""
    content = _user_content(ctx, history_window)
    if skill_text is not None:
        content = skill_block(skill_text) + content
    msgs: list[dict[str, str]] = []
    if system is not None:
        msgs.append({"role": "system", "content": system})
    msgs.append({"role": "user", "content": content})
    return msgs


def student_messages(ctx: TurnContext, *, history_window: int = 2, system: str | None = None) -> list[dict[str, str]]:
    """The student's chat messages for one turn (no privileged context)."""
    return build_messages(ctx, history_window=history_window, system=system)


def teacher_messages(
    ctx: TurnContext, skill_text: str, *, history_window: int = 2, system: str | None = None
) -> list[dict[str, str]]:
    """The teacher's messages with the skill block inside the user message (``placement="user"``)."""
    return build_messages(ctx, history_window=history_window, system=system, skill_text=skill_text)


def student_prompt_text(tokenizer: Any, ctx: TurnContext, *, history_window: int = 2, system: str | None = None) -> str:
    """The student's prompt rendered with the tokenizer's chat template (generation header included)."""
    from icsd_audit.train.models.loading import chat_prompt

    return chat_prompt(tokenizer, student_messages(ctx, history_window=history_window, system=system))


def teacher_prompt_text(
    tokenizer: Any,
    ctx: TurnContext,
    skill_text: str,
    *,
    history_window: int = 2,
    system: str | None = None,
    placement: Literal["prefix", "user"] = "prefix",
) -> str:
    """The privileged teacher's prompt text.

    ``placement="prefix"`` (SDAR): :func:`skill_block` + the student's rendered prompt,
    so ``teacher == skill_block(z) + student`` holds character for character.
    ``placement="user"``: the block opens the user message inside the chat template.
    """
    from icsd_audit.train.models.loading import chat_prompt

    if placement == "prefix":
        return skill_block(skill_text) + student_prompt_text(
            tokenizer, ctx, history_window=history_window, system=system
        )
    if placement == "user":
        return chat_prompt(tokenizer, teacher_messages(ctx, skill_text, history_window=history_window, system=system))
    raise ValueError(f"placement must be 'prefix' (SDAR) or 'user', got {placement!r}")
