"""The ``icsd`` command: a thin typer layer over the library.

Each command module registers its commands on the apps of :mod:`.apps` and imports
the library (and torch) only inside its functions, so ``icsd --help`` stays instant.
Importing the command modules here, in the order the help lists them, is what
registers them.
"""

from __future__ import annotations

from . import audit_coeffs, synth, audit_stats, audit_gradcos, audit_report, train  # noqa: F401,I001  (registration order = help order)
from .apps import app, audit_app

__all__ = ["app", "audit_app"]
