"""One step's numbers for metrics.jsonl and the console: totals reduced over ranks, then turned into means.

Every number a rank contributes is a total of its own rows, declared with how it combines across ranks
(`Totals`: sums add, maxes take the max); `reduce()` does the collectives, and only then are means taken,
so a logged mean is the mean over the whole step, not a mean of per-rank means.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from nanogrpo import grpo
from nanogrpo.dynamic import informative_groups
from nanogrpo.infra import dist
from nanogrpo.model.logprobs import last_sampled
from nanogrpo.optim import is_max_stat
from rewards.diagnostics import hacking_totals
from rewards.registry import mean_metrics


@dataclass
class Totals:
    """One rank's totals: `sums` add up over ranks, `maxes` take the max over ranks."""

    sums: dict[str, float] = field(default_factory=dict)
    maxes: dict[str, float] = field(default_factory=dict)

    def reduce(self) -> Totals:
        """The totals over all ranks (every rank must call it, with the same keys)."""
        # which of the two a Totals fills is fixed by the code, the same on every rank: an empty one
        # needs no collective
        sums = dist.sum_floats(self.sums) if self.sums else {}
        return Totals(sums, dist.max_floats(self.maxes) if self.maxes else {})


def reward_summary(roll, reward: torch.Tensor, parts: dict) -> dict:
    """A step's rewards over all ranks (mean and std of the completions some grader scored, each grader's
    mean, the completions none scored) and its lengths: what GRPO and PPO both log of their rollouts."""
    valid = ~reward.isnan()  # (N,) completions some grader scored
    t = Totals(
        sums={
            "r": float(reward[valid].sum()),
            "r2": float((reward[valid] ** 2).sum()),
            "n_r": float(valid.sum()),
            "len": float(roll.lengths.sum()),
            "trunc": float(roll.truncated.sum()),
            "rows": float(len(roll.lengths)),  # completions (--grpo.mask-truncated: more than trained)
        },
        maxes={"len": float(roll.lengths.max())},
    ).reduce()
    scored = {name: [x for x in vals if x is not None] for name, vals in parts.items()}  # each grader's
    graders = Totals({name: float(sum(ok)) for name, ok in scored.items()}).reduce().sums
    counts = Totals({name: float(len(ok)) for name, ok in scored.items()}).reduce().sums
    s, n_r = t.sums, t.sums["n_r"]  # n_r: completions with a reward, 0 when the judge scored nothing
    mean_r = s["r"] / n_r if n_r else None  # null in metrics.jsonl, not a measured 0
    return {
        "reward": mean_r,
        "reward_std": max(0.0, s["r2"] / n_r - mean_r**2) ** 0.5 if n_r else None,
        **{f"reward/{k}": (graders[k] / counts[k] if counts[k] else None) for k in parts},
        "len_mean": s["len"] / s["rows"],
        "len_max": t.maxes["len"],
        "trunc_rate": s["trunc"] / s["rows"],
        "reward_none": s["rows"] - n_r,
    }


def reduce_stats(stats: dict[str, float] | None) -> dict[str, float] | None:
    """grpo_loss's stats of this rank (summed over micro-batches) -> over all ranks: sums, and *_max maxed."""
    if stats is None:
        return None
    t = Totals(
        {k: v for k, v in stats.items() if not is_max_stat(k)},
        {k: v for k, v in stats.items() if is_max_stat(k)},
    ).reduce()
    return {**t.sums, **t.maxes}


def grpo_summary(
    roll, reward: torch.Tensor, parts: dict, zero_std: torch.Tensor, upd, kl_pen, has_ref
) -> dict:
    """The logged means of a GRPO step: rewards (each grader's too) and lengths (reward_summary), group
    spread, entropy, the loss's stats (grpo.finalize_stats), score against length (hack/*) and, when there
    is one, the KL."""
    m = reward_summary(roll, reward, parts)
    s = (
        Totals(
            {
                "zero": float(zero_std.sum()),
                "groups": float(len(zero_std)),
                "ent": upd.stats["entropy"],
                "loss": upd.loss,
            }
        )
        .reduce()
        .sums
    )
    m.update({
        "frac_zero_std": s["zero"] / s["groups"],
        "entropy": s["ent"] / upd.tokens if upd.tokens else None,
        "tokens": upd.tokens,
        "loss": s["loss"],
        **grpo.finalize_stats(reduce_stats(upd.stats)),
        **grpo.later_pass_stats(reduce_stats(upd.later)),
    })  # fmt: skip
    # reward hacking: each grader's score against completion length within groups (rewards/diagnostics.py)
    r_rows = [None if x != x else x for x in reward.tolist()]  # NaN: no reward
    hack = hacking_totals(parts, r_rows, roll.lengths.tolist(), len(roll.texts) // len(roll.rows))
    m.update({f"hack/{k}": v for k, v in mean_metrics(Totals(hack).reduce().sums).items()})
    m.update(episode_summary(roll))
    if not has_ref:
        m["kl"] = None  # no reference, no KL: null in metrics.jsonl, not a measured 0
    if kl_pen is not None:
        k = Totals({"k": float(kl_pen.sum()), "rows": float(len(roll.lengths))}).reduce().sums
        m["kl_reward"] = k["k"] / k["rows"]  # per completion, over all ranks
    return m


def count(info: dict, key: str) -> float:
    """info[key] as a count the summary adds up: a finite number >= 0 (not a bool); anything else an
    environment put under that key (a list, text, NaN) counts 0."""
    x = info.get(key)
    ok = isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0
    return float(x) if ok else 0.0


def episode_summary(roll) -> dict:
    """--env: the step's episodes over all ranks: turns and observation tokens per episode, the share
    truncated by a budget (and by the turn budget), the share with an invalid action, and the episodes their
    environment failed (raised, timed out, or a reward that is not finite: no reward); {} without an
    environment. Over the episodes with a reward: a tool environment's calls and parse failures per episode
    and the share with no call (its steps count their calls: info "tool_calls"), and a game's win rate (its
    info says "won")."""
    if getattr(roll, "failed", None) is None:
        return {}
    infos = [s.env_info for s in roll.samples]
    ok = [i for i in infos if not i.get("error")]  # the episodes with a reward
    # observation tokens: inside each trajectory, at mask 0
    obs = float(last_sampled(roll.batch.mask).sum().cpu() - roll.lengths.sum().cpu())
    t = Totals({
        "turns": float(sum(i.get("turns", 0) for i in infos)), "obs": obs,
        "invalid": float(sum(bool(i.get("invalid")) for i in infos)), "failed": float(roll.failed.sum()),
        "trunc": float(roll.truncated.sum()), "n": float(len(infos)), "ok": float(len(ok)),
        "out_of_turns": float(sum(bool(i.get("truncated")) and i["turns"] >= i["max_turns"] for i in infos)),
        "tools": float(sum("tool_calls" in i for i in ok)), "calls": float(sum(count(i, "tool_calls") for i in ok)),
        "parse": float(sum(count(i, "tool_parse_errors") for i in ok)), "no_call": float(sum(not count(i, "tool_calls") for i in ok)),
        "games": float(sum("won" in i for i in ok)), "won": float(sum(i.get("won") is True for i in ok)),
    }).reduce().sums  # fmt: skip
    n, ok_n = t["n"], max(t["ok"], 1.0)
    m = {
        "env/turns": t["turns"] / n, "env/obs_tokens": t["obs"] / n, "env/truncated": t["trunc"] / n,
        "env/truncated_turns": t["out_of_turns"] / n,
        "env/invalid": t["invalid"] / n, "env/failed": t["failed"], "env/failed_frac": t["failed"] / n,
    }  # fmt: skip
    if t["tools"]:  # a tool environment
        m.update({"env/tool_calls": t["calls"] / ok_n, "env/tool_parse_errors": t["parse"] / ok_n,
                  "env/no_tool_call": t["no_call"] / ok_n})  # fmt: skip
    if t["games"]:  # a game that says who won: an episode that ended otherwise (a budget) is not a win
        m["env/win_rate"] = t["won"] / ok_n
    return m


def draw_summary(roll, draw, masked: int | None, cfg) -> dict:
    """What choosing the trained groups cost: groups drawn over all rounds, the informative ones kept, extra
    rounds, the mean reward of everything drawn (with --grpo.dynamic-sampling, dynamic.Draw's; without it the
    step's one round: `draw` None); the seconds sampling and scoring took; and with --grpo.mask-truncated the
    fraction of the step's completions taken out of the loss (`masked`: this rank's count; None: off)."""
    if draw is None:  # one round, the step's own prompts: all of them drawn and trained
        g = cfg.grpo
        valid = ~roll.reward.isnan()  # (N,)
        kept = float(informative_groups(roll.reward, g.group_size, g.zero_spread_tol).sum())
        t = Totals({"kept": kept}).reduce().sums
        drawn = (float(roll.reward[valid].sum()), float(valid.sum()))
        groups_drawn, groups_kept, rounds = cfg.prompts_per_step, int(min(t["kept"], cfg.prompts_per_step)), 0
        t_sample = roll.seconds
    else:
        drawn, t_sample = draw.drawn_reward, draw.t_sample
        groups_drawn, groups_kept, rounds = draw.groups_drawn, draw.groups_kept, draw.rounds
    rows = float(len(roll.texts))
    s = Totals({"r": drawn[0], "n": drawn[1], "masked": float(masked or 0), "rows": rows}).reduce().sums
    m = {
        "groups_drawn": groups_drawn,
        "groups_kept": groups_kept,
        "resample_rounds": rounds,
        "reward_drawn": s["r"] / s["n"] if s["n"] else None,  # reward, entropy, lengths: the trained groups'
    }
    if masked is not None:
        m["frac_masked"] = s["masked"] / s["rows"]
    m.update(t_sample=t_sample, t_score=roll.t_score)
    return m


def sample_groups(
    roll,
    reward: torch.Tensor,
    parts: dict,
    adv: torch.Tensor,
    details: dict,
    trained: torch.Tensor | None = None,
) -> list[dict]:
    """The step's groups for samples.jsonl and the run page: each completion with its scores and advantage.

    What was trained on: `trained` (N,) bool marks the completions in the loss (None: all of them); one left
    out (--grpo.mask-truncated, a step that trained nothing) says "trained": false. An episode's turns each
    say whether they were: the model's turns of a trained episode are, the environment's messages never."""
    G = len(roll.texts) // len(roll.rows)
    groups = []
    for i, r in enumerate(roll.rows):
        comps = []
        for j in range(G):
            k = i * G + j
            c = {
                "text": roll.texts[k],
                "reward": None if reward[k].isnan() else float(reward[k]),
                "scores": {name: vals[k] for name, vals in parts.items()},
                "advantage": float(adv[k]),
                "length": int(roll.lengths[k]),
            }
            on = trained is None or bool(trained[k])
            if not on:
                c["trained"] = False
            if (smp := roll.samples[k]).turns is not None:  # an episode: its transcript, turn by turn
                turns = [{**t, "trained": on and t["role"] == "assistant"} for t in smp.turns[1:]]
                c.update(turns=turns, env_reward=smp.env_reward, env_error=smp.env_info.get("error"))
            for name, vals in details.items():
                if vals[k] is not None:
                    c[name] = vals[k]
            comps.append(c)
        groups.append(
            {
                "id": r.get("id"),
                "prompt": roll.samples[i * G].prompt,
                "reference": r.get("reference"),
                "completions": comps,
            }
        )
    return groups


def grader_metrics(reward_fn) -> dict:
    """The graders' own numbers of the step over all ranks (judge tokens, seconds, retries, ...), as means."""
    return mean_metrics(dist.sum_floats(reward_fn.metrics()))


GAP_BOUND = {True: 1e-6, False: 0.5}
"""sampler_kl per token past which the run says its sampler and trainer disagree, by float32 compute or not."""


class StepNotes:
    """The lines a run prints when a step's numbers say it learns nothing, or less than it could: each once when
    its condition starts (again only after it has ended, and at most once in `gap` steps), after the step's
    line. Read from the logged metrics, over all ranks; the main rank prints them (startup.after_step)."""

    def __init__(self, cfg, env=None, dtype=torch.float32, no_call_steps=3, cut_share=0.2, gap: int = 10):
        self.cfg, self.no_call_steps, self.cut_share, self.gap = cfg, no_call_steps, cut_share, gap
        self.own_turns = env.own_turns if env is not None else 0  # the environment's own (0: not known)
        # sampler_kl per token past which sampler and trainer compute different things: rounding's is ~1e-13
        # in float32; in bf16 the demo's reaches 0.13 (LoRA folded into bf16 weights; under --plain 5e-3)
        self.gap_bound = GAP_BOUND[dtype == torch.float32]
        self.no_call = 0  # steps in a row whose episodes made no tool call
        self.holding: set[str] = set()  # the conditions that hold now (each said when it began)
        self.said: dict[str, int] = {}  # the step each was last said at

    def __call__(self, m: dict) -> list[str]:
        step = m.get("step", 0)
        if "env/no_tool_call" in m:
            self.no_call = self.no_call + 1 if m["env/no_tool_call"] >= 1.0 else 0
        checks = {
            self.entropy_line: bool(m.get("entropy_paused")),
            self.no_call_line: self.no_call >= self.no_call_steps,
            self.cut_line: (m.get("env/truncated") or 0.0) > self.cut_share,
            self.gap_line: (m.get("sampler_kl") or 0.0) > self.gap_bound,
        }
        lines = []
        for line, holds in checks.items():
            name = line.__name__
            if not holds:
                self.holding.discard(name)
            elif name not in self.holding:
                self.holding.add(name)
                if step - self.said.get(name, -self.gap) >= self.gap:
                    self.said[name] = step
                    lines.append(f"note: step {step}: {line(m)}")
        return lines

    def entropy_line(self, m: dict) -> str:
        return (
            "every group's completions scored the same (frac_zero_std 1.00), so the step has no learning "
            f"signal, and the entropy bonus (--grpo.entropy-coef {self.cfg.grpo.entropy_coef:g}) is paused until "
            "a group's rewards differ: alone it would only push the entropy up, into gibberish (entropy_paused "
            "in metrics.jsonl). If it lasts, the task is out of the model's reach: an easier task, a partial-credit "
            "grader, or SFT first"
        )

    def no_call_line(self, m: dict) -> str:
        return (
            f"the episodes of the last {self.no_call} steps made no tool call (env/no_tool_call 1.00): the model "
            "does not use the tools, so nothing it is rewarded for can involve them. A small model needs SFT on "
            "tool-use transcripts first (--algo sft, then --lora.init-from; docs/STAGES.md), or take a larger "
            "model that calls tools already"
        )

    def gap_line(self, m: dict) -> str:
        said = (
            f"the sampler and the trainer disagree far past rounding (sampler_kl {m['sampler_kl']:.1e} a token, "
            f"over {self.gap_bound:g})"
        )
        if self.cfg.plain:
            return (
                f"{said}, although under --plain they run the same code: the sampler's loop (its cache, positions "
                "or masks: nanogrpo/model/sampling.py) does not compute what the model's forward does"
            )
        return (
            f"{said}: the fast sampler (packed weights with LoRA folded, the grouped cache, the kernels) does not "
            "compute what the trainer does, and the run trains on another policy's completions. A change to the "
            "model, LoRA or the sampler that the fast paths do not follow does this: rerun with --plain, which "
            "samples with the code as it reads"
        )

    def cut_line(self, m: dict) -> str:
        e, share, turns = self.cfg.env, m["env/truncated"], m.get("env/truncated_turns") or 0.0
        raise_, own = [], self.own_turns and e.max_turns >= self.own_turns  # turns at the environment's limit
        if turns > 0 and not own:
            raise_.append(f"--env.max-turns (now {e.max_turns}; at most the environment's own max_turns)")
        if share - turns > 1e-9:
            raise_.append(f"--env.max-tokens (now {e.max_tokens}: sampled and observation tokens)")
        x = e.truncated_score
        scores = (
            "the sum of its steps' rewards" if x == -1 else "the lowest reward of the environment's range" if x == 0
            else "the highest reward of the environment's range" if x == 1
            else f"the point {x:g} of the way up the environment's reward range"
        )  # fmt: skip
        fix = f"raise {' and '.join(raise_)}" if raise_ else ""
        if turns > 0 and own:
            limit = (
                f"the environment's own max_turns ({self.own_turns}) ended the episodes that ran out of turns"
            )
            fix = f"{fix}; {limit}" if fix else f"{limit}, which no flag raises: the environment sets it"
        return (
            f"{share:.0%} of the episodes were cut by a budget before the environment was done (env/truncated; "
            f"{turns:.0%} ran out of turns), and each scores {scores} (--env.truncated-score {x:g}): {fix}"
        )
