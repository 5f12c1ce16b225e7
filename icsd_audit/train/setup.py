"""What a training run sets up before its first step: the environments and the models.

:func:`env_factory` builds the environments a config names; :func:`build_models` loads the policy (from ``model``,
``init`` or a checkpoint; LoRA-wrapped when asked) and its KL reference, resident or reloaded per pass.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from icsd_audit.envs import TextEnv, make_env
from icsd_audit.train.config import TrainConfig
from icsd_audit.train.models.loading import load_policy
from icsd_audit.train.models.memory import release_freed_memory
from icsd_audit.train.update.logprobs import score_rows, split_rows

__all__ = ["EnvFactory", "env_factory", "Models", "build_models", "Reference", "AdapterReference", "NoReference",
           "frozen_loader"]

#: ``env_factory(split)`` -> a fresh environment instance for that split.
EnvFactory = Callable[[str], TextEnv]


def env_factory(cfg: TrainConfig) -> EnvFactory:
    """``factory(split)`` -> a fresh environment of ``cfg.env`` for that split, with the config's settings."""

    def factory(split: str) -> TextEnv:
        kwargs: dict[str, Any] = {"split": split, "max_steps": cfg.max_turns, "seed": cfg.seed}
        if cfg.env_url and cfg.env == "webshop":
            kwargs["num_goals"] = cfg.server_num_goals
        if cfg.env == "searchqa":
            kwargs.update(corpus=cfg.searchqa_corpus, data_files=cfg.searchqa_data, topk=cfg.retrieval_topk,
                          retriever_url=cfg.retriever_url, protocol=cfg.searchqa_protocol, expert=cfg.searchqa_expert)
        if cfg.env == "clue":
            kwargs.update(boxes=cfg.clue_boxes, clue_accuracy=cfg.clue_accuracy)
        if cfg.env == "alfworld":
            kwargs["data"] = cfg.alfworld_data
            kwargs["expert"] = cfg.policy == "expert"  # the engine carries the handcoded expert
        return make_env(cfg.env, url=cfg.env_url, **kwargs)

    return factory


class Reference:
    """The frozen initial policy's log-probs (k3 KL target).

    Resident (``model`` given): one copy kept all run. Otherwise ``load()`` reads the
    initial weights from their source for each pass and they are freed after it: the
    same float32 weights, so the same numbers, without a model's worth of memory
    sitting idle through the rollout, the teacher and the actor update.
    """

    def __init__(self, model: Any | None, load: Callable[[], Any], **kw: Any):
        self.model, self.load, self.kw = model, load, kw

    def score(self, prompts: list[list[int]], responses: list[list[int]], micro_batch_rows: int) -> list[torch.Tensor]:
        model = self.model if self.model is not None else self.load()
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]) + len(responses[i]))
        out = score_rows(model, prompts, responses, split_rows(order, micro_batch_rows), **self.kw)
        del model
        return [out[i] for i in range(len(prompts))]


def frozen_loader(model: str, *, device: torch.device, seed: int, trust_remote_code: bool = False) -> Callable[[], Any]:
    """A loader of the initial weights as a frozen eval-mode model, without progress bars."""

    def load() -> Any:
        from transformers.utils import logging as hf_logging

        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            m = load_policy(model, device=device, seed=seed, trust_remote_code=trust_remote_code)[0]
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        return m.eval().requires_grad_(False)

    return load


class AdapterReference:
    """LoRA: the initial policy is the policy's own weights with the adapter switched off
    (a fresh adapter) or switched to the frozen initial adapter (a run started from one)."""

    def __init__(self, model: Any, has_reference_adapter: bool, **kw: Any):
        self.model, self.has_reference_adapter, self.kw = model, has_reference_adapter, kw

    def score(self, prompts: list[list[int]], responses: list[list[int]], micro_batch_rows: int) -> list[torch.Tensor]:
        from icsd_audit.train.models.lora import reference_scope

        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]) + len(responses[i]))
        with reference_scope(self.model, self.has_reference_adapter) as model:
            out = score_rows(model, prompts, responses, split_rows(order, micro_batch_rows), **self.kw)
        return [out[i] for i in range(len(prompts))]


class NoReference:
    def score(self, prompts: list[list[int]], responses: list[list[int]], micro_batch_rows: int) -> None:
        return None


@dataclass
class Models:
    """The policy, its tokenizer, the KL reference and what checkpoints save."""

    policy: Any
    tokenizer: Any
    reference: Any
    #: what checkpoints save (the policy, or its adapter only under LoRA)
    saver: Any
    pad_id: int
    score_kw: dict[str, Any]
    #: what the dumps' producer block records about the weights
    info: dict[str, Any]


def build_models(cfg: TrainConfig, *, device: torch.device, ckpt: Path | None, precision: str) -> Models:
    """The policy (from ``model``, ``init`` or a checkpoint; LoRA-wrapped when asked) and its KL reference."""
    from icsd_audit.train.models import lora as lo

    init_adapter = cfg.init_path if cfg.init is not None and lo.is_adapter_dir(str(cfg.init_path)) else None
    base_ref, base_seed = (lo.base_of(init_adapter, cfg.model, cfg.seed) if init_adapter
                           else (cfg.init_path or cfg.model, cfg.seed))
    trust = cfg.trust_remote_code
    initial, tokenizer = load_policy(base_ref, device=device, seed=base_seed, trust_remote_code=trust)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    score_kw: dict[str, Any] = dict(pad_id=pad_id, device=device, temperature=cfg.temperature, precision=precision)
    info: dict[str, Any] = {"base_model": base_ref, "init": cfg.init, "lora": None}
    if cfg.lora_enabled:
        settings = (lo.adapter_settings(init_adapter) if init_adapter else
                    lo.LoraSettings(rank=cfg.lora_rank, alpha=cfg.lora_alpha or 2.0 * cfg.lora_rank,
                                    targets=cfg.lora_targets))
        start = ckpt if ckpt is not None else init_adapter
        policy = (lo.load_adapter(initial, start, trainable=True, reference_from=init_adapter) if start is not None
                  else lo.add_adapter(initial, settings, seed=cfg.seed))
        policy.eval()
        reference: Any = (AdapterReference(policy, init_adapter is not None, **score_kw) if cfg.kl_coef > 0
                          else NoReference())
        info["lora"] = dataclasses.asdict(settings)
        saver = lo.AdapterSaver(policy, lo.adapter_meta(base_model=base_ref, base_seed=base_seed, settings=settings,
                                                        producer="icsd train", init=cfg.init))
        return Models(policy, tokenizer, reference, saver, pad_id, score_kw, info)
    policy = initial if ckpt is None else load_policy(str(ckpt), device=device, trust_remote_code=trust)[0]
    release_freed_memory()  # a first run converts the embedded GGUF in this process
    policy.eval()  # no dropout anywhere (see the module docstring)
    if cfg.kl_coef > 0:
        resident = cfg.resident_reference if cfg.resident_reference is not None else device.type != "cpu"
        ref_model = None
        if resident:
            ref_model = copy.deepcopy(initial) if ckpt is None else initial
            ref_model.eval().requires_grad_(False)
        elif ckpt is not None:
            del initial  # the policy came from the checkpoint; the reference is reloaded per pass
        reference = Reference(ref_model, frozen_loader(base_ref, device=device, seed=cfg.seed, trust_remote_code=trust),
                               **score_kw)
    else:
        reference = NoReference()
    return Models(policy, tokenizer, reference, policy, pad_id, score_kw, info)
