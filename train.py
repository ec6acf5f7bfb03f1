"""nanogrpo: train a language model with GRPO on the CPU, one GPU, or many with torchrun.

    python train.py                       # the demo: SmolLM2-135M-Instruct + LoRA on the built-in task
    python train.py tiny                  # a random tiny model, seconds (what the tests run)
    python train.py --help                # every flag

One step: sample G completions for each of P prompts, score them, turn rewards into group advantages,
then take `num_iterations` optimizer passes over the batch with the clipped surrogate (+ KL) loss. The
loop reads top to bottom, then `grpo_step` and `grpo_update`; what comes before the loop (checks, the model,
--resume) and after a step (its line, a checkpoint) is nanogrpo/startup.py's, and the pieces of a step live in
nanogrpo/ (docs/ARCHITECTURE.md). The other training stages (--algo sft|cpt|dpo|ppo) are step functions in
nanogrpo/stages/, run by the same loop (docs/STAGES.md).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import replace

import torch
import tyro
from tqdm import tqdm

from nanogrpo import grpo
from nanogrpo.config import TrainConfig
from nanogrpo.dynamic import draw_step
from nanogrpo.envs.episode import episode_rollout, failure_causes
from nanogrpo.infra import config_file, dist
from nanogrpo.model.logprobs import Batch, completion_logprobs
from nanogrpo.optim import Update, accumulate_stats, in_slices, micro_slices, step_counts
from nanogrpo.recipes.presets import PRESETS, cli_help
from nanogrpo.rollout import Rollout, loss_rows, rollout
from nanogrpo.stages import Run, step_function
from nanogrpo.startup import NonFiniteStep, after_step, check_flags, finish, start
from nanogrpo.summary import (
    draw_summary,
    episode_summary,
    grader_metrics,
    grpo_summary,
    reward_summary,
    sample_groups,
)


def main(cfg: TrainConfig) -> dict:
    run = start(cfg)  # every check before the model loads, then the model, the optimizer, --resume
    cfg, rank, P = run.cfg, dist.rank(), run.cfg.prompts_per_step
    P_local = P // dist.world()
    step_fn = grpo_step if cfg.algo == "grpo" else step_function(cfg.algo)  # SFT, CPT, DPO, PPO: stages/
    bar = tqdm(range(run.step0, cfg.steps), initial=run.step0, total=cfg.steps, disable=not dist.is_main(), dynamic_ncols=True)  # fmt: skip
    for step in bar:
        t0 = time.perf_counter()
        # every rank draws the same global prompt list and keeps its own slice: whole groups stay on one rank
        idx = run.order.take(P)[rank * P_local : (rank + 1) * P_local]
        lr = run.sched.get_last_lr()[0]  # the lr of this step's (first) optimizer step, not the next one's
        m = step_fn(run, step, [run.data[i] for i in idx], rank * P_local)
        # ---------------------------------------------------------------- machinery: log, print, save
        m["lr"] = lr
        t_step = time.perf_counter() - t0
        m.update(t_step=t_step, tok_per_s=m["tokens"] / max(t_step, 1e-9))
        m.update(run.evaluator(step + 1))  # {} unless --eval-every is due; logged in this step's line
        run.logger.log(m)
        after_step(run, step, m, bar)  # a non-finite step stops the run; the line; a checkpoint when due
    bar.close()
    return finish(run)  # the adapter or model, plots, final eval, run page


def grpo_step(run: Run, step: int, rows: list[dict], first: int) -> dict:
    """One GRPO step on this rank's prompts (`first`: the index of rows[0] in the step's global batch)."""
    cfg, policy, g = run.cfg, run.policy, run.cfg.grpo
    draw = None  # 1-2. G completions of each prompt (or episodes), scored: this rank's groups
    if g.dynamic_sampling:  # DAPO: rounds of fresh prompts until P groups have spread (nanogrpo/dynamic.py)
        draw = draw_step(lambda r: sample_round(run, step, r, rows, first), cfg, policy.pad_id, run.device)
    roll = draw.roll if draw else sample_round(run, step, 0, rows, first)
    reward, parts = roll.reward, roll.parts  # reward (N,): NaN where no grader applied
    n_valid = dist.sum_floats({"n": float((~reward.isnan()).sum())})["n"]
    # --reward.max-empty-steps in a row without a reward: stop, naming what failed the episodes most often
    run.reward_fn.empty_steps.update(n_valid, failure_causes(roll) if run.env is not None else None)
    if n_valid == 0:  # every episode failed, or no grader scored a completion: nothing to learn from
        return empty_step(run, step, roll, draw)
    t2 = time.perf_counter()
    temp, micro = cfg.sampling.temperature, cfg.micro_batch
    ref_logp = kl_pen = None  # 3. the reference, and the KL in the reward (both sides on the trainer's path)
    if g.kl_placement != "none":
        ref_logp = in_slices(lambda b: policy.reference_logprobs(b, temp), roll.batch, micro)  # (N, Tc)
    score = reward  # (N,) NaN where no grader applied: such rows are left out of their group
    if g.kl_placement == "reward":
        pi_logp = in_slices(lambda b: policy.trainer_logprobs(b, temp), roll.batch, micro)  # (N, Tc)
        kl_pen = grpo.kl_penalty(pi_logp, ref_logp, roll.batch.mask, g).cpu()  # (N,)
        score = reward - g.beta * kl_pen  # (N,)
    moments = dist.sum_floats(grpo.reward_moments(score)) if g.scale_rewards == "batch" else None  # all ranks
    adv, zero_std = grpo.compute_advantages(score, g, moments)  # 4. advantages: (N,), (P,)
    # no group of the step (on any rank) has reward spread: no signal, and the entropy bonus alone would only
    # push the entropy up, step after step: it is paused until a group's rewards differ
    paused = g.entropy_coef > 0 and dist.sum_floats({"n": float((~zero_std).sum())})["n"] == 0
    # 5. the loss's rows: all, or --grpo.mask-truncated: not the truncated ones (their rewards counted above)
    batch, adv_b, ref_b, sampler_b, masked = loss_rows(roll, adv.to(run.device), ref_logp, g.mask_truncated)
    step_cfg = replace(cfg, grpo=replace(g, entropy_coef=0.0)) if paused else cfg
    upd = grpo_update(policy, run.opt, run.sched, batch, adv_b, ref_b, sampler_b, step_cfg)  # 6. the passes
    # ---------------------------------------------------------------- machinery: the step's numbers, samples
    m = {"step": step + 1, **grpo_summary(roll, reward, parts, zero_std, upd, kl_pen, ref_logp is not None)}
    if g.entropy_coef > 0:  # a paused bonus: 0, and said (StepNotes)
        m.update(entropy_bonus=m.get("entropy_bonus", 0.0), entropy_paused=float(paused))
    m.update(draw_summary(roll, draw, masked if g.mask_truncated else None, cfg))  # groups drawn and kept
    m.update(grader_metrics(run.reward_fn))  # judge tokens, seconds, retries, ...
    m.update(grad_norm=upd.grad_norm, t_train=time.perf_counter() - t2)
    if dist.is_main() and cfg.log_samples_every and (step + 1) % cfg.log_samples_every == 0:
        trained = ~roll.truncated if masked else None  # --grpo.mask-truncated: the rows left out are marked
        run.logger.log_samples(step + 1, sample_groups(roll, reward, parts, adv, roll.details, trained))
    return m


def grpo_update(policy, opt, sched, batch: Batch, adv, ref_logp, sampler_logp, cfg: TrainConfig) -> Update:
    """--grpo.num-iterations passes over the batch (adv (N,), ref_logp (N, Tc) or None, sampler_logp (N, Tc)),
    each its micro-batches' losses backward, then one clipped optimizer step; passes after the first are
    off-policy. Each micro-batch's loss is normalised by the step's counts on all ranks, so micro-batches and
    ranks add up to the full batch's. pi_old is the first pass's own log-probs (the weights the samples came
    from); the sampler's are logged against them (and, with --grpo.is-correction, corrected for)."""
    g, temp = cfg.grpo, cfg.sampling.temperature
    counts = step_counts(batch)  # seqs, tokens of the step on all ranks
    keep = entropy_mask(policy, batch, cfg) if g.top_entropy_quantile < 1 else None  # (N, Tc) or None
    old_logp = torch.zeros_like(sampler_logp)  # (N, Tc) pi_old, filled by the first pass
    slices = micro_slices(len(batch), cfg.micro_batch)
    stats: list[dict | None] = [None, None]  # stat sums of the first pass, of the later (off-policy) ones
    loss_sum = grad_norm = 0.0
    policy.model.train()
    for it in range(g.num_iterations):
        for k, sl in enumerate(slices):
            mb = batch.rows(sl)
            with policy.no_sync(last=k == len(slices) - 1):  # DDP: one all-reduce per pass
                logp, ent = completion_logprobs(policy.model, mb, temp, policy.autocast, g.entropy_coef != 0)
                if it == 0:  # pi_old: the first pass runs the weights the samples came from
                    old_logp[sl] = logp.detach()
                loss, s = grpo.grpo_loss(
                    logp, old_logp[sl], None if ref_logp is None else ref_logp[sl], adv[sl], mb.mask, g,
                    num_seqs=counts["seqs"], num_tokens=counts["tokens"], max_len=cfg.completion_tokens,
                    sampler_logp=sampler_logp[sl], entropy=ent, keep=None if keep is None else keep[sl],
                )  # fmt: skip
                policy.backward(loss)  # x world: the gradient is the sum over ranks
            s["entropy"] = (ent.detach() * mb.mask).sum()  # logged for the first pass
            stats[it > 0] = accumulate_stats(stats[it > 0], s)
            loss_sum += float(loss.detach()) if it == 0 else 0.0
        grad_norm = policy.step(opt, sched, cfg.optim.grad_clip)  # clip, step, schedule, zero
    return Update(counts["seqs"], counts["tokens"], stats[0], stats[1], loss_sum, grad_norm)


def entropy_mask(policy, batch: Batch, cfg: TrainConfig) -> torch.Tensor:
    """keep (N, Tc) bool: the tokens whose entropy under pi_old is at or above the (1 - q) quantile of the
    step's tokens on ALL ranks, q = --grpo.top-entropy-quantile (Wang et al. 2025).

    One no-grad forward (dropout off) in the step's micro-batches before the update; the mask then holds for
    every --grpo.num-iterations pass (the paper recomputes it each update, from the live policy)."""
    ent = in_slices(lambda b: policy.trainer_entropy(b, cfg.sampling.temperature), batch, cfg.micro_batch)
    pool = torch.cat(dist.gather_objects(ent[batch.mask > 0].cpu()))  # (tokens of the step,) every rank's
    threshold = grpo.entropy_threshold(pool, cfg.grpo.top_entropy_quantile)
    return grpo.high_entropy_tokens(ent, batch.mask, threshold)  # (N, Tc)


def sample_round(run: Run, step: int, r: int, rows: list[dict], first: int) -> Rollout:
    """Round r of a step's sampling on this rank, scored: round 0 samples the step's prompts; a later round
    (--grpo.dynamic-sampling) draws P fresh prompts from the data order, the same list on every rank, and
    samples this rank's slice of them (the order is checkpointed, so a resumed run draws the same)."""
    if r > 0:
        idx = run.order.take(run.cfg.prompts_per_step)[first : first + len(rows)]
        rows = [run.data[i] for i in idx]
    if run.env is None:  # 1. G completions of each prompt, or (--env) G episodes
        roll = rollout(run.policy, rows, step, first, run.cfg, run.device, resample=r)
    else:
        roll = episode_rollout(run.policy, rows, step, first, run.cfg, run.device, run.env, resample=r)
    t1 = time.perf_counter()
    rewards, roll.parts = run.reward_fn(roll.samples)  # 2. score: a score per completion, or None
    roll.reward = torch.tensor([float("nan") if x is None else x for x in rewards])  # (N,)
    if roll.failed is not None:  # an episode its environment failed has no reward
        roll.reward[roll.failed] = float("nan")
    roll.details, roll.t_score = run.reward_fn.details(), time.perf_counter() - t1
    return roll


def empty_step(run: Run, step: int, roll: Rollout, draw) -> dict:
    """A GRPO step in which no completion has a reward: logged (rewards, lengths, the episodes' failures),
    and no update is made (no optimizer or schedule step): the run goes on with the next batch."""
    m = {"step": step + 1, **reward_summary(roll, roll.reward, roll.parts), **episode_summary(roll)}
    m.update(draw_summary(roll, draw, None, run.cfg), tokens=0, loss=None)
    m.update(grader_metrics(run.reward_fn))
    cfg = run.cfg
    if dist.is_main() and cfg.log_samples_every and (step + 1) % cfg.log_samples_every == 0:
        adv, none = (
            torch.zeros(len(roll.texts)),
            torch.zeros(len(roll.texts), dtype=torch.bool),
        )  # nothing trained
        run.logger.log_samples(
            step + 1, sample_groups(roll, roll.reward, roll.parts, adv, roll.details, none)
        )
    return m


def cli(argv: list[str] | None = None) -> TrainConfig:
    """`train.py [PRESET] [--flags]`: the preset (default 'demo') sets the defaults that flags override.

    With --resume the defaults are the run's own config.json instead, so flags name only what changes; with
    --config FILE they are FILE (a run's config.json, or any TrainConfig JSON) for a new run in a folder of
    its own (startup.check_flags)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    name = argv.pop(0) if argv and argv[0] in PRESETS else None
    config = config_file.pop_config_flag(argv)
    default = PRESETS[name or "demo"][1] if config is None else config_file.rerun_defaults(config, name)
    parse = lambda d: tyro.cli(TrainConfig, default=d, args=argv, description=cli_help(name))  # noqa: E731
    return check_flags(parse(default), parse, argv, name, config)  # --config's folder, --resume's config, ...


def run(argv: list[str] | None = None) -> int:
    """`python train.py ARGS`: 0 when the run ends; a bad flag or bad data (2), or a non-finite step (3), is
    one line on stderr that says what to fix (NANOGRPO_DEBUG=1: the traceback instead)."""
    try:
        main(cli(argv))
    except (ValueError, NonFiniteStep) as e:
        if os.environ.get("NANOGRPO_DEBUG"):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 3 if isinstance(e, NonFiniteStep) else 2  # 2: bad flags or data, before training
    return 0


if __name__ == "__main__":
    sys.exit(run())
