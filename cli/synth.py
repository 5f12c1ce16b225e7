"""``icsd synth``: synthetic frozen batches for tests, benchmarks and docs."""

from __future__ import annotations

from pathlib import Path

import typer

from .common import handle_errors, stderr_console
from .apps import app


@app.command("synth")
@handle_errors
def synth(
    out: Path = typer.Argument(..., help="Output directory (one shard per batch)."),
    tokens: int = typer.Option(200_000, "--tokens", "-n", help="Total tokens across batches."),
    batches: int = typer.Option(4, help="Number of actor mini-batches."),
    seed: int = typer.Option(0, help="Random seed."),
    step: int = typer.Option(0, help="Value of the step column."),
) -> None:
    """Write GiGPO-like synthetic token dumps, labelled synthetic in their metadata.

    Example: icsd synth runs/synth --tokens 2000000 --batches 4 --seed 0
    """
    import numpy as np

    from icsd_audit.dumps.writer import DumpWriter
    from icsd_audit.dumps.synth import synth_tokens

    cols = synth_tokens(tokens, seed=seed, n_batches=batches, step=step)
    writer = DumpWriter(out, producer={"name": "icsd synth", "seed": seed, "tokens": tokens}, synthetic=True)
    for b in np.unique(cols["batch_id"]):
        sel = cols["batch_id"] == b
        writer.write(**{k: v[sel] for k, v in cols.items()}, name=f"synth-step{step:06d}-batch{int(b):04d}.parquet")
    stderr_console().print(f"wrote {tokens:,} synthetic tokens in {batches} batches to {out}")
