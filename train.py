"""nanogrpo: train a language model with GRPO on the CPU, one GPU, or many with torchrun.

    python train.py                       # the demo: SmolLM2-135M-Instruct + LoRA on the built-in task
    python train.py tiny                  # a random tiny model, seconds (what the tests run)
    python train.py --help                # every flag

One step: sample G completions for each of P prompts, score them, turn rewards into group advantages,
then take `num_iterations` optimizer passes over the batch with the clipped surrogate (+ KL) loss. The
loop reads top to bottom; the pieces live in nanogrpo/ (docs/ARCHITECTURE.md). The other training stages
(--algo sft|cpt|dpo|ppo) are step functions in nanogrpo/stages/, run by the same loop (docs/STAGES.md).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
import tyro
from tqdm import tqdm

from nanogrpo import grpo, kl
from nanogrpo.config import TrainConfig, updates_per_step, with_epochs
from nanogrpo.data import PromptOrder, check_sft_rows, column_map, load_task, tokenize_prompts
from nanogrpo.dynamic import Scored, draw_step
from nanogrpo.envs import spec as env_spec
from nanogrpo.envs.episode import episode_rollout, failure_causes
from nanogrpo.eval.during import HeldOutEval, check_eval_every, final_eval, held_out_source
from nanogrpo.eval.report import write_report
from nanogrpo.infra import checkpoint as ckpt
from nanogrpo.infra import dist
from nanogrpo.infra.config_file import check_rerun_dir, load_config, pop_config_flag, read_config
from nanogrpo.infra.device import resolve_device_dtype, seed_everything
from nanogrpo.infra.flag_checks import check_config
from nanogrpo.infra.heap import keep_freed_memory
from nanogrpo.infra.metrics import Logger, console_line, fsync_path, step_line
from nanogrpo.infra.provenance import write_environment
from nanogrpo.infra.run_dir import (
    check_resume,
    check_run_record,
    prepare_run_dir,
    release_run_dir,
    started_record,
)
from nanogrpo.model import judge_backend
from nanogrpo.model.attention import check_flash
from nanogrpo.model.logprobs import Batch, completion_logprobs
from nanogrpo.model.memory_fit import fit_to_memory
from nanogrpo.model.static_decode import check_decode
from nanogrpo.optim import Update, build_optimizer, build_scheduler, in_slices, step_counts, update
from nanogrpo.policy import load_policy, prompt_budget, prompt_limit
from nanogrpo.recipes.presets import PRESETS
from nanogrpo.rollout import loss_rows, rollout
from nanogrpo.stages import Run, cpt, dpo, ppo, sft
from nanogrpo.summary import draw_summary, episode_summary, grpo_summary, reward_summary, sample_groups
from rewards import RewardFunction, build_reward, mean_metrics
from rewards.judge import with_run_dir
from rewards.options import with_max_tokens


def main(cfg: TrainConfig) -> dict:
    # ---------------------------------------------------------------- checks that need no model
    check_config(cfg)  # the flags among themselves
    check_eval_every(cfg)  # --eval-every: the held-out rows exist
    cfg = replace(cfg, out_dir=os.path.abspath(cfg.out_dir))  # the run folder, whatever changes the directory
    cfg, env = env_spec.resolve(cfg)  # --env: the environment, one instance built and checked; its budgets
    if cfg.model.attn == "flash":  # flash-attn imports, and the run is on a GPU in 16 bits
        check_flash(cfg.model.device, cfg.model.dtype)
    Logger.check_packages(cfg.wandb, cfg.tensorboard)  # --wandb / --tensorboard without their package
    device, dtype = resolve_device_dtype(cfg.model)
    if device.type == "cpu":  # glibc: a step's freed blocks serve the next step (nanogrpo/infra/heap.py)
        keep_freed_memory()
    dist.init(device.type)
    rank, world = dist.rank(), dist.world()
    check_decode(cfg.sampling.decode, device, dist.parallel_mode(cfg), cfg.model.path)  # graph: CUDA, no FSDP
    if cfg.prompts_per_step % world:
        raise ValueError(f"--prompts-per-step {cfg.prompts_per_step} must be a multiple of the {world} ranks")
    rows, tok, reward_fn, held_out = training_data(cfg)  # read, checked and tokenized before the model loads
    if env is not None:  # --env: the template, a reset on the first row and its first message; the workers
        episodes = (
            cfg.prompts_per_step // world * cfg.grpo.group_size
        )  # a rollout's, forked while we are small
        env = env_spec.check_start(env, tok, rows, cfg.data.system_prompt, *prompt_limit(cfg), episodes, cfg.sampling.decode)  # fmt: skip
    cfg = with_epochs(cfg, len(rows))  # --epochs: the number of steps
    cfg = fit_to_memory(cfg, device, dtype, rows)  # --memory-check: the plan against the free memory
    out = Path(cfg.out_dir)
    # every rank checks the folder (--resume: the saved config; else: no run there yet), one saves config.json
    prepare_run_dir(cfg, write=dist.is_main())
    if dist.is_main():  # environment.json: the resolved device and dtype, versions, git commit, CPU
        write_environment(out, device, dtype, resume=cfg.resume)
    seed_everything(cfg.seed + rank)

    # ---------------------------------------------------------------- model, tokenizer, optimizer
    policy = load_policy(cfg, device, dtype, tok)
    if world > 1 and dist.is_main():
        how = "sharded with FSDP2" if policy.fsdp else "replicated with DDP"
        print(f"torchrun: {world} ranks, the policy {how}")
    opt = build_optimizer(policy.model, cfg.optim)
    sched = build_scheduler(opt, cfg.optim, cfg.steps * updates_per_step(cfg))
    order = PromptOrder(len(rows), cfg.seed, cfg.data.shuffle)
    logger = Logger(
        out, enabled=dist.is_main(), wandb_project=cfg.wandb, tensorboard=cfg.tensorboard, config=asdict(cfg)
    )
    step0 = resume(cfg, policy, opt, sched, order, logger) if cfg.resume else 0  # --resume: its step

    run = Run(cfg, policy, opt, sched, reward_fn, logger, device, order, rows, env)
    evaluator = HeldOutEval(
        cfg, policy, device, held_out, env
    )  # --eval-every: held-out scores (eval/during.py)
    evaluator.start(logger, step0)  # step 0, before any update: a metrics.jsonl line of its own
    step_fn = STAGES[cfg.algo]  # a training stage is a step function (nanogrpo/stages/)
    P_local = cfg.prompts_per_step // world
    bar = tqdm(range(step0, cfg.steps), initial=step0, total=cfg.steps, disable=not dist.is_main(), dynamic_ncols=True)  # fmt: skip
    for step in bar:
        t0 = time.perf_counter()
        # every rank draws the same global prompt list and keeps its own slice: whole groups stay on one rank
        idx = order.take(cfg.prompts_per_step)[rank * P_local : (rank + 1) * P_local]
        lr = sched.get_last_lr()[0]  # the lr of this step's (first) optimizer step, not the next one's
        m = step_fn(run, step, [rows[i] for i in idx], rank * P_local)
        m["lr"] = lr
        t_step = time.perf_counter() - t0
        m.update(t_step=t_step, tok_per_s=m["tokens"] / max(t_step, 1e-9))
        m.update(evaluator(step + 1))  # {} unless --eval-every is due; logged in this step's line
        logger.log(m)
        if bad := {
            k: m[k] for k in ("loss", "grad_norm") if m.get(k) is not None and not math.isfinite(m[k])
        }:
            logger.close()
            release_run_dir(out)
            raise NonFiniteStep(step + 1, bad, ckpt.latest_checkpoint(out / "ckpt"))
        if dist.is_main():
            line = console_line(m)
            bar.set_postfix_str(line.split(" | ")[1])  # the reward (or the SFT loss)
            tqdm.write(line)
        if (cfg.save_every and (step + 1) % cfg.save_every == 0) or step + 1 == cfg.steps:
            _save(policy, out, step + 1, opt, sched, order)
    bar.close()

    return finish(cfg, policy, logger, held_out, env)  # the adapter or model, plots, final eval, run page


def resume(cfg: TrainConfig, policy, opt, sched, order: PromptOrder, logger: Logger) -> int:
    """--resume: the run's state back from its newest complete checkpoint (the weights, the optimizer, the
    schedule, the data order, every rank's RNG) and its logs cut back to that step; returns the step."""
    out, rank, world = Path(cfg.out_dir), dist.rank(), dist.world()
    step0 = 0
    # the newest complete checkpoint, whatever ckpt/latest says: a damaged one is passed over, by name
    point = ckpt.find_resume_point(out / "ckpt")
    if point.path is not None:
        state = point.state
        policy.load_checkpoint(point.path, opt, state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        order.load_state_dict(state["data"])
        ckpt.set_rng_state(state["rng_all"][rank] if world == len(state["rng_all"]) else state["rng"])
        step0 = state["step"]
        # what it was trained with against config.json and the data now (nanogrpo/infra/run_dir.py)
        point.notes.extend(check_run_record(state.get("run"), cfg, point.path))
    # steps logged after it will run again: dropped (with a torn last line), so none appears twice
    dropped = ", ".join(f"{name} {k}" for name, k in logger.truncate_after(step0).items() if k)
    # the checkpoint's own copy of its step's line, if the log lost it (torn, or not yet on the disk)
    if point.path is not None and logger.restore_line(step0, point.state.get("metrics_line")):
        point.notes.append(
            f"metrics.jsonl's line of step {step0} was torn or lost: restored from {point.path}"
        )
    if dist.is_main():
        for note in point.notes:
            print(f"note: {note}")
        cut = f"; logs cut back to it (lines dropped: {dropped})" if dropped else ""
        if point.path is not None:
            print(f"resumed from {point.path} at step {step0}{cut}")
        else:  # the run died before its first checkpoint: its logged steps will be run again
            print(f"no complete checkpoint in {out / 'ckpt'} yet: starting again from step 0{cut}")
    return step0


def finish(
    cfg: TrainConfig, policy, logger: Logger, held_out: tuple[list[dict], str] | None, env=None
) -> dict:
    """The end of a run: the final adapter (or model), the held-out eval, the plots and the run page, and
    summary.json; then the logs closed and the folder's lock released."""
    out = Path(cfg.out_dir)
    summary: dict = {"steps": cfg.steps, "out_dir": str(out)}
    policy.save_final(out / ("adapter" if cfg.lora.r > 0 else "model"))  # every rank: FSDP gathers
    if cfg.eval_prompts > 0 and dist.is_main():
        summary["eval"] = final_eval(cfg, policy, out, held_out, env)
    if dist.is_main():
        if cfg.plots:
            write_report(out)  # the PNGs (nanogrpo/infra/plots.py) and index.html, which embeds them
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    logger.close()
    release_run_dir(out)  # the folder's lock (nanogrpo/infra/run_dir.py)
    if env is not None:  # --env: the worker processes (on an error, they go at exit)
        env.workers.close()
    dist.shutdown()
    return summary


class NonFiniteStep(RuntimeError):
    """A step whose loss or gradient norm is not finite: the weights it stepped to are not saved, the run
    stops (train.py exits 3), and the last checkpoint on disk is one of finite weights."""

    def __init__(self, step: int, bad: dict, last: Path | None):
        what = ", ".join(f"{k} {v}" for k, v in bad.items())
        kept = (
            f"the last checkpoint, {last}, holds finite weights" if last else "no checkpoint was written yet"
        )
        super().__init__(
            f"step {step}: {what} is not finite, so the run stops before saving it; {kept}. Look at this "
            "step in metrics.jsonl (rewards out of range? a learning rate too high?), then --resume or start again"
        )


def training_data(
    cfg: TrainConfig,
) -> tuple[list[dict], object, RewardFunction | None, tuple[list[dict], str] | None]:
    """The training rows (CPT: windows of the text), the tokenizer, for GRPO and PPO the reward, and the
    held-out rows with their source (None without any); every row checked, naming file and line, and every
    prompt tokenized, before any model loads."""
    judge_backend.register()  # a local judge model runs on nanogrpo's model and sampler
    # the held-out rows are read once, now: a bad or missing --data.eval must not wait for the run's end, and
    # the evaluations during training and at its end score the rows checked here, whatever the file becomes
    eval_source = held_out_source(cfg)  # --data.eval, or the demo task's held-out split
    held_out = load_task(eval_source, "eval", column_map(cfg.data)) if eval_source else None
    if cfg.algo == "cpt":
        tok = prompt_budget(cfg)[0]
        return cpt.load_windows(cfg.data, tok), tok, None, held_out
    rows, source = load_task(cfg.data.train, "train", column_map(cfg.data))  # --data.*-field: renamed columns
    reward_fn = None
    if cfg.algo in ("grpo", "ppo"):
        # a judge keeps its cache in the run folder, so a resumed run does not pay twice
        # the overlong grader's limit defaults to --sampling.max-new-tokens
        reward_cfg = with_max_tokens(with_run_dir(cfg.reward, cfg.out_dir), cfg.completion_tokens)
        reward_fn = build_reward(reward_cfg)
        reward_fn.validate(rows, source)
        if held_out is not None and cfg.eval_prompts > 0:  # the final eval scores it with these graders
            reward_fn.validate(held_out[0][: cfg.eval_prompts], held_out[1])
    elif cfg.algo == "dpo":
        dpo.check_rows(rows, source)  # chosen/rejected, or options + answer
    else:
        check_sft_rows(rows, cfg.data.template, source)  # the target: --data.template, or the reference
    tok, limit = prompt_budget(cfg)  # the prompts are tokenized once, here, and checked against the model
    if n_cut := tokenize_prompts(rows, tok, cfg.data.system_prompt, limit, cfg.data.long_prompts, source):
        if dist.is_main():
            print(
                f"{n_cut} prompts of {source} cut to their last {limit} tokens (--data.long-prompts truncate)"
            )
    return rows, tok, reward_fn, held_out


def grpo_step(run: Run, step: int, rows: list[dict], first: int) -> dict:
    """One GRPO step on this rank's prompts (`first`: the index of rows[0] in the step's global batch)."""
    cfg, policy, g = run.cfg, run.policy, run.cfg.grpo
    # 1-2. sample G completions per prompt and score them; --grpo.dynamic-sampling: rounds of fresh prompts
    # until P groups have spread (nanogrpo/dynamic.py). roll: this rank's share of the groups that train
    draw = draw_step(lambda r: sample_round(run, step, r, rows, first), cfg, policy.pad_id, run.device)
    roll, reward, parts = draw.roll, draw.reward, draw.parts  # reward (N,): NaN where no grader applied
    n_valid = dist.sum_floats({"n": float((~reward.isnan()).sum())})["n"]
    # --reward.max-empty-steps in a row without a reward: stop, naming what failed the episodes most often
    run.reward_fn.empty_steps.update(n_valid, failure_causes(roll) if run.env is not None else None)
    if n_valid == 0:  # every episode failed, or no grader scored a completion: nothing to learn from
        return empty_step(run, step, draw)
    t2 = time.perf_counter()
    temp, micro = cfg.sampling.temperature, cfg.micro_batch
    ref_logp = kl_pen = None  # 3. the reference, and the KL in the reward (both sides on the trainer's path)
    if g.kl_placement != "none":
        ref_logp = in_slices(lambda b: policy.reference_logprobs(b, temp), roll.batch, micro)  # (N, Tc)
    score = reward  # (N,) NaN where no grader applied: such rows are left out of their group
    if g.kl_placement == "reward":
        pi_logp = in_slices(lambda b: policy.trainer_logprobs(b, temp), roll.batch, micro)  # (N, Tc)
        kl_pen = kl.kl_penalty(pi_logp, ref_logp, roll.batch.mask, g).cpu()  # (N,)
        score = reward - g.beta * kl_pen  # (N,)
    moments = dist.sum_floats(grpo.reward_moments(score)) if g.scale_rewards == "batch" else None  # all ranks
    adv, zero_std = grpo.compute_advantages(score, g, moments)  # 4. advantages: (N,), (P,)
    # 5. the loss's rows: all, or --grpo.mask-truncated: not the truncated ones (their rewards counted above)
    batch, adv_b, ref_b, sampler_b, masked = loss_rows(roll, adv.to(run.device), ref_logp, g.mask_truncated)
    upd = grpo_update(policy, run.opt, run.sched, batch, adv_b, ref_b, sampler_b, cfg)  # 6. the passes
    m = {"step": step + 1, **grpo_summary(roll, reward, parts, zero_std, upd, kl_pen, ref_logp is not None)}
    m.update(draw_summary(draw, masked if g.mask_truncated else None))  # groups drawn and kept, rounds
    m.update(t_sample=draw.t_sample, t_score=draw.t_score)
    m.update(mean_metrics(dist.sum_floats(run.reward_fn.metrics())))  # judge tokens, seconds, retries, ...
    m.update(grad_norm=upd.grad_norm, t_train=time.perf_counter() - t2)
    if dist.is_main() and cfg.log_samples_every and (step + 1) % cfg.log_samples_every == 0:
        run.logger.log_samples(step + 1, sample_groups(roll, reward, parts, adv, draw.details))
    return m


def empty_step(run: Run, step: int, draw) -> dict:
    """A GRPO step in which no completion has a reward: logged (rewards, lengths, the episodes' failures),
    and no update is made (no optimizer or schedule step): the run goes on with the next batch."""
    roll, reward, parts = draw.roll, draw.reward, draw.parts
    m = {"step": step + 1, **reward_summary(roll, reward, parts), **episode_summary(roll)}
    m.update(draw_summary(draw, None), t_sample=draw.t_sample, t_score=draw.t_score, tokens=0, loss=None)
    m.update(mean_metrics(dist.sum_floats(run.reward_fn.metrics())))
    cfg = run.cfg
    if dist.is_main() and cfg.log_samples_every and (step + 1) % cfg.log_samples_every == 0:
        adv = torch.zeros(len(roll.texts))  # (N,) nothing trained
        run.logger.log_samples(step + 1, sample_groups(roll, reward, parts, adv, draw.details))
    return m


def grpo_update(
    policy,
    opt,
    sched,
    batch: Batch,
    adv: torch.Tensor,
    ref_logp,
    sampler_logp: torch.Tensor,
    cfg: TrainConfig,
) -> Update:
    """--grpo.num-iterations passes of the GRPO loss over the batch, each ended by an optimizer step (optim.update:
    the micro-batches, backward, clip, step); passes after the first are off-policy.

    The loss is normalised by the step's counts summed over all ranks, so the sum over micro-batches and
    ranks is the full-batch loss. pi_old is the first pass's own log-probs (the weights the samples came
    from), not the sampler's: the sampler's go in as `sampler_logp`, to log the gap and, with
    --grpo.is-correction, to correct it. --grpo.entropy-coef makes the entropy differentiable;
    --grpo.top-entropy-quantile picks the tokens that keep the policy gradient first (entropy_mask)."""
    g, temp = cfg.grpo, cfg.sampling.temperature
    counts = step_counts(batch)  # seqs, tokens of the step on all ranks
    keep = entropy_mask(policy, batch, cfg) if g.top_entropy_quantile < 1 else None  # (N, Tc)
    old_logp = torch.zeros_like(sampler_logp)  # (N, Tc) the trainer's log-probs before the update

    def loss_fn(it: int, sl: slice, mb: Batch) -> tuple[torch.Tensor, dict]:
        logp, ent = completion_logprobs(
            policy.model, mb, temp, policy.autocast, entropy_grad=g.entropy_coef != 0
        )  # (n, Tc), (n, Tc)
        if it == 0:  # pi_old: the first pass runs the weights the samples came from
            old_logp[sl] = logp.detach()
        loss, stats = grpo.grpo_loss(
            logp, old_logp[sl], None if ref_logp is None else ref_logp[sl], adv[sl], mb.mask, g,
            num_seqs=counts["seqs"], num_tokens=counts["tokens"], max_len=cfg.completion_tokens,
            sampler_logp=sampler_logp[sl], entropy=ent, keep=None if keep is None else keep[sl],
        )  # fmt: skip
        stats["entropy"] = (ent.detach() * mb.mask).sum()  # logged for the first pass
        return loss, stats

    return update(
        policy, opt, sched, batch, counts, loss_fn,
        passes=g.num_iterations, micro=cfg.micro_batch, grad_clip=cfg.optim.grad_clip,
    )  # fmt: skip


def entropy_mask(policy, batch: Batch, cfg: TrainConfig) -> torch.Tensor:
    """keep (N, Tc) bool: the tokens whose entropy under pi_old is at or above the (1 - q) quantile of the
    step's tokens on ALL ranks, q = --grpo.top-entropy-quantile (Wang et al. 2025).

    One no-grad forward (dropout off) in the step's micro-batches before the update; the mask then holds for
    every --grpo.num-iterations pass (the paper recomputes it each update, from the live policy)."""
    ent = in_slices(lambda b: policy.trainer_entropy(b, cfg.sampling.temperature), batch, cfg.micro_batch)
    pool = torch.cat(dist.gather_objects(ent[batch.mask > 0].cpu()))  # (tokens of the step,) every rank's
    threshold = grpo.entropy_threshold(pool, cfg.grpo.top_entropy_quantile)
    return grpo.high_entropy_tokens(ent, batch.mask, threshold)  # (N, Tc)


def sample_round(run: Run, step: int, r: int, rows: list[dict], first: int) -> Scored:
    """Round r of a step's sampling on this rank: round 0 samples the step's prompts; a later round
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
    rewards, parts = run.reward_fn(roll.samples)  # 2. score: a score per completion, or None
    reward = torch.tensor([float("nan") if x is None else x for x in rewards])  # (N,)
    if roll.failed is not None:  # an episode its environment failed has no reward
        reward[roll.failed] = float("nan")
    return Scored(roll, reward, parts, run.reward_fn.details(), time.perf_counter() - t1)


STAGES = {"grpo": grpo_step, "sft": sft.step, "cpt": cpt.step, "dpo": dpo.step, "ppo": ppo.step}


def _save(policy, out: Path, step: int, opt, sched, order: PromptOrder) -> None:
    rngs = dist.gather_objects(ckpt.rng_state())  # every rank restores its own dropout/sampling RNG
    save_weights, opt_state = policy.checkpoint_parts(opt)  # every rank: FSDP gathers to rank 0
    if dist.is_main():
        for log in ("metrics.jsonl", "samples.jsonl"):  # the logs up to this step are on the disk before it
            if (out / log).is_file():
                fsync_path(out / log)
        extra = {"data": order.state_dict(), "rng_all": rngs}
        # what the run trains with (config and data fingerprints: checked on --resume), and the step's log
        # line, which --resume restores if a crash tore it
        extra.update(run=started_record(out), metrics_line=step_line(out / "metrics.jsonl", step))
        ckpt.save_checkpoint(out / "ckpt", step, save_weights, opt_state, sched, extra)
    dist.barrier()


def cli(argv: list[str] | None = None) -> TrainConfig:
    """`train.py [PRESET] [--flags]`: the preset (default 'demo') sets the defaults that flags override.

    With --resume the defaults are the run's own config.json instead, so flags name only what changes, and
    a change that would break exact resumption is refused (nanogrpo/infra/run_dir.py). With --config FILE they are
    FILE (a run's config.json, or any TrainConfig JSON) for a new run in a folder of its own."""
    argv = list(sys.argv[1:] if argv is None else argv)
    name = argv.pop(0) if argv and argv[0] in PRESETS else None
    config = pop_config_flag(argv)
    presets = "; ".join(f"'{k}': {desc}" for k, (desc, _) in PRESETS.items())
    description = (
        f"nanogrpo: GRPO (or SFT, CPT, DPO, PPO) for language models. Presets (first argument): {presets}. Defaults below "
        f"are the '{name or 'demo'}' preset's; with --resume they are the run's config.json. --config FILE: a new run "
        "whose defaults are FILE (a run's config.json, or a TrainConfig JSON with some fields) instead of a preset."
    )
    if config is not None:
        if name:
            raise ValueError(
                f"the preset '{name}' and --config {config} both set the defaults: drop '{name}' to rerun the "
                f"config (flags still override it), or drop --config to start from the preset"
            )
        hint = "remove or rename it (python train.py --help lists every option)"
        base = replace(read_config(config, "--config", hint), resume=False)  # a resumed run's config too
        cfg = tyro.cli(TrainConfig, default=base, args=argv, description=description)
        check_rerun_dir(config, cfg)
    else:
        cfg = tyro.cli(TrainConfig, default=PRESETS[name or "demo"][1], args=argv, description=description)
    saved = None
    if cfg.resume:
        # the run's config is its preset: the one named here only chose the default --out-dir
        if name and os.environ.get("RANK", "0") == "0":
            print(f"note: --resume continues {cfg.out_dir}/config.json; the '{name}' preset is not applied")
        saved = load_config(cfg.out_dir)
        cfg = tyro.cli(TrainConfig, default=saved, args=argv, description=description)
    if os.environ.get("NANOGRPO_ALLOW_USER_CODE") == "1":  # as --reward.allow-user-code (docs/RUNS.md)
        cfg = replace(cfg, reward=replace(cfg.reward, allow_user_code=True))
    beta_given = any(a == "--grpo.beta" or a.startswith("--grpo.beta=") for a in argv)
    if beta_given and cfg.grpo.kl_placement == "none":
        raise ValueError(
            "--grpo.beta has no effect with --grpo.kl-placement none: "
            "add --grpo.kl-placement loss|reward or drop --grpo.beta"
        )
    if saved is not None:
        check_resume(saved, cfg)  # before anything loads (main checks again, for callers of main())
    return cfg


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
