"""The training configuration's error: every problem at once, each with its fix."""

from __future__ import annotations

__all__ = ["ConfigError", "NO_ALLOCATOR"]

#: ``allocator="none"``: plain GRPO/GiGPO, no distillation term
NO_ALLOCATOR = "none"


class ConfigError(ValueError):
    """One or more configuration errors; each line says what is wrong and how to fix it."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("invalid training config: " + "; ".join(self.problems))
