"""Run folders as data: the manifest, loading, comparison across runs (SPEC 10), paper tables, trackers.

- :mod:`.folders` -- find and read run folders (config, ``run.json``, ``metrics.jsonl``);
- :mod:`.estimates` -- mean, median, IQM, difference of means, probability of improvement, bootstrap over runs;
- :mod:`.compare` -- :func:`compare_runs`: groups, strata, scores, refusals;
- :mod:`.curves` -- learning curves and mechanism trajectories with bootstrap bands;
- :mod:`.tables` -- the paper's Tables 1, 3 and 4 from runs (Markdown, LaTeX, CSV);
- :mod:`.render` -- terminal/Markdown/HTML tables and the ``--out`` folder;
- :mod:`.manifest`, :mod:`.recorder`, :mod:`.trackers` -- what a training run records: ``run.json`` and
  the ``--report-to`` experiment trackers.

Example::

    from icsd_audit.runs import load_runs, compare_runs

    runs, skipped = load_runs(["runs/"])
    c = compare_runs(runs, metric="eval/success", skipped=skipped)
    print(c.group("icsd").iqm, c.pair("icsd", "sdar").probability_of_improvement)
"""

from __future__ import annotations

from icsd_audit.runs.compare import CompareError, Comparison, compare_runs
from icsd_audit.runs.folders import Run, load_run, load_runs

__all__ = ["Run", "load_run", "load_runs", "compare_runs", "Comparison", "CompareError"]
