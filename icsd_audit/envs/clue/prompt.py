"""The clue environment's compact turn prompt: only vocabulary words, no chat boilerplate.

``boxes 1 to 8 . start 1 to 8 open 4 right 5 to 8 . open 6 left 5 to 5 .`` is the
prompt of a third turn: the instruction, the first observation, then every shown past
turn as its action and the observation that came back, each closed by ``.``. An
invalid turn shows its observation alone (``invalid 5 to 8 .``): whatever words the
reply held are not repeated back. The tiny word model's chat
template adds ``>`` after it, and the reply (``open K``) starts there. With a
``window`` smaller than the turns taken, the oldest turns are dropped, and the
first observation with them.
"""

from __future__ import annotations

from typing import Any, Sequence

from .vocab import INVALID

__all__ = ["clue_prompt"]


def clue_prompt(instruction: str, observation: str, history: Sequence[Any], window: int) -> str:
    """The prompt text of a turn; ``history`` holds entries with ``.observation`` and ``.action``, oldest first."""
    if window < 0:
        raise ValueError(f"history window must be >= 0, got {window}")
    hist = list(history)
    if not hist:
        return f"{instruction} {observation}"
    start = max(0, len(hist) - window)
    parts = [instruction]
    if start == 0:
        parts.append(hist[0].observation)
    for k in range(start, len(hist)):
        after = hist[k + 1].observation if k + 1 < len(hist) else observation
        action = "" if after.split()[:1] == [INVALID] else hist[k].action
        parts.append(" ".join(p for p in (action, after, ".") if p))
    return " ".join(parts)
