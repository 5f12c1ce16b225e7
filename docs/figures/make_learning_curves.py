"""Learning curves of matched training runs (GRPO vs GRPO+SDAR vs GRPO+ICSD), from their metrics.

Reads ``metrics.jsonl`` of each run folder (one JSON line per step, as ``icsd train``
writes it), draws success, score, invalid-action rate and the per-step trusted-conflict
mass side by side (raw per-step values; a step where a metric is undefined, e.g. TCM
with no active token, is left out), and prints a Markdown table of what was measured.  Runs are
compared over the steps that every run completed, so an arm that ran longer never
looks better by having more steps.

Run from the repository root:

    python docs/figures/make_learning_curves.py examples/curves/none examples/curves/sdar examples/curves/icsd \
        --labels GRPO GRPO+SDAR GRPO+ICSD --out docs/figures/learning_curves.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from icsd_audit.report.figures.style import BASE_COLOR, COMPARE_COLOR, NEUTRAL_COLOR, TEXT_WIDTH, new_figure, paper_style, save_figure

PANELS = (
    ("rollout/success", "success rate"),
    ("rollout/score", "WebShop score"),
    ("rollout/invalid_rate", "invalid-action rate"),
    ("alloc/tcm", "trusted-conflict mass"),
)
COLORS = (NEUTRAL_COLOR, BASE_COLOR, COMPARE_COLOR)


def read_metrics(run: Path) -> dict[str, np.ndarray]:
    """Metric name -> per-step values (NaN where a step lacks it), ordered by step."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows.sort(key=lambda r: r["step"])
    keys = sorted({k for r in rows for k in r})
    def value(r: dict, k: str) -> float:
        v = r.get(k)
        return float(v) if isinstance(v, (int, float)) else np.nan  # None/absent: not measured

    return {k: np.array([value(r, k) for r in rows]) for k in keys}


def moving_mean(x: np.ndarray, w: int) -> np.ndarray:
    """Trailing mean over up to ``w`` steps, ignoring steps where the metric is undefined."""
    ok = ~np.isnan(x)
    c = np.cumsum(np.insert(np.where(ok, x, 0.0), 0, 0.0))
    k = np.cumsum(np.insert(ok.astype(float), 0, 0.0))
    idx = np.arange(1, x.size + 1)
    lo = np.maximum(idx - w, 0)
    cnt = k[idx] - k[lo]
    return np.where(cnt > 0, (c[idx] - c[lo]) / np.maximum(cnt, 1), np.nan)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--labels", nargs="+", default=None)
    ap.add_argument("--out", type=Path, default=Path("docs/figures/learning_curves.png"))
    ap.add_argument("--window", type=int, default=1,
                    help="trailing-mean window in steps (1: the raw per-step values; >1 adds thin raw lines underneath)")
    args = ap.parse_args()
    labels = args.labels or [r.name for r in args.runs]
    runs = [read_metrics(r) for r in args.runs]
    n = min(m["step"].size for m in runs)

    with paper_style():
        fig = new_figure(TEXT_WIDTH, 1.9)
        axes = fig.subplots(1, len(PANELS))
        for ax, (key, title) in zip(axes, PANELS):
            for m, label, color in zip(runs, labels, COLORS):
                if key not in m or np.isnan(m[key][:n]).all():
                    continue
                y = m[key][:n]
                steps = m["step"][:n]
                if args.window > 1:
                    ax.plot(steps, y, color=color, lw=0.5, alpha=0.45)
                ax.plot(steps, moving_mean(y, args.window), color=color, label=label, marker="o", ms=2.5)
            ax.set_title(title)
            ax.set_ylim(-0.03, 1.03)  # all four are fractions: a flat zero stays visibly at zero
            ax.set_xlabel("training step")
        axes[0].legend(loc="best")
        save_figure(fig, args.out)

    print(f"steps completed by every run: {n}")
    print("| run | " + " | ".join(t for _, t in PANELS) + " |")
    print("|---|" + "---:|" * len(PANELS))
    half = max(1, n // 2)
    for m, label in zip(runs, labels):
        cells = []
        for key, _ in PANELS:
            y = m.get(key, np.full(n, np.nan))[:n]
            if np.isnan(y).all():
                cells.append("-")
                continue
            cells.append(f"{np.nanmean(y[:half]):.3f} -> {np.nanmean(y[half:]):.3f}")
        print(f"| {label} | " + " | ".join(cells) + " |")
    print(f"(cells: mean over steps 0..{half - 1} -> mean over steps {half}..{n - 1})")


if __name__ == "__main__":
    main()
