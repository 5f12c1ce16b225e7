"""The clue environment's tasks: where the key is, and the clue the privileged teacher sees.

Task i of a split is row i of three seeded streams (the key's box, a uniform ``u``, the
wrong box), seeded by (split, boxes), so a task is the same in every run and every
process, whatever ``clue_accuracy`` is. One uniform
draw ``u`` decides the clue: right when ``u < clue_accuracy``, else a box drawn
uniformly from the other ``boxes - 1``. Because ``u`` does not depend on the accuracy,
raising the accuracy only turns wrong clues right (the settings are nested), and the
share of right clues over ``n`` tasks is a Binomial(n, clue_accuracy) draw.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

__all__ = ["ClueTask", "SPLIT_SIZES", "SPLIT_IDS", "make_task", "make_tasks", "clue_text"]

#: Tasks per split (the held-out split is what ``icsd eval`` and the trainer's evaluation draw from).
SPLIT_SIZES = {"train": 4096, "eval": 512}
#: A number per split, mixed into every task's seed ('test' is an alias of 'eval').
SPLIT_IDS = {"train": 1, "eval": 2}


@dataclass(frozen=True)
class ClueTask:
    """One hidden key."""

    index: int
    #: The box holding the key (1-based).
    target: int
    #: The box the clue names (1-based); equals ``target`` when the clue is right.
    clue: int
    #: Number of boxes (1..boxes).
    boxes: int

    @property
    def clue_right(self) -> bool:
        return self.clue == self.target


def make_task(split_id: int, index: int, *, boxes: int, clue_accuracy: float) -> ClueTask:
    """Task ``index`` of the split numbered ``split_id`` (see the module docstring)."""
    return _split_tasks(int(split_id), int(boxes), float(clue_accuracy), int(index) + 1)[int(index)]


@lru_cache(maxsize=16)
def _split_tasks(split_id: int, boxes: int, clue_accuracy: float, n: int) -> tuple[ClueTask, ...]:
    # one stream per (split, boxes) draws every task's three numbers at once; task i is row i of it,
    # whatever n is (each column is drawn with its own generator, so a longer split extends a shorter one)
    cols = [np.random.default_rng([0xC1DE, split_id, boxes, c]) for c in range(3)]
    target = cols[0].integers(1, boxes + 1, size=n)
    u = cols[1].random(n)
    other = cols[2].integers(1, boxes, size=n)  # 1..boxes-1, shifted past the target
    wrong = np.where(other < target, other, other + 1)
    clue = np.where(u < clue_accuracy, target, wrong)
    return tuple(ClueTask(index=i, target=int(t), clue=int(c), boxes=boxes)
                 for i, (t, c) in enumerate(zip(target.tolist(), clue.tolist())))


def make_tasks(split: str, *, boxes: int, clue_accuracy: float, n: int | None = None) -> tuple[ClueTask, ...]:
    """The first ``n`` tasks (default: all) of ``split`` ('train' or 'eval'; 'test' is 'eval')."""
    key = "eval" if split == "test" else split
    if key not in SPLIT_IDS:
        raise ValueError(f"unknown clue split {split!r}; choose 'train' or 'eval' (alias 'test')")
    count = SPLIT_SIZES[key] if n is None else int(n)
    return _split_tasks(SPLIT_IDS[key], int(boxes), float(clue_accuracy), count)


def clue_text(task: ClueTask) -> str:
    """The privileged text the teacher sees: ``clue key in box K``."""
    return f"clue key in box {task.clue}"
