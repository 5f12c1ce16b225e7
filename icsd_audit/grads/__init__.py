"""Gradient compatibility: is the distillation direction aligned with the RL direction?

- :mod:`~icsd_audit.grads.sketch` -- per-token gradient sketches from a model's layers
  (``icsd train --sketch-k``), and :mod:`~icsd_audit.grads.sketch_format` -- how they
  are stored in dump columns and metadata;
- :mod:`~icsd_audit.grads.compat` -- the maths: RL and distillation weights, cosines,
  jackknife errors (torch and numpy only);
- :mod:`~icsd_audit.audit.gradcos` -- ``icsd audit gradcos``: per-batch cosines from dumps
  with permutation controls;
- :mod:`~icsd_audit.grads.replay` -- exact per-token gradients by replaying a model, the
  reference the sketches are checked against.
"""
