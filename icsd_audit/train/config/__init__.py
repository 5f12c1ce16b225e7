"""The training configuration: :class:`TrainConfig` (one field per setting, each with its docstring), its checks,
``key=value`` overrides, shipped warm starts, and the named presets.

- :mod:`~icsd_audit.train.config.fields` -- the fields, derived values, (de)serialisation;
- :mod:`~icsd_audit.train.config.checks` -- the rules that tie fields together, every problem with its fix;
- :mod:`~icsd_audit.train.config.overrides` -- ``--set key=value`` parsing and the fields' docs;
- :mod:`~icsd_audit.train.config.warmstarts` -- ``init=warmstart:NAME``;
- :mod:`~icsd_audit.train.config.presets` -- the named presets (``paper``, ``cpu-demo``, ...).
"""

from __future__ import annotations

from icsd_audit.train.config.checks import REWARDS
from icsd_audit.train.config.errors import ConfigError
from icsd_audit.train.config.fields import TrainConfig
from icsd_audit.train.config.overrides import field_docs, parse_override
from icsd_audit.train.config.presets import CPU_WARM_START, PRESETS, from_preset, preset, preset_for
from icsd_audit.train.config.warmstarts import (WARM_START_PREFIX, resolve_init, same_base, shipped_warm_starts,
                                                warm_starts_dir)

__all__ = ["TrainConfig", "ConfigError", "field_docs", "parse_override", "REWARDS", "WARM_START_PREFIX", "resolve_init",
           "same_base", "shipped_warm_starts", "warm_starts_dir", "CPU_WARM_START", "PRESETS", "from_preset", "preset",
           "preset_for"]
