"""The groups a GRPO step trains: one round of sampling, or DAPO's dynamic sampling (verl's filter_groups).

    draw = draw_step(sample_round, cfg, pad_id, device)   # draw.roll: this rank's share of the trained groups

A group whose rewards have no spread (max - min <= --grpo.zero-spread-tol, or fewer than 2 rewards) has
advantage 0 everywhere: it gives no policy gradient. With --grpo.dynamic-sampling such groups are dropped
and up to --grpo.max-resample-rounds extra rounds each draw P = prompts_per_step fresh prompts from the data
order, until the step holds P informative groups (extra ones are discarded); when the rounds run out, the
earliest groups without spread fill the step up to P. So every step trains exactly P groups.

Under torchrun the rule does not depend on the ranks: every round's P prompts are the same list on every
rank, each rank samples and scores its slice, the ranks share which groups are informative (a small
all-gather), and the trained list is chosen in global order, the same on every rank. The chosen groups then
move to the rank that trains them (an object all-gather of their pieces: `Group`), so each rank trains its
P/world share of the global list, as one process would. Without the flag train.py's grpo_step does not
come here: its step is the one round of its own prompts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from nanogrpo.config import TrainConfig
from nanogrpo.infra import dist
from nanogrpo.model.logprobs import last_sampled
from nanogrpo.rollout import Rollout, assemble


@dataclass
class Group:
    """One prompt's G completions with everything the step needs of them, on the CPU: the form a scored
    Rollout's group takes to move between ranks (plain CPU tensors and lists, cut to the group's longest completion,
    without the device batch that `assemble` rebuilds on arrival)."""

    row: dict  # the data row (with its `_prompt_ids`)
    texts: list[str]  # (G,)
    completion_ids: torch.Tensor  # (G, L) long
    mask: torch.Tensor  # (G, L) float
    sampler_logp: torch.Tensor  # (G, L)
    truncated: torch.Tensor  # (G,) bool
    reward: torch.Tensor  # (G,)
    parts: dict[str, list]  # each grader's (G,) scores
    details: dict[str, list]  # (G,) each
    episodes: tuple | None = None  # --env: (G,) prompt ids, (G,) Samples (their transcripts), (G,) failed


@dataclass
class Draw:
    """The groups a step trains on this rank (its share of the chosen ones, scored) and what drawing them
    cost."""

    roll: Rollout  # the trained groups, with their scores (`t_score`: every round's scoring)
    t_sample: float  # every round's sampling, and the exchange between ranks
    groups_drawn: int  # all rounds, all ranks
    groups_kept: int  # informative groups among the trained ones (at most P)
    rounds: int  # extra rounds of sampling (0: the step's first draw was enough)
    drawn_reward: tuple[float, float]  # this rank's sum and count of valid rewards over everything drawn


def informative_groups(reward: torch.Tensor, G: int, tol: float) -> torch.Tensor:
    """(P,) bool: groups of G consecutive rewards (N,) = (P * G,) with at least 2 valid (not NaN) rewards
    whose max - min is above tol."""
    r = reward.view(-1, G)  # (P, G)
    ok = ~r.isnan()  # (P, G)
    hi = torch.where(ok, r, -torch.inf).amax(1)  # (P,)
    lo = torch.where(ok, r, torch.inf).amin(1)  # (P,)
    return (ok.sum(1) >= 2) & (hi - lo > tol)  # (P,)


def choose_groups(flags: list[list[bool]], P: int) -> list[tuple[int, int]]:
    """The P groups a step trains, as (round, index in the round's global batch), in drawing order: the
    first P informative ones, filled up with the earliest groups without spread when there are fewer."""
    drawn = [(r, j) for r, f in enumerate(flags) for j in range(len(f))]
    kept = [c for c in drawn if flags[c[0]][c[1]]][:P]
    fill = [c for c in drawn if not flags[c[0]][c[1]]][: P - len(kept)]
    return sorted(kept + fill)


def split_groups(roll: Rollout) -> list[Group]:
    """A scored rollout cut into its groups (CPU tensors)."""
    G = len(roll.texts) // len(roll.rows)
    out = []
    for i, row in enumerate(roll.rows):
        sl = slice(i * G, (i + 1) * G)
        # the group's longest completion, to its last sampled token (an episode's observations lie between
        # its turns, and it ends on a turn): the rest is padding
        L = int(last_sampled(roll.batch.mask[sl]).max())
        pieces = (roll.batch.targets, roll.batch.mask, roll.sampler_logp)
        ids, mask, logp = (t[sl, :L].cpu() for t in pieces)  # (G, L)
        trunc, parts = roll.truncated[sl].cpu(), {k: v[sl] for k, v in roll.parts.items()}
        details = {k: v[sl] for k, v in roll.details.items()}
        eps = None
        if roll.failed is not None:  # each trajectory's own prompt and transcript travel with it
            Tp, p_ids, p_attn = roll.batch.prompt_len, roll.batch.ids[sl], roll.batch.attn[sl]
            prompts = [r[:Tp][a[:Tp] > 0].tolist() for r, a in zip(p_ids, p_attn)]
            eps = (prompts, roll.samples[sl], roll.failed[sl].cpu())
        out.append(Group(row, roll.texts[sl], ids, mask, logp, trunc, roll.reward[sl], parts, details, eps))
    return out


def join_groups(groups: list[Group], pad_id: int, device: torch.device) -> Rollout:
    """Groups laid out as one scored rollout again, padded to their longest completion: split_groups'
    inverse."""
    L = max(g.completion_ids.shape[1] for g in groups)
    pad = lambda t, value: F.pad(t, (0, L - t.shape[1]), value=value)
    ids = torch.cat([pad(g.completion_ids, pad_id) for g in groups])  # (N, L)
    mask = torch.cat([pad(g.mask, 0.0) for g in groups])  # (N, L)
    logp = torch.cat([pad(g.sampler_logp, 0.0) for g in groups])  # (N, L)
    texts = [t for g in groups for t in g.texts]
    truncated = torch.cat([g.truncated for g in groups])  # (N,)
    eps = [g.episodes for g in groups] if groups[0].episodes is not None else None
    prompts = [p for e in eps for p in e[0]] if eps else None
    roll = assemble(
        [g.row for g in groups], texts, ids, mask, logp, truncated, pad_id, device, prompt_ids=prompts
    )
    if eps:  # the transcripts back on the Samples, under their new group index
        roll.samples = [replace(smp, group=i) for i, e in enumerate(eps) for smp in e[1]]
        roll.failed = torch.cat([e[2] for e in eps])  # (N,)
    G = len(groups[0].texts)
    gather = lambda name, what: [x for g in groups for x in getattr(g, what).get(name, [None] * G)]
    parts = {k: gather(k, "parts") for k in groups[0].parts}
    details = {k: gather(k, "details") for k in dict.fromkeys(k for g in groups for k in g.details)}
    roll.reward, roll.parts, roll.details = torch.cat([g.reward for g in groups]), parts, details
    return roll


def exchange(own: dict[tuple[int, int], Group], chosen: list[tuple[int, int]]) -> dict:
    """The chosen groups on every rank, each sent by the rank that sampled it (one object all-gather)."""
    out: dict[tuple[int, int], Group] = {}
    for part in dist.gather_objects({c: own[c] for c in chosen if c in own}):
        out.update(part)
    return out


def draw_step(sample_round: Callable[[int], Rollout], cfg: TrainConfig, pad_id: int, device) -> Draw:
    """The groups this rank trains at a step. `sample_round(r)` samples and scores this rank's slice of
    round r's P prompts (round 0: the step's own; later rounds draw fresh ones from the data order)."""
    g, P, rank = cfg.grpo, cfg.prompts_per_step, dist.rank()
    P_local = P // dist.world()
    rounds = 1 + (g.max_resample_rounds if g.dynamic_sampling else 0)  # without the flag: round 0 as drawn
    own: dict[tuple[int, int], Group] = {}  # this rank's groups, by (round, index in the round)
    flags: list[list[bool]] = []  # per round, (P,) informative, in global order
    t_sample = t_score = r_sum = r_n = 0.0
    for r in range(rounds):
        s = sample_round(r)  # this rank's P_local groups of round r
        if r == 0:
            round0 = s  # the step's batch when nothing is dropped
        t_sample, t_score = t_sample + s.seconds, t_score + s.t_score
        valid = ~s.reward.isnan()  # (N,)
        r_sum, r_n = r_sum + float(s.reward[valid].sum()), r_n + float(valid.sum())
        ok = informative_groups(s.reward, g.group_size, g.zero_spread_tol)  # (P_local,)
        flags.append([f for part in dist.gather_objects(ok.tolist()) for f in part])  # (P,)
        if rounds > 1:
            own.update({(r, rank * P_local + i): grp for i, grp in enumerate(split_groups(s))})
        if sum(map(sum, flags)) >= P:
            break
    chosen = choose_groups(flags, P)  # (P,) (round, index): the same list on every rank
    t0 = time.perf_counter()
    if chosen == [(0, j) for j in range(P)]:  # round 0 as drawn: every rank keeps its own groups
        trained = round0
    else:  # every rank takes part in the exchange, since every rank took this branch
        moved = exchange(own, chosen)
        mine = chosen[rank * P_local : (rank + 1) * P_local]  # this rank's share, in global order
        trained = join_groups([moved[c] for c in mine], pad_id, device)
    t_sample += time.perf_counter() - t0
    trained.t_score = t_score
    return Draw(
        trained, t_sample=t_sample, groups_drawn=P * len(flags), groups_kept=min(sum(map(sum, flags)), P),
        rounds=len(flags) - 1, drawn_reward=(r_sum, r_n),
    )  # fmt: skip
