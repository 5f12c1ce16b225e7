"""Regenerate the PNGs of docs/figures.md from synthetic data (docs/figures.md gives its time and memory).

Why a script: the gallery must be reproducible and honest about its source.  The
sign-region, landscape and share-shift figures come straight from the shipped
``examples/synthetic`` (what ``icsd audit figures examples/synthetic`` draws).  Those
four batches hold one training step and no gradient sketches, so the dynamics
figure uses a 40-step synthetic run and the gradient figure 16 synthetic batches
with a random dense ``grad`` column (Gaussian per-token vectors, k = 64): both are
generated here with :func:`icsd_audit.dumps.synth.synth_tokens`, labelled synthetic, and
deleted afterwards.

Run from the repository root:  python docs/figures/make_figures.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from icsd_audit.dumps.writer import DumpWriter
from icsd_audit.report.figures import alignment_figure, dynamics_figure, landscape_figure, quadrant_figure, shift_figure
from icsd_audit.report.figures.style import save_figure
from icsd_audit.report.results import ReportOptions
from icsd_audit.report.build import audit_dumps
from icsd_audit.dumps.synth import synth_tokens

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "docs" / "figures"
DPI = 200


def _write_run(out: Path, n_steps: int, tokens: int, grad_dim: int = 0, seed: int = 0) -> None:
    """One batch per step, batch_id = step, optionally a random dense gradient sketch per token."""
    rng = np.random.default_rng(seed)
    writer = DumpWriter(out, producer={"name": "docs/figures/make_figures.py", "seed": seed}, synthetic=True)
    for s in range(n_steps):
        cols = synth_tokens(tokens, seed=seed * 1000 + s, n_batches=1, step=s)
        cols["batch_id"] = np.full_like(cols["batch_id"], s)
        if grad_dim:
            cols["grad"] = rng.standard_normal((tokens, grad_dim)).astype(np.float32)
        writer.write(**cols, name=f"step{s:04d}.parquet")


def main() -> int:
    torch.set_num_threads(1)
    OUT.mkdir(parents=True, exist_ok=True)
    opts = ReportOptions(n_resamples=10_000, seed=0)
    examples = audit_dumps([ROOT / "examples" / "synthetic"], opts)
    save_figure(quadrant_figure(examples.stats.quadrants, include_neutral=True), OUT / "quadrants.png", dpi=DPI)
    save_figure(landscape_figure(examples.landscape), OUT / "landscape.png", dpi=DPI)
    save_figure(shift_figure(examples.stats.shift), OUT / "shift.png", dpi=DPI)
    with tempfile.TemporaryDirectory(prefix="icsd-docs-") as tmp:
        _write_run(Path(tmp) / "dyn", n_steps=40, tokens=8_000, seed=1)
        dyn = audit_dumps([Path(tmp) / "dyn"], opts)
        save_figure(dynamics_figure(dyn.dynamics, show_diff=True), OUT / "dynamics.png", dpi=DPI)
        _write_run(Path(tmp) / "grad", n_steps=16, tokens=3_000, grad_dim=64, seed=2)
        grad = audit_dumps([Path(tmp) / "grad"], opts)
        save_figure(alignment_figure(grad.gradcos), OUT / "alignment.png", dpi=DPI)
    t = examples.stats.tcm
    print(f"examples/synthetic: TCM {100 * t.base.estimate:.1f} % -> {100 * t.compare.estimate:.1f} % "
          f"({100 * t.diff.estimate:+.2f} pp [{100 * t.diff.ci_low:+.2f}, {100 * t.diff.ci_high:+.2f}])")
    g = grad.gradcos
    print(f"synthetic grads: gain {g.gain.estimate:+.3f} [{g.gain.ci_low:+.3f}, {g.gain.ci_high:+.3f}], "
          f"permutation gain {g.perm_gain.estimate:+.3f}, pairing {g.pairing_gain.estimate:+.3f}")
    print(f"wrote {', '.join(sorted(p.name for p in OUT.glob('*.png')))} to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
