"""The training configuration: :class:`TrainConfig` (one field per setting, each with its docstring), its checks,
``key=value`` overrides, shipped warm starts, and the named presets."""

from __future__ import annotations

from icsd_audit.train.config.fields import (REWARDS, WARM_START_PREFIX, ConfigError, TrainConfig, field_docs,
                                            parse_override, resolve_init, same_base, shipped_warm_starts,
                                            warm_starts_dir)
from icsd_audit.train.config.presets import CPU_WARM_START, PRESETS, from_preset, preset, preset_for

__all__ = ["TrainConfig", "ConfigError", "field_docs", "parse_override", "REWARDS", "WARM_START_PREFIX", "resolve_init",
           "same_base", "shipped_warm_starts", "warm_starts_dir", "CPU_WARM_START", "PRESETS", "from_preset", "preset",
           "preset_for"]
