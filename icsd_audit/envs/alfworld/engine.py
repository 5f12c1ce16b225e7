"""The real ALFWorld engine: TextWorld's PDDL player with ALFWorld's wrappers and handcoded expert.

Everything that imports ``alfworld`` / ``textworld`` lives here, imported lazily, so the
rest of icsd works without the ``alfworld`` extra. :func:`require_engine` raises one
clear line when it is missing.
"""

from __future__ import annotations

import importlib.util
import random
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

__all__ = ["ENGINE_HINT", "EngineMissingError", "engine_available", "require_engine", "make_game_env",
           "expert_play", "keep_argv", "memoize_parsing"]

ENGINE_HINT = "--env alfworld needs the ALFWorld engine: pip install 'icsd-audit[alfworld]'"


class EngineMissingError(ImportError):
    """The ``alfworld`` extra (alfworld, textworld[pddl]) is not installed."""


def engine_available() -> bool:
    """Whether alfworld, textworld and fast_downward can be imported (without importing them)."""
    try:
        return all(importlib.util.find_spec(m) is not None for m in ("alfworld", "textworld", "fast_downward"))
    except (ImportError, ValueError):
        return False


def require_engine() -> None:
    if not engine_available():
        raise EngineMissingError(ENGINE_HINT)


@contextmanager
def keep_argv() -> Iterator[None]:
    """Restore ``sys.argv`` afterwards: fast_downward's PDDL translator overwrites it on every load."""
    saved = list(sys.argv)
    try:
        yield
    finally:
        sys.argv = saved


def memoize_parsing() -> None:
    """Parse each of TextWorld's grammar and logic snippets once per process (a 2x faster engine).

    TextWorld re-parses the same few dozen text templates and rule conditions with
    TatSu on every step (half of a step's time, profiled). Parsing is a pure function of
    (text, rule name); the memo returns a deep copy of the first parse, so callers still
    get objects of their own. Installed once; the tests check that games play the same
    text with and without it.
    """
    import copy

    import textworld.logic as tw_logic
    from textworld.envs.pddl import textgen

    for module in (textgen, tw_logic):
        original = module._parse_and_convert
        if getattr(original, "_icsd_memo", False):
            continue
        cache: dict[tuple[str, str | None], Any] = {}

        def memo(text: str, rule_name: str | None = None, _original: Any = original, _cache: dict = cache,
                 **kwargs: Any) -> Any:
            if kwargs.get("trace") or not isinstance(text, str):
                return _original(text, rule_name=rule_name, **kwargs)
            key = (text, rule_name)
            if key not in _cache:
                _cache[key] = _original(text, rule_name=rule_name)
            return copy.deepcopy(_cache[key])

        memo._icsd_memo = True  # type: ignore[attr-defined]
        memo._icsd_original = original  # type: ignore[attr-defined]
        module._parse_and_convert = memo
    _memoize_translation()


def _memoize_translation() -> None:
    """Translate each (domain, problem) from PDDL to SAS once per process (a 3x faster game load).

    TextWorld's ``PddlState`` runs fast-downward's ``pddl2sas`` twice per load and twice per
    reset (plain and optimised), about a second each for an ALFWorld problem; it is a pure
    function of its text arguments. The memo returns a deep copy of the first result's
    parsed task (callers keep objects of their own) and the same SAS text.
    """
    import copy

    import fast_downward

    original = fast_downward.pddl2sas
    if getattr(original, "_icsd_memo", False):
        return
    cache: dict[tuple[str, str, bool], Any] = {}

    def memo(domain: str, problem: str, verbose: bool = False, optimize: bool = False) -> Any:
        if verbose:
            return original(domain, problem, verbose=verbose, optimize=optimize)
        key = (domain, problem, bool(optimize))
        if key not in cache:
            if len(cache) >= 64:  # a few dozen games' worth; a long run cycles through hundreds
                cache.pop(next(iter(cache)))
            cache[key] = original(domain, problem, verbose=False, optimize=optimize)
        task, sas = cache[key]
        return copy.deepcopy(task), sas

    memo._icsd_memo = True  # type: ignore[attr-defined]
    memo._icsd_original = original  # type: ignore[attr-defined]
    fast_downward.pddl2sas = memo


def make_game_env(*, expert: bool = False, memoize: bool = True) -> Any:
    """A TextWorld PDDL environment wrapped as ALFWorld's ``AlfredTWEnv`` wraps it.

    Demangled object names (``mug 1``), the game file in the state, and with ``expert``
    the handcoded expert's next action in ``state["extra.expert_plan"]``.
    """
    require_engine()
    if memoize:
        memoize_parsing()
    import textworld
    from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredExpert, AlfredInfos
    from textworld.envs import PddlEnv

    infos = textworld.EnvInfos(won=True, admissible_commands=True, extras=["gamefile"])
    env: Any = AlfredInfos(AlfredDemangler(PddlEnv(infos), shuffle=False))
    if expert:
        env = AlfredExpert(env, expert_type="handcoded")
    return env


def expert_play(env: Any, game_file: str | Path, *, max_steps: int, seed: int = 0) -> tuple[bool, list[str]]:
    """Let the handcoded expert play ``game_file`` for at most ``max_steps`` steps: (won, actions).

    The expert breaks ties with :mod:`random`; it is seeded with ``seed`` here and the
    global random state is restored afterwards, so a check is reproducible.
    """
    saved = random.getstate()
    random.seed(seed)
    actions: list[str] = []
    try:
        with keep_argv():
            env.load(str(game_file))
            state = env.reset()
        won = bool(state["won"])
        while not won and len(actions) < max_steps:
            action = state["extra.expert_plan"][0]
            state, _, _ = env.step(action)
            actions.append(action)
            won = bool(state["won"])
    except Exception:  # the expert gives up by raising (timeout, no plan)
        return False, actions
    finally:
        random.setstate(saved)
    return won, actions
