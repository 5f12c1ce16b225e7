"""Text environments for multi-turn agent training.

:mod:`icsd_audit.envs.base` holds the protocol (:class:`TextEnv`, :class:`Observation`,
:class:`StepResult`) and the verl-agent style action parser; :func:`make_env` builds an
environment by name. Environment packages are imported lazily.
"""

from __future__ import annotations

from typing import Any

from .base import (
    Observation,
    ParsedAction,
    StepResult,
    TextEnv,
    is_admissible,
    match_admissible,
    normalize_action,
    parse_action,
    step_info,
)

__all__ = [
    "Observation",
    "ParsedAction",
    "StepResult",
    "TextEnv",
    "is_admissible",
    "match_admissible",
    "normalize_action",
    "parse_action",
    "step_info",
    "make_env",
    "success_rule",
    "ENV_NAMES",
    "PRIVILEGED_ENVS",
]

ENV_NAMES = ("webshop", "alfworld", "searchqa", "clue")
#: Environments whose observations carry the teacher's privileged text themselves
#: (``Observation.meta["privileged"]``): their teacher needs no SkillBank.
PRIVILEGED_ENVS = ("clue",)


def make_env(name: str, *, url: str | None = None, **kwargs: Any) -> TextEnv:
    """Build environment ``name``; with ``url`` the real-server adapter instead of the built-in one.

    ``make_env("webshop", split="eval")`` is the offline WebShop;
    ``make_env("webshop", url="http://127.0.0.1:3000", split="eval")`` talks to a WebShop
    server; ``make_env("searchqa", split="eval")`` is Search-QA over the built-in KB (``url``:
    a Search-R1 retrieval server); ``make_env("alfworld", split="eval")`` plays ALFWorld
    games on the real engine (the ``alfworld`` extra; ``data=PATH`` for the official games);
    ``make_env("clue", split="eval", boxes=8, clue_accuracy=0.7)`` is the clue testbed.
    Keyword arguments go to the environment's constructor.
    """
    if name == "webshop":
        if url:
            from .webshop.server import WebShopServerEnv

            return WebShopServerEnv(url, **kwargs)
        from .webshop.env import WebShopEnv

        return WebShopEnv(**kwargs)
    if name == "searchqa":
        # Search-QA's remote part is its retriever: the URL goes to the retriever, not the env
        from .searchqa.env import SearchQAEnv

        if url and not kwargs.get("retriever_url"):
            kwargs["retriever_url"] = url
        return SearchQAEnv(**kwargs)
    if name == "alfworld":
        if url:
            raise ValueError("ALFWorld runs in-process on the real engine; it takes no url")
        from .alfworld.env import AlfWorldEnv

        return AlfWorldEnv(**kwargs)
    if name == "clue":
        if url:
            raise ValueError("the clue environment runs in-process; it takes no url")
        from .clue.env import ClueEnv

        return ClueEnv(**kwargs)
    raise ValueError(f"unknown environment {name!r}; available: {', '.join(ENV_NAMES)}")


def success_rule(name: str) -> str:
    """What a won episode of environment ``name`` is, in words (each environment package says it)."""
    import importlib

    if name not in ENV_NAMES:
        return "was won by the environment's own rule"
    return str(importlib.import_module(f"icsd_audit.envs.{name}").SUCCESS_RULE)
