"""Test-session settings.

Under CI (``CI`` set, as ``.ci/run`` is run) Hypothesis derandomizes: the same examples
every run, so a green suite stays green and a red one is reproducible. Locally it keeps
exploring new examples each run.
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
