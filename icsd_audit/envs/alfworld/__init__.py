"""ALFWorld for multi-turn agents on the real engine (TextWorld's PDDL player, ALFWorld's domain).

* :class:`AlfWorldEnv`: the environment (verl-agent's observation and action format).
* :mod:`.generate`: the seeded game generator; :mod:`.games`: generated or official games.
* :mod:`.engine`: everything that imports the ``alfworld`` extra.
"""

from .engine import ENGINE_HINT, EngineMissingError, engine_available, require_engine
from .scenes import TASK_COLUMNS, TASK_TYPES, column_of

__all__ = ["SUCCESS_RULE", "AlfWorldEnv", "ENGINE_HINT", "EngineMissingError", "engine_available", "require_engine", "TASK_TYPES",
           "TASK_COLUMNS", "column_of"]


def __getattr__(name: str):
    if name == "AlfWorldEnv":
        from .env import AlfWorldEnv

        return AlfWorldEnv
    raise AttributeError(name)

#: what a won episode is, in words (the run's closing lines and docs quote it)
SUCCESS_RULE = (
    "completed its household task"
)
