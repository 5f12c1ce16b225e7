"""The actor's learning-rate schedule: verl's constant schedule with a linear warm-up.

verl builds the actor's scheduler in ``verl/workers/fsdp_workers.py`` (SDAR's copy,
jasonchen505/SDAR@aa18336, lines 371-383): ``num_warmup_steps = int(lr_warmup_steps_ratio
* total_training_steps)`` and ``get_constant_schedule_with_warmup``, whose factor
(``verl/utils/torch_functional.py`` lines 522-525) is ``step / max(1, num_warmup_steps)``
below the warm-up and 1 after it. The scheduler is stepped once per ``update_actor`` call
(``fsdp_workers.py`` line 626), after the update, so a training step's every optimizer
step (all its mini-batches and epochs) uses the factor of that training step's index,
counted from 0, and ``total_training_steps`` counts training steps, not optimizer steps.
The learning rate is a pure function of the step, so a resumed run needs no scheduler
state.
"""

from __future__ import annotations

__all__ = ["warmup_steps", "warmup_lr"]


def warmup_steps(total_steps: int, ratio: float) -> int:
    """verl's warm-up length: ``int(ratio * total_steps)`` training steps (truncated, as verl does)."""
    return int(ratio * total_steps)


def warmup_lr(step: int, *, lr: float, total_steps: int, ratio: float) -> float:
    """The learning rate of training step ``step`` (from 0): ``lr * step / max(1, n)`` for
    ``step < n`` warm-up steps, ``lr`` from step ``n`` on (``lr`` itself when ``ratio`` is 0)."""
    n = warmup_steps(total_steps, ratio)
    if step < n:
        return lr * (float(step) / float(max(1, n)))
    return lr
