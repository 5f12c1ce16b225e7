"""The training configuration: one dataclass, presets, validation with fix-it messages.

Every field carries a docstring (the string right below it); :func:`field_docs` reads
them back, so ``icsd train --list-fields`` and docs/training.md show the same text.

Presets:

* ``paper``: the WebShop column of the paper's Table A1 (SDAR-aligned protocol):
  16 tasks x 8 rollouts, 15 turns, prompt/response 4096/512 tokens, actor mini-batch
  64 prompts (x 8 rollouts = 512 turn rows, as verl counts it), lr 1e-6, ratio clip 0.2,
  KL 0.01, lambda 0.01, 150 updates, validation on 128 held-out instructions; GiGPO
  with gamma 0.95 and unit step weight. The model defaults to the embedded
  SmolLM2-135M; pass ``model=`` (a local Qwen2.5-Instruct folder) to match the paper.
* ``paper-searchqa`` / ``cpu-demo-searchqa``: the same for Search-QA (Table A1's Search-QA
  column: 128 x 8 rollouts, 4 turns, actor mini-batch 256 prompts, KL 0.001, 200 updates,
  512 held-out questions; reward = exact match); ``--env searchqa --preset paper`` picks
  them (:func:`preset_for`).
* ``cpu-demo``: the embedded SmolLM2-135M on CPU, 2 tasks x 4 rollouts, 2 turns,
  48-token replies, 2 steps of four 4-row actor mini-batches (8 optimizer updates),
  gradient sketches with k = 32 in the dumps;
  it finishes in about ten minutes on a 2-core machine and writes real frozen batches
  (docs/training.md lists the measured time and the departures that make it fit).
* ``paper-alfworld``: the ALFWorld column of Table A1: 16 tasks x 8 rollouts, 50 turns,
  prompt/response 2048/512 tokens, actor mini-batch 256 prompts (x 8 = 2048 turn rows),
  lr 1e-6, ratio clip 0.2, KL 0.01, lambda 0.01, 150 updates, validation on 128 held-out
  games; GiGPO with gamma 0.95, unit step weight and ``mean_std_norm`` (verl-agent's
  ALFWorld GiGPO script; WebShop's uses ``mean_norm``).
* ``cpu-demo-alfworld``: ``cpu-demo`` on ALFWorld (3 turns, 1536-token prompts: the
  opening lists every receptacle and the admissible actions run to dozens).

``--env alfworld --preset paper`` (or ``cpu-demo``) picks the ALFWorld variant
(:func:`preset_for`).

``allocator="none"`` is plain GRPO/GiGPO: the distillation weight is forced to 0, the
teacher pass is skipped and no dumps are written (there is no allocation to dump);
with ``hybrid='rlsd'`` or ``'skill-sd'`` the teacher runs for that baseline, and still
nothing is dumped (:mod:`icsd_audit.train.hybrid`).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import inspect
import json
import math
import textwrap
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping

__all__ = ["TrainConfig", "ConfigError", "PRESETS", "preset", "preset_for", "field_docs", "parse_override", "REWARDS",
           "WARM_START_PREFIX", "resolve_init", "shipped_warm_starts", "warm_starts_dir"]

#: Reward shaping names (see ``TrainConfig.reward``).
REWARDS = ("won10", "score")
#: Invalid-turn rules (see ``TrainConfig.invalid_rule`` and icsd_audit.train.rollout.INVALID_RULES).
INVALID_RULE_NAMES = ("format", "admissible")
_PRECISIONS = ("auto", "float32", "bf16-mixed")
_NO_ALLOCATOR = "none"


class ConfigError(ValueError):
    """One or more configuration errors; each line says what is wrong and how to fix it."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("invalid training config: " + "; ".join(self.problems))


@dataclass
class TrainConfig:
    """Everything one ``icsd train`` run needs. Field docs: ``icsd train --list-fields``."""

    # ------------------------------------------------------------------ run
    out_dir: str = "runs/icsd"
    """Run folder: metrics.jsonl, config.json, dumps/, checkpoints/ and eval.jsonl go here."""
    seed: int = 0
    """Master seed. Step s reseeds every RNG from (seed, s), so a resumed run repeats the same steps."""
    total_steps: int = 150
    """Number of training steps (one rollout batch and its actor update each)."""
    threads: int | None = None
    """CPU threads for torch (None: $ICSD_THREADS, else the cores idle at the start, at least 1; see icsd_audit.threads for why)."""
    report_to: str = ""
    """Experiment trackers that also get every step's metrics and the config: comma-separated tensorboard, mlflow, trackio, wandb (each an optional extra, local stores by default; docs/compare.md); '' or 'none': metrics.jsonl only."""

    # ------------------------------------------------------------------ model
    model: str = "embedded"
    """Policy: a local Hugging Face causal-LM folder, 'embedded' (SmolLM2-135M-Instruct) or 'tiny-random' (tests)."""
    device: str = "auto"
    """'auto' (CUDA when available), 'cpu', 'cuda', 'cuda:1', ..."""
    precision: str = "auto"
    """'float32', or 'bf16-mixed' (fp32 weights and optimizer, bf16 autocast); 'auto' = bf16-mixed on CUDA, float32 on CPU."""
    trust_remote_code: bool = False
    """Run Python code shipped in the model folder (a config's auto_map); off unless asked for: a model folder from elsewhere could run anything."""
    lora_rank: int = 0
    """LoRA rank r (the peft library): 0 = full fine-tuning; r > 0 trains rank-r adapters on lora_targets with the base weights frozen (KL reference = the same weights with the adapter disabled; checkpoints hold the adapter and its AdamW state only; docs/training.md, LoRA)."""
    lora_alpha: float | None = None
    """LoRA scaling alpha: an adapter adds alpha / r * B A x to a layer's output; None: 2 * lora_rank."""
    lora_targets: str = "all-linear"
    """Modules that get adapters: 'all-linear' (peft: every linear layer of the decoder blocks, i.e. q/k/v/o and gate/up/down projections for Llama/Qwen; never the LM head) or comma-separated module-name suffixes, e.g. 'q_proj,v_proj'."""
    init: str | None = None
    """Start from this folder instead of the plain model: a LoRA adapter folder (peft's files plus icsd_adapter.json naming its base, as icsd train checkpoints and icsd sft write; training continues that adapter, and the KL reference is base + that adapter) or a full Hugging Face model folder (it replaces model); or 'warmstart:NAME', a warm start shipped with icsd (icsd_audit/warmstarts/NAME; the cpu-demo and cpu-study presets start from 'warmstart:webshop-smollm2-135m', and drop it when --model names another base or the engine is verl)."""

    # ------------------------------------------------------------------ environment and prompts
    env: str = "webshop"
    """Environment name (built-in: webshop, alfworld, searchqa, clue; alfworld needs `pip install 'icsd-audit[alfworld]'`)."""
    env_url: str | None = None
    """URL of a real WebShop server; None uses the built-in offline WebShop."""
    alfworld_data: str | None = None
    """Official ALFWorld data folder (holding json_2.1.1/; train and valid_unseen games); None: $ALFWORLD_DATA, else the built-in generated games."""
    server_num_goals: int | None = None
    """With env_url: how many goals the WebShop server loaded (its train split is every goal after the first 500, as in verl-agent); required to train against a server. WebShop prints it at start-up ('Loaded N goals.', web_agent_site/envs/web_agent_text_env.py)."""
    clue_boxes: int = 8
    """env='clue': number of boxes the key may be in (2..12)."""
    clue_accuracy: float = 1.0
    """env='clue': probability that a task's clue (what the privileged teacher sees) names the key's box; otherwise it names another box (fixed per task)."""
    train_split: str = "train"
    """Task split rollouts draw from."""
    eval_split: str = "eval"
    """Held-out split for evaluation."""
    max_turns: int = 15
    """Maximum action turns per episode (Table A1: 15 for WebShop, 50 for ALFWorld)."""
    history_window: int = 2
    """How many past (observation, action) pairs the prompt shows."""
    system_prompt: str | None = None
    """Optional system message (None keeps the chat template's default)."""
    one_shot: bool = False
    """Prepend one worked example exchange (a search turn) to every prompt; helps tiny models keep the format."""
    require_think: bool = True
    """A reply must contain <think>...</think> before its <action> to be valid (verl-agent's WebShop projection)."""
    reward: str = "won10"
    """Step reward: 'won10' (verl-agent: 10 when the episode is won, else 0) or 'score' (WebShop's continuous score at purchase)."""
    invalid_penalty: float = 0.1
    """Subtracted from an action turn's score when the turn is invalid (verl-agent's invalid_action_penalty_coef)."""
    invalid_rule: str = "format"
    """Which turns are invalid: 'format' (the environment's reference rule for a malformed reply: verl-agent's for WebShop and ALFWorld, missing <action> or, with require_think, <think> tags, or CJK text; Search-QA's by searchqa_protocol) or 'admissible' (also a well-formed but non-admissible action)."""
    enable_thinking: bool | None = None
    """Passed to the chat template as enable_thinking: False renders Qwen3's non-thinking mode (the paper's concise non-thinking interface, Table 3); None passes nothing (templates without the switch ignore it either way)."""
    policy: str = "model"
    """Who writes the replies: 'model' (the policy being trained) or 'expert' (each environment's expert: rollouts and evaluation only, no gradient; icsd train/eval --policy expert)."""

    # ------------------------------------------------------------------ rollout
    n_tasks: int = 16
    """Tasks per step (Table A1 train batch)."""
    group_size: int = 8
    """Rollouts per task: one GRPO/GiGPO group (Table A1: 8)."""
    max_prompt_tokens: int = 4096
    """Longest student prompt; longer prompts lose tokens from the left (counted in the metrics)."""
    max_response_tokens: int = 512
    """Longest reply per action turn."""
    temperature: float = 1.0
    """Sampling temperature. The policy is softmax(logits / temperature) in every pass (rollout, teacher, reference, actor), as in verl."""
    rollout_batch_rows: int = 128
    """Prompts per batched generate call (KV-cache sampling)."""
    recompute_old_logp: bool = False
    """Recompute old log-probs with a forward pass after the rollout (verl's way; advisable in bf16) instead of keeping the sampler's."""

    # ------------------------------------------------------------------ advantages
    adv_estimator: str = "gigpo"
    """'grpo' or 'gigpo' (icsd_audit.train.advantages)."""
    gamma: float = 0.95
    """GiGPO discount of step returns."""
    step_weight: float = 1.0
    """GiGPO weight of the step-level advantage."""
    gigpo_mode: str = "mean_norm"
    """GiGPO normalisation: 'mean_norm' or 'mean_std_norm' (verl-agent's GiGPO scripts: mean_norm for WebShop, mean_std_norm for ALFWorld and Search; the paper-alfworld preset follows them)."""
    norm_adv_by_std: bool = True
    """GRPO: divide by the group std (False: Dr. GRPO)."""

    # ------------------------------------------------------------------ privileged self-teacher
    skillbank: str | None = None
    """SkillBank: a built-in name, a JSON file or an SDAR skills folder (None: the bank named after the environment)."""
    skill_mode: str = "match"
    """Retrieval: 'match' (keyword match, see skill_match), 'all' (SDAR's skill_all) or 'general'."""
    skill_match: str = "sdar"
    """Keyword rule of skill_mode='match': 'sdar' (SDAR's get_privileged_info_from_prompt: plain substrings on the whole lower-cased student prompt, every matching category) or 'instruction' (the bank's own rule on the task instruction only; whole words for the shipped banks)."""
    student_skills: str = "off"
    """Retrieved skills in the *student* prompt too (paper's extended-table baselines): 'off', 'train' (rollouts and actor: Skill-GRPO), 'eval' (evaluation only: with icsd eval, the Skill-Prompt* baseline) or 'both' (Skill-GRPO*); 'train' and 'both' need allocator='none'."""
    skill_placement: str = "prefix"
    """'prefix' (SDAR: the skill block in front of the rendered student prompt) or 'user' (inside the user message)."""

    # ------------------------------------------------------------------ actor
    lr: float = 1e-6
    """AdamW learning rate (Table A1: 1e-6)."""
    weight_decay: float = 0.01
    """AdamW weight decay (verl's default)."""
    grad_clip: float = 1.0
    """Gradient-norm clip per optimizer step (verl's default)."""
    ppo_epochs: int = 1
    """Passes over the step's rows."""
    mini_batch_rows: int = 512
    """Action-turn rows per actor mini-batch = per optimizer step = per allocation (Table A1: 64 prompts x 8 rollouts)."""
    micro_batch_rows: int = 8
    """Rows per forward/backward micro-batch (gradient accumulation inside a mini-batch)."""
    shuffle_rows: bool = False
    """Shuffle rows before cutting mini-batches (verl-agent keeps rollout order: False)."""
    clip_ratio: float = 0.2
    """PPO ratio clip epsilon."""
    dual_clip: float = 3.0
    """Dual-clip constant c for negative advantages (verl's clip_ratio_c)."""
    kl_coef: float = 0.01
    """Coefficient of the low-variance (k3) KL to the frozen initial policy; 0 skips the reference pass."""

    # ------------------------------------------------------------------ distillation allocation
    allocator: str = "icsd"
    """'none' (plain GRPO/GiGPO: the paper's 'GRPO'/'GiGPO' rows; with student_skills: 'Skill-GRPO') or an allocator of icsd_audit.alloc.variants: opsd ('+ OPSD'; with pg_coef=0: stand-alone 'OPSD'), sdar ('+ SDAR'), icsd ('+ ICSD'), fisher ('+ Fisher magnitude'), sign ('+ Sign-only'), influence-only ('+ Influence only'), gaussian, permuted."""
    pg_coef: float = 1.0
    """Weight of the PPO surrogate in the actor loss; 0 drops the RL loss (stand-alone OPSD: allocator='opsd', pg_coef=0, the paper's 'OPSD' row)."""
    trust: str = "laplace"
    """Base trust g: 'laplace' (paper), 'sigmoid' (SDAR's public code) or 'uniform'."""
    trust_beta: float = 5.0
    """Slope of the sigmoid trust."""
    trust_eta: float = 0.4
    """Split parameter eta of the Laplace trust map g (paper: 0.4; SPEC 3). Recorded in every dump's allocator block, from which the audit recomputes."""
    influence_eta: float = 0.5
    """Split parameter eta of the calibrated influence map m (paper: 0.5; SPEC 4); the paper's sensitivity figure sweeps it (docs/reproduce.md)."""
    distill_coef: float = 0.01
    """lambda: weight of the allocated distillation term lambda/|B| * sum c_t * l_KD_t (Table A1: 0.01)."""
    alloc_eps: float = 1e-4
    """Scale floor and turn-mass threshold of the allocator (SPEC 2)."""
    min_group: int = 8
    """Smallest calibration group that gets its own fit (SPEC 2)."""
    alloc_seed: int = 0
    """Seed of the 'permuted' allocator (the same for every mini-batch, so an audit with --seed reproduces it)."""
    skip_first_prepass: bool = True
    """Skip the no-grad ratio pass on a step's first mini-batch, where the policy is still the rollout policy (ratio = 1 exactly); not for 'fisher', which needs the pass's score norms."""
    alloc_scope: str = "mini-batch"
    """Where the allocation is fitted: 'mini-batch' (the SPEC's batch: one allocation per actor mini-batch from a no-grad ratio pre-pass) or 'micro-batch' (each gradient micro-batch allocates from its own forward: no extra pass, as the paper and SDAR's code do; batch_id = 1000 * mini-batch id + micro index)."""
    teacher_rescore: bool = False
    """Re-score the teacher with the current weights on every mini-batch after a step's first (one extra no-grad teacher forward per mini-batch); False keeps SDAR's timing: the teacher is scored once per step with the rollout weights."""

    # ------------------------------------------------------------------ hybrid distillation baselines
    hybrid: str = "none"
    """The paper's hybrid distillation baselines (Table 1), as SDAR's code defines them (icsd_audit.train.hybrid): 'rlsd' (turn advantages reweighted per token by the teacher-student gap, no distillation term) or 'skill-sd' (GRPO plus SDAR's K3 importance-weighted self-distillation loss); both use the privileged teacher without an allocation, so they need allocator='none' and write no dumps. 'none': off."""
    rlsd_lambda: float = 0.5
    """RLSD's initial mixing weight lam in A * ((1 - lam) + lam * w_t) (SDAR examples/rlsd_trainer/run_alfworld_3b.sh line 55, rlsd.rlsd_lambda; not pinned down by the paper)."""
    rlsd_warmdown_steps: int = 100
    """RLSD's lam decays linearly to 0 at SDAR's global step W = this (step s here is SDAR's s + 1; run_alfworld_3b.sh line 56, rlsd.warmdown_steps; SDAR's code falls back to 50)."""
    rlsd_clip_eps: float = 0.2
    """RLSD's token weight w_t = exp(sign(A) * (teacher_logp - old_logp)) is clipped to [1 - eps, 1 + eps] (run_alfworld_3b.sh line 57, rlsd.clip_eps)."""
    sdl_coef: float = 0.001
    """Skill-SD's weight of the token-mean self-distillation loss (SDAR examples/skillsd_trainer/run_alfworld_3b.sh line 55, skillsd.sdl_lambda; SDAR's code falls back to 0.1); constant, as in SDAR's actor."""

    # ------------------------------------------------------------------ memory (no effect on any number)
    recompute_activations: bool = True
    """Activation checkpointing in the actor's gradient pass: decoder blocks are recomputed in the backward instead of stored (same numbers bit for bit; most of the actor's activation memory saved for one more forward of the blocks)."""
    spill_optimizer_state: bool | None = None
    """Keep AdamW's moments (twice the weights) in an unlinked temporary file in the run folder between optimizer steps, read back for each step (same numbers bit for bit; one read and write of the moments per step); None: on CPU only."""
    resident_reference: bool | None = None
    """Keep the frozen reference policy in memory all run (True) or load it for each reference pass and free it after (False: one model's worth of memory less, about a second per step on the 135M model); None: resident on GPU only."""

    # ------------------------------------------------------------------ outputs
    dump_every: int = 1
    """Write the per-token rows of every actor mini-batch every N steps (0: never)."""
    sketch_k: int = 0
    """Per-token gradient sketches in the dumps, for `icsd audit gradcos`: 0 = off; else k_out = k_in = sketch_k random projections per sketched layer (columns sketch.<layer>.out|in), taken in the gradient micro-batches."""
    sketch_layers: str = "auto"
    """Layers to sketch: 'auto' (LM head + the last block's attention output projection and MLP) or comma-separated nn.Linear module names, all after the last attention."""
    sketch_seed: int = 0
    """Base seed of the sketch's random projections (each layer's seed is derived from it and the layer name; stored in the dump metadata)."""
    checkpoint_every: int = 10
    """Checkpoint every N steps (0: only at the end)."""
    keep_checkpoints: int = 1
    """How many recent checkpoints to keep (older ones are deleted once a new one is complete). A 135M-model checkpoint is 1.6 GB, of which 1.08 GB is AdamW state."""
    checkpoint_optimizer: bool = True
    """Save AdamW's moments in checkpoints (False: weights and RNG state only, a third of the size; a resume from such a checkpoint restarts AdamW from zero moments and says so)."""
    eval_every: int = 0
    """Evaluate on held-out instructions every N steps and at the end (0: never)."""
    eval_tasks: int = 128
    """Held-out instructions per evaluation (Table A1 validation batch: 128)."""
    eval_temperature: float = 0.4
    """Sampling temperature at evaluation (0: greedy)."""

    # ------------------------------------------------------------------ Search-QA data
    searchqa_corpus: str | None = None
    """Search-QA: a Search-R1 JSONL corpus (id, contents) to search with BM25; None: the built-in synthetic KB."""
    searchqa_data: str | None = None
    """Search-QA: 'train.parquet,test.parquet' in Search-R1's format (question, golden_answers, data_source); None: built-in."""
    retriever_url: str | None = None
    """Search-QA: a running Search-R1 retrieval server (POST /retrieve), used instead of BM25."""
    retrieval_topk: int = 3
    """Search-QA: passages returned per search (Search-R1: 3)."""
    searchqa_protocol: str = "search-r1"
    """Search-QA: 'search-r1' (Search-R1's rollout: one growing context per episode, its prompt, its reply rule) or 'verl-agent' (verl-agent's search environment, as SDAR's scripts run it: the prompt rebuilt each turn with the last history_window steps, search_projection's reply rule). Both end at max_turns with a final-answer turn."""

    # ------------------------------------------------------------------ derived
    @property
    def distill_enabled(self) -> bool:
        """Whether the run has a distillation term (allocator other than 'none')."""
        return self.allocator != _NO_ALLOCATOR

    @property
    def teacher_enabled(self) -> bool:
        """Whether the run scores the privileged teacher (an allocator, or a hybrid baseline)."""
        return self.distill_enabled or self.hybrid != "none"

    @property
    def effective_distill_coef(self) -> float:
        """lambda as deployed: 0 for allocator 'none'."""
        return self.distill_coef if self.distill_enabled else 0.0

    @property
    def skillbank_name(self) -> str:
        return self.skillbank if self.skillbank else self.env

    @property
    def chat_kwargs(self) -> dict[str, Any]:
        """Extra variables for the chat template (``enable_thinking`` when set)."""
        return {} if self.enable_thinking is None else {"enable_thinking": bool(self.enable_thinking)}

    def allocator_settings(self) -> dict[str, Any]:
        """What the dump metadata records under ``allocator`` (the audit's options)."""
        return {
            "allocator": self.allocator,
            "trust": self.trust,
            "trust_eta": self.trust_eta,
            "influence_eta": self.influence_eta,
            "trust_beta": self.trust_beta,
            "eps": self.alloc_eps,
            "min_group": self.min_group,
            "seed": self.alloc_seed,
            "lambda": self.effective_distill_coef,
            "compute_dtype": "float64 from float32-rounded inputs",
            "alloc_scope": self.alloc_scope,
            # SPEC 9's names: own-forward (micro-batch scope) or prepass (a no-grad pass over the mini-batch)
            "ratio_source": ("own-forward" if self.alloc_scope == "micro-batch" else
                             "prepass" + ("; fixed-1 on a step's first mini-batch" if self.skip_first_prepass
                                          and self.allocator != "fisher" else "")),
            "teacher_logp": ("re-scored with the current weights per mini-batch" if self.teacher_rescore
                             else "scored once per step with the rollout weights (SDAR)"),
        }

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "TrainConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError([f"unknown field(s) {unknown}; see `icsd train --list-fields` for the valid names"])
        return cls(**dict(data))

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "TrainConfig":
        """Preset ``name`` with ``overrides``. A preset's shipped warm start belongs to its base model:
        when ``model`` names another model (and ``init`` is not given), the run starts from that model."""
        from icsd_audit.train.presets import preset  # presets build TrainConfigs: imported at call time

        base = preset(name)
        if ("model" in overrides and "init" not in overrides and base.init is not None
                and base.init.startswith(WARM_START_PREFIX) and not _same_base(overrides["model"], base.init)):
            overrides = {**overrides, "init": None}
        return base.replace(**overrides)

    def replace(self, **overrides: Any) -> "TrainConfig":
        known = {f.name for f in fields(self)}
        bad = sorted(set(overrides) - known)
        if bad:
            raise ConfigError([f"unknown field(s) {bad}; see `icsd train --list-fields` for the valid names"])
        return dataclasses.replace(self, **overrides)

    def save(self, path: str | Path) -> Path:
        """Write the config as JSON through a temporary file and a rename (never half-written)."""
        from icsd_audit.outputs import write_text_atomic

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        return write_text_atomic(path, json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    def input_paths(self) -> dict[str, str]:
        """What the run reads from disk, by label (an output may neither be, hold nor lie inside one of them)."""
        found: dict[str, str] = {}
        if self.model.strip().lower() in ("embedded", "default", "smollm2", "smollm2-135m-instruct"):
            from icsd_audit.train.models import model_cache_dir

            found["embedded model's cache folder"] = str(model_cache_dir())
        elif self.model != "tiny-random":
            found["input model folder"] = self.model
        if self.skillbank and Path(self.skillbank).expanduser().exists():
            found["skillbank"] = self.skillbank
        if self.searchqa_corpus:
            found["searchqa_corpus file"] = self.searchqa_corpus
        for i, f in enumerate(x.strip() for x in (self.searchqa_data or "").split(",") if x.strip()):
            found[f"searchqa_data file {i + 1}"] = f
        if self.alfworld_data:
            found["alfworld_data folder"] = self.alfworld_data
        if self.init is not None:
            with contextlib.suppress(ConfigError):  # an unknown warm start is validate()'s to report
                found["init folder"] = str(self.init_path)
        return found

    # ------------------------------------------------------------------ validation
    def validate(self, *, env_here: bool = True) -> "TrainConfig":
        """Raise :class:`ConfigError` listing every problem with its fix; return self when fine.

        ``env_here=False`` skips the checks that the environment's engine is installed on this
        machine (``icsd train --engine verl --dry-run`` writes files for another machine).
        """
        from icsd_audit.alloc.variants import allocator_names, trust_names

        p = self._type_problems()
        if p:  # the checks below compare values; with a wrong type they would fail with a traceback instead
            raise ConfigError(p)

        def need(cond: bool, msg: str) -> None:
            if not cond:
                p.append(msg)

        for f in fields(self):
            v = getattr(self, f.name)
            need(not isinstance(v, float) or math.isfinite(v), f"{f.name}={v!r} must be a finite number")
        for name in ("seed", "alloc_seed", "sketch_seed"):
            v = getattr(self, name)
            need(v >= 0, f"{name}={v!r} must be an integer >= 0")

        for name in ("total_steps", "max_turns", "n_tasks", "group_size", "max_prompt_tokens", "max_response_tokens",
                     "rollout_batch_rows", "ppo_epochs", "mini_batch_rows", "micro_batch_rows", "min_group"):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"{name}={v!r} must be an integer >= 1")
        for name in ("dump_every", "checkpoint_every", "eval_every", "history_window", "sketch_k"):
            v = getattr(self, name)
            need(isinstance(v, int) and v >= 0, f"{name}={v!r} must be an integer >= 0 (0 turns it off)")
        need(isinstance(self.lora_rank, int) and not isinstance(self.lora_rank, bool) and self.lora_rank >= 0,
             f"lora_rank={self.lora_rank!r} must be an integer >= 0 (0: full fine-tuning)")
        need(self.lora_alpha is None or self.lora_alpha > 0, f"lora_alpha={self.lora_alpha} must be > 0 (or None: 2 * rank)")
        need(bool(self.lora_targets.strip(" ,")),
             f"lora_targets={self.lora_targets!r} names no module; use 'all-linear' or e.g. 'q_proj,v_proj'")
        p.extend(self._init_problems())
        need(self.keep_checkpoints >= 1, f"keep_checkpoints={self.keep_checkpoints} must be >= 1")
        need(self.eval_tasks >= 1, f"eval_tasks={self.eval_tasks} must be >= 1")
        need(self.threads is None or self.threads >= 1, f"threads={self.threads} must be >= 1 or None")
        need(self.group_size >= 2 or self.adv_estimator not in ("grpo", "gigpo"),
             f"group_size={self.group_size}: group-relative advantages need at least 2 rollouts per task; set group_size >= 2")
        need(self.temperature > 0, f"temperature={self.temperature} must be > 0 for training (sampling); use e.g. 1.0")
        need(self.eval_temperature >= 0, f"eval_temperature={self.eval_temperature} must be >= 0 (0 = greedy)")
        need(self.lr > 0, f"lr={self.lr} must be > 0")
        need(self.weight_decay >= 0, f"weight_decay={self.weight_decay} must be >= 0")
        need(self.grad_clip > 0, f"grad_clip={self.grad_clip} must be > 0")
        need(0 < self.clip_ratio < 1, f"clip_ratio={self.clip_ratio} must lie in (0, 1); the paper uses 0.2")
        need(self.dual_clip > 1, f"dual_clip={self.dual_clip} must be > 1 (verl requires clip_ratio_c > 1); the paper uses 3")
        need(self.kl_coef >= 0, f"kl_coef={self.kl_coef} must be >= 0 (0 skips the reference pass)")
        need(self.distill_coef >= 0, f"distill_coef={self.distill_coef} must be >= 0")
        need(self.invalid_penalty >= 0, f"invalid_penalty={self.invalid_penalty} must be >= 0")
        need(0 <= self.gamma <= 1, f"gamma={self.gamma} must lie in [0, 1]")
        need(self.alloc_eps > 0, f"alloc_eps={self.alloc_eps} must be > 0")
        need(self.trust_beta > 0, f"trust_beta={self.trust_beta} must be > 0")
        for name in ("trust_eta", "influence_eta"):
            v = getattr(self, name)
            need(0 < v < 1, f"{name}={v} must lie in (0, 1); the paper uses 0.4 (trust) and 0.5 (influence)")
        need(self.invalid_rule in INVALID_RULE_NAMES,
             f"invalid_rule={self.invalid_rule!r}: choose one of {list(INVALID_RULE_NAMES)}")
        need(self.reward in REWARDS, f"reward={self.reward!r}: choose one of {list(REWARDS)}")
        need(self.precision in _PRECISIONS, f"precision={self.precision!r}: choose one of {list(_PRECISIONS)}")
        need(self.adv_estimator in ("grpo", "gigpo"), f"adv_estimator={self.adv_estimator!r}: choose 'grpo' or 'gigpo'")
        need(self.gigpo_mode in ("mean_norm", "mean_std_norm"),
             f"gigpo_mode={self.gigpo_mode!r}: choose 'mean_norm' or 'mean_std_norm'")
        need(self.skill_mode in ("match", "all", "general"), f"skill_mode={self.skill_mode!r}: choose match, all or general")
        need(self.skill_match in ("sdar", "instruction"),
             f"skill_match={self.skill_match!r}: choose 'sdar' (SDAR's rule) or 'instruction'")
        need(self.student_skills in ("off", "train", "eval", "both"),
             f"student_skills={self.student_skills!r}: choose off, train, eval or both")
        need(self.student_skills in ("off", "eval") or not self.teacher_enabled,
             f"student_skills={self.student_skills!r} with allocator={self.allocator!r}, hybrid={self.hybrid!r} would "
             "show the teacher's skill to the student as well; use allocator='none' and hybrid='none' (Skill-GRPO) "
             "or student_skills='off'")
        p.extend(self._hybrid_problems())
        need(self.pg_coef >= 0, f"pg_coef={self.pg_coef} must be >= 0 (0: no RL loss)")
        need(self.pg_coef > 0 or self.distill_enabled,
             "pg_coef=0 with allocator='none' leaves no loss at all; pick allocator='opsd' for stand-alone OPSD")
        need(self.skill_placement in ("prefix", "user"), f"skill_placement={self.skill_placement!r}: choose 'prefix' (SDAR) or 'user'")
        valid_alloc = [_NO_ALLOCATOR, *allocator_names()]
        need(self.allocator in valid_alloc, f"allocator={self.allocator!r}: choose one of {valid_alloc}")
        need(self.trust in trust_names(), f"trust={self.trust!r}: choose one of {trust_names()}")
        need(isinstance(self.sketch_seed, int) and not isinstance(self.sketch_seed, bool),
             f"sketch_seed={self.sketch_seed!r} must be an integer")
        need(bool(self.sketch_layers.strip(" ,")),
             f"sketch_layers={self.sketch_layers!r} names no layer; use 'auto' or comma-separated module names")
        if isinstance(self.sketch_k, int) and self.sketch_k > 0:
            need(self.distill_enabled and self.dump_every > 0,
                 f"sketch_k={self.sketch_k} but this run writes no dumps (allocator={self.allocator!r}, "
                 f"dump_every={self.dump_every}); pick an allocator other than 'none' and dump_every >= 1, or set sketch_k=0")
        need(self.alloc_scope in ("mini-batch", "micro-batch"),
             f"alloc_scope={self.alloc_scope!r}: choose 'mini-batch' or 'micro-batch'")
        need(self.micro_batch_rows <= self.mini_batch_rows,
             f"micro_batch_rows={self.micro_batch_rows} exceeds mini_batch_rows={self.mini_batch_rows}; lower micro_batch_rows")
        from icsd_audit.envs import ENV_NAMES

        need(self.env in ENV_NAMES, f"env={self.env!r}: available environments are {list(ENV_NAMES)}")
        if self.env == "alfworld":
            from icsd_audit.envs.alfworld.engine import ENGINE_HINT, engine_available

            need(engine_available() or not env_here, ENGINE_HINT)
            need(not self.env_url, f"env_url={self.env_url!r}: ALFWorld runs in-process; unset env_url")
        if self.env == "webshop" and self.env_url:
            need(self.server_num_goals is None or self.server_num_goals > 500,
                 f"server_num_goals={self.server_num_goals} must exceed the 500 held-out goals")
        need(self.alfworld_data is None or self.env == "alfworld",
             f"alfworld_data is set but env={self.env!r}; use --env alfworld or drop alfworld_data")
        if self.alfworld_data is not None:
            need(Path(self.alfworld_data).expanduser().is_dir(),
                 f"alfworld_data={self.alfworld_data!r} is not a folder; point it at the folder holding json_2.1.1/")
        need(not self.one_shot or self.env in _ONE_SHOT_ENVS,
             f"one_shot=True has no worked example for env {self.env!r}; set one_shot=False")
        if not (self.model in _MODEL_ALIASES or Path(self.model).expanduser().is_dir()):
            p.append(f"model={self.model!r} is neither 'embedded', 'tiny-random', 'tiny-word' nor a local folder; "
                     "download the model (e.g. `huggingface-cli download ORG/NAME --local-dir DIR`) and pass DIR")
        need(self.policy in ("model", "expert"), f"policy={self.policy!r}: choose 'model' or 'expert'")
        p.extend(self._searchqa_problems())
        p.extend(self._clue_problems())
        try:
            from icsd_audit.runs.trackers import parse_report_to

            parse_report_to(self.report_to)
        except ValueError as exc:
            p.append(f"report_to={self.report_to!r}: {exc}")
        if p:
            raise ConfigError(p)
        return self

    def _hybrid_problems(self) -> list[str]:
        from icsd_audit.train.hybrid import hybrid_names

        if self.hybrid not in hybrid_names():
            return [f"hybrid={self.hybrid!r}: choose one of {hybrid_names()}"]
        p = []
        if not 0 <= self.rlsd_lambda <= 1:
            p.append(f"rlsd_lambda={self.rlsd_lambda} must lie in [0, 1] (SDAR's scripts: 0.5)")
        if self.rlsd_warmdown_steps < 1:
            p.append(f"rlsd_warmdown_steps={self.rlsd_warmdown_steps} must be >= 1 (SDAR's scripts: 100)")
        if not 0 < self.rlsd_clip_eps < 1:
            p.append(f"rlsd_clip_eps={self.rlsd_clip_eps} must lie in (0, 1) (SDAR's scripts: 0.2)")
        if self.sdl_coef < 0:
            p.append(f"sdl_coef={self.sdl_coef} must be >= 0 (SDAR's scripts: 0.001)")
        if self.hybrid != "none":
            if self.distill_enabled:
                p.append(f"hybrid={self.hybrid!r} uses the teacher without an allocated distillation term (SDAR's "
                         f"{self.hybrid} trainer has none), so allocator={self.allocator!r} cannot join it; add "
                         "--allocator none")
            if self.teacher_rescore:
                p.append(f"teacher_rescore=True re-scores the teacher for an allocation; hybrid={self.hybrid!r} uses "
                         "the step's teacher, as SDAR does: set teacher_rescore=False")
        return p

    def _type_problems(self) -> list[str]:
        """Each field whose value does not have its declared type (int, float, bool, str, or None where allowed)."""
        kinds = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,)}
        p = []
        for f in fields(self):
            v = getattr(self, f.name)
            parts = [t.strip() for t in str(f.type).split("|")]
            if v is None and "None" in parts:
                continue
            allowed = tuple(c for t in parts for c in kinds.get(t, ()))
            if allowed and (not isinstance(v, allowed) or (isinstance(v, bool) and bool not in allowed)):
                p.append(f"{f.name}={v!r} must be {' or '.join(parts)}, not {type(v).__name__}")
        return p

    def validate_training(self, *, env_here: bool = True) -> "TrainConfig":
        """:meth:`validate`, plus what only training (rollouts on the train split) needs; before any model loads."""
        self.validate(env_here=env_here)
        if self.env == "webshop" and self.env_url and self.train_split == "train" and self.server_num_goals is None:
            raise ConfigError([
                "env_url is set but server_num_goals is not: training on a WebShop server's train split (goals 500..N-1, "
                "as verl-agent splits them) needs N, the number of goals the server loaded ('Loaded N goals.' in its "
                "start-up log); add --set server_num_goals=N"])
        return self

    @property
    def init_path(self) -> str | None:
        """``init`` as a folder: a shipped warm start's reference (``warmstart:NAME``) resolved; None when unset."""
        return resolve_init(self.init)

    def _init_problems(self) -> list[str]:
        if self.init is None:
            return []
        from icsd_audit.train.lora import AdapterError, adapter_settings, is_adapter_dir, is_model_dir

        try:
            d = Path(str(resolve_init(self.init))).expanduser()
        except ConfigError as e:
            return e.problems
        if is_adapter_dir(d):
            try:
                rank = adapter_settings(d).rank
            except AdapterError as e:
                return [f"init={self.init!r}: {e}"]
            if self.lora_rank not in (0, rank):
                return [f"init={self.init!r} is a rank-{rank} adapter, which training continues; drop lora_rank="
                        f"{self.lora_rank} or set it to {rank}"]
            return []
        if is_model_dir(d):
            return []
        return [f"init={self.init!r} is neither a LoRA adapter folder (adapter_config.json) nor a model folder "
                "(config.json); pass a folder written by icsd train, icsd sft or save_pretrained"]

    @property
    def lora_enabled(self) -> bool:
        """LoRA training: a rank was set, or the run starts from an adapter."""
        if self.lora_rank > 0:
            return True
        from icsd_audit.train.lora import is_adapter_dir

        return self.init is not None and is_adapter_dir(str(self.init_path))

    def _clue_problems(self) -> list[str]:
        from icsd_audit.envs.clue.vocab import MAX_BOXES

        p = []
        if not 2 <= self.clue_boxes <= MAX_BOXES:
            p.append(f"clue_boxes={self.clue_boxes} must lie in 2..{MAX_BOXES} (the word vocabulary's box numbers)")
        if not (math.isfinite(self.clue_accuracy) and 0.0 <= self.clue_accuracy <= 1.0):
            p.append(f"clue_accuracy={self.clue_accuracy} must lie in [0, 1]")
        if self.model == "tiny-word" and self.env != "clue":
            p.append(f"model='tiny-word' knows only the clue environment's words; use env='clue' or another model "
                     f"(env={self.env!r})")
        if self.env == "clue" and self.student_skills != "off" and self.skillbank is None:
            p.append(f"student_skills={self.student_skills!r}: the clue environment's privileged text is the teacher's "
                     "alone; set student_skills='off' or name a skillbank")
        return p

    def _searchqa_problems(self) -> list[str]:
        p = []
        named = [k for k in ("searchqa_corpus", "searchqa_data", "retriever_url") if getattr(self, k)]
        if named and self.env != "searchqa":
            p.append(f"{', '.join(named)} only apply to env='searchqa' (env={self.env!r}); unset them or set env=searchqa")
        if self.searchqa_protocol not in ("search-r1", "verl-agent"):
            p.append(f"searchqa_protocol={self.searchqa_protocol!r}: choose 'search-r1' or 'verl-agent'")
        if not (isinstance(self.retrieval_topk, int) and self.retrieval_topk >= 1):
            p.append(f"retrieval_topk={self.retrieval_topk!r} must be an integer >= 1 (Search-R1 uses 3)")
        files = [self.searchqa_corpus] if self.searchqa_corpus else []
        files += [f.strip() for f in (self.searchqa_data or "").split(",") if f.strip()]
        p.extend(f"Search-QA file {f} not found; check the path in searchqa_corpus / searchqa_data"
                 for f in files if not Path(f).expanduser().is_file())
        if self.searchqa_corpus and self.retriever_url:
            p.append(f"searchqa_corpus={self.searchqa_corpus!r} and retriever_url={self.retriever_url!r} contradict each "
                     "other: the server would be searched and the corpus ignored; set only one")
        if self.searchqa_data and not (self.searchqa_corpus or self.retriever_url or self.env_url):
            p.append("searchqa_data is set but nothing to search: set searchqa_corpus=corpus.jsonl or "
                     "retriever_url=http://host:port")
        return p


_MODEL_ALIASES = ("embedded", "default", "smollm2", "smollm2-135m-instruct", "tiny-random", "tiny-word")
_EMBEDDED_ALIASES = _MODEL_ALIASES[:4]

#: ``init`` may name a warm start shipped with icsd: ``warmstart:NAME`` is the adapter folder
#: ``icsd_audit/warmstarts/NAME`` (written by ``icsd sft``; docs/training.md, "Warm start from the expert").
#: Configs record the name, not the install path, so runs of different machines compare.
WARM_START_PREFIX = "warmstart:"


def warm_starts_dir() -> Path:
    """Where the shipped warm starts live (package data)."""
    return Path(__file__).resolve().parents[1] / "warmstarts"


def shipped_warm_starts() -> list[str]:
    """Names of the shipped warm starts (``init=warmstart:NAME``)."""
    root = warm_starts_dir()
    return sorted(d.name for d in root.iterdir() if (d / "adapter_config.json").is_file()) if root.is_dir() else []


def resolve_init(init: str | None) -> str | None:
    """The folder ``init`` names: ``warmstart:NAME`` -> the shipped adapter's folder; any other value as it is."""
    if init is None or not init.startswith(WARM_START_PREFIX):
        return init
    name = init[len(WARM_START_PREFIX):]
    folder = warm_starts_dir() / name
    if not name or Path(name).name != name or not (folder / "adapter_config.json").is_file():
        raise ConfigError([f"init={init!r}: no shipped warm start {name!r}; shipped: "
                           f"{', '.join(WARM_START_PREFIX + n for n in shipped_warm_starts()) or 'none'}"])
    return str(folder)


def _same_base(model: Any, warm_start: str) -> bool:
    """Whether ``model`` is the base a shipped warm start was trained on (read from its icsd_adapter.json)."""
    try:
        meta = json.loads((Path(str(resolve_init(warm_start))) / "icsd_adapter.json").read_text())
    except (ConfigError, OSError, ValueError):
        return True  # let validation report the warm start itself
    base = str(meta.get("base_model", ""))
    return model == base or (model in _EMBEDDED_ALIASES and base in _EMBEDDED_ALIASES)
_ONE_SHOT_ENVS = ("webshop", "searchqa", "alfworld")


def field_docs() -> dict[str, tuple[str, str, Any]]:
    """Field name -> (type, docstring, default), read from this module's source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(TrainConfig)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant):
                docs[node.target.id] = str(nxt.value.value)
    defaults = TrainConfig()
    return {f.name: (str(f.type), docs.get(f.name, ""), getattr(defaults, f.name)) for f in fields(TrainConfig)}


def parse_override(text: str) -> tuple[str, Any]:
    """``'key=value'`` -> (key, typed value), typed by the field's default/annotation."""
    if "=" not in text:
        raise ConfigError([f"override {text!r} must look like key=value, e.g. lr=1e-5"])
    key, raw = (s.strip() for s in text.split("=", 1))
    types = {f.name: str(f.type) for f in fields(TrainConfig)}
    if key not in types:
        raise ConfigError([f"unknown field {key!r} in override {text!r}; see `icsd train --list-fields`"])
    t = types[key]
    if raw.lower() in ("none", "null") and "None" in t:
        return key, None
    try:
        if t.startswith("bool"):
            if raw.lower() in ("1", "true", "yes", "on"):
                return key, True
            if raw.lower() in ("0", "false", "no", "off"):
                return key, False
            raise ValueError(raw)
        if t.startswith("int"):
            return key, int(raw)
        if t.startswith("float"):
            return key, float(raw)
    except ValueError:
        raise ConfigError([f"override {text!r}: {raw!r} is not a valid {t.split(' ')[0]}"]) from None
    return key, raw


_PRESET_NAMES = ("CPU_WARM_START", "PRESETS", "preset", "preset_for")


def __getattr__(name: str) -> Any:
    """The presets live in :mod:`icsd_audit.train.presets` (they build TrainConfigs); named here too, lazily,
    so that importing either module first works."""
    if name in _PRESET_NAMES:
        from icsd_audit.train import presets

        return getattr(presets, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
