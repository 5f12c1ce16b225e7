"""Shared look of every icsd figure: Okabe-Ito colours, paper-column sizes, no global state.

Why a module of its own: the five figures must agree on which colour means which
weighting (readers compare them side by side in a paper), must stay readable when
printed at one column width, and must never touch the caller's matplotlib state.
Figures are therefore plain :class:`matplotlib.figure.Figure` objects with an Agg
canvas attached (no pyplot, no ``matplotlib.use``: a user who already chose an
interactive backend keeps it, and nothing here can open a window), and the paper
rc settings are applied only inside :func:`paper_style` while a figure is built or
saved.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator, Sequence

from matplotlib import rc_context
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

__all__ = [
    "OKABE_ITO",
    "BASE_COLOR",
    "COMPARE_COLOR",
    "PERMUTED_COLOR",
    "DIFF_COLOR",
    "NEUTRAL_COLOR",
    "DENSITY_COLOR",
    "LANDSCAPE_CMAP",
    "COLUMN_WIDTH",
    "TEXT_WIDTH",
    "PAPER_RC",
    "paper_style",
    "new_figure",
    "resolve_axes",
    "render",
    "save_figure",
    "write_atomic",
    "percent",
    "display_name",
    "plain",
    "format_pp",
]

#: Okabe & Ito (2008), distinguishable under the common colour-vision deficiencies.
OKABE_ITO: dict[str, str] = {
    "black": "#000000",
    "orange": "#E69F00",
    "sky_blue": "#56B4E9",
    "bluish_green": "#009E73",
    "yellow": "#F0E442",
    "blue": "#0072B2",
    "vermillion": "#D55E00",
    "reddish_purple": "#CC79A7",
}

# Roles.  The paper draws ICSD in blue; the base allocation (SDAR) gets the
# orange that Okabe-Ito pairs with blue for maximal contrast in every deficiency.
BASE_COLOR = OKABE_ITO["orange"]
COMPARE_COLOR = OKABE_ITO["blue"]
PERMUTED_COLOR = OKABE_ITO["reddish_purple"]
DIFF_COLOR = OKABE_ITO["bluish_green"]
NEUTRAL_COLOR = "#7F7F7F"
DENSITY_COLOR = "#4D4D4D"
#: sequential, darker = more mass, as in the paper's landscape panels
LANDSCAPE_CMAP = "Blues"

#: inches: one column of a two-column paper (ACL/ICML/NeurIPS-style) and the full text width
COLUMN_WIDTH = 3.35
TEXT_WIDTH = 6.9

#: rc settings for print: 7-8 pt text at one column width, light spines, vector-friendly fonts
PAPER_RC: dict[str, Any] = {
    "font.size": 7.5,
    "axes.titlesize": 8,
    "axes.labelsize": 7.5,
    "xtick.labelsize": 7,
    "ytick.labelsize": 7,
    "legend.fontsize": 7,
    "legend.frameon": False,
    "axes.linewidth": 0.6,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "xtick.major.width": 0.6,
    "ytick.major.width": 0.6,
    "xtick.major.size": 2.5,
    "ytick.major.size": 2.5,
    "lines.linewidth": 1.2,
    "errorbar.capsize": 2.0,
    "savefig.dpi": 300,
    "savefig.bbox": "tight",
    "savefig.pad_inches": 0.02,
    "pdf.fonttype": 42,  # embed TrueType: editable text in the PDF, accepted by publishers
    "ps.fonttype": 42,
    "svg.fonttype": "none",
    "svg.hashsalt": "icsd",  # stable element ids: the same figure gives the same SVG bytes
    "font.family": "DejaVu Sans",  # ships with matplotlib: no font lookups, same glyphs everywhere
}


@contextlib.contextmanager
def paper_style() -> Iterator[None]:
    """Apply :data:`PAPER_RC` for the duration of the block only (restored afterwards)."""
    with rc_context(PAPER_RC):
        yield


def new_figure(width: float = COLUMN_WIDTH, height: float = 2.2) -> Figure:
    """A pyplot-free Figure with an Agg canvas: renders headless, never opens a window."""
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def resolve_axes(ax: Axes | Sequence[Axes] | None, n: int, *, width: float, height: float,
                 layout: tuple[int, int] | None = None, **subplot_kw: Any) -> tuple[Figure, list[Axes]]:
    """The caller's axes (exactly ``n`` of them) or a new figure holding ``n`` panels.

    A figure function draws ``n`` panels; a caller embedding it in a larger figure
    passes its own Axes (one, or a sequence of ``n``) and gets their Figure back.
    """
    if ax is None:
        fig = new_figure(width, height)
        rows, cols = layout or (1, n)
        axes = fig.subplots(rows, cols, squeeze=False, **subplot_kw).ravel().tolist()[:n]
        return fig, axes
    axes = [ax] if isinstance(ax, Axes) else list(ax)
    if len(axes) != n:
        raise ValueError(f"this figure draws {n} panel(s); got {len(axes)} Axes")
    fig: Any = axes[0].figure
    while not isinstance(fig, Figure):  # a SubFigure: climb to the root Figure
        fig = fig.figure
    return fig, axes


def render(fig: Figure, fmt: str = "png", dpi: int | None = None) -> bytes:
    """The figure encoded as ``fmt`` (png, pdf, svg), in memory, with the paper rc."""
    buf = io.BytesIO()
    with paper_style():
        if fig.canvas is None or not hasattr(fig.canvas, "print_figure"):
            FigureCanvasAgg(fig)
        fig.savefig(buf, format=fmt, dpi=dpi if dpi is not None else PAPER_RC["savefig.dpi"],
                    metadata=_metadata(fmt))
    return buf.getvalue()


def _metadata(fmt: str) -> dict[str, Any] | None:
    # No creation dates: the same results give byte-identical PDFs/SVGs (diffable docs).
    if fmt == "pdf":
        return {"CreationDate": None, "Creator": "icsd"}
    if fmt == "svg":
        return {"Date": None, "Creator": "icsd"}
    if fmt == "png":
        return {"Software": "icsd"}
    return None


def save_figure(fig: Figure, path: str | Path, fmt: str | None = None, dpi: int | None = None) -> Path:
    """Write ``fig`` atomically (temporary file in the same directory, then rename)."""
    path = Path(path)
    fmt = fmt or path.suffix.lstrip(".") or "png"
    data = render(fig, fmt, dpi)
    write_atomic(path, data)
    return path


def write_atomic(path: Path, data: bytes) -> None:
    """Readers of ``path`` see the old file or the complete new one, never a partial one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        from icsd_audit.outputs import umask_mode

        umask_mode(tmp)  # mkstemp's 0600 would hide a shared report from its readers
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def percent(x: float) -> float:
    """Fractions (the statistics' unit) to percent (the figures' unit)."""
    return 100.0 * float(x)


_DISPLAY = {"sdar": "SDAR", "icsd": "ICSD", "opsd": "OPSD", "grpo": "GRPO", "gigpo": "GiGPO"}


def display_name(name: str) -> str:
    """How an allocator label reads in a legend: the paper's spelling for known ones."""
    return _DISPLAY.get(name.lower(), name[:1].upper() + name[1:]) if name else name


def plain(text: object) -> str:
    """``text`` drawn as written: every ``$`` escaped so matplotlib never parses it as mathtext.

    Every string from user data or flags (run labels, environment and metric names,
    titles, batch and step labels) passes through this before it reaches a figure: an
    unbalanced ``$\\frac{1}{$`` would otherwise stop the figure with a mathtext parse error,
    and ``$x$`` would be typeset. Matplotlib shows ``\\$`` as ``$`` (figures.md).
    """
    return str(text).replace("$", r"\$")


def format_pp(x: float, digits: int = 1) -> str:
    """A signed difference in percentage points with a true minus sign ("+6.2", "\u22127.5", "0")."""
    v = round(float(x), digits)
    if v == 0:
        return "0"
    return f"{v:+.{digits}f}".replace("-", "\u2212")
