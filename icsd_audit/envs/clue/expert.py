"""The clue expert: bisection on the feedback, ignoring the clue.

It opens the middle box (rounded down) of the interval the key can still be in
(:attr:`~.env.ClueEnv.interval`, narrowed by every ``left``/``right``), so it wins every
task within ``ceil(log2(boxes + 1))`` turns, and an invalid turn someone else played
leaves its interval where it was. It reads only what the student sees (the feedback),
so it is the best student policy, not an oracle that knows the box; ``noisy_reply``
is the same expert with a share of its replies swapped for a random box or a
malformed reply (for warm starts and tests of the referee).
"""

from __future__ import annotations

import random
from typing import Any

from .vocab import OPEN

__all__ = ["expert_reply", "noisy_reply"]


def expert_reply(env: Any) -> str:
    """The expert's reply for ``env``'s current turn (a :class:`~.env.ClueEnv` mid-episode)."""
    if env.task is None:
        raise RuntimeError("no running episode; call reset() first")
    lo, hi = env.interval
    return f"{OPEN} {(lo + hi) // 2}"


def noisy_reply(env: Any, rng: random.Random, *, p_random: float, p_invalid: float) -> str:
    """With probability ``p_invalid`` a malformed reply, else with ``p_random`` a random box, else the expert's."""
    u = rng.random()
    if u < p_invalid:
        return OPEN
    if u < p_invalid + p_random:
        return f"{OPEN} {rng.randint(1, env.boxes)}"
    return expert_reply(env)
