"""Warm start from the expert: supervised fine-tuning on the expert's turns (``icsd sft``).

A 135M model rarely writes a well-formed reply, let alone buys the right product, so RL
from it learns the format before anything else. ``icsd sft`` first teaches it what the
environment's expert does, in the exact prompts the trainer will show it:

1. **Data.** The expert (:mod:`icsd_audit.envs.expert`) plays ``episodes`` distinct tasks
   of the train split (drawn with the seed) through the training loop's own rollout:
   the same :class:`~icsd_audit.train.rollout.collect.PromptBuilder` built from the same
   :class:`~icsd_audit.train.config.fields.TrainConfig` (student prompts, no privileged
   context), reply parser, validity rule and turn budget
   (:func:`~icsd_audit.train.rollout.policy.expert_turns`). Each valid turn is one example:
   the student prompt and the expert's reply tokens through the end-of-turn token.
2. **Held-out split.** The expert also plays the first ``heldout_episodes`` tasks of the
   held-out (eval) split, the very tasks ``icsd eval`` plays first. Their turns are never
   trained on: the held-out loss is measured on them before training and after every
   epoch, and the trained policy's success is measured on the first ``eval_tasks`` of
   the same split with :func:`~icsd_audit.train.eval.evaluate` (``icsd eval``'s code:
   its temperature, turn budget and validity rule).
3. **Loss.** The mean negative log-likelihood of the reply tokens (prompt tokens carry
   no loss), computed by the trainer's own log-prob function (left-padded prompts,
   right-padded replies) at ``temperature`` 1: the usual cross-entropy, so the base
   model's calibration is kept and the RL loop samples at its own temperature. Token
   mean over each optimizer batch (``batch_rows`` turns, accumulated over
   micro-batches), AdamW, a linear warm-up then cosine decay, gradient-norm clip.
4. **What is trained.** Rank-``lora_rank`` LoRA adapters over the frozen base
   (:mod:`.lora`; the default, a few MB), or every weight with ``lora_rank = 0``.

The output folder is what ``icsd train --init`` takes: peft's adapter files and
``icsd_adapter.json`` (or, for full fine-tuning, a Hugging Face model folder), plus
``sft.json`` (data, settings, losses, the evaluation, times, load average, peak memory)
and ``sft_metrics.jsonl`` (one line per optimizer step and per held-out measurement).
It is written into a hidden staging folder and renamed when complete.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

__all__ = ["SFTConfig", "SFTExample", "SFTData", "SFTResult", "collect_data", "train_tasks", "reply_nll",
           "heldout_loss", "batch_gradients", "lr_at", "run_sft", "prompt_settings", "prompt_changes",
           "PROMPT_FIELDS", "SFT_REPORT", "SFT_METRICS"]

#: The report and the per-step log an ``icsd sft`` folder holds next to the adapter.
SFT_REPORT = "sft.json"
SFT_METRICS = "sft_metrics.jsonl"


@dataclass(frozen=True)
class SFTConfig:
    """What ``icsd sft`` trains on and how (prompts, env and model come from the TrainConfig)."""

    episodes: int = 64
    """Expert episodes on distinct tasks of the train split (each gives one example per valid turn)."""
    heldout_episodes: int = 16
    """Expert episodes on the first tasks of the held-out split: their turns give the held-out loss, never a gradient."""
    eval_tasks: int = 16
    """Held-out tasks the trained policy plays once each for its success rate (icsd eval's first tasks); 0: skip."""
    epochs: int = 2
    """Passes over the training turns."""
    lr: float = 2e-4
    """Peak AdamW learning rate (LoRA adapters learn at about 1e-4 to 1e-3; full fine-tuning wants ~1e-5)."""
    warmup: float = 0.1
    """Share of the optimizer steps with a linear warm-up from 0 to lr; cosine decay to 0 after it."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Gradient-norm clip per optimizer step."""
    batch_rows: int = 8
    """Turns per optimizer step (the loss is their reply-token mean)."""
    micro_batch_rows: int = 2
    """Turns per forward/backward micro-batch (gradient accumulation inside an optimizer step)."""
    lora_rank: int = 8
    """LoRA rank r (0: full fine-tuning of every weight)."""
    lora_alpha: float | None = None
    """LoRA scaling alpha (None: 2 * lora_rank)."""
    lora_targets: str = "all-linear"
    """Modules that get adapters: 'all-linear' or comma-separated module names (docs/training.md, LoRA)."""
    temperature: float = 1.0
    """The fitted distribution is softmax(logits / temperature) (1: the usual cross-entropy; the RL loop then samples at its own temperature)."""
    seed: int = 0
    """Seeds the task draw, the adapter's initial A, the order of the turns in each epoch."""
    recompute_activations: bool = True
    """Activation checkpointing in the gradient pass (same numbers, less memory, one more forward)."""

    def validate(self) -> "SFTConfig":
        p: list[str] = []
        for name in ("episodes", "epochs", "batch_rows", "micro_batch_rows"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                p.append(f"{name}={v!r} must be an integer >= 1")
        for name in ("heldout_episodes", "eval_tasks", "lora_rank", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                p.append(f"{name}={v!r} must be an integer >= 0")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            p.append(f"temperature={self.temperature} must be > 0")
        if not (math.isfinite(self.lr) and self.lr > 0):
            p.append(f"lr={self.lr} must be a finite number > 0")
        if not 0 <= self.warmup < 1:
            p.append(f"warmup={self.warmup} must lie in [0, 1)")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            p.append(f"weight_decay={self.weight_decay} must be >= 0")
        if not (math.isfinite(self.grad_clip) and self.grad_clip > 0):
            p.append(f"grad_clip={self.grad_clip} must be > 0")
        if self.lora_alpha is not None and not (math.isfinite(self.lora_alpha) and self.lora_alpha > 0):
            p.append(f"lora_alpha={self.lora_alpha} must be > 0 (or None: 2 * rank)")
        if not self.lora_targets.strip(" ,"):
            p.append(f"lora_targets={self.lora_targets!r} names no module; use 'all-linear' or e.g. 'q_proj,v_proj'")
        if isinstance(self.micro_batch_rows, int) and isinstance(self.batch_rows, int) \
                and self.micro_batch_rows > self.batch_rows:
            p.append(f"micro_batch_rows={self.micro_batch_rows} exceeds batch_rows={self.batch_rows}")
        if p:
            from icsd_audit.train.config import ConfigError

            raise ConfigError(p)
        return self


@dataclass(frozen=True)
class SFTExample:
    """One turn to imitate: the student prompt's ids and the expert's reply ids (through end-of-turn)."""

    task: int
    turn: int
    prompt_ids: list[int]
    reply_ids: list[int]


@dataclass
class SFTData:
    train: list[SFTExample]
    heldout: list[SFTExample]
    #: counts that say what the data is (episodes, turns, tokens, wins, cut replies)
    summary: dict[str, Any] = field(default_factory=dict)


@dataclass
class SFTResult:
    out_dir: Path
    report: dict[str, Any]


# --------------------------------------------------------------------------- data


def _play_expert(cfg: Any, *, tokenizer: Any, builder: Any, split: str, tasks: Sequence[int],
                 chunk: int = 32) -> list[Any]:
    """The expert's turns on ``tasks`` of ``split`` (envs made as the trainer makes them, expert state on)."""
    from icsd_audit.train.setup import env_factory as make_env_factory
    from icsd_audit.train.rollout.collect import expert_turns
    from icsd_audit.train.rollout.collect import RolloutSettings

    factory = make_env_factory(cfg.replace(policy="expert"))
    settings = RolloutSettings(max_turns=cfg.max_turns, max_response_tokens=cfg.max_response_tokens,
                               temperature=cfg.temperature, batch_rows=cfg.rollout_batch_rows,
                               require_think=cfg.require_think, reward=cfg.reward, record_logp=False,
                               invalid_rule=cfg.invalid_rule)
    out: list[Any] = []
    for start in range(0, len(tasks), chunk):  # bounded env instances at a time
        part = list(tasks[start:start + chunk])
        envs = [factory(split) for _ in part]
        out.extend(expert_turns(tokenizer=tokenizer, builder=builder, envs=envs, tasks=part, settings=settings))
    return out


def _examples(turns: Sequence[Any]) -> list[SFTExample]:
    return [SFTExample(task=t.task, turn=t.turn, prompt_ids=list(t.prompt_ids), reply_ids=list(t.reply_ids))
            for t in turns if t.valid]


def _describe(turns: Sequence[Any], max_response_tokens: int, max_prompt_tokens: int) -> dict[str, Any]:
    won = {t.task: t.won for t in turns}
    valid = [t for t in turns if t.valid]
    return {
        "episodes": len(won), "won": int(sum(won.values())), "turns": len(turns), "valid_turns": len(valid),
        "prompt_tokens": int(sum(len(t.prompt_ids) for t in valid)),
        "reply_tokens": int(sum(len(t.reply_ids) for t in valid)),
        "longest_prompt": max((len(t.prompt_ids) for t in valid), default=0),
        "longest_reply": max((len(t.reply_ids) for t in valid), default=0),
        # a reply the rollout's token budget would cut (it could never be written whole in training)
        "replies_over_max_response_tokens": int(sum(len(t.reply_ids) > max_response_tokens for t in valid)),
        # prompts that reached max_prompt_tokens lost their beginning (as in training)
        "prompts_at_max_prompt_tokens": int(sum(len(t.prompt_ids) >= max_prompt_tokens for t in valid)),
    }


def train_tasks(num_tasks: int, episodes: int, seed: int) -> list[int]:
    """``episodes`` distinct task indices of a split of ``num_tasks``, drawn with ``seed``."""
    if episodes > num_tasks:
        raise ValueError(f"--episodes {episodes} exceeds the {num_tasks} tasks of the train split")
    rng = np.random.default_rng([int(seed), 0x5F7])  # a stream of its own: not the training loop's task draw
    return sorted(int(t) for t in rng.choice(num_tasks, size=episodes, replace=False))


def collect_data(cfg: Any, sft: SFTConfig, *, tokenizer: Any, builder: Any) -> SFTData:
    """The expert's turns: ``sft.episodes`` train-split tasks to train on, the held-out split's first tasks to measure."""
    from icsd_audit.train.setup import env_factory as make_env_factory

    probe = make_env_factory(cfg.replace(policy="expert"))
    n_train = int(probe(cfg.train_split).num_tasks)
    n_heldout = int(probe(cfg.eval_split).num_tasks)
    tr = _play_expert(cfg, tokenizer=tokenizer, builder=builder, split=cfg.train_split,
                      tasks=train_tasks(n_train, sft.episodes, sft.seed))
    held_tasks = list(range(min(sft.heldout_episodes, n_heldout)))
    ho = _play_expert(cfg, tokenizer=tokenizer, builder=builder, split=cfg.eval_split, tasks=held_tasks) \
        if held_tasks else []
    summary = {"train": _describe(tr, cfg.max_response_tokens, cfg.max_prompt_tokens),
               "heldout": _describe(ho, cfg.max_response_tokens, cfg.max_prompt_tokens),
               "train_split": cfg.train_split, "heldout_split": cfg.eval_split, "heldout_tasks": held_tasks}
    data = SFTData(train=_examples(tr), heldout=_examples(ho), summary=summary)
    if not data.train:
        raise ValueError(f"the expert wrote no valid turn on {sft.episodes} {cfg.env} tasks; nothing to train on")
    return data


# --------------------------------------------------------------------------- the loss


def reply_nll(model: Any, rows: Sequence[SFTExample], *, pad_id: int, device: torch.device,
              temperature: float) -> tuple[torch.Tensor, int]:
    """(sum over the rows' reply tokens of -log softmax(logits / temperature)[token], number of those tokens).

    Differentiable; prompt tokens carry no loss. The log-probs are the trainer's
    (:func:`~icsd_audit.train.update.logprobs.response_logprobs`: left-padded prompts,
    right-padded replies, position ids from the attention mask).
    """
    from icsd_audit.train.update.logprobs import pack, response_logprobs

    packed = pack([r.prompt_ids for r in rows], [r.reply_ids for r in rows], pad_id=pad_id, device=device)
    logp = response_logprobs(model, packed, temperature=temperature)
    return -(logp * packed.response_mask).sum(), int(packed.response_mask.sum())


def _by_length(rows: Sequence[SFTExample], idx: Sequence[int], size: int) -> list[list[int]]:
    """``idx`` cut into micro-batches of similar total length (less padding)."""
    order = sorted(idx, key=lambda i: len(rows[i].prompt_ids) + len(rows[i].reply_ids))
    return [order[i:i + size] for i in range(0, len(order), size)]


def heldout_loss(model: Any, rows: Sequence[SFTExample], *, micro_batch_rows: int, pad_id: int,
                 device: torch.device, temperature: float, progress: Callable[[int], None] | None = None) -> float:
    """Mean reply-token negative log-likelihood of ``rows`` (no gradient); NaN for no rows.

    ``progress(rows_done)`` is called after each micro-batch.
    """
    total, count, done = 0.0, 0, 0
    with torch.no_grad():
        for mb in _by_length(rows, range(len(rows)), micro_batch_rows):
            s, n = reply_nll(model, [rows[i] for i in mb], pad_id=pad_id, device=device, temperature=temperature)
            total, count, done = total + float(s), count + n, done + len(mb)
            if progress is not None:
                progress(done)
    return total / count if count else float("nan")


def batch_gradients(model: Any, rows: Sequence[SFTExample], batch: Sequence[int], *, micro_batch_rows: int,
                    pad_id: int, device: torch.device, temperature: float, recompute_activations: bool = True,
                    progress: Callable[[int], None] | None = None) -> tuple[float, int]:
    """Accumulate into ``.grad`` the gradient of the batch's reply-token mean NLL; return (NLL sum, tokens).

    Each micro-batch's summed NLL is divided by the whole batch's token count before its
    backward, so the accumulated gradient is the big batch's token mean (what one pass
    over all the rows would give), whatever the micro-batch size.
    """
    from icsd_audit.train.models.memory import checkpointed_blocks

    n_tok = sum(len(rows[i].reply_ids) for i in batch)
    total, done = 0.0, 0
    for mb in _by_length(rows, batch, micro_batch_rows):
        with checkpointed_blocks(model) if recompute_activations else nullcontext():
            s, _ = reply_nll(model, [rows[i] for i in mb], pad_id=pad_id, device=device, temperature=temperature)
            (s / n_tok).backward()
        total, done = total + float(s.detach()), done + len(mb)
        if progress is not None:
            progress(done)
    return total, n_tok


def lr_at(update: int, total: int, *, lr: float, warmup: float) -> float:
    """Learning rate of optimizer step ``update`` (0-based) of ``total``: linear warm-up, then cosine to 0."""
    n_warm = int(math.ceil(warmup * total))
    if update < n_warm:
        return lr * (update + 1) / n_warm
    span = max(total - n_warm, 1)
    return lr * 0.5 * (1.0 + math.cos(math.pi * (update - n_warm) / span))


# --------------------------------------------------------------------------- the run


def _load_model(cfg: Any, sft: SFTConfig, device: torch.device) -> tuple[Any, Any, Any]:
    """(policy to train, tokenizer, what saves it): base + fresh adapter, or the whole model."""
    from icsd_audit.train.models import lora as lo
    from icsd_audit.train.models.loading import load_policy

    model, tok = load_policy(cfg.model, device=device, seed=cfg.seed, trust_remote_code=cfg.trust_remote_code)
    if sft.lora_rank == 0:
        model.eval()  # no dropout: the loss is the deterministic one the trainer computes
        return model, tok, model
    settings = lo.LoraSettings(rank=sft.lora_rank, alpha=sft.lora_alpha or 2.0 * sft.lora_rank,
                               targets=sft.lora_targets)
    policy = lo.add_adapter(model, settings, seed=sft.seed)
    policy.eval()
    meta = lo.adapter_meta(base_model=cfg.model, base_seed=cfg.seed, settings=settings, producer="icsd sft",
                           env=cfg.env, sft=asdict(sft), prompts=prompt_settings(cfg))
    return policy, tok, lo.AdapterSaver(policy, meta)


#: TrainConfig fields that shape the student's prompts and replies: a warm start fits the
#: prompts of these settings, and a run that changes them shows the adapter other prompts.
PROMPT_FIELDS = ("env", "max_turns", "history_window", "system_prompt", "one_shot", "require_think",
                 "max_prompt_tokens", "max_response_tokens", "temperature", "enable_thinking", "searchqa_protocol",
                 "skill_placement", "student_skills", "invalid_rule")


def prompt_settings(cfg: Any) -> dict[str, Any]:
    return {k: getattr(cfg, k) for k in PROMPT_FIELDS}


def prompt_changes(fitted: dict[str, Any] | None, cfg: Any) -> tuple[str, str] | None:
    """("field=old, ...", "field=new, ...") for the prompt and reply settings in which ``cfg`` departs from
    those a warm start recorded (``icsd_adapter.json``'s ``prompts``); None when none does.

    The turn budget and the sampling temperature are left out: they change no prompt.
    """
    if not fitted:
        return None
    now = prompt_settings(cfg)
    keys = [k for k in PROMPT_FIELDS if k in fitted and k not in ("max_turns", "temperature") and fitted[k] != now[k]]
    if not keys:
        return None
    return ", ".join(f"{k}={fitted[k]!r}" for k in keys), ", ".join(f"{k}={now[k]!r}" for k in keys)


class _Log:
    """Lines to the reporter with the elapsed time; a quiet stretch never exceeds ``every`` seconds."""

    def __init__(self, say: Callable[[str], None], every: float = 20.0):
        self.say, self.every, self.t0 = say, every, time.perf_counter()
        self.last = self.t0

    def line(self, text: str) -> None:
        from icsd_audit.train.run.metrics import clock

        now = time.perf_counter()
        self.say(f"[{clock(now - self.t0)}] {text}")
        self.last = now

    def heartbeat(self, text: str) -> None:
        if time.perf_counter() - self.last >= self.every:
            self.line(text)


def _plain_modes(folder: Path) -> None:
    """Files as the user's umask makes them (safetensors writes 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    for f in folder.iterdir():
        if f.is_file():
            f.chmod(0o666 & ~umask)


def run_sft(cfg: Any, sft: SFTConfig, out_dir: str | Path, *, say: Callable[[str], None] | None = None,
            overwrite: bool = False) -> SFTResult:
    """Collect the expert's turns, fine-tune, measure, and write the warm start to ``out_dir``.

    ``cfg`` (a :class:`~icsd_audit.train.config.fields.TrainConfig`) gives the model, environment,
    prompt settings, temperatures, seed, threads and device; ``cfg.init`` is not used
    (the warm start is trained from ``cfg.model``). ``out_dir`` must not exist (or, with
    ``overwrite``, is moved aside to ``OUT.old-DATE`` first; nothing is deleted).
    """
    from icsd_audit.outputs import check_not_input, staging_dir, terminate_cleanly
    from icsd_audit.train.run.folder import move_aside

    sft.validate()
    cfg = cfg.replace(init=None).validate()
    out = Path(out_dir)
    check_not_input(out, cfg.input_paths(), option="--out")
    if os.path.lexists(out) and not overwrite:
        raise FileExistsError(f"--out {out} exists; pick a new folder, or --overwrite to move it aside "
                              f"(to {out.name}.old-DATE; nothing is deleted)")
    from icsd_audit.train.setup import env_factory as make_env_factory

    train_tasks(int(make_env_factory(cfg.replace(policy="expert"))(cfg.train_split).num_tasks), sft.episodes,
                sft.seed)  # too many episodes: say so before any model loads
    log = _Log(say or (lambda s: None))
    stage = staging_dir(out, "sft")
    try:
        with terminate_cleanly():  # SIGTERM removes the staging folder too
            report = _run(cfg, sft, stage, log)
            if os.path.lexists(out):
                aside = move_aside(out)
                log.line(f"moved the old {out} aside to {aside}")
            os.replace(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return SFTResult(out_dir=out, report=report)


def _run(cfg: Any, sft: SFTConfig, stage: Path, log: _Log) -> dict[str, Any]:
    from icsd_audit.runs.manifest import hardware
    from icsd_audit.train.eval import evaluate
    from icsd_audit.train.setup import env_factory as make_env_factory
    from icsd_audit.train.models.loading import resolve_precision
    from icsd_audit.train.models.memory import peak_rss_bytes, release_freed_memory
    from icsd_audit.train.models.loading import resolve_device, set_threads
    from icsd_audit.train.rollout.collect import PromptBuilder

    t_start, load_start = time.perf_counter(), os.getloadavg()
    threads = set_threads(cfg.threads)
    device = resolve_device(cfg.device)
    torch.manual_seed(sft.seed)
    log.line(f"loading {cfg.model} ({'LoRA rank %d' % sft.lora_rank if sft.lora_rank else 'full fine-tuning'}, "
             f"{threads} thread(s))")
    model, tok, saver = _load_model(cfg, sft, device)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    builder = PromptBuilder.from_config(tok, cfg)
    t0 = time.perf_counter()
    data = collect_data(cfg, sft, tokenizer=tok, builder=builder)
    t_collect = time.perf_counter() - t0
    s = data.summary
    log.line(f"expert data: {len(data.train)} turns of {s['train']['episodes']} {cfg.train_split} episodes "
             f"({s['train']['won']} won; {s['train']['prompt_tokens'] + s['train']['reply_tokens']} tokens), "
             f"held out {len(data.heldout)} turns of {s['heldout']['episodes']} {cfg.eval_split} episodes "
             f"({t_collect:.1f} s)")
    if s["train"]["replies_over_max_response_tokens"]:
        log.line(f"note: {s['train']['replies_over_max_response_tokens']} expert replies are longer than "
                 f"max_response_tokens={cfg.max_response_tokens}: rollouts would cut them")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=sft.lr, betas=(0.9, 0.999), weight_decay=sft.weight_decay)
    kw = dict(pad_id=pad_id, device=device, temperature=sft.temperature)
    metrics = (stage / SFT_METRICS).open("w")
    rng = np.random.default_rng([sft.seed, 0x5F8])
    per_epoch = math.ceil(len(data.train) / sft.batch_rows)
    total = per_epoch * sft.epochs
    epochs: list[dict[str, Any]] = []
    t_heldout = 0.0

    def measure(epoch: int, train_loss: float | None) -> None:
        nonlocal t_heldout
        t1 = time.perf_counter()
        loss = heldout_loss(model, data.heldout, micro_batch_rows=sft.micro_batch_rows, **kw,
                            progress=lambda k: log.heartbeat(f"held-out loss: {k}/{len(data.heldout)} turns")) \
            if data.heldout else float("nan")
        t_heldout += time.perf_counter() - t1
        rec = {"epoch": epoch, "train_loss": train_loss, "heldout_loss": loss if math.isfinite(loss) else None}
        epochs.append(rec)
        metrics.write(json.dumps({"kind": "heldout", **rec}) + "\n")
        metrics.flush()
        log.line(f"epoch {epoch}: held-out loss {loss:.4f}" + ("" if train_loss is None else
                                                               f", train loss {train_loss:.4f}"))

    measure(0, None)
    t0 = time.perf_counter()
    update = 0
    for epoch in range(1, sft.epochs + 1):
        order = rng.permutation(len(data.train)).tolist()
        ep_sum, ep_tok = 0.0, 0
        for b in range(per_epoch):
            batch = order[b * sft.batch_rows:(b + 1) * sft.batch_rows]
            loss_sum, n_tok = batch_gradients(
                model, data.train, batch, micro_batch_rows=sft.micro_batch_rows,
                recompute_activations=sft.recompute_activations, **kw,
                progress=lambda k: log.heartbeat(f"epoch {epoch} step {update + 1}/{total}: {k}/{len(batch)} turns"))
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, sft.grad_clip))
            lr = lr_at(update, total, lr=sft.lr, warmup=sft.warmup)
            for g in opt.param_groups:
                g["lr"] = lr
            opt.step()
            opt.zero_grad(set_to_none=True)
            release_freed_memory()
            update += 1
            ep_sum, ep_tok = ep_sum + loss_sum, ep_tok + n_tok
            rec = {"kind": "step", "epoch": epoch, "step": update, "loss": loss_sum / n_tok, "tokens": n_tok,
                   "lr": lr, "grad_norm": grad_norm, "seconds": time.perf_counter() - t0}
            metrics.write(json.dumps(rec) + "\n")
            metrics.flush()
            log.line(f"epoch {epoch} step {update}/{total}: loss {rec['loss']:.4f} lr {lr:.2e} "
                     f"grad norm {grad_norm:.3f}")
        measure(epoch, ep_sum / ep_tok)
    t_train = time.perf_counter() - t0 - t_heldout
    metrics.close()

    ev: dict[str, Any] | None = None
    t_eval = 0.0
    if sft.eval_tasks:
        log.line(f"evaluating the trained policy on the first {sft.eval_tasks} {cfg.eval_split} tasks "
                 f"(temperature {cfg.eval_temperature})")
        t1 = time.perf_counter()
        factory = make_env_factory(cfg)
        ev = evaluate(model=model, tokenizer=tok, builder=builder, make_env=lambda: factory(cfg.eval_split),
                      n_tasks=sft.eval_tasks, max_turns=cfg.max_turns, max_response_tokens=cfg.max_response_tokens,
                      temperature=cfg.eval_temperature, require_think=cfg.require_think,
                      batch_rows=cfg.rollout_batch_rows, device=device, seed=cfg.seed, split=cfg.eval_split,
                      precision=resolve_precision(cfg.precision, device), invalid_rule=cfg.invalid_rule).to_dict()
        t_eval = time.perf_counter() - t1
        log.line(f"held-out success {ev['success']:.3f}, score {ev['score']:.3f}, invalid {ev['invalid_rate']:.3f} "
                 f"over {ev['n_tasks']} tasks ({t_eval:.1f} s)")
    saver.save_pretrained(str(stage))
    if sft.lora_rank == 0:
        tok.save_pretrained(str(stage))
    else:
        (stage / "README.md").unlink(missing_ok=True)  # peft's blank model-card template; sft.json says what this is
    _plain_modes(stage)
    from icsd_audit.version import __version__

    report = {
        "format": "icsd-sft", "version": 1, "icsd_version": __version__,
        "model": cfg.model, "env": cfg.env, "kind": "lora" if sft.lora_rank else "full",
        "sft": asdict(sft), "prompts": prompt_settings(cfg), "train_config": cfg.to_dict(),
        "data": data.summary, "epochs": epochs, "eval": ev,
        "seconds": {"collect": t_collect, "train": t_train, "heldout_loss": t_heldout, "eval": t_eval,
                    "total": time.perf_counter() - t_start},
        "load_average": {"start": list(load_start), "end": list(os.getloadavg())},
        "peak_rss_bytes": peak_rss_bytes(), "threads": threads, "hardware": hardware(),
        "trainable_parameters": int(sum(p.numel() for p in params)),
    }
    (stage / SFT_REPORT).write_text(json.dumps(report, indent=2, sort_keys=True, allow_nan=False) + "\n")
    log.line(f"wrote the warm start ({report['trainable_parameters']:,} trained parameters) in "
             f"{report['seconds']['total']:.0f} s")
    return report

