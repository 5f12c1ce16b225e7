"""Prompt assembly for one action turn: student prompt, privileged teacher prompt, reply format.

A turn's prompt is built from the task instruction, the current observation, the
admissible actions and a window of the last ``H`` (observation, action) history entries,
in verl-agent's layout (one user message; the model first reasons inside
``<think>...</think>`` and then gives exactly one action inside ``<action>...</action>``;
``icsd_audit.envs.base.parse_action`` reads the reply).

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

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "ENV_INTROS",
    "HistoryEntry",
    "REPLY_FORMAT",
    "REPLY_FORMATS",
    "SKILL_HEADER",
    "TurnContext",
    "build_messages",
    "render_history",
    "student_messages",
    "student_prompt_text",
    "teacher_messages",
    "teacher_prompt_text",
    "skill_block",
]

#: SDAR's header for the privileged block.
SKILL_HEADER = "[Privileged Skill Information]"

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


@dataclass(frozen=True)
class HistoryEntry:
    """One past step: the observation the agent saw and the action it took."""

    observation: str
    action: str


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
    #: Exact SkillBank key of the task (a Search-QA data source), or None: keyword matching decides.
    key: str | None = None

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


def _user_content(ctx: TurnContext, history_window: int) -> str:
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


def skill_block(skill_text: str) -> str:
    """SDAR's privileged block: header, the skill text, then a blank line."""
    return f"{SKILL_HEADER}\n{skill_text}\n\n"


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
    from icsd_audit.train.models import chat_prompt

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
    from icsd_audit.train.models import chat_prompt

    if placement == "prefix":
        return skill_block(skill_text) + student_prompt_text(
            tokenizer, ctx, history_window=history_window, system=system
        )
    if placement == "user":
        return chat_prompt(tokenizer, teacher_messages(ctx, skill_text, history_window=history_window, system=system))
    raise ValueError(f"placement must be 'prefix' (SDAR) or 'user', got {placement!r}")
