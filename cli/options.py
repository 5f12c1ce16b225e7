"""Options shared by the ``icsd audit`` commands, defined once so names, defaults and help agree.

Typer reads these ``OptionInfo`` objects as metadata only, so one object can serve as
the default of a parameter in several commands.  Nothing here imports torch.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import typer


def _checked(test: Callable[[Any], bool], want: str) -> Callable[[Any], Any]:
    """A callback refusing, before any work, a value that fails ``test``.

    Click words it ``Invalid value for '--trust-beta': nan is not a finite number > 0``:
    one line that names the option (numpy's own "expected non-negative integer" for
    ``--seed -1`` did not).  ``None`` (a default left to the dumps' provenance) passes.
    """

    def callback(value: Any) -> Any:
        if value is not None and not test(value):
            raise typer.BadParameter(f"{value!r} is not {want}")
        return value

    return callback


POSITIVE_FINITE = _checked(lambda v: math.isfinite(v) and v > 0, "a finite number > 0")
AT_LEAST_1 = _checked(lambda v: v >= 1, "an integer >= 1")
NON_NEGATIVE = _checked(lambda v: v >= 0, "an integer >= 0")
SEED_RANGE = _checked(lambda v: 0 <= v < 2**63, "an integer in [0, 2^63)")
OPEN_UNIT = _checked(lambda v: 0 < v < 1, "a number in (0, 1)")
ABOVE_1 = _checked(lambda v: math.isfinite(v) and v > 1, "a finite number > 1")

# readable=False: the reader reports an unreadable input as one ``FILE: ...`` line like every other error
PATHS = typer.Argument(..., help="Parquet files or directories of token dumps.", readable=False)
ALLOCATOR = typer.Option("icsd", help="Allocator: icsd, sdar, opsd, fisher, sign, influence-only, gaussian, permuted.")
BASE = typer.Option("sdar", "--base", help="Base allocator (the reference side of every difference).")
COMPARE = typer.Option("icsd", "--compare", help="Compared allocator: icsd, fisher, sign, influence-only, gaussian, ...")
TRUST = typer.Option("laplace", help="Base trust: laplace, sigmoid, uniform.")
TRUST_BETA = typer.Option(5.0, help="Slope of the sigmoid trust.", callback=POSITIVE_FINITE)
MIN_GROUP = typer.Option(8, help="Smallest calibration group that gets its own fit.", callback=AT_LEAST_1)
EPS = typer.Option(1e-4, help="Allocator scale floor, turn-mass threshold and TCM zero threshold for |u|.",
                   callback=POSITIVE_FINITE)
SEED = typer.Option(0, help="Seed of the bootstrap and of the permuted allocator / permutation controls.",
                    callback=SEED_RANGE)
RESAMPLES = typer.Option(10_000, "--resamples", help="Bootstrap resamples.", callback=AT_LEAST_1)
CONFIDENCE = typer.Option(0.95, "--confidence", help="Confidence level of the percentile intervals.", callback=OPEN_UNIT)
CLIP_EPS = typer.Option(0.2, help="Clip epsilon of the PPO surrogate.", callback=OPEN_UNIT)
DUAL_CLIP = typer.Option(3.0, help="Dual-clip constant of the PPO surrogate.", callback=ABOVE_1)
PERMUTATIONS = typer.Option(20, "--permutations", help="Shuffles of the ICSD scores in the permutation control.",
                            callback=NON_NEGATIVE)
GRID = typer.Option(20, help="Landscape grid size (bins per rank axis, at most 1000).", callback=AT_LEAST_1)
JSON = typer.Option(False, "--json", help="Print one JSON object on stdout, nothing else.")
