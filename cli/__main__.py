"""``python -m icsd_audit.cli`` runs the same entry point as the ``icsd`` console script."""

from .main import entry

entry()
