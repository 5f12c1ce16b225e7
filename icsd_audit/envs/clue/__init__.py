"""Clue: a laptop-scale multi-turn task whose privileged teacher's reliability is a dial.

* :class:`ClueEnv`: find the key in one of N boxes through ``open K`` turns and
  left/right feedback; the teacher sees a clue right with probability ``clue_accuracy``.
* :mod:`.vocab`: the few dozen words everything in it is made of (the tiny word-level
  model's vocabulary, :mod:`icsd_audit.train.models.tiny_word`).
* :mod:`.prompt`: its compact prompt (no chat boilerplate: every word is a vocabulary word).
"""

from .env import INSTRUCTION, ClueEnv, parse_reply
from .tasks import ClueTask, clue_text, make_task, make_tasks
from .vocab import MAX_BOXES, WORDS

__all__ = ["SUCCESS_RULE", "ClueEnv", "ClueTask", "INSTRUCTION", "MAX_BOXES", "WORDS", "clue_text", "make_task", "make_tasks",
           "parse_reply"]

#: what a won episode is, in words (the run's closing lines and docs quote it)
SUCCESS_RULE = "opened the box holding the key within the turn budget"
