"""Publication figures of the audit: one function per paper figure, result object in, Figure out.

Every function takes the frozen result objects of :mod:`icsd_audit.stats.api` (or the
gradient-compatibility summary) and never a path, never a token array: figures
draw statistics, they do not compute them (the only arithmetic is display
arithmetic: percent, and the centred step mean the paper's dynamics plot
overlays).  Each accepts an optional matplotlib Axes (or one per panel) to draw
into, and returns the Figure.

Headless by construction: figures are :class:`matplotlib.figure.Figure` objects
with an Agg canvas, built without pyplot, so importing this package neither
selects a backend nor opens a window, and a user's own backend choice stands.

- :func:`quadrant_figure` -- paper Figure A1, mass share per sign region;
- :func:`landscape_figure` -- continuous_joint_allocation (a-b), intensity over ranks;
- :func:`shift_figure` -- continuous_joint_allocation (c), share shift by advantage bin;
- :func:`alignment_figure` -- gradient_alignment_flow, cosines and permutation control;
- :func:`dynamics_figure` -- Figure A3 (e-f), trusted mass on A < 0 per training step;
- :func:`strata_figure` -- token strata (SPEC 11), mass share and TCM per covariate bin.

See ``docs/figures.md``.
"""

from __future__ import annotations

from icsd_audit.report.figures.alignment import alignment_figure
from icsd_audit.report.figures.dynamics import centered_mean, dynamics_figure
from icsd_audit.report.figures.landscape import landscape_figure, zero_rank_of
from icsd_audit.report.figures.quadrants import REGION_LABELS, quadrant_figure
from icsd_audit.report.figures.shift import shift_figure, shift_positions
from icsd_audit.report.figures.strata import strata_figure
from icsd_audit.report.figures.style import COLUMN_WIDTH, OKABE_ITO, TEXT_WIDTH, paper_style, render, save_figure

__all__ = [
    "quadrant_figure",
    "landscape_figure",
    "shift_figure",
    "alignment_figure",
    "dynamics_figure",
    "strata_figure",
    "centered_mean",
    "zero_rank_of",
    "shift_positions",
    "REGION_LABELS",
    "OKABE_ITO",
    "COLUMN_WIDTH",
    "TEXT_WIDTH",
    "paper_style",
    "render",
    "save_figure",
]
