"""The resampling engine under the action-turn bootstrap: drawing the counts of each resample
(``counts``), the products of counts and per-turn sums (``resample``; the sorted-tile products of
stratified families, ``segments``) and the forked worker that runs them beside the stream (``forked``).
The statistics' families and intervals (``icsd_audit.stats.bootstrap``) sit on top of it."""
