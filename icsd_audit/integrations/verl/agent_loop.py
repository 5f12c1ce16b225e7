"""``icsd_env``: a verl agent loop that plays one episode of a built-in environment per data row.

Registered through the run's ``agent_loops.yaml`` (:mod:`~icsd_audit.integrations.verl.env`);
verl instantiates it per sample in its agent-loop workers and calls ``run(sampling_params,
**row)``.  The episode is the TRL engine's (:class:`~icsd_audit.integrations.trl.rollout.EpisodeRollout`),
played through verl's rollout server instead of HF ``generate``:

* the prompt is the built-in student prompt of the task's first observation
  (:class:`~icsd_audit.train.rollout.collect.PromptBuilder` with the run's ``config.json``);
* each turn the server samples one reply (at most ``max_response_tokens`` tokens, verl's
  sampling parameters otherwise) from ``prompt + conversation so far``; the run's
  :class:`~icsd_audit.train.rollout.collect.TurnReferee` parses it, steps the environment and
  books reward and validity; the next observation is what the chat template appends
  after the reply (:class:`~icsd_audit.integrations.trl.rollout.ChatSeams`), masked 0 in
  ``response_mask``;
* the episode ends when the environment says so, after ``max_turns`` turns, or before an
  observation would push the context past ``max_prompt_tokens`` or the response past
  verl's ``response_length`` (a context stop);
* ``reward_score`` is the episode's return minus ``invalid_penalty`` times its share of
  invalid turns (the TRL engine's score), so verl's reward manager is not consulted.

A data row names its task in ``extra_info`` (``env``, ``env_split``, ``task``).
"""

from __future__ import annotations

import json
import time
import uuid
from functools import lru_cache
from typing import Any

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput

from icsd_audit.integrations.trl.rollout import ChatSeams

__all__ = ["EnvAgentLoop"]


#: idle environments per (run config, split) in this process: building one (WebShop's catalogue) takes seconds
_ENV_POOL: dict[tuple[int, str], list[Any]] = {}


@lru_cache(maxsize=4)
def _run_config(path: str) -> Any:
    from icsd_audit.train.config import TrainConfig

    with open(path) as f:
        return TrainConfig.from_dict(json.load(f))


class EnvAgentLoop(AgentLoopBase):
    """One episode of the run's environment per sample (see the module docstring)."""

    def __init__(self, *args: Any, run_config: str, **kwargs: Any):
        super().__init__(*args, **kwargs)
        from icsd_audit.train.rollout.collect import PromptBuilder, RolloutSettings, TurnReferee

        self.cfg = cfg = _run_config(str(run_config))
        self.builder = PromptBuilder.from_config(self.tokenizer, cfg)  # the TRL engine's builder (engines.run_trl)
        self.referee = TurnReferee(RolloutSettings(max_turns=cfg.max_turns, max_response_tokens=cfg.max_response_tokens,
                                                   temperature=cfg.temperature, batch_rows=1,
                                                   require_think=cfg.require_think, reward=cfg.reward,
                                                   record_logp=True, invalid_rule=cfg.invalid_rule))
        self.seams = ChatSeams(self.tokenizer)
        self.response_length = int(self.rollout_config.response_length)
        eos = self.tokenizer.eos_token_id
        self.stop_ids = [int(i) for i in (eos if isinstance(eos, (list, tuple)) else [eos]) if i is not None]

    def _acquire(self, split: str) -> Any:
        """An idle environment of ``split`` from this process's pool (episodes run concurrently, one env each)."""
        from icsd_audit.train.setup import env_factory as make_env_factory

        idle = _ENV_POOL.setdefault((id(self.cfg), split), [])
        return idle.pop() if idle else make_env_factory(self.cfg)(split)

    def _release(self, split: str, env: Any) -> None:
        _ENV_POOL[(id(self.cfg), split)].append(env)

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        info = dict(kwargs.get("extra_info") or {})
        if info.get("env") != self.cfg.env:
            raise ValueError(f"agent loop icsd_env runs {self.cfg.env!r} (the run's config.json); the row's "
                             f"extra_info names env {info.get('env')!r}")
        task = int(info["task"])
        split = str(info.get("env_split", self.cfg.train_split))
        env = self._acquire(split)
        try:
            return await self._play(env, task, sampling_params)
        finally:
            self._release(split, env)

    async def _play(self, env: Any, task: int, sampling_params: dict[str, Any]) -> AgentLoopOutput:
        from icsd_audit.train.rollout.prompts import observation_content
        from icsd_audit.train.rollout.collect import Trajectory, turn_context

        t0 = time.perf_counter()
        obs = env.reset(task)
        prompt_ids, _ = self.builder.student(turn_context(obs, self.builder.env))
        traj = Trajectory(traj=0, slot=0, task=task, rollout=0)
        resp: list[int] = []
        mask: list[int] = []
        logps: list[float] = []
        params = {**sampling_params, "max_tokens": int(self.cfg.max_response_tokens)}
        request_id = uuid.uuid4().hex
        t_env, t_gen, context_stop = time.perf_counter() - t0, 0.0, False
        for turn in range(self.cfg.max_turns):
            t1 = time.perf_counter()
            out = await self.server_manager.generate(request_id=request_id, prompt_ids=prompt_ids + resp,
                                                     sampling_params=params)
            t_gen += time.perf_counter() - t1
            t1 = time.perf_counter()
            reply = [int(i) for i in out.token_ids]
            step = self.referee.play(env, self.tokenizer.decode(reply, skip_special_tokens=True), obs, traj, turn)
            resp += reply
            mask += [1] * len(reply)
            logps += [float(x) for x in out.log_probs] if out.log_probs else [0.0] * len(reply)
            obs = step.result.observation
            if step.done:
                t_env += time.perf_counter() - t1
                break
            user = observation_content(turn_context(obs, self.builder.env), self.builder.history_window)
            nxt = list(self.tokenizer(self.seams.after_reply(reply, self.stop_ids, user),
                                      add_special_tokens=False).input_ids)
            t_env += time.perf_counter() - t1
            if (len(prompt_ids) + len(resp) + len(nxt) > self.cfg.max_prompt_tokens
                    or len(resp) + len(nxt) >= self.response_length):
                context_stop = True  # the next turn's context would pass a bound: stop before it
                break
            resp += nxt
            mask += [0] * len(nxt)
            logps += [0.0] * len(nxt)
        score = traj.ret - self.cfg.invalid_penalty * traj.n_invalid / max(traj.n_turns, 1)
        L = self.response_length
        return AgentLoopOutput(
            prompt_ids=prompt_ids, response_ids=resp[:L], response_mask=mask[:L],
            response_logprobs=logps[:L] if logps else None, reward_score=float(score),
            num_turns=2 * traj.n_turns + 1, metrics=AgentLoopMetrics(generate_sequences=t_gen, tool_calls=t_env),
            extra_fields={"episode_turns": traj.n_turns, "episode_won": float(traj.won),
                          "episode_invalid_turns": traj.n_invalid, "episode_context_stop": float(context_stop)})
