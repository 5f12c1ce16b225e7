"""Clue: find the key hidden in one of N boxes, with left/right feedback; the teacher gets a clue.

The rules (docs/envs.md, "Clue"):

* A task hides the key in one box of ``boxes`` (numbered 1..boxes). The first
  observation is ``start 1 to N``.
* A turn's reply is ``open K``: exactly those two words, K a box number in range
  (case and surrounding whitespace do not matter). The environment answers ``found``
  (the episode ends, reward 1, won) when the key is in box K, else ``left LO to HI``
  or ``right LO to HI``: the side of K the key is on, then the boxes the key can still
  be in given every answer so far. Opening a box again is valid and gets the same
  answer.
* Any other reply is invalid: the observation is ``invalid LO to HI`` (the interval
  unchanged), nothing else changes, the turn counts, and ``info["valid_action"]`` is
  False (the trainer's invalid-action penalty then applies; :meth:`ClueEnv.reply_valid`
  is the ``format`` rule).
* After ``max_steps`` turns without ``found`` the episode ends with reward 0.
* The privileged teacher sees ``clue key in box C`` (``Observation.meta["privileged"]``),
  where C is the key's box with probability ``clue_accuracy`` and another box otherwise
  (:mod:`.tasks`: fixed per task, nested across accuracies).

The student never sees the clue; with feedback it can always win by bisection when
``max_steps >= ceil(log2(boxes + 1))`` (the expert, :mod:`.expert`, does exactly that).
"""

from __future__ import annotations

import math
import numbers
import random
import re
from typing import Any

from ..base import Observation, ParsedAction, StepResult, normalize_action, step_info
from .tasks import ClueTask, clue_text, make_tasks
from .vocab import FOUND, INVALID, LEFT, MAX_BOXES, OPEN, RIGHT, START

__all__ = ["ClueEnv", "parse_reply", "INSTRUCTION"]

#: The task instruction (the same for every task: only the feedback tells tasks apart).
INSTRUCTION = "boxes 1 to {boxes} ."
_OPEN = re.compile(rf"^{OPEN} (\d+)$")


def parse_reply(text: str, *, boxes: int) -> ParsedAction:
    """The action of a reply: ``open K`` with 1 <= K <= boxes is valid, anything else is not."""
    action = normalize_action(text or "")
    if not action:
        return ParsedAction(action="", valid=False, reason="empty")
    m = _OPEN.match(action)
    if m is None or not 1 <= int(m.group(1)) <= boxes:
        return ParsedAction(action=action, valid=False, reason="not_admissible")
    return ParsedAction(action=f"{OPEN} {int(m.group(1))}", valid=True, reason="")


class ClueEnv:
    """Clue episodes (see the module docstring).

    Args:
        split: ``"train"`` or ``"eval"`` (``"test"`` is an alias).
        max_steps: turn budget.
        seed: seeds the draw of a task when ``reset()`` gets none.
        boxes: number of boxes (2..:data:`~.vocab.MAX_BOXES`).
        clue_accuracy: probability that a task's clue names the key's box.
    """

    name = "clue"

    def __init__(self, split: str = "train", *, max_steps: int = 4, seed: int = 0, boxes: int = 8,
                 clue_accuracy: float = 1.0):
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        if not 2 <= boxes <= MAX_BOXES:
            raise ValueError(f"boxes must lie in 2..{MAX_BOXES} (the word vocabulary's box numbers), got {boxes}")
        if not 0.0 <= clue_accuracy <= 1.0:
            raise ValueError(f"clue_accuracy must lie in [0, 1], got {clue_accuracy}")
        self.split, self.max_steps, self.boxes = split, int(max_steps), int(boxes)
        self.clue_accuracy = float(clue_accuracy)
        self.tasks: tuple[ClueTask, ...] = make_tasks(split, boxes=self.boxes, clue_accuracy=self.clue_accuracy)
        self._rng = random.Random(seed)
        self._task: ClueTask | None = None
        self._done = True
        self._steps = 0
        # the key's possible boxes given the feedback so far (the expert's interval)
        self._lo, self._hi = 1, self.boxes

    @property
    def num_tasks(self) -> int:
        return len(self.tasks)

    @property
    def task(self) -> ClueTask | None:
        """The current task (privileged: the key's box and the clue)."""
        return self._task

    @property
    def steps(self) -> int:
        return self._steps

    @property
    def interval(self) -> tuple[int, int]:
        """The boxes (lo, hi) the key can still be in, given this episode's feedback."""
        return self._lo, self._hi

    @property
    def data_info(self) -> dict[str, Any]:
        """Recorded in dump metadata."""
        return {"tasks": "generated", "boxes": self.boxes, "clue_accuracy": self.clue_accuracy, "synthetic": True,
                "bisection_turns": math.ceil(math.log2(self.boxes + 1))}

    def parse_reply(self, text: str, *, require_think: bool = False) -> ParsedAction:
        """The reply's action (``require_think`` does not apply: replies have no reasoning block)."""
        return parse_reply(text, boxes=self.boxes)

    def reply_valid(self, text: str) -> bool:
        """The ``format`` rule: a reply is valid when it is ``open K`` with K in range."""
        return parse_reply(text, boxes=self.boxes).valid

    def reset(self, task: int | ClueTask | None = None) -> Observation:
        if task is None:
            t = self.tasks[self._rng.randrange(len(self.tasks))]
        elif isinstance(task, ClueTask):
            t = task
        elif isinstance(task, numbers.Integral) and not isinstance(task, bool):
            if not 0 <= int(task) < len(self.tasks):
                raise IndexError(f"task index {task} out of range for split {self.split!r} ({len(self.tasks)} tasks)")
            t = self.tasks[int(task)]
        else:
            raise TypeError(f"task must be an int index, a ClueTask or None, not {type(task).__name__}")
        self._task, self._done, self._steps = t, False, 0
        self._lo, self._hi = 1, t.boxes
        return self._obs(self._answer(START))

    def step(self, action: str) -> StepResult:
        if self._done or self._task is None:
            raise RuntimeError("the episode is over; call reset() first")
        self._steps += 1
        parsed = parse_reply(action, boxes=self.boxes)
        reward, won = 0.0, False
        if not parsed.valid:
            text = self._answer(INVALID)
        else:
            k = int(parsed.action.split()[1])
            target = self._task.target
            if k == target:
                text, reward, won, self._done = FOUND, 1.0, True, True
            elif target < k:
                self._hi = min(self._hi, k - 1)
                text = self._answer(LEFT)
            else:
                self._lo = max(self._lo, k + 1)
                text = self._answer(RIGHT)
        truncated = not self._done and self._steps >= self.max_steps
        self._done = self._done or truncated
        info = step_info(won=won, score=reward, valid_action=parsed.valid, steps=self._steps, truncated=truncated,
                         clue_right=self._task.clue_right)
        return StepResult(self._obs(text), reward, self._done, info)

    def _answer(self, word: str) -> str:
        return f"{word} {self._lo} to {self._hi}"

    def _obs(self, text: str) -> Observation:
        assert self._task is not None
        meta = {"step": self._steps, "privileged": clue_text(self._task), "skill_key": None,
                "clue_right": self._task.clue_right}
        return Observation(text=text, available_actions=(), instruction=INSTRUCTION.format(boxes=self.boxes), meta=meta)
