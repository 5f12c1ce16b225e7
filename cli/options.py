"""Options shared by the ``icsd audit`` commands, defined once so names, defaults and help agree.

Typer reads these ``OptionInfo`` objects as metadata only, so one object can serve as
the default of a parameter in several commands.  Nothing here imports torch.
"""

from __future__ import annotations

import typer

# readable=False: the reader reports an unreadable input as one ``FILE: ...`` line like every other error
PATHS = typer.Argument(..., help="Parquet files or directories of token dumps.", readable=False)
ALLOCATOR = typer.Option("icsd", help="Allocator: icsd, sdar, opsd, fisher, sign, influence-only, gaussian, permuted.")
BASE = typer.Option("sdar", "--base", help="Base allocator (the reference side of every difference).")
COMPARE = typer.Option("icsd", "--compare", help="Compared allocator: icsd, fisher, sign, influence-only, gaussian, ...")
TRUST = typer.Option("laplace", help="Base trust: laplace, sigmoid, uniform.")
TRUST_BETA = typer.Option(5.0, help="Slope of the sigmoid trust.")
MIN_GROUP = typer.Option(8, help="Smallest calibration group that gets its own fit.")
EPS = typer.Option(1e-4, help="Allocator scale floor, turn-mass threshold and TCM zero threshold for |u|.")
SEED = typer.Option(0, help="Seed of the bootstrap and of the permuted allocator / permutation controls.")
RESAMPLES = typer.Option(10_000, "--resamples", help="Bootstrap resamples.")
CONFIDENCE = typer.Option(0.95, "--confidence", help="Confidence level of the percentile intervals.")
CLIP_EPS = typer.Option(0.2, help="Clip epsilon of the PPO surrogate.")
DUAL_CLIP = typer.Option(3.0, help="Dual-clip constant of the PPO surrogate.")
PERMUTATIONS = typer.Option(20, "--permutations", help="Shuffles of the ICSD scores in the permutation control.")
GRID = typer.Option(20, help="Landscape grid size (bins per rank axis).")
JSON = typer.Option(False, "--json", help="Print one JSON object on stdout, nothing else.")
