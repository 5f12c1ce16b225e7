"""Options shared by the ``icsd`` commands, defined once so names, defaults and help agree.

Typer reads these ``OptionInfo`` objects as metadata only, so one object can serve as
the default of a parameter in several commands. :func:`allocator_options` gives a command
the allocator settings' options, with the help text and defaults of
:class:`~icsd_audit.alloc.settings.AllocatorSettings`. Nothing here imports torch
(:mod:`icsd_audit.alloc.settings` imports its registries lazily through torch's light modules only).
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any, Callable, Optional

import typer

from icsd_audit.alloc.settings import DEFAULTS, SETTING_HELP


def _checked(test: Callable[[Any], bool], want: str) -> Callable[[Any], Any]:
    """A callback refusing, before any work, a value that fails ``test``.

    Click words it ``Invalid value for '--trust-beta': nan is not a finite number > 0``:
    one line that names the option (numpy's own "expected non-negative integer" for
    ``--seed -1`` did not).  ``None`` (a default left to the dumps' provenance) passes.
    """

    def callback(value: Any) -> Any:
        if value is not None and not test(value):
            raise typer.BadParameter(f"{value!r} is not {want}")
        return value

    return callback


POSITIVE_FINITE = _checked(lambda v: math.isfinite(v) and v > 0, "a finite number > 0")
AT_LEAST_1 = _checked(lambda v: v >= 1, "an integer >= 1")
NON_NEGATIVE = _checked(lambda v: v >= 0, "an integer >= 0")
SEED_RANGE = _checked(lambda v: 0 <= v < 2**63, "an integer in [0, 2^63)")
OPEN_UNIT = _checked(lambda v: 0 < v < 1, "a number in (0, 1)")
ABOVE_1 = _checked(lambda v: math.isfinite(v) and v > 1, "a finite number > 1")

# readable=False: the reader reports an unreadable input as one ``FILE: ...`` line like every other error
PATHS = typer.Argument(..., help="Parquet files or directories of token dumps, or URLs of a store (s3://, gs://, "
                                     "hf://, memory://; the cloud extra).", readable=False)
# Allocator settings default to what the dumps record as deployed (SPEC 9, their `allocator` block), else to
# SPEC's defaults (named in each help); a flag given replaces the recorded value, and says so on one stderr line.
_DEPLOYED = "(default: as deployed, recorded in the dumps; else {})"
ALLOCATOR = typer.Option(None, show_default=False, help="Allocator: icsd, sdar, opsd, fisher, sign, influence-only, "
                         "gaussian, permuted. " + _DEPLOYED.format("icsd"))
BASE = typer.Option(None, "--base", show_default=False, help="Base allocator, the reference side of every difference "
                    "(default: sdar with the deployed trust; the deployed allocator when that is sdar or opsd).")
COMPARE = typer.Option(None, "--compare", show_default=False, help="Compared allocator: icsd, fisher, sign, "
                       "influence-only, gaussian, ... (default: the deployed allocator; icsd when sdar or opsd was "
                       "deployed).")
#: the settings every command takes through :func:`allocator_options` (the allocator and its seed are named per
#: command: --allocator or --compare, and each command's --seed says what else it seeds)
SHARED_SETTINGS = ("trust", "trust_beta", "trust_eta", "influence_eta", "min_group", "eps")
_CHECKS = {"trust_beta": POSITIVE_FINITE, "trust_eta": OPEN_UNIT, "influence_eta": OPEN_UNIT, "min_group": AT_LEAST_1,
           "eps": POSITIVE_FINITE}


def _setting_option(name: str, note: str) -> Any:
    default = getattr(DEFAULTS, name)
    return typer.Option(None, "--" + name.replace("_", "-"), show_default=False, callback=_CHECKS.get(name),
                        help=f"{SETTING_HELP[name]} {note.format(default)}")


def allocator_options(note: str = _DEPLOYED) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a command the options of :data:`SHARED_SETTINGS` (``--trust``, ``--trust-beta``, ...).

    The decorated function takes ``settings: dict`` (setting -> the value given, ``None`` where not given) instead
    of one parameter per setting; ``note`` ends each help text and names the default (``{}``).
    """
    options = {name: _setting_option(name, note) for name in SHARED_SETTINGS}
    kinds = {"trust": Optional[str], "min_group": Optional[int]}

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def command(*args: Any, **kwargs: Any) -> Any:
            given = {name: kwargs.pop(name) for name in SHARED_SETTINGS}
            return fn(*args, settings=given, **kwargs)

        params = [p for p in sig.parameters.values() if p.name != "settings"]
        params += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=options[name],
                                     annotation=kinds.get(name, Optional[float])) for name in SHARED_SETTINGS]
        command.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
        return command

    return wrap


# each command's --seed names only what that command draws: no bootstrap in coeffs, permutation controls only
# where gradient cosines are computed
_SEED = "Seed of {} (default: 0) and of the permuted allocator " + _DEPLOYED.format("0") + "."
SEED = typer.Option(None, show_default=False, help=_SEED.format("the bootstrap"), callback=SEED_RANGE)
SEED_PERMUTATIONS = typer.Option(None, "--seed", show_default=False,
                                 help=_SEED.format("the bootstrap and the permutation controls"), callback=SEED_RANGE)
SEED_ALLOCATOR = typer.Option(None, "--seed", show_default=False, help="Seed of the permuted allocator "
                              + _DEPLOYED.format("0") + ".", callback=SEED_RANGE)
RESAMPLES = typer.Option(10_000, "--resamples", help="Bootstrap resamples (count; the interval's Monte Carlo error "
                         "shrinks as 1/sqrt of it).", callback=AT_LEAST_1)
CONFIDENCE = typer.Option(0.95, "--confidence", help="Confidence level of the percentile intervals, a fraction "
                          "(0.95: 95 % intervals).", callback=OPEN_UNIT)
CLIP_EPS = typer.Option(0.2, help="Clip epsilon of the PPO surrogate, in ratio units: a token is outside the clip "
                        "range when its ratio is outside [1 - eps, 1 + eps].", callback=OPEN_UNIT)
DUAL_CLIP = typer.Option(3.0, help="Dual-clip constant of the PPO surrogate, a ratio: the cap binds on tokens with a "
                         "negative advantage and a ratio above it.", callback=ABOVE_1)
PERMUTATIONS = typer.Option(20, "--permutations", help="Shuffles of the ICSD scores in the permutation control "
                            "(count; the control is their mean).", callback=NON_NEGATIVE)
GRID = typer.Option(20, help="Landscape grid size, in bins per rank axis (20: a 20 x 20 grid of rank cells; at most "
                    "1000).", callback=AT_LEAST_1)
JSON = typer.Option(False, "--json", help="Print one JSON object on stdout, nothing else.")
BACKEND = typer.Option("local", "--backend", help="Where the per-batch work runs: local (threads here) or ray (one Ray "
                                                  "task per batch; the ray extra). The same numbers either way.")
RAY_ADDRESS = typer.Option(None, "--ray-address", show_default=False,
                           help="Ray cluster for --backend ray (auto, HOST:PORT, ray://...; default: a local cluster "
                                "with ICSD_THREADS CPUs).")
