"""The episode rollout: G trajectories for each prompt, turn by turn, laid out as one training batch.

    roll = episode_rollout(policy, rows, step, first, cfg, device, env)     # env: the run's EnvSpec

A trajectory is `prompt | turn 1 | observation 1 | turn 2 | ... | turn K`, every part after the prompt in
the completion's columns: the sampled turns at mask 1 with their sampler log-probs, the observations at mask
0 with log-prob 0, so the loss, the KL and the entropy see only what the model chose, and the observations
are context. The sampler continues each trajectory's cache from turn to turn (row_sampler.Sampler): turn 1
prefills each distinct first message once, a later turn feeds only the last sampled token and the new
observation. Its log-probs come from the same program and weights as the trainer's, which recomputes them
over the whole trajectory; nothing is synced.

Seeds: the G members of group i reset with one seed, prompt_seed(seed, step, first + i, resample), so they
face one situation; member j samples turn t from its own generator seeded from (that seed, j, t), so a
trajectory is the same on any rank, in any batch, and after a resume.

Faults: each episode's environment runs in a worker process (envs/workers.py). One that cannot be built, raises,
returns what the protocol does not allow, a reward that is not finite (a step's, or the episode's sum), or runs
past --env.step-timeout-s ends its episode with no reward (left out of its group, as a completion no grader
scores), the reason in env_info["error"], counted in env/failed; the other episodes go on. An observation is
text: a control token's text in it stays text (envs/render.py), and one longer than the budget could hold is
cut before it is tokenized.

Budgets: a turn samples at most --sampling.max-new-tokens, an episode at most --env.max-tokens after the
prompt (sampled plus observation tokens) and --env.max-turns turns; an episode that ends on a budget before
the environment says done is truncated (what --grpo.mask-truncated drops), and scores --env.truncated-score
(by default the lowest reward of the environment's range: a game cut short is not a draw).

Tool environments: a step's info may count the turn's tool calls ("tool_calls") and name a call that could not
be parsed ("tool_parse_error"); the episode adds them up (env_info "tool_calls", "tool_parse_errors"), and the
step logs them (summary.episode_summary).
"""

from __future__ import annotations

import hashlib
import math
import re
import time
from dataclasses import dataclass, field

import torch

from nanogrpo.config import SamplingConfig
from nanogrpo.envs import Step
from nanogrpo.envs.keeper import printable
from nanogrpo.envs.spec import EnvSpec
from nanogrpo.model.fast.row_sampler import Sampler
from nanogrpo.model.fast.sampler import sampling_weights
from nanogrpo.model.paths import plain
from nanogrpo.model.sampling import Episodes, eval_mode, finish_text
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
    tools: bool = False  # a step's info counted tool calls: a tool environment
    tool_calls: int = 0  # the calls its steps counted (info "tool_calls")
    tool_errors: int = 0  # steps whose call could not be parsed (info "tool_parse_error")
    info: dict = field(default_factory=dict)  # the last step's info
    observation: str = ""  # the last step's observation: what the next turn reads
    fresh: list[int] = field(
        default_factory=list
    )  # its ids, which the sampler feeds next (the rest it holds)

    @property
    def completion(self) -> str:
        """The last assistant turn: what the reference graders score."""
        return next((t["content"] for t in reversed(self.turns) if t["role"] == "assistant"), "")


def play(
    model, tok, env: EnvSpec, rows: list[dict], group_seeds: list[int], sampling: SamplingConfig, G: int, *,
    system_prompt: str, eos_ids, pad_id: int, autocast=None, fold_lora: bool = True,
) -> list[Trajectory]:  # fmt: skip
    """Play G episodes of each row (episode k: rows[k // G]), turn by turn, batched across the live episodes;
    each episode's environment runs in worker k of env.workers (envs/workers.py). The sampler continues each
    episode's cache (row_sampler.Sampler): turn 1 prefills each distinct first message once for the episodes
    that share it, a later turn feeds only an episode's new observation."""
    workers = env.workers
    assert workers is not None and env.turns is not None, "an EnvSpec from envs.spec.check_start"
    stop = tuple(dict.fromkeys((*sampling.stop, *env.stop)))  # the run's and the environment's
    trajs = _reset(env, rows, group_seeds, G, tok, system_prompt)
    try:
        weights = eval_mode(model) if plain() else sampling_weights(model, len(trajs), fold_lora, autocast)
        with weights as w:
            if plain():  # --plain: the plain loop on the weights as they are, its cache continued
                sampler = Episodes(model, sampling.max_new_tokens, autocast)
            else:  # the row sampler (fast/row_sampler.py): a cache row a sample, in the packed weights
                limit = max(len(t.prompt_ids) for t in trajs) + env.max_tokens + sampling.max_new_tokens
                head, packed, amp = w
                sampler = Sampler(model, head, sampling.max_new_tokens, packed, amp, limit)
            on: list[int] = []  # the episode of each sampler row
            for turn in range(env.max_turns):
                live = [k for k, t in enumerate(trajs) if not t.over]
                if not live:
                    break
                if turn == 0:  # each distinct first message once
                    firsts = list(dict.fromkeys(tuple(trajs[k].prompt_ids) for k in live))
                    index = [firsts.index(tuple(trajs[k].prompt_ids)) for k in live]
                    logits = sampler.prefill([list(p) for p in firsts], index)  # (L, V)
                else:  # the episodes that go on, fed only their new observation
                    sampler.keep([on.index(k) for k in live])
                    logits = sampler.extend([trajs[k].fresh for k in live])  # (L, V)
                on = live
                room = [env.max_tokens - len(trajs[k].ids) for k in live]  # (L,) tokens each may still take
                gens = [
                    torch.Generator(device=logits.device).manual_seed(turn_seed(group_seeds[k // G], k % G, turn))
                    for k in live
                ]  # fmt: skip
                out = sampler.decode(
                    logits, max(1, min(sampling.max_new_tokens, max(room))), gens, temperature=sampling.temperature,
                    top_p=sampling.top_p, top_k=sampling.top_k, eos_ids=eos_ids, stop_strings=stop, tokenizer=tok,
                    pad_id=pad_id, decode_mode=sampling.decode,
                )  # fmt: skip
                texts, on_eos = _append_turns(trajs, live, out, room, tok, stop, eos_ids, env.turns.opening)
                replies = workers.call({k: ("step", (text, env.max_chars)) for k, text in texts.items()})
                for k in live:
                    _take(trajs[k], *replies[k])
                    _observe(trajs[k], env, tok, on_eos[k], last_turn=turn + 1 == env.max_turns)
    finally:  # each instance dropped in its worker (its own clean-up, under the time limit)
        workers.call({k: ("end", None) for k in range(len(trajs))})
    return trajs


def _append_turns(
    trajs, live, out, room, tok, stop, eos_ids, opening: str = ""
) -> tuple[dict[int, str], dict[int, str]]:
    """Each live episode's sampled turn appended (its tokens at mask 1 with their log-probs, cut where the
    episode's budget ends); returns each one's text and the text of the EOS token it ended on ('' if none:
    Gemma's turns end on <end_of_turn>, not on the tokenizer's <eos>). A turn's text, the assistant message,
    starts with `opening`, the part of it the prompt wrote (Qwen3.5's '<think>\n': render.TurnFormat)."""
    lengths, ids_all, logp_all = out.lengths.tolist(), out.completion_ids.tolist(), out.logp.tolist()
    texts, on_eos = {}, {}
    for row, k in enumerate(live):
        t, n = trajs[k], min(lengths[row], room[row])
        ids = ids_all[row][:n]  # a turn past the episode's budget is cut there
        texts[k] = opening + finish_text(tok.decode(ids, skip_special_tokens=True), stop)
        on_eos[k] = tok.decode(ids[-1:]) if ids and ids[-1] in eos_ids else ""
        t.ids += ids
        t.mask += [1.0] * n
        t.logp += logp_all[row][:n]
        t.turns.append({"role": "assistant", "content": texts[k]})
    return texts, on_eos


def _observe(t: Trajectory, env: EnvSpec, tok, on_eos: str, last_turn: bool) -> None:
    """After a step: the observation appended at mask 0 (`t.fresh`: what the next turn feeds), or the episode
    over (done, failed, out of turns, or no room for the observation and a turn)."""
    t.fresh = []
    if t.over or last_turn:
        t.over = True
        return
    obs_ids = env.turns.observation_ids(tok, t.observation, on_eos)
    if len(t.ids) + len(obs_ids) >= env.max_tokens:  # no room left for the observation and a turn
        t.over = True
        return
    t.turns.append({"role": env.role, "content": t.observation})
    t.ids += obs_ids
    t.mask += [0.0] * len(obs_ids)
    t.logp += [0.0] * len(obs_ids)
    t.fresh = obs_ids


def _reset(env: EnvSpec, rows: list[dict], group_seeds: list[int], G: int, tok, system_prompt: str):
    """One Trajectory per episode, its instance built and reset with its group's seed in its worker; an
    instance that cannot be built, a reset that fails or returns what is not text, or a first message past
    the prompt limit fails its episode."""
    workers, n = env.workers, len(rows) * G
    made = workers.call({k: ("make", None) for k in range(n)})
    firsts = workers.call({
        k: ("reset", (dict(rows[k // G]), group_seeds[k // G], env.first_chars)) for k in range(n) if not made[k][1]
    })  # fmt: skip
    trajs: list[Trajectory] = []
    for k in range(n):
        row = rows[k // G]
        message, err = firsts[k] if k in firsts else made[k]
        ids = row["_prompt_ids"] if err else env.first_ids(tok, row, message, system_prompt)
        if not err and len(ids) > env.prompt_limit:
            err = (
                f"reset: a first message of {len(ids)} tokens, over the prompt limit of {env.prompt_limit} "
                "(--env.max-turns and --env.max-tokens leave the rest of the model's positions to it)"
            )
        trajs.append(Trajectory(list(ids), str(row.get("prompt", "")) if message is None else message))
        trajs[-1].failed, trajs[-1].over = err, bool(err)
    return trajs


def _take(t: Trajectory, res: Step | None, err: str) -> None:
    """A step's reply on trajectory t: its reward added, or the episode failed; t.observation set."""
    if not err and not math.isfinite(t.reward + res.reward):
        err = f"step: the episode's rewards add up to {t.reward + res.reward}, not a finite number"
    if err:
        t.failed, t.over = err, True
        return
    t.reward += res.reward
    t.info = res.info
    t.invalid += bool(res.info.get("invalid"))
    if "tool_calls" in res.info:  # a tool environment: the calls of this turn (docs/ENVS.md)
        n = res.info["tool_calls"]
        t.tools, t.tool_calls = True, t.tool_calls + (n if type(n) is int and n > 0 else 0)
    t.tool_errors += "tool_parse_error" in res.info
    t.done = t.over = res.done
    t.observation = res.observation or ""


def episode_rollout(
    policy, rows: list[dict], step: int, first: int, cfg, device, env: EnvSpec, resample: int = 0
):
    """GRPO's rollout (nanogrpo/rollout.py) with episodes: G trajectories per row, laid out as a Rollout
    whose completion columns hold turns and observations (module docstring)."""
    t0 = time.perf_counter()
    seeds = [prompt_seed(cfg.seed, step, first + i, resample) for i in range(len(rows))]
    policy.model.eval()
    with policy.gathered(), torch.inference_mode():  # FSDP: full weights for the sampler
        trajs = play(
            policy.core, policy.tokenizer, env, rows, seeds, cfg.sampling, cfg.grpo.group_size,
            system_prompt=cfg.data.system_prompt, eos_ids=policy.eos_ids, pad_id=policy.pad_id,
            autocast=policy.autocast, fold_lora=cfg.sampling.fold_lora,
        )  # fmt: skip
    note_failures(trajs, env.label)
    roll = layout(trajs, rows, env, policy.pad_id, device)
    roll.seconds = time.perf_counter() - t0
    return roll


_NOTED: set[str] = set()  # the kinds of failure already printed


def note_failures(trajs: list[Trajectory], label: str, most: int = 5) -> None:
    """Print one line the first time each kind of failure shows (at most `most` kinds a run): the episodes are
    counted in env/failed every step, and a user's environment file is debugged from this line (with
    NANOGRPO_DEBUG=1 its worker prints the traceback)."""
    for t in trajs:
        kind = re.sub(r"\d+(\.\d+)?", "N", t.failed)[:80]
        if t.failed and kind not in _NOTED and len(_NOTED) < most:
            _NOTED.add(kind)
            print(
                f"note: environment {label!r} failed an episode: {printable(t.failed)} (counted in env/failed)",
                flush=True,
            )


FIXES = (  # what fixes a failure, by what its reason says (the first that matches)
    ("over ", "raise --env.step-timeout-s or make the environment faster"),
    ("prompt limit", "lower --env.max-turns or --env.max-tokens"),
    ("make:", "the class must build with no arguments, once per episode"),
    ("process died", "the environment ended its own process (os._exit, a crash)"),
    ("reset:", "check what reset reads from the rows (--data.train)"),
    ("", "fix the environment; NANOGRPO_DEBUG=1 prints each failure's traceback"),
)


def failure_causes(roll) -> dict[str, int]:
    """This rank's failed episodes of a step by the kind of failure: {'"reason" (fix)': count}, what
    --reward.max-empty-steps names when it stops a run whose every episode fails."""
    causes: dict[str, int] = {}
    for s in roll.samples:
        if err := s.env_info.get("error"):
            fix = next(f for key, f in FIXES if key in err)
            cause = f"{err[:160]!r} ({fix})"
            causes[cause] = causes.get(cause, 0) + 1
    return causes


def layout(trajs: list[Trajectory], rows: list[dict], env: EnvSpec, pad_id: int, device):
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
    for t, smp in zip(trajs, roll.samples):
        smp.turns = [{"role": "user", "content": t.prompt}, *t.turns]
        smp.env_reward = episode_reward(t, env)
        smp.env_info = episode_info(t, env)
    roll.failed = torch.tensor([bool(t.failed) for t in trajs])  # (N,)
    return roll


def episode_reward(t: Trajectory, env: EnvSpec) -> float | None:
    """The episode's reward: None when its environment failed it; for one a budget ended before the environment
    said done, env.cut_reward (--env.truncated-score: by default the lowest of reward_range, so that a game cut
    short never outscores one played to its end, a loss included); else the sum of its steps' rewards."""
    if t.failed:
        return None
    return env.cut_reward if not t.done and env.cut_reward is not None else t.reward


def episode_info(t: Trajectory, env: EnvSpec) -> dict:
    """What the graders and the logs read of an episode besides its transcript (Sample.env_info): the last
    step's info, then the episode's own facts (a tool environment's calls and parse failures: its totals)."""
    turns = sum(x["role"] == "assistant" for x in t.turns)
    info = {**t.info, "reward_range": tuple(env.reward_range), "turns": turns, "max_turns": env.max_turns,
            "invalid": t.invalid, "done": t.done, "truncated": not (t.done or t.failed), "error": t.failed}  # fmt: skip
    if t.tools:
        info.update(tool_calls=t.tool_calls, tool_parse_errors=t.tool_errors)
    return info


def play_rows(
    model, tok, rows, env: EnvSpec, sampling: SamplingConfig, *, num_samples: int = 1, seed: int = 0, seeds=None,
    system_prompt: str = "", autocast=None, batch_rows: int = 16,
) -> list[dict]:  # fmt: skip
    """One episode per (row, sample), in row order (row i's at i*k .. i*k+k-1), for evaluation: each a
    record {"completion", "tokens", "turns", "env_reward", "env_info"}, played `batch_rows` rows at a time.
    Row i's environments reset with seeds[i] (default: from `seed` and i), the same for every model compared
    on these rows."""
    from nanogrpo.data import render_prompt
    from nanogrpo.policy import eos_and_pad

    eos, pad_id = eos_and_pad(model.config, tok)
    rows = [{**r, "_prompt_ids": render_prompt(tok, r, system_prompt)} for r in rows]
    group_seeds = (
        list(seeds) if seeds is not None else [(seed * 1_000_003 + i) * 4099 for i in range(len(rows))]
    )
    trajs: list[Trajectory] = []
    with torch.no_grad():
        for i in range(0, len(rows), batch_rows):
            trajs += play(
                model, tok, env, rows[i : i + batch_rows], group_seeds[i : i + batch_rows], sampling, num_samples,
                system_prompt=system_prompt, eos_ids=tuple(eos), pad_id=pad_id, autocast=autocast,
            )  # fmt: skip
    note_failures(trajs, env.label)
    return [
        {
            "completion": t.completion,
            "tokens": int(sum(t.mask)),
            "turns": [{"role": "user", "content": t.prompt}, *t.turns],
            "env_reward": episode_reward(t, env),
            "env_info": episode_info(t, env),
        }
        for t in trajs
    ]
