"""Checkpoints: the policy as a loadable Hugging Face folder plus optimizer and RNG state, and no pickles.

``<out_dir>/checkpoints/step-000009/`` holds ``save_pretrained`` output (weights as
safetensors, config, tokenizer with its chat template: ``icsd eval --model`` and any
HF code load it as is) and the trainer state in two files that cannot run code when
read: ``trainer_state.json`` (format name and version, the next step to run, the
config, the optimizer's hyper-parameters, the Python and NumPy RNG states, extra
plain values) and ``trainer_state.safetensors`` (every tensor: AdamW's moments and
step counts, the torch and CUDA RNG states). Why not ``torch.save``: a pickle may
name any callable, so resuming from a checkpoint folder someone else made could run
their code. Checkpoints of older versions (``trainer_state.pt``) are still read, with
``torch.load(weights_only=True)``, which refuses any pickle that names a callable
beyond tensors, plain containers and NumPy arrays: such a file is refused in one line
(:class:`CheckpointError`) and nothing in it runs.

A checkpoint is written into a hidden staging folder (``.step-000009.icsd-ckpt-HOST-PID-*``)
and renamed into place, so a crash never leaves a partial one where
:func:`latest_checkpoint` would find it; staging folders of processes that no longer
run are removed by the next save (and by :func:`remove_stale`). Only the newest
``keep`` are kept (``--keep-checkpoints``, default 1), and never at the cost of the one
just written. Sizes for the 135M default: 0.54 GB of weights plus 1.08 GB of AdamW
moments; ``checkpoint_optimizer=False`` writes the weights and RNG state only.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["save_checkpoint", "load_trainer_state", "latest_checkpoint", "checkpoint_dir", "rng_state", "set_rng_state",
           "is_checkpoint", "remove_stale", "CheckpointError", "check_trainer_state", "check_optimizer_fits", "MAX_STEPS",
           "STATE_FILE", "TENSOR_FILE", "LEGACY_STATE_FILE"]

_PREFIX = "step-"
STATE_FILE = "trainer_state.json"
TENSOR_FILE = "trainer_state.safetensors"
#: what versions before 0.4 wrote (a torch pickle); read with weights_only=True only
LEGACY_STATE_FILE = "trainer_state.pt"
_FORMAT, _VERSION = "icsd.trainer_state", 1


class CheckpointError(ValueError):
    """A checkpoint that cannot or must not be loaded: one line naming the file."""


def checkpoint_dir(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ------------------------------------------------------------------------------ plain values <-> JSON


def _plain(x: Any) -> Any:
    """JSON-ready copy that keeps tuples apart from lists (``random.setstate`` and AdamW's betas want tuples)."""
    if isinstance(x, tuple):
        return {"__tuple__": [_plain(v) for v in x]}
    if isinstance(x, list):
        return [_plain(v) for v in x]
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, np.ndarray):
        return {"__ndarray__": x.tolist(), "dtype": str(x.dtype)}
    if isinstance(x, np.generic):
        return x.item()
    return x


def _unplain(x: Any) -> Any:
    if isinstance(x, dict):
        if set(x) == {"__tuple__"}:
            return tuple(_unplain(v) for v in x["__tuple__"])
        if set(x) == {"__ndarray__", "dtype"}:
            return np.asarray(x["__ndarray__"], dtype=np.dtype(x["dtype"]))
        return {k: _unplain(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_unplain(v) for v in x]
    return x


def _split(prefix: str, value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """``value`` with every tensor moved into ``tensors`` (key ``prefix``...) and replaced by a reference."""
    if torch.is_tensor(value):
        tensors[prefix] = value.detach().cpu().contiguous()
        return {"__tensor__": prefix}
    if isinstance(value, dict):
        return {str(k): _split(f"{prefix}.{k}", v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        parts = [_split(f"{prefix}.{i}", v, tensors) for i, v in enumerate(value)]
        return {"__tuple__": parts} if isinstance(value, tuple) else parts
    return _plain(value)


def _join(value: Any, tensors: dict[str, torch.Tensor], where: Path) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__tensor__"}:
            key = value["__tensor__"]
            if key not in tensors:
                raise CheckpointError(f"{where}: tensor {key!r} named in {STATE_FILE} is missing")
            return tensors[key]
        if set(value) == {"__tuple__"}:
            return tuple(_join(v, tensors, where) for v in value["__tuple__"])
        if set(value) == {"__ndarray__", "dtype"}:
            return _unplain(value)
        return {k: _join(v, tensors, where) for k, v in value.items()}
    if isinstance(value, list):
        return [_join(v, tensors, where) for v in value]
    return value


# ------------------------------------------------------------------------------ writing


def _write_state(folder: Path, state: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    doc = {"format": _FORMAT, "version": _VERSION, **{k: _split(k, v, tensors) for k, v in state.items()}}
    save_file(tensors, str(folder / TENSOR_FILE), metadata={"format": _FORMAT})
    (folder / STATE_FILE).write_text(json.dumps(doc, sort_keys=True) + "\n")


def save_checkpoint(out_dir: str | Path, *, next_step: int, model: Any, tokenizer: Any, optimizer: Any,
                    config: dict[str, Any], keep: int = 1, extra: dict[str, Any] | None = None,
                    with_optimizer: bool = True) -> Path:
    """Write the checkpoint taken after ``next_step - 1`` steps; prune all but the newest ``keep``.

    ``with_optimizer=False`` leaves AdamW's moments out (two thirds of a checkpoint's
    size); the loaded state then has ``"optimizer": None``. ``extra`` holds further
    plain values or tensors, returned by :func:`load_trainer_state` at the top level.
    The checkpoint just written is never pruned, whatever the names of the others.
    """
    from icsd_audit.outputs import staging_dir, umask_tree

    root = checkpoint_dir(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    target = root / f"{_PREFIX}{next_step - 1:06d}"
    tmp = staging_dir(target, "ckpt")
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        opt_state = optimizer.state_dict() if with_optimizer else None
        _write_state(tmp, {"next_step": int(next_step), "optimizer": opt_state, "rng": rng_state(),
                           "config": config, **(extra or {})})
        umask_tree(tmp)  # safetensors writes 0600: a checkpoint gets the modes of any new file
        if target.exists():  # the same step written again (a resumed run redid it): the new one replaces it
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    older = [p for p in _complete(root) if p != target]
    for old in older[: max(0, len(older) - (keep - 1))]:
        shutil.rmtree(old, ignore_errors=True)
    return target


# ------------------------------------------------------------------------------ finding and reading


def is_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a complete checkpoint folder (of this version or an older one)."""
    p = Path(path)
    return p.is_dir() and ((p / STATE_FILE).is_file() or (p / LEGACY_STATE_FILE).is_file())


def _complete(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest step first."""
    return sorted((p for p in root.glob(f"{_PREFIX}*") if is_checkpoint(p)),
                  key=lambda p: (int(p.name[len(_PREFIX):]) if p.name[len(_PREFIX):].isdigit() else -1, p.name))


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The newest complete checkpoint under ``out_dir`` (None when there is none)."""
    root = checkpoint_dir(out_dir)
    if not root.is_dir():
        return None
    ckpts = _complete(root)
    return ckpts[-1] if ckpts else None


def remove_stale(out_dir: str | Path) -> list[Path]:
    """Remove the staging folders that killed runs left under ``<out_dir>/checkpoints``.

    Those of this version name their process (removed once it no longer runs); the
    ``.step-N.tmp-*`` folders of older versions name none and are removed only by a
    caller that holds the run folder's lock (:mod:`icsd_audit.train.run.folder`).
    """
    from icsd_audit.outputs import remove_stale as remove

    root = checkpoint_dir(out_dir)
    return remove(root) if root.is_dir() else []


def _numpy_globals() -> list[Any]:
    core = getattr(np, "_core", None) or np.core
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def _load_legacy(f: Path) -> dict[str, Any]:
    try:
        with torch.serialization.safe_globals(_numpy_globals()), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's note on the pickle protocol: the refusal below says what counts
            state = torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise CheckpointError(
            f"{f}: refused: this pickle names objects other than tensors, plain values and NumPy arrays, so loading "
            "it could run code; icsd reads trainer state without running any (weights_only=True). Resume only from "
            "checkpoints you made, or retrain") from None
    except (RuntimeError, EOFError, ValueError) as exc:
        raise CheckpointError(f"{f}: not a readable trainer state ({' '.join(str(exc).split())[:200]})") from None
    if not isinstance(state, dict) or "next_step" not in state:
        raise CheckpointError(f"{f}: not an icsd trainer state (no next_step)")
    return state


def load_trainer_state(path: str | Path) -> dict[str, Any]:
    """The trainer state of a checkpoint folder: ``next_step``, ``optimizer`` (a state dict or None), ``rng``,
    ``config`` and any extra entries. Never runs code from the files (see the module docstring)."""
    p = Path(path)
    folder = p if p.is_dir() else p.parent
    if (folder / STATE_FILE).is_file():
        return check_trainer_state(_load_state(folder), folder)
    if (folder / LEGACY_STATE_FILE).is_file():
        return check_trainer_state(_load_legacy(folder / LEGACY_STATE_FILE), folder)
    raise FileNotFoundError(f"{folder} is not an icsd checkpoint (no {STATE_FILE}); "
                            "pass a folder under <out_dir>/checkpoints/")


def _load_state(folder: Path) -> dict[str, Any]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from icsd_audit.train.models.weightfiles import WeightFileError, read_json, safetensors_header

    f = folder / STATE_FILE
    try:
        doc = read_json(f, what="trainer state")
        if os.path.lexists(folder / TENSOR_FILE):
            safetensors_header(folder / TENSOR_FILE)
    except WeightFileError as exc:
        raise CheckpointError(str(exc)) from None
    if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
        raise CheckpointError(f"{f}: not an icsd trainer state (format {doc.get('format') if isinstance(doc, dict) else None!r})")
    if doc.get("version") != _VERSION:
        raise CheckpointError(f"{f}: trainer state version {doc.get('version')!r}; this icsd reads version {_VERSION}")
    try:
        tensors = load_file(str(folder / TENSOR_FILE)) if (folder / TENSOR_FILE).is_file() else {}
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{folder / TENSOR_FILE}: not a readable safetensors file ({exc})") from None
    try:
        state = {k: _join(v, tensors, folder / TENSOR_FILE) for k, v in doc.items() if k not in ("format", "version")}
    except (TypeError, ValueError, OverflowError) as exc:  # a crafted ndarray dtype or value
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"{f}: not a trainer state icsd wrote ({' '.join(str(exc).split())[:160]})") from None
    if "next_step" not in state:
        raise CheckpointError(f"{f}: no next_step")
    opt = state.get("optimizer")
    if isinstance(opt, dict) and isinstance(opt.get("state"), dict):  # JSON keys are strings; torch's are parameter ids
        bad = sorted(k for k in opt["state"] if not (isinstance(k, str) and k.isdigit()))
        if bad:
            raise CheckpointError(f"{f}: optimizer.state has keys {bad[:3]}, not parameter numbers")
        opt["state"] = {int(k): v for k, v in opt["state"].items()}
    return state


#: the most steps a run may have (a next_step above it is a corrupt or crafted file, not a run)
MAX_STEPS = 10**9


def check_trainer_state(state: dict[str, Any], folder: str | Path) -> dict[str, Any]:
    """Refuse a trainer state whose values this version cannot use, before anything is deleted or loaded.

    ``next_step`` must be an integer in 1..MAX_STEPS and match the folder's name
    (``step-000004`` holds ``next_step`` 5); ``config`` a JSON object; ``optimizer`` None or
    AdamW's state dict (its tensors floating point); ``rng`` the four generators' states,
    each accepted by its generator (tried on a copy, then the caller's states restored).
    """
    folder = Path(folder)
    f = folder / (STATE_FILE if (folder / STATE_FILE).is_file() else LEGACY_STATE_FILE)
    n = state.get("next_step")
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_STEPS:
        raise CheckpointError(f"{f}: next_step is {n!r}; a checkpoint holds an integer from 1 to {MAX_STEPS}")
    tail = folder.name[len(_PREFIX):] if folder.name.startswith(_PREFIX) else ""
    if tail.isdigit() and int(tail) + 1 != n:
        raise CheckpointError(f"{f}: next_step is {n}, but the folder {folder.name} is the checkpoint taken after step "
                              f"{int(tail)} (next_step {int(tail) + 1})")
    if not isinstance(state.get("config"), dict):
        raise CheckpointError(f"{f}: config is {type(state.get('config')).__name__}, not the run's configuration")
    _check_optimizer(state.get("optimizer"), f)
    _check_rng(state.get("rng"), f)
    return state


def _check_optimizer(opt: Any, f: Path) -> None:
    if opt is None:
        return
    if not (isinstance(opt, dict) and isinstance(opt.get("state"), dict) and isinstance(opt.get("param_groups"), list)
            and all(isinstance(g, dict) and isinstance(g.get("params"), list)
                    and all(isinstance(i, int) and not isinstance(i, bool) for i in g["params"])
                    for g in opt["param_groups"])):
        raise CheckpointError(f"{f}: optimizer is not AdamW's state (state, and param_groups naming parameter numbers)")
    for pid, st in opt["state"].items():
        if not isinstance(st, dict):
            raise CheckpointError(f"{f}: optimizer.state.{pid} is {type(st).__name__}, not AdamW's moments")
        for key in ("step", "exp_avg", "exp_avg_sq"):
            v = st.get(key)
            if key in st and not (torch.is_tensor(v) and v.is_floating_point() and bool(torch.isfinite(v).all())):
                what = f"{v.dtype} tensor" if torch.is_tensor(v) else type(v).__name__
                raise CheckpointError(f"{f}: optimizer.state.{pid}.{key} is a {what}; AdamW keeps finite "
                                      "floating-point tensors")


def _check_rng(rng: Any, f: Path) -> None:
    if not isinstance(rng, dict) or not {"python", "numpy", "torch"} <= set(rng):
        raise CheckpointError(f"{f}: rng does not hold the python, numpy and torch generator states")
    if not (torch.is_tensor(rng["torch"]) and rng["torch"].dtype == torch.uint8):
        raise CheckpointError(f"{f}: rng.torch is not a uint8 tensor (torch's generator state)")
    saved = rng_state()
    try:
        set_rng_state({k: v for k, v in rng.items() if k != "cuda"})
    except Exception as exc:  # noqa: BLE001  (NumPy and torch raise IndexError, TypeError... on a crafted state)
        raise CheckpointError(f"{f}: rng is not a generator state ({' '.join(str(exc).split())[:120]})") from None
    finally:
        set_rng_state(saved)


def check_optimizer_fits(opt: dict[str, Any] | None, params: list[Any], where: str | Path) -> None:
    """Refuse AdamW state whose parameter count or moment shapes differ from the parameters it would update."""
    if opt is None:
        return
    groups = opt["param_groups"]
    ids = [i for g in groups for i in (g.get("params") or [])]
    if len(ids) != len(params) or sorted(ids) != list(range(len(params))):
        raise CheckpointError(f"{where}: its optimizer state is for {len(ids)} parameter tensors; this model trains "
                              f"{len(params)}: the checkpoint is of another model or another LoRA setting")
    for i, st in opt["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            if key in st and tuple(st[key].shape) != tuple(params[i].shape):
                raise CheckpointError(f"{where}: optimizer.state.{i}.{key} has shape {tuple(st[key].shape)}; "
                                      f"parameter {i} of this model has {tuple(params[i].shape)}")
