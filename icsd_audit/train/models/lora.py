"""LoRA adapters (the ``peft`` library): training, warm starts, evaluation and merged export.

With ``lora_rank = r > 0`` the policy is the frozen base model plus rank-r adapters
(``W x + alpha / r * B A x``) on ``lora_targets``; only ``A`` and ``B`` are trained, so
the optimizer holds two moments of the adapters only and a checkpoint is the adapter
folder peft writes (``adapter_config.json``, ``adapter_model.safetensors``) plus
:data:`ADAPTER_META`, which names the base model in icsd's own terms (``embedded``,
``tiny-random`` with its seed, or a folder), and the trainer state.

**The KL reference is the initial policy without a second copy of the base.** A fresh
adapter starts with ``B = 0``: the initial policy is the base itself, so the reference
pass runs the policy's own weights under ``disable_adapter()`` (the base's forward,
bit for bit). A run started from an adapter (``init``, e.g. a warm start from ``icsd
sft``) continues that adapter; its initial policy is base + that adapter, so the initial
adapter is loaded a second time, frozen, as peft adapter ``reference`` (a copy of the
adapter, a few MB, never of the base) and the reference pass switches to it.

The self-teacher is the current policy (adapter on) with the privileged prompt, as in
full fine-tuning; the sampler, the ratio pre-pass and the gradient pass run the same
adapted model. Dumps do not change.

A run's base model is what :func:`base_of` finds: the adapter's :data:`ADAPTER_META`
when starting from or evaluating an adapter, else ``model``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

__all__ = ["ADAPTER_META", "REFERENCE_ADAPTER", "LoraSettings", "AdapterError", "is_adapter_dir", "is_model_dir",
           "read_adapter_meta", "adapter_settings", "require_peft", "base_of", "add_adapter", "load_adapter", "AdapterSaver",
           "reference_scope", "export_merged", "same_model", "trainable_parameters"]

#: icsd's metadata next to peft's files: the base model (icsd names), LoRA settings, producer.
ADAPTER_META = "icsd_adapter.json"
#: Name of the frozen copy of a run's initial adapter (the KL reference of a warm start).
REFERENCE_ADAPTER = "reference"
_FORMAT = "icsd-adapter"
_EMBEDDED = {"embedded", "default", "smollm2", "smollm2-135m-instruct"}


class AdapterError(ValueError):
    """An adapter folder cannot be used as asked; the message says why and what to do."""


@dataclass(frozen=True)
class LoraSettings:
    """What an adapter is: rank, scaling alpha and the modules it adapts."""

    rank: int
    alpha: float
    #: ``all-linear`` (peft: every linear layer but the output head) or comma-separated module-name suffixes
    targets: str

    def peft_config(self) -> Any:
        require_peft()
        from peft import LoraConfig

        targets: Any = "all-linear" if self.targets == "all-linear" else [t.strip() for t in self.targets.split(",")
                                                                        if t.strip()]
        # no dropout: the model stays in eval mode so the ratio pre-pass and the gradient pass agree
        return LoraConfig(r=int(self.rank), lora_alpha=float(self.alpha), target_modules=targets, lora_dropout=0.0,
                          bias="none", task_type="CAUSAL_LM")


def require_peft() -> None:
    """One line naming the install command when peft is missing (only LoRA needs it)."""
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        raise AdapterError("LoRA needs the peft library, part of the [train] extra: pip install 'icsd-audit[train]' "
                           "(from a checkout: pip install -e '.[train]')")


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path).expanduser() / "adapter_config.json").is_file()


def is_model_dir(path: str | Path) -> bool:
    return (Path(path).expanduser() / "config.json").is_file()


def read_adapter_meta(path: str | Path) -> dict[str, Any]:
    """:data:`ADAPTER_META` of an adapter folder, or ``{}`` for a plain peft folder."""
    f = Path(path).expanduser() / ADAPTER_META
    if not f.is_file():
        return {}
    meta = _read_json(f)
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        raise AdapterError(f"{f}: not an icsd adapter description (format {_FORMAT!r} expected)")
    return meta


def adapter_settings(path: str | Path) -> LoraSettings:
    """Rank, alpha and targets of a saved adapter (from peft's ``adapter_config.json``)."""
    f = Path(path).expanduser() / "adapter_config.json"
    cfg = _read_json(f)
    if not isinstance(cfg, dict):
        raise AdapterError(f"{f}: not a JSON object")
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"{f}: peft_type {cfg.get('peft_type')!r}; icsd trains and loads LoRA adapters only")
    t = cfg.get("target_modules")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not (isinstance(r, int) and not isinstance(r, bool) and r >= 1 and isinstance(alpha, (int, float))
            and not isinstance(alpha, bool) and (t is None or isinstance(t, (str, list)))):
        raise AdapterError(f"{f}: r={r!r}, lora_alpha={alpha!r}, target_modules={t!r} are not a LoRA adapter's "
                           "settings (r an integer >= 1, lora_alpha a number)")
    targets = "all-linear" if t in ("all-linear", None) else ",".join(sorted(map(str, t))) if isinstance(t, list) else t
    return LoraSettings(rank=r, alpha=float(alpha), targets=targets)


def _read_json(f: Path) -> Any:
    from icsd_audit.train.models.weightfiles import WeightFileError, read_json

    try:
        return read_json(f)
    except (OSError, WeightFileError) as e:
        raise AdapterError(str(e) if isinstance(e, WeightFileError) else f"{f}: not readable ({e})") from None


def same_model(a: str, b: str) -> bool:
    """Whether two model references name the same base (aliases, or the same folder)."""
    if a == b or (a in _EMBEDDED and b in _EMBEDDED):
        return True
    if a in _EMBEDDED | {"tiny-random"} or b in _EMBEDDED | {"tiny-random"}:
        return False
    return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def base_of(adapter: str | Path, model: str | None, seed: int) -> tuple[str, int]:
    """(base model reference, seed of a ``tiny-random`` base) for an adapter folder.

    The adapter's metadata names its base; ``model`` (the run's or the command's
    ``--model``) must name the same one, unless the recorded base is a folder that no
    longer exists (moved: ``model`` is then taken as the base, and peft checks the shapes).
    """
    meta = read_adapter_meta(adapter)
    recorded = meta.get("base_model")
    if recorded is None:
        if model is None:
            raise AdapterError(f"{adapter} does not name its base model ({ADAPTER_META} missing); pass --model BASE")
        return model, seed
    rec_seed = int(meta.get("base_seed", seed))
    if model is None or same_model(str(recorded), model):
        return str(recorded), rec_seed
    moved = str(recorded) not in _EMBEDDED | {"tiny-random"} and not Path(str(recorded)).expanduser().exists()
    if moved and Path(model).expanduser().is_dir():
        return model, seed
    raise AdapterError(f"adapter {adapter} was trained over base {recorded!r}, not {model!r}; "
                       f"pass --model {recorded} (or omit --model)")


@contextmanager
def _seeded(seed: int) -> Iterator[None]:
    with torch.random.fork_rng(devices=[]), _quiet():
        torch.manual_seed(int(seed))
        yield


@contextmanager
def _quiet() -> Iterator[None]:
    """peft 0.21 calls a transformers 5 property that warns it is deprecated: not the user's business."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        # missing adapter keys: _check_tensor_names refuses them in one line after the load
        warnings.filterwarnings("ignore", message="Found missing adapter keys", category=UserWarning)
        yield


def add_adapter(model: Any, settings: LoraSettings, *, seed: int = 0) -> Any:
    """``model`` wrapped by peft with a fresh adapter (``B = 0``, ``A`` seeded; the caller's RNG untouched)."""
    require_peft()
    from peft import get_peft_model

    with _seeded(seed):
        try:
            return get_peft_model(model, settings.peft_config())
        except ValueError as e:
            raise AdapterError(f"lora_targets={settings.targets!r}: {e}") from None


def load_adapter(model: Any, adapter: str | Path, *, trainable: bool, reference_from: str | Path | None = None) -> Any:
    """``model`` with the adapter of a folder (``trainable`` for training), peft's ``default``.

    ``reference_from``: also load that folder's adapter, frozen, as :data:`REFERENCE_ADAPTER`.
    """
    require_peft()
    from peft import PeftModel

    from icsd_audit.train.models.weightfiles import WeightFileError, check_folder

    try:  # headers and configs before peft and safetensors parse them
        for folder in [adapter] + ([reference_from] if reference_from is not None else []):
            check_folder(Path(folder).expanduser())
    except WeightFileError as e:
        raise AdapterError(str(e)) from None
    try:
        with _quiet():
            peft_model = PeftModel.from_pretrained(model, str(Path(adapter).expanduser()), is_trainable=trainable)
            if reference_from is not None:
                peft_model.load_adapter(str(Path(reference_from).expanduser()), adapter_name=REFERENCE_ADAPTER,
                                        is_trainable=False)
                peft_model.set_adapter("default")
    except (RuntimeError, ValueError, KeyError) as e:  # shape mismatch, missing keys: wrong base
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise AdapterError(f"adapter {adapter} does not fit its base model: {first}") from None
    _check_tensor_names(peft_model, Path(adapter).expanduser())
    return peft_model


def _check_tensor_names(peft_model: Any, folder: Path) -> None:
    """Refuse an adapter file whose tensors are not exactly those of the adapter peft built (peft only warns of
    missing ones, which keep their fresh initial values, and drops unexpected ones without a word)."""
    from peft import get_peft_model_state_dict

    from icsd_audit.train.models.weightfiles import safetensors_header

    f = folder / "adapter_model.safetensors"
    if not f.is_file():
        return
    want = set(get_peft_model_state_dict(peft_model, adapter_name="default"))
    have = set(safetensors_header(f))
    for kind, names in (("missing", sorted(want - have)), ("unexpected", sorted(have - want))):
        if names:
            raise AdapterError(f"{f}: {len(names)} {kind} tensor(s) ({', '.join(names[:3])}"
                               f"{', ...' if len(names) > 3 else ''}) for the adapter its adapter_config.json "
                               "describes; refusing to train from a partial adapter")


def trainable_parameters(model: Any) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


@contextmanager
def reference_scope(model: Any, has_reference_adapter: bool) -> Iterator[Any]:
    """Within the block ``model`` computes the run's initial policy (see the module docstring)."""
    if has_reference_adapter:
        model.set_adapter(REFERENCE_ADAPTER)
        try:
            yield model
        finally:
            # peft's set_adapter marks the active adapter trainable and the others frozen
            model.set_adapter("default")
            for n, p in model.named_parameters():
                if f".{REFERENCE_ADAPTER}." in n:
                    p.requires_grad_(False)
    else:
        with model.disable_adapter():
            yield model


class AdapterSaver:
    """``save_pretrained`` of the trained adapter only, plus :data:`ADAPTER_META` (what checkpoints call)."""

    def __init__(self, model: Any, meta: dict[str, Any]):
        self.model, self.meta = model, meta

    def save_pretrained(self, folder: str, **_: Any) -> None:
        self.model.save_pretrained(folder, selected_adapters=["default"], safe_serialization=True)
        Path(folder, ADAPTER_META).write_text(json.dumps(self.meta, indent=2, sort_keys=True) + "\n")


def adapter_meta(*, base_model: str, base_seed: int | None, settings: LoraSettings, producer: str,
                 **extra: Any) -> dict[str, Any]:
    """The :data:`ADAPTER_META` record."""
    from icsd_audit.version import __version__

    meta: dict[str, Any] = {"format": _FORMAT, "version": 1, "base_model": base_model, "lora": asdict(settings),
                            "producer": producer, "icsd_version": __version__, **extra}
    if base_model == "tiny-random":
        meta["base_seed"] = int(base_seed or 0)
    return meta


def _inside(a: Path, b: Path) -> bool:
    return a == b or b in a.parents


def export_merged(*, model: str | None, adapter: str | Path, out: str | Path, seed: int = 0) -> Path:
    """Merge an adapter into its base and write a plain Hugging Face folder at ``out``.

    Refuses an ``out`` that is, or lies inside, the base or the adapter folder, and an
    ``out`` that exists; written into a temporary folder next to ``out`` and renamed.
    """
    from icsd_audit.train.models.loading import load_policy

    adapter_p = Path(adapter).expanduser().resolve()
    out_p = Path(out).expanduser().resolve()
    if not is_adapter_dir(adapter_p):
        raise AdapterError(f"--adapter {adapter}: no adapter_config.json there (not a peft adapter folder)")
    base_ref, base_seed = base_of(adapter_p, model, seed)
    inputs = [adapter_p] + ([Path(base_ref).expanduser().resolve()] if Path(base_ref).expanduser().is_dir() else [])
    for src in inputs:
        if _inside(out_p, src) or _inside(src, out_p):
            raise AdapterError(f"--out {out} overlaps the input {src}; write the merged model elsewhere")
    if out_p.exists():
        raise AdapterError(f"--out {out} exists; pick a new folder (an export never replaces files)")
    base, tok = load_policy(base_ref, device=torch.device("cpu"), seed=base_seed)
    merged = load_adapter(base, adapter_p, trainable=False).merge_and_unload()
    out_p.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_p.name}.tmp-", dir=out_p.parent))
    try:
        merged.save_pretrained(str(tmp), safe_serialization=True)
        tok.save_pretrained(str(tmp))
        (tmp / "icsd_export.json").write_text(json.dumps(
            {"base_model": base_ref, "adapter": str(adapter_p), "adapter_meta": read_adapter_meta(adapter_p)},
            indent=2, sort_keys=True) + "\n")
        from icsd_audit.outputs import umask_tree

        umask_tree(tmp)  # mkdtemp and safetensors make it private; an export is an ordinary model folder
        os.replace(tmp, out_p)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_p
