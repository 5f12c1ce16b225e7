"""ALFWorld on the real engine behind the :class:`~icsd_audit.envs.base.TextEnv` protocol.

Each instance owns one TextWorld ``PddlEnv`` (with its own copy of fast-downward's
library, as TextWorld loads it) wrapped the way ALFWorld's ``AlfredTWEnv`` wraps it, and
plays the games of one split (:mod:`.games`: the generated ones, or the official data
when ``data`` / ``$ALFWORLD_DATA`` is set).

What the agent sees follows verl-agent's ALFWorld environment manager:

* the observation is the engine's text: the opening description (room, receptacles and
  ``Your task is to: ...``) after ``reset``, then each action's feedback;
* the task instruction is the text after ``Your task is to: `` in the opening;
* the admissible actions are the engine's admissible commands without ``help``;
* an episode is won when the engine's goal check passes; it ends then or after
  ``max_steps`` steps (the paper: 50).

An action the engine does not admit is not sent to it (the engine would answer
``Nothing happens.`` and change nothing): the step counts, the observation is
``Nothing happens.`` and ``info["valid_action"]`` is False.

With ``expert=True`` the engine carries ALFWorld's handcoded expert (``AlfredExpert``,
``HandCodedTWAgent``), whose next command :meth:`AlfWorldEnv.expert_action` returns (the
expert policy, :mod:`.expert`). The expert breaks ties with :mod:`random`; each episode
gets its own random stream seeded with the task index, swapped in around every engine
call, so the expert plays a game the same way whatever else runs between its turns
(the manifest's check seeds it the same way).

The observation's ``meta["skill_key"]`` is the game's task type (``pick_heat_then_place_in_recep``,
...): the privileged teacher retrieves the SkillBank category with that key, as SDAR
looks skills up by the game file's task type (``SkillProvider.get_privileged_info``).
"""

from __future__ import annotations

import numbers
import random
from contextlib import contextmanager
from typing import Any, Iterator

from ..base import Observation, StepResult, match_admissible, step_info
from .engine import keep_argv, make_game_env, require_engine
from .games import GameRef, game_files
from .scenes import TASK_COLUMNS, column_of

__all__ = ["AlfWorldEnv", "TASK_MARKER", "NOTHING_HAPPENS"]

TASK_MARKER = "Your task is to: "
NOTHING_HAPPENS = "Nothing happens."


def _instruction(intro: str) -> str:
    at = intro.find(TASK_MARKER)
    if at < 0:
        raise ValueError("the game's opening text has no 'Your task is to: ' line")
    return intro[at + len(TASK_MARKER):].strip()


class AlfWorldEnv:
    """ALFWorld games of one split on the real engine (see the module docstring).

    Args:
        split: ``"train"`` or ``"eval"`` (official data: ``eval`` = ``valid_unseen``;
            ``valid_seen`` / ``valid_unseen`` are accepted too).
        max_steps: episode budget (Table A1: 50).
        seed: seeds the draw of a task when ``reset()`` gets no task.
        data: the official ALFWorld data folder (holding ``json_2.1.1/``); None uses
            ``$ALFWORLD_DATA`` when set, else the built-in generated games.
    """

    name = "alfworld"

    def __init__(self, split: str = "train", *, max_steps: int = 50, seed: int = 0, data: str | None = None,
                 expert: bool = False):
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        require_engine()
        #: Whether the engine carries the handcoded expert (:meth:`expert_action`).
        self.expert = bool(expert)
        self._expert_random: Any = None
        self.split = split
        self.games = game_files(split, data=data)
        self.max_steps = int(max_steps)
        self._rng = random.Random(seed)
        self._engine: Any = None
        self._loaded: str | None = None
        self._game: GameRef | None = None
        self._state: Any = None
        self._obs: Observation | None = None
        self._steps = 0
        self._done = True
        self._won = False

    # ------------------------------------------------------------------ protocol
    @property
    def num_tasks(self) -> int:
        return len(self.games)

    @property
    def game(self) -> GameRef | None:
        """The current episode's game."""
        return self._game

    def task_type(self, task: int) -> str:
        """ALFWorld task type of task ``task`` of the split (no engine call)."""
        return self.games.task_type(int(task))

    def task_column(self, task: int) -> str:
        """The paper's column (Pick, Look, Clean, Heat, Cool, Pick2) of task ``task``."""
        return column_of(self.task_type(task))

    @property
    def data_info(self) -> dict[str, Any]:
        """Where the games come from, synthetic or official (the trainer stores it in the dumps as ``env_data``)."""
        return {"name": self.name, "split": self.split, "tasks": len(self.games), **self.games.describe()}

    #: Per-type success for evaluation (:func:`icsd_audit.train.eval.group_success`): the paper's
    #: columns in its order, and ``Avg`` over episodes (Table 1's ALFWorld Avg is wins / games).
    task_groups = tuple(TASK_COLUMNS.values())
    group_average = "episodes"

    def task_group(self, task: int) -> str:
        """The paper's column (Pick, Look, Clean, Heat, Cool, Pick2) of task ``task``."""
        return self.task_column(task)

    def reset(self, task: int | None = None) -> Observation:
        """Start an episode on task index ``task`` of the split, or a random task."""
        if task is None:
            task = self._rng.randrange(len(self.games))
        elif not isinstance(task, numbers.Integral) or isinstance(task, bool):
            raise TypeError(f"task must be an int index or None, not {type(task).__name__}")
        task = int(task)
        if not 0 <= task < len(self.games):
            raise IndexError(f"task index {task} out of range for split {self.split!r} ({len(self.games)} tasks)")
        game = self.games.ref(task)
        if self._engine is None:
            self._engine = make_game_env(expert=self.expert)
        if self.expert:
            self._expert_random = random.Random(task).getstate()
        with keep_argv(), self._expert_stream():  # the PDDL translator overwrites sys.argv
            if self._loaded != str(game.path) or self.expert:  # the expert reads its game at load
                self._engine.load(str(game.path))
                self._loaded = str(game.path)
            self._state = self._engine.reset()
        self._game = game
        self._steps, self._done, self._won = 0, False, bool(self._state["won"])
        intro = str(self._state["feedback"])
        self._instruction = _instruction(intro)
        self._obs = self._observation(intro)
        return self._obs

    def step(self, action: str) -> StepResult:
        """Apply one action; an action the engine does not admit is a no-op."""
        if self._done or self._obs is None:
            raise RuntimeError("the episode is over; call reset() first")
        self._steps += 1
        matched = match_admissible(action, self._obs.available_actions)
        if matched is not None:
            with self._expert_stream():
                self._state, _, _ = self._engine.step(matched)
            self._won = bool(self._state["won"])
            text = str(self._state["feedback"])
        else:
            text = NOTHING_HAPPENS
        truncated = not self._won and self._steps >= self.max_steps
        self._done = self._won or truncated
        self._obs = self._observation(text) if matched is not None else Observation(
            text=text, available_actions=self._obs.available_actions, instruction=self._instruction,
            meta={**self._obs.meta, "step": self._steps})
        score = 1.0 if self._won else 0.0
        info = step_info(won=self._won, score=score, valid_action=matched is not None, steps=self._steps,
                         truncated=truncated, task_type=self._game.task_type if self._game else "")
        return StepResult(self._obs, score, self._done, info)

    # ------------------------------------------------------------------ the handcoded expert
    def expert_action(self) -> str:
        """The handcoded expert's next command in the current state (an admissible one, else ``look``)."""
        if not self.expert:
            raise ValueError("this AlfWorldEnv has no expert; create it with expert=True (before reset)")
        if self._state is None or self._done:
            raise RuntimeError("no running episode; call reset() first")
        plan = self._state.get("extra.expert_plan") or ["look"]
        return str(plan[0])

    @contextmanager
    def _expert_stream(self) -> Iterator[None]:
        """Run the engine (and so the expert's planning) on this episode's own random stream."""
        if not self.expert:
            yield
            return
        outside = random.getstate()
        random.setstate(self._expert_random)
        try:
            yield
        finally:
            self._expert_random = random.getstate()
            random.setstate(outside)

    # ------------------------------------------------------------------ views
    def _observation(self, text: str) -> Observation:
        actions = tuple(a for a in self._state["admissible_commands"] if a != "help")
        task_type = self._game.task_type if self._game else ""
        meta = {"step": self._steps, "task_type": task_type, "skill_key": task_type or None,
                "gamefile": str(self._game.path) if self._game else ""}
        return Observation(text=text, available_actions=actions, instruction=self._instruction, meta=meta)
