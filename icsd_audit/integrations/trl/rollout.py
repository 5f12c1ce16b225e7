"""Whole episodes of the built-in environments as a TRL ``rollout_func`` (``icsd train --engine trl``).

TRL's ``GRPOTrainer`` calls ``rollout_func(prompts, trainer)`` once per generation batch
with every prompt repeated ``num_generations`` times, one entry per completion it
expects.  :class:`EpisodeRollout` plays one episode per entry with the trainer's current
weights (batched HF ``generate`` over the still-running episodes, turn by turn) and
returns each episode as one TRL row:

* ``prompt_ids``: the student prompt of the task's first observation, built by the
  built-in loop's :class:`~icsd_audit.train.rollout.collect.PromptBuilder` (system prompt,
  one-shot example, left truncation to ``max_prompt_tokens``);
* ``completion_ids``: reply 1, observation 2, reply 2, ..., reply K.  A reply is the
  sampled ids (through the end-of-turn token when the model emitted it).  An observation
  is what the chat template appends after a reply: the rest of its closing of the
  assistant message, a user message holding the new observation, the admissible actions
  and the reply format (the built-in turn prompt without its history block, since the
  conversation itself is the history), and the next assistant header;
* ``env_mask``: 1 on reply tokens, 0 on observation tokens (TRL's ``tool_mask``: the
  policy loss, the allocation and the dumps see reply tokens only, and each run of 1s
  is one action turn);
* ``logprobs``: the sampler's log-probs of the reply tokens (softmax(logits / T), as
  the built-in sampler records them) and 0 on observation tokens.  TRL reads them only
  for vLLM importance sampling and its off-policy mask, neither of which runs here;
* extra fields for the reward function :func:`episode_reward` (``episode_reward``, the
  score below, and the episode's turns, win, invalid turns and context stop, logged as
  ``episodes/*`` metrics) and ``teacher_prompt_ids`` for ``ICSDGRPOTrainer``'s teacher pass.

Turns are judged by the built-in loop's :class:`~icsd_audit.train.rollout.collect.TurnReferee`
(reply parser, reward shaping ``reward``, invalid rule ``invalid_rule``).  An episode's
score is its return minus ``invalid_penalty`` times its *share* of invalid turns: the
built-in GRPO scores every turn row ``R - invalid_penalty * invalid_row``, and one TRL row
per episode carries the mean of those row scores.

**Why one growing conversation** rather than the built-in's prompt re-rendered each turn
with a window of history: TRL trains on ``prompt + completion`` as one sequence, so each
reply must be sampled from exactly that context, else the tokens would not come from the
policy TRL scores.

**Limits** (the run config's, on the growing context): a reply has at most
``max_response_tokens`` tokens; the context of every ``generate`` call (prompt plus
completion so far) has at most ``max_prompt_tokens``, the bound the built-in loop puts
on a turn's prompt.  The built-in loop cuts a long prompt from the left; here the trained
sequence must be the sampled one, so when the next observation would push the context
past the bound the episode stops before it (a *context stop*: it has played fewer turns
than the environment allows, and its score is what it collected).  Only the first prompt
is cut from the left, as the built-in loop cuts it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from icsd_audit.envs import TextEnv
from icsd_audit.train.models.loading import chat_prompt
from icsd_audit.train.rollout.prompts import TurnContext, observation_content
from icsd_audit.train.rollout.collect import PromptBuilder, RolloutSettings, Trajectory, TurnReferee, turn_context
from icsd_audit.train.rollout.sampling import pad_and_stop_ids, sample

__all__ = ["ChatSeams", "EpisodeBatch", "EpisodeRollout", "episode_reward"]

#: ``sampler(model, contexts, **sampling options) -> (reply ids, reply log-probs)``: :func:`sample`'s signature.
Sampler = Callable[..., tuple[list[list[int]], list[Any]]]


class ChatSeams:
    """The text the tokenizer's chat template puts between a reply and the next reply.

    Found by rendering a probe conversation, so it holds for any template that renders
    an assistant message's content verbatim and appends later messages after earlier
    ones (ChatML templates such as SmolLM2's and the tiny test model's); others are refused
    with one line when the rollout is built.
    """

    _PROBE = "\u2063icsd reply probe\u2063"  # invisible separators: no template rewrites them

    def __init__(self, tokenizer: Any):
        self.tok = tokenizer
        self._msgs = [{"role": "user", "content": "probe"}, {"role": "assistant", "content": self._PROBE}]
        self._closed = chat_prompt(tokenizer, self._msgs, add_generation_prompt=False)
        at = self._closed.rfind(self._PROBE)
        if at < 0 or not self.user_turn("probe"):
            raise ValueError("the tokenizer's chat template does not render an assistant reply verbatim; "
                             "TRL multi-turn episodes need a template that appends turns (ChatML-like)")
        #: what the template writes after an assistant message's content (ChatML: "<|im_end|>\n")
        self.closing = self._closed[at + len(self._PROBE):]

    def user_turn(self, content: str) -> str:
        """The text a user message adds after a closed assistant message, through the next assistant header."""
        full = chat_prompt(self.tok, [*self._msgs, {"role": "user", "content": content}], add_generation_prompt=True)
        if not full.startswith(self._closed):
            raise ValueError("the tokenizer's chat template re-renders earlier turns when a message is added; "
                             "TRL multi-turn episodes need a template that appends turns (ChatML-like)")
        return full[len(self._closed):]

    def after_reply(self, reply_ids: Sequence[int], stop_ids: Sequence[int], content: str) -> str:
        """Everything between a sampled reply and the next reply, for a user message ``content``.

        A reply that ended with a stop token the closing starts with (ChatML's ``<|im_end|>``)
        already holds that part of the closing; a reply cut at the token budget gets all of it.
        """
        closing = self.closing
        if reply_ids and reply_ids[-1] in stop_ids:
            stop = self.tok.decode([reply_ids[-1]])
            if closing.startswith(stop):
                closing = closing[len(stop):]
        return closing + self.user_turn(content)


@dataclass
class EpisodeBatch:
    """Whole episodes as TRL rows (see the module docstring) and what the episodes did."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    env_mask: list[list[int]]
    logprobs: list[list[float]]
    trajectories: list[Trajectory]
    #: the privileged prompt of each episode (SkillBank block + its student prompt), None without a teacher
    teacher_prompt_ids: list[list[int]] | None
    prompt_truncated: list[bool]
    context_stops: list[bool]
    timings: dict[str, float]

    def scores(self, invalid_penalty: float) -> list[float]:
        """Each episode's return minus ``invalid_penalty`` times its share of invalid turns."""
        return [t.ret - invalid_penalty * t.n_invalid / max(t.n_turns, 1) for t in self.trajectories]

    def to_trl(self, invalid_penalty: float) -> dict[str, list]:
        """The ``rollout_func`` result: TRL's three keys, ``env_mask`` and the extra fields."""
        trajs = self.trajectories
        out: dict[str, list] = {
            "prompt_ids": self.prompt_ids, "completion_ids": self.completion_ids, "logprobs": self.logprobs,
            "env_mask": self.env_mask, "episode_reward": self.scores(invalid_penalty),
            "episode_turns": [t.n_turns for t in trajs], "episode_won": [float(t.won) for t in trajs],
            "episode_invalid_turns": [t.n_invalid for t in trajs],
            "episode_context_stop": [float(s) for s in self.context_stops],
            "episode_prompt_cut": [float(c) for c in self.prompt_truncated],
            "episode_return": [t.ret for t in trajs], "episode_score": [t.score for t in trajs],
        }
        if self.teacher_prompt_ids is not None:
            out["teacher_prompt_ids"] = self.teacher_prompt_ids
        return out


def episode_reward(completions: list, episode_reward: list[float], episode_turns: list[int] | None = None,
                   episode_won: list[float] | None = None, episode_invalid_turns: list[int] | None = None,
                   episode_context_stop: list[float] | None = None, episode_prompt_cut: list[float] | None = None,
                   episode_return: list[float] | None = None, episode_score: list[float] | None = None,
                   log_metric: Callable[[str, float], None] | None = None, **_: Any) -> list[float]:
    """TRL reward function: the score :class:`EpisodeRollout` computed, forwarded as an extra field.

    With TRL's ``log_metric`` it also logs the episodes' mean turns, win rate, invalid-turn
    share, context-stop share, share of first prompts cut from the left, shaped return and
    WebShop score (``episodes/*``).
    """
    if log_metric is not None and episode_turns is not None:
        n = max(len(episode_turns), 1)
        turns = sum(episode_turns)
        log_metric("episodes/turns", turns / n)
        if episode_won is not None:
            log_metric("episodes/won", sum(episode_won) / n)
        if episode_invalid_turns is not None:
            log_metric("episodes/invalid_turn_share", sum(episode_invalid_turns) / max(turns, 1))
        if episode_context_stop is not None:
            log_metric("episodes/context_stops", sum(episode_context_stop) / n)
        if episode_prompt_cut is not None:
            log_metric("episodes/prompt_cut", sum(episode_prompt_cut) / n)
        if episode_return is not None:
            log_metric("episodes/return", sum(episode_return) / n)
        if episode_score is not None:
            log_metric("episodes/score", sum(episode_score) / n)
    return [float(r) for r in episode_reward]


class EpisodeRollout:
    """``rollout_func`` for TRL: plays whole episodes of an environment (see the module docstring).

    ``tasks`` maps each dataset prompt (a first observation's student prompt text) to the
    environment task it starts; ``teacher_skill(ctx, student_text)`` is the run's skill
    retrieval (:func:`~icsd_audit.train.teacher.self_teacher.skill_retriever`), None without a teacher.
    ``sampler`` is :func:`~icsd_audit.train.rollout.sampling.sample` unless a test scripts replies.
    """

    def __init__(self, *, tokenizer: Any, builder: PromptBuilder, make_env: Callable[[], TextEnv],
                 settings: RolloutSettings, invalid_penalty: float, tasks: Mapping[str, int],
                 teacher_skill: Callable[[TurnContext, str], str] | None = None, sampler: Sampler = sample):
        self.tok, self.builder, self.make_env = tokenizer, builder, make_env
        self.settings, self.invalid_penalty, self.tasks = settings, invalid_penalty, dict(tasks)
        self.teacher_skill, self.sampler = teacher_skill, sampler
        self.referee = TurnReferee(settings)
        self.seams = ChatSeams(tokenizer)
        self.envs: list[TextEnv] = []  # one per concurrent episode, kept across calls

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list]:
        missing = next((p for p in prompts if p not in self.tasks), None)
        if missing is not None:
            raise ValueError(f"rollout got a prompt that starts no known task: {str(missing)[:80]!r}...")
        from trl.models import unwrap_model_for_generation

        t0 = time.perf_counter()
        # TRL's own generation context: gradient checkpointing off (else generate runs without a KV
        # cache, recomputing the whole context for every token) and DeepSpeed ZeRO-3 weights gathered
        with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator,
                                         gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
                                         gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs) as model:
            batch = self.play(model, [self.tasks[p] for p in prompts], device=trainer.accelerator.device,
                              group_size=trainer.num_generations)
        log = getattr(trainer, "_log_metric", None)  # what TRL hands reward functions as log_metric
        if log is not None:  # where a step's time goes: TRL times only the whole step
            log("time/rollout", time.perf_counter() - t0)
            for k, v in batch.timings.items():
                log(f"time/rollout_{k}", v)
        return batch.to_trl(self.invalid_penalty)

    def _user_content(self, ctx: TurnContext) -> str:
        return observation_content(ctx, self.builder.history_window)

    def play(self, model: Any, tasks: Sequence[int], *, device: torch.device, group_size: int = 1) -> EpisodeBatch:
        """One episode per entry of ``tasks``, each to its end, ``max_turns`` turns or a context stop."""
        s, b, tok = self.settings, self.builder, self.tok
        n = len(tasks)
        while len(self.envs) < n:
            self.envs.append(self.make_env())
        envs = self.envs[:n]
        pad_id, stop_ids = pad_and_stop_ids(model, tok)
        g = max(int(group_size), 1)
        trajs = [Trajectory(traj=i, slot=i // g, task=int(t), rollout=i % g) for i, t in enumerate(tasks)]
        t0 = time.perf_counter()
        obs = [env.reset(t.task) for env, t in zip(envs, trajs)]
        ctx0 = [turn_context(o, b.env) for o in obs]
        first = [b.student(c) for c in ctx0]
        prompt_ids = [ids for ids, _ in first]
        teacher = None
        if self.teacher_skill is not None:
            teacher = [b.teacher(c, ids, self.teacher_skill(c, b.student_text(c)))[0] for c, ids in zip(ctx0, prompt_ids)]
        comp: list[list[int]] = [[] for _ in range(n)]
        mask: list[list[int]] = [[] for _ in range(n)]
        logps: list[list[float]] = [[] for _ in range(n)]
        stopped = [False] * n
        t_env, t_gen = time.perf_counter() - t0, 0.0
        for turn in range(s.max_turns):
            active = [i for i in range(n) if not trajs[i].done]
            for lo in range(0, len(active), s.batch_rows):
                chunk = active[lo: lo + s.batch_rows]
                t1 = time.perf_counter()
                resp, lp = self.sampler(model, [prompt_ids[i] + comp[i] for i in chunk],
                                        max_new_tokens=s.max_response_tokens, temperature=s.temperature, pad_id=pad_id,
                                        stop_ids=stop_ids, device=device, precision=s.precision, want_logp=True)
                t_gen += time.perf_counter() - t1
                t1 = time.perf_counter()
                for j, i in enumerate(chunk):
                    out = self.referee.play(envs[i], tok.decode(resp[j], skip_special_tokens=True), obs[i], trajs[i], turn)
                    comp[i] += resp[j]
                    mask[i] += [1] * len(resp[j])
                    logps[i] += lp[j].tolist()
                    obs[i] = out.result.observation
                    if out.done:
                        continue
                    text = self.seams.after_reply(resp[j], stop_ids, self._user_content(turn_context(obs[i], b.env)))
                    nxt = list(tok(text, add_special_tokens=False).input_ids)
                    if len(prompt_ids[i]) + len(comp[i]) + len(nxt) > b.max_prompt_tokens:
                        trajs[i].done = stopped[i] = True  # the next turn's context would pass the bound
                        continue
                    comp[i] += nxt
                    mask[i] += [0] * len(nxt)
                    logps[i] += [0.0] * len(nxt)
                t_env += time.perf_counter() - t1
        return EpisodeBatch(prompt_ids=prompt_ids, completion_ids=comp, env_mask=mask, logprobs=logps,
                            trajectories=trajs, teacher_prompt_ids=teacher, prompt_truncated=[c for _, c in first],
                            context_stops=stopped, timings={"generate": t_gen, "env": t_env})
