"""``icsd synth``: synthetic frozen batches for tests, benchmarks and docs."""

from __future__ import annotations

from pathlib import Path

import typer

from . import options as O
from .common import handle_errors, stderr_console
from .apps import app


@app.command("synth")
@handle_errors
def synth(
    out: Path = typer.Argument(..., help="Output directory (one shard per batch)."),
    tokens: int = typer.Option(200_000, "--tokens", "-n", help="Total tokens across batches.", callback=O.AT_LEAST_1),
    batches: int = typer.Option(4, help="Number of actor mini-batches.", callback=O.AT_LEAST_1),
    seed: int = typer.Option(0, help="Random seed.", callback=O.SEED_RANGE),
    step: int = typer.Option(0, help="Value of the step column.", callback=O.NON_NEGATIVE),
) -> None:
    """Write GiGPO-like synthetic token dumps, labelled synthetic in their metadata.

    All or nothing: the shards are written into a hidden folder beside OUT and renamed to OUT once complete, so a stop (SIGTERM, Ctrl-C: exit 143 / 130) or a full disk leaves no OUT. OUT must be new or empty.

    Example: icsd synth runs/synth --tokens 2000000 --batches 4 --seed 0
    """
    import os
    import shutil
    import sys

    import numpy as np

    from icsd_audit.dumps.synth import synth_tokens
    from icsd_audit.dumps.writer import DumpWriter
    from icsd_audit.outputs import GracefulStop, Stopped, check_output_dir, staging_dir

    check_output_dir(out, [], owned=lambda rel: False, option="OUT")  # new or empty: never mixed with other files
    if step < 0:
        raise ValueError(f"--step {step}: must be >= 0")
    staged = None
    try:
        with GracefulStop() as stop:
            cols = synth_tokens(tokens, seed=seed, n_batches=batches, step=step)
            staged = staging_dir(out, "synth")
            writer = DumpWriter(staged, producer={"name": "icsd synth", "seed": seed, "tokens": tokens}, synthetic=True)
            ids = np.unique(cols["batch_id"])
            for b in ids:
                sel = cols["batch_id"] == b
                with stop.critical():
                    writer.write(**{k: v[sel] for k, v in cols.items()},
                                 name=f"synth-step{step:06d}-batch{int(b):04d}.parquet")
            with stop.critical():
                os.rename(staged, out)  # replaces an empty OUT; fails rather than replace a non-empty one
                staged = None
    except Stopped as exc:
        print(f"stopped by {exc.signal_name}: nothing was written ({out} not created)", file=sys.stderr)
        raise typer.Exit(exc.exit_code) from None
    except OSError as exc:  # a full disk: name the shard under OUT, not the hidden folder removed below
        if staged is None or not str(exc.filename or "").startswith(f"{staged}{os.sep}"):
            raise
        raise OSError(exc.errno, exc.strerror, str(out / os.path.relpath(exc.filename, staged))) from None
    finally:
        if staged is not None:
            shutil.rmtree(staged, ignore_errors=True)
    note = "" if len(ids) == batches else (f" (asked for {batches}: a batch holds whole trajectories, so "
                                           f"{tokens:,} tokens make {len(ids)})")
    stderr_console().print(f"wrote {tokens:,} synthetic tokens in {len(ids)} batch(es) to {out}{note}", highlight=False,
                           soft_wrap=True)
