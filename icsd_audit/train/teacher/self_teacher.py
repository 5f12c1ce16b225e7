"""The privileged self-teacher: the policy itself, without gradient, with a skill prepended.

For every action-turn row, the teacher sees the student's prompt with the retrieved
skill text ``z`` in front of it (SDAR's ``[Privileged Skill Information]`` block; the
skill is retrieved from a SkillBank by keyword match, ``skill_match``: on the whole
student prompt as SDAR does, or on the task instruction) and scores the *same* response
tokens the student sampled.

**Timing (SDAR's choice).** By default the teacher runs once per step, before the actor
update, with the weights the rollout used; during the update its log-probs are
constants (``sg`` in the paper). ``delta = teacher_logp - student_logp`` is formed in the
actor at allocation time (:mod:`icsd_audit.train.update.actor`) with the student log-prob of
that moment, so after the first optimizer step of a step, delta pairs a current student
with a rollout-time teacher. That is what SDAR's trainer does (one teacher
``compute_log_prob`` per batch, before ``update_actor``). ``teacher_rescore=True`` instead
re-scores the teacher rows of every mini-batch after the first with the current weights
(one more no-grad forward over the teacher prompts per mini-batch), so that both sides
of delta come from the same weights.

:class:`NoTeacher` stands in for runs without distillation (``allocator="none"``): it
costs nothing and reports no teacher.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from icsd_audit.train.update.logprobs import score_rows, split_rows
from icsd_audit.train.rollout.collect import PromptBuilder, TurnRow
from icsd_audit.train.teacher.skills import SkillBank

__all__ = ["SelfTeacher", "NoTeacher", "make_teacher", "skill_retriever"]


def skill_retriever(bank: SkillBank, *, skill_mode: str, skill_match: str) -> Callable[[Any, str], str]:
    """``fn(ctx, student_text)`` -> skill text by the run's rule (the teacher's rule, for a skilled student)."""
    cache: dict[tuple[str, str | None], str] = {}

    def fn(ctx: Any, student_text: str) -> str:
        key = getattr(ctx, "key", None)
        if skill_match == "sdar" and skill_mode == "match":
            return bank.retrieve_sdar(student_text, key=key).text
        if (ctx.task, key) not in cache:
            cache[(ctx.task, key)] = bank.retrieve(ctx.task, key=key, mode=skill_mode).text
        return cache[(ctx.task, key)]

    return fn


class SelfTeacher:
    """Scores rows under the privileged prompt with the (shared) policy weights."""

    enabled = True

    def __init__(self, model: Any, builder: PromptBuilder, bank: SkillBank | None, *, skill_mode: str, micro_batch_rows: int,
                 pad_id: int, device: torch.device, temperature: float, precision: str, skill_match: str = "sdar"):
        self.model, self.builder, self.bank = model, builder, bank
        self.skill_mode = skill_mode
        self.skill_match = skill_match
        self.micro_batch_rows = micro_batch_rows
        self.pad_id, self.device, self.temperature, self.precision = pad_id, device, temperature, precision
        self._skills: dict[tuple[str, str | None], str] = {}
        self.last_stats: dict[str, float] = {}
        #: The privileged prompt ids of the last scored rows (for ``teacher_rescore``).
        self.last_prompts: list[list[int]] | None = None

    def skill(self, task_text: str, key: str | None = None) -> str:
        """The retrieved skill text z for a task instruction and optional exact key (``skill_match='instruction'``; cached)."""
        if (task_text, key) not in self._skills:
            self._skills[(task_text, key)] = self.bank.retrieve(task_text, key=key, mode=self.skill_mode).text
        return self._skills[(task_text, key)]

    def skill_for(self, row: TurnRow) -> str:
        """The skill text z for one turn: the environment's own privileged text when it gives one (the clue env),
        else the bank's by the configured rule (an exact ``ctx.key`` wins in both)."""
        own = getattr(row.ctx, "privileged", None)
        if own is not None:
            return own
        if self.bank is None:
            raise ValueError(f"environment {row.ctx.env!r} gave no privileged text and the teacher has no SkillBank")
        key = getattr(row.ctx, "key", None)
        if self.skill_match == "sdar" and self.skill_mode == "match":
            return self.bank.retrieve_sdar(self.builder.student_text(row.ctx), key=key).text
        return self.skill(row.ctx.task, key)

    def prompts(self, rows: Sequence[TurnRow]) -> list[list[int]]:
        return [self.builder.teacher(r.ctx, r.prompt_ids, self.skill_for(r))[0] for r in rows]

    def score(self, rows: Sequence[TurnRow]) -> list[Tensor] | None:
        """Teacher log-probs of each row's response tokens (float32 CPU tensors)."""
        prompts = self.prompts(rows)
        self.last_prompts = prompts
        order = sorted(range(len(rows)), key=lambda i: len(prompts[i]) + len(rows[i].response_ids))
        out = score_rows(self.model, prompts, [r.response_ids for r in rows], split_rows(order, self.micro_batch_rows),
                         pad_id=self.pad_id, device=self.device, temperature=self.temperature, precision=self.precision)
        n = max(len(rows), 1)
        self.last_stats = {"teacher_prompt_tokens_mean": sum(len(p) for p in prompts) / n}
        return [out[i] for i in range(len(rows))]


class NoTeacher:
    """No distillation: no teacher pass."""

    enabled = False
    last_stats: dict[str, float] = {}
    last_prompts = None

    def score(self, rows: Sequence[TurnRow]) -> None:
        return None


def make_teacher(enabled: bool, **kwargs: Any) -> SelfTeacher | NoTeacher:
    return SelfTeacher(**kwargs) if enabled else NoTeacher()
