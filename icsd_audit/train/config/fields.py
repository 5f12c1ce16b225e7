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
  512 held-out questions; reward = exact match; as SDAR's search scripts: invalid penalty
  0.01, learning-rate warm-up ratio 0.1, greedy validation); ``--env searchqa --preset paper``
  picks them (:func:`preset_for`).
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
nothing is dumped (:mod:`icsd_audit.train.update.hybrid`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar, Mapping

from icsd_audit.alloc.settings import DEFAULTS, AllocatorSettings
from icsd_audit.train.config.checks import config_names, config_problems, training_problems
from icsd_audit.train.config.errors import NO_ALLOCATOR, ConfigError
from icsd_audit.train.config.warmstarts import resolve_init

__all__ = ["TrainConfig"]


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
    clue_boxes: int = 8
    """env='clue': number of boxes the key may be in (2..12)."""
    clue_accuracy: float = 1.0
    """env='clue': probability that a task's clue (what the privileged teacher sees) names the key's box; otherwise it names another box (fixed per task)."""
    env_url: str | None = None
    """URL of a real WebShop server; None uses the built-in offline WebShop."""
    alfworld_data: str | None = None
    """Official ALFWorld data folder (holding json_2.1.1/; train and valid_unseen games); None: $ALFWORLD_DATA, else the built-in generated games."""
    server_num_goals: int | None = None
    """With env_url: how many goals the WebShop server loaded (its train split is every goal after the first 500, as in verl-agent); required to train against a server. WebShop prints it at start-up ('Loaded N goals.', web_agent_site/envs/web_agent_text_env.py)."""
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
    """'grpo' or 'gigpo' (icsd_audit.train.update.advantages)."""
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
    skill_bank_mode: str = "task"
    """The teacher's skills on WebShop and ALFWorld: 'task' (task-specific, by skill_mode and skill_match: SDAR's code since its fix of 2026-06-22, jasonchen505/SDAR@7e013ba) or 'general' (SDAR's first release, @92f1b0f, which gave its published numbers, the paper's Skill-SD and RLSD rows among them: no game file reached the teacher, so both environments fell through to the general skills only). Search-QA routes by data source under both (the first release did too); skill_mode='all' wins over both, as SDAR's skill_all did; student skills (student_skills) are never affected."""
    skill_match: str = "sdar"
    """Keyword rule of skill_mode='match': 'sdar' (SDAR's get_privileged_info_from_prompt: plain substrings on the whole lower-cased student prompt, every matching category) or 'instruction' (the bank's own rule on the task instruction only; whole words for the shipped banks)."""
    student_skills: str = "off"
    """Retrieved skills in the *student* prompt too (paper's extended-table baselines): 'off', 'train' (rollouts and actor: Skill-GRPO), 'eval' (evaluation only: with icsd eval, the Skill-Prompt* baseline) or 'both' (Skill-GRPO*); 'train' and 'both' need allocator='none'."""
    skill_placement: str = "prefix"
    """'prefix' (SDAR: the skill block in front of the rendered student prompt) or 'user' (inside the user message)."""

    # ------------------------------------------------------------------ actor
    lr: float = 1e-6
    """AdamW learning rate (Table A1: 1e-6)."""
    lr_warmup_steps_ratio: float = 0.0
    """Linear learning-rate warm-up, verl's actor schedule: int(ratio * total_steps) warm-up steps; step s (from 0) runs at lr * s / max(1, warm-up steps) until then, at lr after (so step 0 runs at 0 when the ratio is > 0). 0: lr from the first step. SDAR's search scripts: 0.1."""
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
    # The allocator settings: defaults and help text are AllocatorSettings' (icsd_audit.alloc.settings), the one
    # place they are written; here alloc_eps and alloc_seed name its eps and seed (the run has its own seed).
    allocator: str = DEFAULTS.allocator
    """'none' (plain GRPO/GiGPO: the paper's 'GRPO'/'GiGPO' rows; with student_skills: 'Skill-GRPO') or an allocator of icsd_audit.alloc: opsd ('+ OPSD'; with pg_coef=0: stand-alone 'OPSD'), sdar ('+ SDAR'), icsd ('+ ICSD'), fisher ('+ Fisher magnitude'), sign ('+ Sign-only'), influence-only ('+ Influence only'), gaussian, permuted."""
    pg_coef: float = 1.0
    """Weight of the PPO surrogate in the actor loss; 0 drops the RL loss (stand-alone OPSD: allocator='opsd', pg_coef=0, the paper's 'OPSD' row)."""
    trust: str = DEFAULTS.trust
    trust_beta: float = DEFAULTS.trust_beta
    trust_eta: float = DEFAULTS.trust_eta
    influence_eta: float = DEFAULTS.influence_eta
    distill_coef: float = 0.01
    """lambda: weight of the allocated distillation term lambda/|B| * sum c_t * l_KD_t (Table A1: 0.01)."""
    alloc_eps: float = DEFAULTS.eps
    min_group: int = DEFAULTS.min_group
    alloc_seed: int = DEFAULTS.seed
    skip_first_prepass: bool = True
    """Skip the no-grad ratio pass on a step's first mini-batch, where the policy is still the rollout policy (ratio = 1 exactly); not for 'fisher', which needs the pass's score norms."""
    alloc_scope: str = "mini-batch"
    """Where the allocation is fitted: 'mini-batch' (the SPEC's batch: one allocation per actor mini-batch from a no-grad ratio pre-pass) or 'micro-batch' (each gradient micro-batch allocates from its own forward: no extra pass, as the paper and SDAR's code do; batch_id = 1000 * mini-batch id + micro index)."""
    verl_record_only: bool = False
    """icsd train --engine verl only: write a command that trains with verl's own v1 sync trainer and its own loss (ppo_loss, or distillation_ppo_loss where the command is given verl's distillation.* options) and records it with +icsd.record=true into OUT/dumps, instead of the icsd_sync trainer; the allocator settings are not used (apply them afterwards with icsd audit). Needs adv_estimator='grpo'."""
    teacher_rescore: bool = False
    """Re-score the teacher with the current weights on every mini-batch after a step's first (one extra no-grad teacher forward per mini-batch); False keeps SDAR's timing: the teacher is scored once per step with the rollout weights."""

    # ------------------------------------------------------------------ hybrid distillation baselines
    hybrid: str = "none"
    """The paper's hybrid distillation baselines (Table 1), as SDAR's code defines them (icsd_audit.train.update.hybrid): 'rlsd' (turn advantages reweighted per token by the teacher-student gap, no distillation term) or 'skill-sd' (GRPO plus SDAR's K3 importance-weighted self-distillation loss); both use the privileged teacher without an allocation, so they need allocator='none' and write no dumps. 'none': off."""
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
    trim_memory: bool = True
    """Hand freed heap memory back to the OS after each phase of a step and serve the gradient pass's blocks of 1 MB and more by their own mmaps (same numbers bit for bit; keeps a 135M model's peak memory down, while a tiny model pays the system calls and page faults for nothing)."""
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
    searchqa_expert: str = "gold"
    """Search-QA's expert (policy='expert'): 'gold' (the oracle search chain, then the gold answer whatever retrieval returned: EM 1, it proves the referee) or 'retrieval' (says only what it read: each query is the next oracle hop's entity once a retrieved passage or the question names it, else the question; the answer a gold answer only once the question's whole chain was retrieved and a passage holds it, else the last search's top passage title: its EM is the share of questions whose evidence the retriever surfaced within the turn budget, plus lucky guesses; docs/envs.md, "Experts")."""
    searchqa_protocol: str = "search-r1"
    """Search-QA: 'search-r1' (Search-R1's rollout: one growing context per episode, its prompt, its reply rule) or 'verl-agent' (verl-agent's search environment, as SDAR's scripts run it: the prompt rebuilt each turn with the last history_window steps, search_projection's reply rule). Both end at max_turns with a final-answer turn."""

    # ------------------------------------------------------------------ derived
    @property
    def distill_enabled(self) -> bool:
        """Whether the run has a distillation term (allocator other than 'none')."""
        return self.allocator != NO_ALLOCATOR

    @property
    def teacher_enabled(self) -> bool:
        """Whether the run scores the privileged teacher (an allocator, or a hybrid baseline)."""
        return self.distill_enabled or self.hybrid != "none"

    @property
    def effective_distill_coef(self) -> float:
        """lambda as deployed: 0 for allocator 'none'."""
        return self.distill_coef if self.distill_enabled else 0.0

    @property
    def teacher_skill_mode(self) -> str:
        """The teacher's retrieval mode: skill_mode, or 'general' where skill_bank_mode='general' reproduces SDAR's first release."""
        if self.skill_bank_mode == "general" and self.skill_mode == "match" and self.env != "searchqa":
            return "general"
        return self.skill_mode

    @property
    def skillbank_name(self) -> str:
        return self.skillbank if self.skillbank else self.env

    @property
    def chat_kwargs(self) -> dict[str, Any]:
        """Extra variables for the chat template (``enable_thinking`` when set)."""
        return {} if self.enable_thinking is None else {"enable_thinking": bool(self.enable_thinking)}

    #: config field -> the AllocatorSettings field it sets
    ALLOCATION_FIELDS: ClassVar[dict[str, str]] = {
        "allocator": "allocator", "trust": "trust", "trust_beta": "trust_beta", "trust_eta": "trust_eta",
        "influence_eta": "influence_eta", "alloc_eps": "eps", "min_group": "min_group", "alloc_seed": "seed"}

    def allocation(self) -> AllocatorSettings:
        """The run's allocator settings (``allocator='none'`` keeps its other settings, allocated as SDAR would be)."""
        values = {dst: getattr(self, src) for src, dst in self.ALLOCATION_FIELDS.items()}
        if values["allocator"] == NO_ALLOCATOR:
            values["allocator"] = "sdar"
        try:
            return AllocatorSettings(**values)
        except ValueError as e:
            names = {dst: src for src, dst in self.ALLOCATION_FIELDS.items()}
            raise ConfigError([config_names(str(e), names)]) from None

    def allocator_settings(self) -> dict[str, Any]:
        """What the dump metadata records under ``allocator`` (the audit's options): the allocation's SPEC 9
        serialisation, plus how this run deployed it."""
        return {
            **self.allocation().to_dict(),
            "allocator": self.allocator,
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
            from icsd_audit.train.models.loading import model_cache_dir

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

    # ------------------------------------------------------------------ validation (rules: config/checks.py)
    def validate(self, *, env_here: bool = True) -> "TrainConfig":
        """Raise :class:`ConfigError` listing every problem with its fix; return self when fine.

        ``env_here=False`` skips the checks that the environment's engine is installed on this
        machine (``icsd train --engine verl --dry-run`` writes files for another machine).
        """
        problems = config_problems(self, env_here=env_here)
        if problems:
            raise ConfigError(problems)
        return self

    def validate_training(self, *, env_here: bool = True) -> "TrainConfig":
        """:meth:`validate`, plus what only training (rollouts on the train split) needs; before any model loads."""
        self.validate(env_here=env_here)
        problems = training_problems(self)
        if problems:
            raise ConfigError(problems)
        return self

    @property
    def init_path(self) -> str | None:
        """``init`` as a folder: a shipped warm start's reference (``warmstart:NAME``) resolved; None when unset."""
        return resolve_init(self.init)

    @property
    def lora_enabled(self) -> bool:
        """LoRA training: a rank was set, or the run starts from an adapter."""
        if self.lora_rank > 0:
            return True
        from icsd_audit.train.models.lora import is_adapter_dir

        return self.init is not None and is_adapter_dir(str(self.init_path))



