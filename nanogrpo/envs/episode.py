"""The episode rollout: G trajectories for each prompt, turn by turn, laid out as one training batch.

    roll = episode_rollout(policy, rows, step, first, cfg, device, factory)

A trajectory is `prompt | turn 1 | observation 1 | turn 2 | ... | turn K`, every part after the prompt in
the completion's columns: the sampled turns at mask 1 with their sampler log-probs, the observations at mask
0 with log-prob 0, so the loss, the KL and the entropy see only what the model chose, and the observations
are context. Every turn re-prefills the whole history through the one sampler (`generate`), so each turn's
log-probs come from the same program and weights as the trainer's; nothing is synced.

Seeds: the G members of group i reset with one seed, prompt_seed(seed, step, first + i, resample), so they
face one situation; member j samples turn t from its own generator seeded from (that seed, j, t), so a
trajectory is the same on any rank, in any batch, and after a resume. An environment that raises, runs past
--env.step-timeout-s or returns a reward that is not finite ends its episode with no reward (left out of its
group, as a completion no grader scores) and is counted; the other episodes go on.

Budgets: a turn samples at most --sampling.max-new-tokens, an episode at most --env.max-tokens after the
prompt (sampled plus observation tokens) and --env.max-turns turns; an episode that ends on a budget before
the environment says done is truncated (what --grpo.mask-truncated drops).
"""

from __future__ import annotations

import functools
import hashlib
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from nanogrpo.config import SamplingConfig
from nanogrpo.envs import Step, attrs
from nanogrpo.envs.render import TurnFormat
from nanogrpo.model.sampling import finish_text, generate
from nanogrpo.rollout import assemble, prompt_seed


def turn_seed(group_seed: int, member: int, turn: int) -> int:
    """The seed of member `member`'s generator for turn `turn` of the group seeded `group_seed`."""
    key = f"{group_seed},{member},{turn}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1  # < 2**63


@dataclass
class Trajectory:
    """One episode: the prompt's ids, and after it the turns and observations with their mask and log-probs."""

    prompt_ids: list[int]
    prompt: str  # the first user message as text
    ids: list[int] = field(default_factory=list)  # (T,) after the prompt
    mask: list[float] = field(default_factory=list)  # (T,) 1 on sampled tokens
    logp: list[float] = field(default_factory=list)  # (T,) sampler log-probs, 0 on observations
    turns: list[dict] = field(default_factory=list)  # the transcript after the prompt: {"role", "content"}
    reward: float = 0.0  # the sum of the steps' rewards
    done: bool = False  # the environment ended it
    over: bool = False  # no more turns: done, a budget, or a failure
    failed: str = ""  # why the environment failed it ('' = it did not)
    invalid: int = 0  # steps whose info said invalid
    info: dict = field(default_factory=dict)  # the last step's info
    observation: str = ""  # the last step's observation: what the next turn reads

    @property
    def completion(self) -> str:
        """The last assistant turn: what the reference graders score."""
        return next((t["content"] for t in reversed(self.turns) if t["role"] == "assistant"), "")


def _call(fn, limit_s: float) -> tuple[Any, str]:
    """fn() within the time limit: (its value, '') or (None, why it failed)."""
    from rewards.user import call_with_limit

    try:
        return call_with_limit(fn, limit_s), ""
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # the time limit's _Overtime, SystemExit and anything an environment raises
        name = type(e).__name__
        return None, f"over {limit_s:g} s" if name == "_Overtime" else f"{name}: {e}"[:300]


def play(
    model,
    tok,
    envs: list,
    rows: list[dict],
    group_seeds: list[int],
    sampling: SamplingConfig,
    *,
    render_prompt,
    max_turns: int,
    max_tokens: int,
    timeout_s: float,
    fmt: TurnFormat,
    eos_ids,
    pad_id: int,
    autocast=None,
    fold_lora: bool = True,
    prompt_limit: int = 1 << 30,
) -> list[Trajectory]:
    """Play one episode per environment in `envs` (G per row, rows[i // G]), turn by turn, batched across
    the live episodes; `render_prompt(row, message)` gives the prompt ids of a first message (None: the row's
    own, `row['_prompt_ids']`)."""
    G = len(envs) // len(rows)
    trajs = _reset(envs, rows, group_seeds, render_prompt, timeout_s, prompt_limit)
    a = attrs(envs[0])
    stop, role = (
        tuple(dict.fromkeys((*sampling.stop, *a["stop"]))),
        a["role"],
    )  # stop: the run's and the env's
    for turn in range(max_turns):
        live = [k for k, t in enumerate(trajs) if not t.over]
        if not live:
            break
        room = [max_tokens - len(trajs[k].ids) for k in live]  # (L,) tokens each may still take
        cap = max(1, min(sampling.max_new_tokens, max(room)))
        gens = [
            torch.Generator(device=model.lm_head_weight.device).manual_seed(
                turn_seed(group_seeds[k // G], k % G, turn)
            )
            for k in live
        ]
        out = generate(
            model, [trajs[k].prompt_ids + trajs[k].ids for k in live], max_new_tokens=cap,
            temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, eos_ids=eos_ids,
            stop_strings=stop, tokenizer=tok, generator=gens, pad_id=pad_id, autocast=autocast,
            fold_lora=fold_lora, decode=sampling.decode,
        )  # fmt: skip
        lengths, ids_all, logp_all = out.lengths.tolist(), out.completion_ids.tolist(), out.logp.tolist()
        for row_i, k in enumerate(live):
            t, n = trajs[k], min(lengths[row_i], room[row_i])
            ids = ids_all[row_i][:n]  # a turn past the episode's budget is cut there
            text = finish_text(tok.decode(ids, skip_special_tokens=True), stop)
            t.ids += ids
            t.mask += [1.0] * n
            t.logp += logp_all[row_i][:n]
            t.turns.append({"role": "assistant", "content": text})
            _step(t, envs[k], text, timeout_s)
            if t.over:
                continue
            if turn + 1 == max_turns:
                t.over = True  # out of turns
                continue
            obs = fmt.observation_text(t.observation, bool(ids) and ids[-1] in eos_ids)
            obs_ids = tok(obs, add_special_tokens=False)["input_ids"]
            if len(t.ids) + len(obs_ids) >= max_tokens:  # no room left for the observation and a turn
                t.over = True
                continue
            t.turns.append({"role": role, "content": t.observation})
            t.ids += obs_ids
            t.mask += [0.0] * len(obs_ids)
            t.logp += [0.0] * len(obs_ids)
    return trajs


def _reset(envs: list, rows: list[dict], group_seeds: list[int], render_prompt, timeout_s: float,
           prompt_limit: int) -> list[Trajectory]:  # fmt: skip
    """One Trajectory per environment, reset with its group's seed; an environment whose reset raises,
    returns something other than text, or a first message past the prompt limit fails its episode."""
    G = len(envs) // len(rows)
    trajs: list[Trajectory] = []
    for k, env in enumerate(envs):
        row, seed = rows[k // G], group_seeds[k // G]
        message, err = _call(lambda: env.reset(dict(row), seed), timeout_s)  # noqa: B023 (called at once)
        if not err and not isinstance(message, (str, type(None))):
            err = f"reset returned {type(message).__name__}, not str"
        ids = row["_prompt_ids"] if err or message is None else render_prompt(row, message)
        if not err and len(ids) > prompt_limit:
            err = "reset returned a first message longer than the prompt limit"
        trajs.append(Trajectory(list(ids), str(row.get("prompt", "")) if message is None else str(message)))
        trajs[-1].failed, trajs[-1].over = err, bool(err)
    return trajs


def _step(t: Trajectory, env, text: str, timeout_s: float) -> None:
    """One environment step on trajectory t: its reward added, or the episode failed; t.observation set."""
    res, err = _call(lambda: env.step(text), timeout_s)
    if not err and not isinstance(res, Step) and not all(hasattr(res, a) for a in ("reward", "done")):
        err = f"step returned {type(res).__name__}, not a Step"
    if not err:
        try:
            reward = float(res.reward)
        except (TypeError, ValueError):
            reward = math.nan
        if not math.isfinite(reward):
            err = f"step returned the reward {res.reward!r}, not a finite number"
    if err:
        t.failed, t.over = err, True
        return
    t.reward += reward
    t.info = dict(getattr(res, "info", None) or {})
    t.invalid += bool(t.info.get("invalid"))
    t.done = bool(res.done)
    t.over = t.done
    t.observation = "" if res.observation is None else str(res.observation)


def episode_rollout(policy, rows: list[dict], step: int, first: int, cfg, device, factory, resample: int = 0):
    """GRPO's rollout (nanogrpo/rollout.py) with episodes: G trajectories per row, laid out as a Rollout
    whose completion columns hold turns and observations (module docstring)."""
    from nanogrpo.data import render_prompt

    t0 = time.perf_counter()
    G, s, e, tok = cfg.grpo.group_size, cfg.sampling, cfg.env, policy.tokenizer
    envs = [factory() for _ in range(len(rows) * G)]
    fmt = TurnFormat.of(tok, attrs(envs[0])["role"], e.format, cfg.data.system_prompt)
    seeds = [prompt_seed(cfg.seed, step, first + i, resample) for i in range(len(rows))]
    policy.model.eval()
    with policy.gathered(), torch.inference_mode():  # FSDP: full weights for the sampler
        trajs = play(
            policy.core, tok, envs, rows, seeds, s,
            render_prompt=lambda row, msg: render_prompt(tok, {"prompt": msg}, cfg.data.system_prompt),
            max_turns=e.max_turns, max_tokens=e.max_tokens, timeout_s=e.step_timeout_s, fmt=fmt,
            eos_ids=policy.eos_ids, pad_id=policy.pad_id, autocast=policy.autocast, fold_lora=s.fold_lora,
            prompt_limit=_prompt_limit(cfg),
        )  # fmt: skip
    roll = layout(trajs, rows, envs, e.max_turns, policy.pad_id, device)
    roll.seconds = time.perf_counter() - t0
    return roll


@functools.lru_cache(maxsize=4)
def _prompt_limit(cfg) -> int:
    """The run's longest prompt (policy.prompt_budget), once per config: a first message longer fails its episode."""
    from nanogrpo.policy import prompt_budget

    return prompt_budget(cfg)[1]


def layout(trajs: list[Trajectory], rows: list[dict], envs: list, max_turns: int, pad_id: int, device):
    """The trajectories as a Rollout: (N, T) ids, mask and log-probs padded to the longest, each
    trajectory's own prompt, and on every Sample the transcript, the episode's reward and its info."""
    T = max(1, max(len(t.ids) for t in trajs))
    ids = torch.full((len(trajs), T), pad_id, dtype=torch.long)  # (N, T)
    mask, logp = torch.zeros(len(trajs), T), torch.zeros(len(trajs), T)  # (N, T), (N, T)
    for k, t in enumerate(trajs):
        ids[k, : len(t.ids)] = torch.tensor(t.ids, dtype=torch.long)
        mask[k, : len(t.mask)] = torch.tensor(t.mask)
        logp[k, : len(t.logp)] = torch.tensor(t.logp)
    truncated = torch.tensor([not t.done and not t.failed for t in trajs])  # (N,) a budget ended it
    G = len(trajs) // len(rows)
    groups = [{**r, "prompt": trajs[i * G].prompt if trajs[i * G].turns else r.get("prompt", "")}
              for i, r in enumerate(rows)]  # fmt: skip
    roll = assemble(groups, [t.completion for t in trajs], ids, mask, logp, truncated, pad_id, device,
                    prompt_ids=[t.prompt_ids for t in trajs])  # fmt: skip
    for t, smp, env in zip(trajs, roll.samples, envs):
        a = attrs(env)
        smp.turns = [{"role": "user", "content": t.prompt}, *t.turns]
        smp.env_reward = None if t.failed else t.reward
        smp.env_info = episode_info(t, a["reward_range"], max_turns)
    roll.failed = torch.tensor([bool(t.failed) for t in trajs])  # (N,)
    return roll


def episode_info(t: Trajectory, reward_range, max_turns: int) -> dict:
    """What the graders and the logs read of an episode besides its transcript (Sample.env_info)."""
    turns = sum(x["role"] == "assistant" for x in t.turns)
    return {**t.info, "reward_range": tuple(reward_range), "turns": turns, "max_turns": max_turns,
            "invalid": t.invalid, "done": t.done, "error": t.failed}  # fmt: skip


@dataclass(frozen=True)
class EpisodeRunner:
    """What playing episodes needs besides the model: the environment and the run's --env budgets."""

    factory: Any
    max_turns: int
    max_tokens: int
    timeout_s: float = 10.0
    format: str = "auto"

    @classmethod
    def of(cls, cfg, factory) -> EpisodeRunner | None:
        e = cfg.env
        return (
            None if factory is None else cls(factory, e.max_turns, e.max_tokens, e.step_timeout_s, e.format)
        )

    @classmethod
    def from_flags(cls, e, max_new_tokens: int, allow_user_code: bool) -> EpisodeRunner | None:
        """eval.py generate's --env.*: the environment checked and its budgets resolved, or None without one."""
        from nanogrpo.envs import resolve_env

        if not e.on:
            return None
        e, factory = resolve_env(e, max_new_tokens, allow_user_code)
        return cls(factory, e.max_turns, e.max_tokens, e.step_timeout_s, e.format)


def play_rows(
    model, tok, rows, runner: EpisodeRunner, sampling: SamplingConfig, *, num_samples: int = 1, seed: int = 0,
    seeds=None, system_prompt: str = "", autocast=None,
) -> list[dict]:  # fmt: skip
    """One episode per (row, sample), in row order (row i's at i*k .. i*k+k-1), for evaluation: each a
    record {"completion", "tokens", "turns", "env_reward", "env_info"}. Row i's environments reset with
    seeds[i] (default: from `seed` and i), the same for every model compared on these rows."""
    from nanogrpo.data import render_prompt
    from nanogrpo.model.sampling import eos_and_pad

    eos, pad_id = eos_and_pad(model.config, tok)
    envs = [runner.factory() for _ in rows for _ in range(num_samples)]
    rows = [{**r, "_prompt_ids": render_prompt(tok, r, system_prompt)} for r in rows]
    group_seeds = (
        list(seeds) if seeds is not None else [(seed * 1_000_003 + i) * 4099 for i in range(len(rows))]
    )
    fmt = TurnFormat.of(tok, attrs(envs[0])["role"], runner.format, system_prompt)
    with torch.no_grad():
        trajs = play(
            model, tok, envs, rows, group_seeds, sampling,
            render_prompt=lambda row, msg: render_prompt(tok, {"prompt": msg}, system_prompt),
            max_turns=runner.max_turns, max_tokens=runner.max_tokens, timeout_s=runner.timeout_s, fmt=fmt,
            eos_ids=tuple(eos), pad_id=pad_id, autocast=autocast,
        )  # fmt: skip
    return [
        {
            "completion": t.completion,
            "tokens": int(sum(t.mask)),
            "turns": [{"role": "user", "content": t.prompt}, *t.turns],
            "env_reward": None if t.failed else t.reward,
            "env_info": episode_info(t, attrs(env)["reward_range"], runner.max_turns),
        }
        for t, env in zip(trajs, envs)
    ]
