"""Batched multi-turn rollouts: n tasks x G rollouts against text environments.

A step's rollout runs ``n * G`` environment instances side by side. At each turn every
still-running episode builds its prompt (task, current observation, admissible actions,
a window of history; :mod:`icsd_audit.train.rollout.prompts`), all prompts are sampled in
batched ``generate`` calls (KV cache, left padding), each reply is parsed for its
``<action>`` (:func:`icsd_audit.envs.parse_action`) and sent to the environment. Every
action turn becomes one training row holding its prompt ids, its sampled response ids
and the log-probs the sampler assigned to them (the "old" log-probs, from the raw
logits divided by the temperature: sampling is from the full softmax, no top-k/top-p,
so these are exactly log pi_old of the sampled tokens up to kernel numerics).

Which turns are *invalid* (flagged on the row; the advantage estimator subtracts
``invalid_penalty`` from the row's score, as verl-agent's ``apply_invalid_action_penalty``
does) is chosen by name from :data:`INVALID_RULES`:

* ``format`` (default): the environment's reference rule for a malformed reply. For
  WebShop and ALFWorld verl-agent's (:func:`icsd_audit.envs.base.well_formed`: no
  ``<action>``/``</action>`` tags, no ``<think>``/``</think>`` tags when required, CJK
  characters); an environment with its own reply format says so with a
  ``reply_valid(text)`` method (Search-QA: Search-R1's ``postprocess_predictions`` or
  verl-agent's ``search_projection``, by its protocol). A well-formed reply whose action
  the page does not admit is a valid turn that leaves the environment unchanged.
* ``admissible`` (this toolkit's stricter option): additionally a well-formed reply
  whose action is empty or not admissible (by the parser or by the environment).

Either way an action the environment cannot carry out leaves it unchanged and counts
as a turn.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor

from icsd_audit.envs import Observation, StepResult, TextEnv, parse_action
from icsd_audit.envs.base import ParsedAction, well_formed
from icsd_audit.train.models.loading import chat_prompt
from icsd_audit.train.update.advantages import TurnRecords, anchor_id
from icsd_audit.train.rollout.prompts import (HistoryEntry, TurnContext, build_messages, growing_pieces, is_growing, skill_block,
                                     student_messages)
from icsd_audit.train.rollout.policy import ExpertPolicy, ExpertTurn, ModelPolicy, PolicyTurn, TurnPolicy
from icsd_audit.train.rollout.sampling import sample, sampling_config

__all__ = [
    "expert_turns",
    "REWARD_FNS",
    "INVALID_RULES",
    "ONE_SHOT",
    "PromptBuilder",
    "TurnRow",
    "Trajectory",
    "RolloutBatch",
    "RolloutSettings",
    "sample",
    "sampling_config",
    "collect_rollouts",
    "turn_context",
    "TurnOutcome",
    "TurnReferee",
]

#: Step reward shaping, looked up once by name: verl-agent's WebShop reward is 10 for a
#: won episode and 0 otherwise; 'score' keeps WebShop's continuous purchase score.
REWARD_FNS: dict[str, Callable[[StepResult], float]] = {
    "won10": lambda r: 10.0 if r.won else 0.0,
    "score": lambda r: float(r.reward),
}

def _format_rule(text: str, parsed: ParsedAction, res: StepResult, think: bool, env: Any = None) -> bool:
    own = getattr(env, "reply_valid", None)
    return bool(own(text)) if own is not None else well_formed(text, require_think=think)


def _admissible_rule(text: str, parsed: ParsedAction, res: StepResult, think: bool, env: Any = None) -> bool:
    return bool(parsed.valid and res.info.get("valid_action", True))


#: ``rule(reply_text, parsed, step_result, require_think, env)`` -> whether the turn is valid.
INVALID_RULES: dict[str, Callable[..., bool]] = {"format": _format_rule, "admissible": _admissible_rule}

#: One worked exchange per environment for ``one_shot`` (a made-up instruction that is
#: in no split, on the search page, and a well-formed reply).
ONE_SHOT: dict[str, tuple[TurnContext, str]] = {
    "webshop": (
        TurnContext(
            task="i am looking for a men's cotton t-shirt in navy blue in size large, and price lower than 30.00 dollars",
            observation="Search",
            actions=("search[<your query>]",),
            env="webshop",
        ),
        "<think>I need to find the product first, so I search for it with its key attributes.</think>"
        "<action>search[men's cotton t-shirt navy blue]</action>",
    ),
    "searchqa": (
        TurnContext(task="who wrote the novel Pride and Prejudice?", observation="No search results yet.", actions=None,
                    env="searchqa"),
        "<think>I do not know the author for sure, so I search for the novel first.</think>"
        "<search> Pride and Prejudice novel author </search>",
    ),
    # no generated game puts a spraybottle in a fridge (CAN_CONTAIN has no such pair)
    "alfworld": (
        TurnContext(
            task="put some spraybottle in fridge.",
            observation="-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room. Looking quickly "
                        "around you, you see a cabinet 1, a countertop 1, a fridge 1, and a toilet 1.\n\n"
                        "Your task is to: put some spraybottle in fridge.",
            actions=("go to cabinet 1", "go to countertop 1", "go to fridge 1", "go to toilet 1", "inventory", "look"),
            env="alfworld",
        ),
        "<think>I must find a spraybottle first; toiletries are often on the toilet, so I look there.</think>"
        "<action>go to toilet 1</action>",
    ),
}


#: Distinct prompts a :class:`PromptBuilder` keeps rendered and tokenized (a bound on its memory: at most a few
#: MB of text for the long WebShop prompts, which rarely repeat).
PROMPT_CACHE = 1024


class PromptBuilder:
    """Student and teacher prompt token ids for one turn, with the run's prompt options."""

    def __init__(self, tokenizer: Any, *, env: str, history_window: int, max_prompt_tokens: int,
                 system_prompt: str | None = None, one_shot: bool = False, skill_placement: str = "prefix",
                 student_skill: Callable[[TurnContext, str], str] | None = None, protocol: str | None = None,
                 chat_kwargs: Mapping[str, Any] | None = None):
        self.tok = tokenizer
        #: Extra keyword arguments of the chat template (``enable_thinking=False`` for Qwen3's non-thinking mode).
        self.chat_kwargs = dict(chat_kwargs or {})
        #: ``student_skill(ctx, student_text)`` -> skill text shown to the *student* too
        #: (Skill-Prompt / Skill-GRPO baselines); None: the student never sees skills.
        self.student_skill = student_skill
        self.env = env
        self.history_window = history_window
        self.max_prompt_tokens = max_prompt_tokens
        self.system_prompt = system_prompt
        self.skill_placement = skill_placement
        self._prefix: list[dict[str, str]] = []
        if system_prompt is not None:
            self._prefix.append({"role": "system", "content": system_prompt})
        if one_shot:
            ex_ctx, ex_reply = ONE_SHOT[env]
            ex_ctx = dataclasses.replace(ex_ctx, protocol=protocol)  # the run's layout for the example too
            self._prefix += [*student_messages(ex_ctx, history_window=history_window),
                             {"role": "assistant", "content": ex_reply}]
        self._skill_ids: dict[str, list[int]] = {}
        # rendered prompt text and its ids by content: an environment with few distinct prompts (the clue
        # testbed's few hundred) renders and tokenizes each once; a full cache stops growing, never evicts
        self._rendered: dict[tuple[tuple[str, str], ...], str] = {}
        self._encoded: dict[str, tuple[int, ...]] = {}

    @classmethod
    def from_config(cls, tokenizer: Any, cfg: Any, *,
                    student_skill: Callable[[TurnContext, str], str] | None = None) -> "PromptBuilder":
        """The builder of a :class:`~icsd_audit.train.config.fields.TrainConfig`'s prompts (every engine builds it here)."""
        return cls(tokenizer, env=cfg.env, history_window=cfg.history_window, max_prompt_tokens=cfg.max_prompt_tokens,
                   system_prompt=cfg.system_prompt, one_shot=cfg.one_shot, skill_placement=cfg.skill_placement,
                   student_skill=student_skill, protocol=cfg.searchqa_protocol if cfg.env == "searchqa" else None,
                   chat_kwargs=cfg.chat_kwargs)

    def encode(self, text: str) -> list[int]:
        ids = self._encoded.get(text)
        if ids is None:
            ids = tuple(self.tok(text, add_special_tokens=False).input_ids)
            if len(self._encoded) < PROMPT_CACHE:
                self._encoded[text] = ids
        return list(ids)

    def _truncate(self, ids: list[int], limit: int) -> tuple[list[int], bool]:
        return (ids[-limit:], True) if len(ids) > limit else (ids, False)

    def _pieces(self, ctx: TurnContext, skill_text: str | None = None) -> list[str]:
        """The prompt text in the pieces it is tokenized in: the chat-rendered turn prompt,
        then, for a growing context, every reply and observation so far (Search-R1
        concatenates the ids of separately tokenized pieces)."""
        msgs = [*self._prefix, *build_messages(ctx, history_window=self.history_window, skill_text=skill_text)]
        key = tuple((m["role"], m["content"]) for m in msgs)
        first = self._rendered.get(key)
        if first is None:
            first = chat_prompt(self.tok, msgs, **self.chat_kwargs)
            if len(self._rendered) < PROMPT_CACHE:
                self._rendered[key] = first
        return [first, *growing_pieces(ctx)] if is_growing(ctx) else [first]

    def student_text(self, ctx: TurnContext) -> str:
        return "".join(self._pieces(ctx))

    def _ids(self, pieces: list[str]) -> list[int]:
        return [i for p in pieces for i in self.encode(p)]

    def student(self, ctx: TurnContext) -> tuple[list[int], bool]:
        """The student's prompt ids (left-truncated to ``max_prompt_tokens``) and whether it was cut.

        With ``student_skill`` the retrieved skill is placed as for the teacher (Skill-Prompt).
        """
        pieces = self._pieces(ctx)
        text = "".join(pieces)
        ids, cut = self._truncate(self._ids(pieces), self.max_prompt_tokens)
        if self.student_skill is not None:
            ids = self.teacher(ctx, ids, self.student_skill(ctx, text))[0]
        return ids, cut

    def teacher(self, ctx: TurnContext, student_ids: list[int], skill_text: str) -> tuple[list[int], bool]:
        """The privileged prompt ids for the same turn.

        ``prefix`` (SDAR): the skill block's ids followed by the student's exact prompt
        ids, i.e. SDAR's text ``block + student prompt`` (the student text opens with a
        chat special token, so tokenizing the two parts apart changes nothing).
        ``user``: the block opens the user message; the whole is re-rendered and cut
        from the left to ``max_prompt_tokens`` + the block's length.
        """
        if skill_text not in self._skill_ids:
            self._skill_ids[skill_text] = self.encode(skill_block(skill_text))
        block = self._skill_ids[skill_text]
        if self.skill_placement == "prefix":
            return block + list(student_ids), False
        return self._truncate(self._ids(self._pieces(ctx, skill_text)), self.max_prompt_tokens + len(block))


@dataclass
class TurnRow:
    """One action turn: a training row."""

    slot: int  # index of the task in this step's task list: the GRPO/GiGPO group
    task: int  # task index in the environment's split
    traj: int  # trajectory index within the step (slot * G + rollout)
    rollout: int
    turn: int
    ctx: TurnContext
    prompt_ids: list[int]
    response_ids: list[int]
    old_logp: Tensor | None  # float32 (len(response_ids),), None when not recorded
    response_text: str
    action: str
    action_valid: bool
    reward: float  # shaped step reward
    done: bool
    prompt_truncated: bool
    anchor: int  # anchor_id(observation text), GiGPO's anchor state


@dataclass
class Trajectory:
    traj: int
    slot: int
    task: int
    rollout: int
    n_turns: int = 0
    n_invalid: int = 0
    won: bool = False
    score: float = 0.0  # WebShop score at the end of the episode (0 unless it bought)
    ret: float = 0.0  # sum of shaped step rewards
    done: bool = False


@dataclass
class RolloutBatch:
    rows: list[TurnRow]
    trajectories: list[Trajectory]
    tasks: list[int]
    group_size: int
    timings: dict[str, float] = field(default_factory=dict)

    def turn_records(self) -> TurnRecords:
        """The advantage estimator's input: one record per row."""
        rows = self.rows
        return TurnRecords.from_arrays(
            group=[r.slot for r in rows],
            traj=[r.traj for r in rows],
            turn=[r.turn for r in rows],
            reward=[r.reward for r in rows],
            anchor=[r.anchor for r in rows],
            invalid=[not r.action_valid for r in rows],
        )

    def metrics(self) -> dict[str, float]:
        trajs = self.trajectories
        n = max(len(trajs), 1)
        rows = self.rows
        nr = max(len(rows), 1)
        return {
            "success": sum(t.won for t in trajs) / n,
            "score": sum(t.score for t in trajs) / n,
            "reward": sum(t.ret for t in trajs) / n,
            "turns": sum(t.n_turns for t in trajs) / n,
            "invalid_rate": sum(not r.action_valid for r in rows) / nr,
            "rows": float(len(rows)),
            "response_tokens_mean": sum(len(r.response_ids) for r in rows) / nr,
            "prompt_tokens_mean": sum(len(r.prompt_ids) for r in rows) / nr,
            "prompt_truncated": float(sum(r.prompt_truncated for r in rows)),
        }


@dataclass(frozen=True)
class RolloutSettings:
    max_turns: int
    max_response_tokens: int
    temperature: float  # 0: greedy
    batch_rows: int
    require_think: bool
    reward: str
    record_logp: bool
    precision: str = "float32"
    invalid_rule: str = "format"  # a key of INVALID_RULES


def _reply_parser(env: TextEnv) -> Callable[..., Any]:
    """The env's own reply parser (Search-QA's <search>/<answer> tags) or verl-agent's <action> parser."""
    own = getattr(env, "parse_reply", None)
    if own is None:
        return parse_action
    return lambda text, available, *, require_think: own(text, require_think=require_think)


def turn_context(obs: Observation, env: str, history: Sequence[HistoryEntry] = ()) -> TurnContext:
    """A turn's prompt inputs from its observation.

    An environment with free-form actions (Search-QA) lists none: the prompt then shows no list.
    """
    return TurnContext(task=obs.instruction, observation=obs.text, actions=obs.available_actions or None,
                       history=tuple(history), env=env, key=obs.meta.get("skill_key"),
                       protocol=obs.meta.get("protocol"), privileged=obs.meta.get("privileged"))


@dataclass(frozen=True)
class TurnOutcome:
    """What one reply did in its environment."""

    text: str  # the reply, special tokens dropped
    parsed: ParsedAction
    result: StepResult
    valid: bool
    reward: float  # shaped step reward
    done: bool  # the environment ended the episode or the turn budget is spent
    context_text: str = ""  # the reply as a growing context keeps it (the env's ``context_reply``)


class TurnReferee:
    """Sends a reply to its environment and books the turn on its trajectory, by the run's rules.

    The reward shaping and the invalid-turn rule are looked up once; the built-in loop and
    the TRL engine's rollout (:mod:`icsd_audit.integrations.trl.rollout`) both judge turns
    here, so an episode scores the same on either engine.
    """

    def __init__(self, settings: RolloutSettings):
        self.reward_fn = REWARD_FNS[settings.reward]
        self.is_valid = INVALID_RULES[settings.invalid_rule]
        self.require_think = settings.require_think
        self.max_turns = settings.max_turns

    def play(self, env: TextEnv, text: str, obs: Observation, traj: Trajectory, turn: int) -> TurnOutcome:
        parsed = _reply_parser(env)(text, obs.available_actions, require_think=self.require_think)
        res = env.step(parsed.action)
        valid = bool(self.is_valid(text, parsed, res, self.require_think, env))
        r = self.reward_fn(res)
        traj.n_turns += 1
        traj.n_invalid += int(not valid)
        traj.ret += r
        done = bool(res.done) or turn + 1 >= self.max_turns
        if res.done:
            traj.won = bool(res.won)
            traj.score = float(res.info.get("score", 0.0))
        traj.done = done
        keep = getattr(env, "context_reply", None)
        return TurnOutcome(text=text, parsed=parsed, result=res, valid=valid, reward=r, done=done,
                           context_text=keep(text) if keep is not None else text)


def collect_rollouts(
    *,
    model: Any,
    tokenizer: Any,
    builder: PromptBuilder,
    envs: Sequence[TextEnv],
    tasks: Sequence[int],
    group_size: int,
    settings: RolloutSettings,
    device: torch.device,
    policy: Any = None,
) -> RolloutBatch:
    """Run ``len(tasks) x group_size`` episodes to the end or ``max_turns`` turns.

    ``policy`` (a :class:`icsd_audit.train.rollout.policy.TurnPolicy`) writes the replies; by
    default the model samples them. Whoever writes them, they go through the same
    parser, validity rule, rewards and history.
    """
    import time


    n_eps = len(tasks) * group_size
    if len(envs) < n_eps:
        raise ValueError(f"need {n_eps} environment instances, got {len(envs)}")
    referee = TurnReferee(settings)
    if policy is None:
        policy = ModelPolicy(model, tokenizer, max_response_tokens=settings.max_response_tokens,
                             temperature=settings.temperature, device=device, precision=settings.precision,
                             record_logp=settings.record_logp)
    trajs = [Trajectory(traj=i, slot=i // group_size, task=int(tasks[i // group_size]), rollout=i % group_size)
             for i in range(n_eps)]
    t0 = time.perf_counter()
    obs: list[Observation] = [envs[i].reset(trajs[i].task) for i in range(n_eps)]
    history: list[list[HistoryEntry]] = [[] for _ in range(n_eps)]
    rows: list[TurnRow] = []
    t_env = time.perf_counter() - t0
    t_gen = 0.0
    for turn in range(settings.max_turns):
        active = [i for i in range(n_eps) if not trajs[i].done]
        if not active:
            break
        ctxs = {i: turn_context(obs[i], builder.env, history[i]) for i in active}
        prompts = {i: builder.student(ctxs[i]) for i in active}
        for chunk_start in range(0, len(active), settings.batch_rows):
            chunk = active[chunk_start: chunk_start + settings.batch_rows]
            t1 = time.perf_counter()
            replies = policy.reply([PolicyTurn(env=envs[i], observation=obs[i], ctx=ctxs[i], prompt_ids=prompts[i][0],
                                               episode=i) for i in chunk])
            t_gen += time.perf_counter() - t1
            t1 = time.perf_counter()
            for rep, i in zip(replies, chunk):
                tr = trajs[i]
                out = referee.play(envs[i], rep.text, obs[i], tr, turn)
                rows.append(TurnRow(
                    slot=tr.slot, task=tr.task, traj=tr.traj, rollout=tr.rollout, turn=turn, ctx=ctxs[i],
                    prompt_ids=prompts[i][0], response_ids=rep.response_ids, old_logp=rep.logp, response_text=out.text,
                    action=out.parsed.action, action_valid=out.valid, reward=out.reward, done=out.done,
                    prompt_truncated=prompts[i][1], anchor=anchor_id(obs[i].text),
                ))
                history[i].append(HistoryEntry(observation=obs[i].text, action=out.parsed.action, reply=out.context_text))
                obs[i] = out.result.observation
            t_env += time.perf_counter() - t1
    rows.sort(key=lambda r: (r.traj, r.turn))
    return RolloutBatch(rows=rows, trajectories=trajs, tasks=[int(t) for t in tasks], group_size=group_size,
                        timings={"generate": t_gen, "env": t_env})


def expert_turns(*, tokenizer: Any, builder: Any, envs: Sequence[TextEnv], tasks: Sequence[int], settings: Any,
                 policy: TurnPolicy | None = None) -> list[ExpertTurn]:
    """Play ``tasks`` once each with the expert (or ``policy``) and return every turn as a supervised pair.

    ``builder`` is the trainer's :class:`~icsd_audit.train.rollout.collect.PromptBuilder` (so the
    prompts are the ones the student is trained on); ``settings`` a
    :class:`~icsd_audit.train.rollout.collect.RolloutSettings`. The alfworld expert needs
    environments created with ``expert=True``.
    """
    pol = policy if policy is not None else ExpertPolicy(tokenizer)
    batch = collect_rollouts(model=None, tokenizer=tokenizer, builder=builder, envs=envs, tasks=tasks, group_size=1,
                             settings=settings, device=torch.device("cpu"), policy=pol)
    won = {t.traj: t.won for t in batch.trajectories}
    return [ExpertTurn(task=r.task, turn=r.turn, prompt_ids=list(r.prompt_ids), prompt_text=builder.student_text(r.ctx),
                       reply=r.response_text, reply_ids=list(r.response_ids), valid=r.action_valid, won=won[r.traj])
            for r in batch.rows]
