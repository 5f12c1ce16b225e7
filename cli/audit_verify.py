"""``icsd audit verify``: recompute each batch with its recorded settings and compare with the stored g, m, c."""

from __future__ import annotations

import json
import sys
from typing import List, Optional

import typer

from . import options as O
from .common import check_backend, handle_errors, set_threads, thread_count
from .apps import audit_app

#: exit status when a batch differs (bad input is 2, as for every command)
EXIT_DIFFERS = 1


@audit_app.command("verify")
@handle_errors
def verify(paths: List[str] = O.PATHS, as_json: bool = O.JSON, backend: str = O.BACKEND,
           ray_address: Optional[str] = O.RAY_ADDRESS) -> None:
    """Recompute each batch with the settings its file records and compare with the stored g, m, c.

    Batches are recomputed in float64 from the stored inputs with the allocator settings each file records
    (SPEC 9). Prints one line per batch that differs (max abs and rel error) and a summary line. Exit 0 when
    every batch agrees within float32 storage tolerance, 1 when any differs, 2 on bad input (no recorded
    settings, no g/m/c column, unreadable dumps).

    Example: icsd audit verify runs/cpu-demo/dumps --json
    """
    from icsd_audit.audit.verify import verify_dumps

    check_backend(backend, ray_address)
    set_threads()
    res = verify_dumps(paths, backend=backend, ray_address=ray_address, workers=thread_count())
    if as_json:
        sys.stdout.write(json.dumps(res.to_dict(), allow_nan=False) + "\n")
    else:
        for b in res.differing:
            print(b.line())
        print(res.summary())
    if not res.ok:
        raise typer.Exit(EXIT_DIFFERS)
