"""A run's start and end, around train.py's loop: one call each, so that the loop reads as the algorithm.

    cfg = check_flags(cfg, ...)   # train.py's cli: --config's folder, --resume's own config.json
    run = start(cfg)              # every check that needs no model, then the model, the optimizer, --resume
    after_step(run, step, m, bar) # the step's line (and a note when it learns nothing), a checkpoint saved
    summary = finish(run)         # the final adapter or model, the held-out table, the plots, the run page

`start` refuses, before any model loads and in one line that says what to fix (docs/RUNS.md): the flags among
themselves, the held-out rows, --env (the environment built and reset in a worker, its first message against
the prompt limit), flash-attn, the loggers, the device, torchrun, the data (every row read, checked and
tokenized), the memory plan (which may pick a micro-batch), the run folder. Only then do the model, the
optimizer, the schedule and the data order come, and with --resume the run's state from its newest complete
checkpoint.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import torch
from tqdm import tqdm

from nanogrpo import judge_backend
from nanogrpo.config import TrainConfig, updates_per_step, with_epochs
from nanogrpo.data import PromptOrder, check_sft_rows, column_map, load_task, prompt_budget, tokenize_prompts
from nanogrpo.envs import spec as env_spec
from nanogrpo.eval.during import HeldOutEval, check_eval_every, final_eval, held_out_source
from nanogrpo.eval.report import write_report
from nanogrpo.infra import checkpoint as ckpt
from nanogrpo.infra import dist
from nanogrpo.infra.config_file import check_rerun_dir, load_config
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
from nanogrpo.model import hf_model
from nanogrpo.model.attention import check_flash
from nanogrpo.model.fast.static_decode import check_decode
from nanogrpo.model.memory_fit import fit_to_memory
from nanogrpo.model.zoo import resolve_model
from nanogrpo.optim import optimizer_and_schedule
from nanogrpo.policy import load_policy, prompt_limit
from nanogrpo.recipes.presets import check_preset_inputs
from nanogrpo.stages import Run, cpt, dpo
from nanogrpo.summary import StepNotes
from nanogrpo_base.rows import json_safe
from rewards import RewardFunction, build_reward
from rewards.judge import with_run_dir
from rewards.options import with_max_tokens


def start(cfg: TrainConfig) -> Run:
    """The run of `cfg`, checked and loaded: its model, optimizer, schedule, data order, logger and, with
    --resume, the step it goes on from (module docstring)."""
    # ---------------------------------------------------------------- every check before the model loads
    cfg, env, device, dtype = check_run(cfg)  # the flags, --env, flash-attn, loggers, device, torchrun
    rows, tok, reward_fn, held_out = training_data(cfg)  # read, checked and tokenized
    cfg, env = check_with_data(cfg, env, rows, tok, device, dtype)  # --env's start, memory plan, run folder
    rank, world = dist.rank(), dist.world()
    seed_everything(cfg.seed + rank)

    # ---------------------------------------------------------------- model, optimizer, resume
    policy = load_policy(cfg, device, dtype, tok)
    if world > 1 and dist.is_main():
        how = "sharded with FSDP2" if policy.fsdp else "replicated with DDP"
        print(f"torchrun: {world} ranks, the policy {how}")
    opt, sched = optimizer_and_schedule(policy.model, cfg.optim, cfg.steps * updates_per_step(cfg))
    order = PromptOrder(len(rows), cfg.seed, cfg.data.shuffle)
    out = Path(cfg.out_dir)
    logger = Logger(
        out, enabled=dist.is_main(), wandb_project=cfg.wandb, tensorboard=cfg.tensorboard, config=asdict(cfg)
    )
    run = Run(cfg, policy, opt, sched, reward_fn, logger, device, order, rows, env, held_out=held_out)
    run.step0 = resume(run) if cfg.resume else 0  # --resume: its step
    run.evaluator = HeldOutEval(cfg, policy, device, held_out, env)  # --eval-every (eval/during.py)
    run.evaluator.start(logger, run.step0)  # step 0, before any update: a metrics.jsonl line of its own
    run.notes = StepNotes(cfg, env, dtype)  # said once: a paused entropy bonus, no call, cut episodes, a gap
    return run


def check_flags(
    cfg: TrainConfig,
    parse: Callable[[TrainConfig], TrainConfig],
    argv: list[str],
    preset: str | None,
    config: str | None,
) -> TrainConfig:
    """train.py's flags, parsed over the preset (`cfg`), checked before anything loads: --config FILE starts a
    new run in a folder of its own; with --resume they are parsed again (`parse(defaults)`) over the run's
    own config.json, and a change that would break exact resumption is refused (infra/run_dir.py);
    NANOGRPO_ALLOW_USER_CODE=1 is --reward.allow-user-code (docs/RUNS.md); --grpo.beta without a KL
    placement is refused."""
    if config is not None:
        check_rerun_dir(config, cfg)  # --config: a new run, in a folder of its own
    saved = None
    if cfg.resume:
        # the run's config is its preset: the one named here only chose the default --out-dir
        if preset and os.environ.get("RANK", "0") == "0":
            print(f"note: --resume continues {cfg.out_dir}/config.json; the '{preset}' preset is not applied")
        saved = load_config(cfg.out_dir)
        cfg = parse(saved)
    if os.environ.get("NANOGRPO_ALLOW_USER_CODE") == "1":
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


def check_run(cfg: TrainConfig) -> tuple[TrainConfig, object, torch.device, torch.dtype]:
    """Every check that needs neither the data nor a model (the flags among themselves, the held-out rows,
    --env built and checked, flash-attn, the loggers, torchrun's ranks); then the device and dtype, and
    torchrun's process group. Returns the run's config (its folder an absolute path, --env's budgets), the
    environment spec (None without --env), the device and the dtype."""
    check_config(cfg)  # the flags among themselves
    check_eval_every(cfg)  # --eval-every: the held-out rows exist
    check_preset_inputs(cfg)  # the research agent's probe judge, written by its pipeline's first stage
    cfg = replace(cfg, out_dir=os.path.abspath(cfg.out_dir))  # the run folder, whatever changes the directory
    cfg, env = env_spec.resolve(cfg)  # --env: the environment, one instance built and checked; its budgets
    if cfg.model.attn == "flash":  # flash-attn imports, and the run is on a GPU in 16 bits
        check_flash(cfg.model.device, cfg.model.dtype)
    Logger.check_packages(cfg.wandb, cfg.tensorboard)  # --wandb / --tensorboard without their package
    device, dtype = resolve_device_dtype(cfg.model)
    if device.type == "cpu":  # glibc: a step's freed blocks serve the next step (nanogrpo/infra/heap.py)
        keep_freed_memory()
    dist.init(device.type)
    world = dist.world()
    # which model runs the folder; the plain path for transformers' (--model.impl), decided here for the run
    general = hf_model.start(resolve_model(cfg.model.path), cfg.model.impl, cfg.plain, say=dist.is_main())
    if general:
        hf_model.check_flags(cfg.model.attn, cfg.sampling.decode)
    elif not cfg.plain:  # --plain samples with the plain loop (flag_checks refuses another --sampling.decode)
        check_decode(
            cfg.sampling.decode, device, dist.parallel_mode(cfg), cfg.model.path
        )  # graph: CUDA, no FSDP
    if cfg.prompts_per_step % world:
        raise ValueError(f"--prompts-per-step {cfg.prompts_per_step} must be a multiple of the {world} ranks")
    if cfg.plain and dist.is_main():
        print(PLAIN_LINE)
    return cfg, env, device, dtype


PLAIN_LINE = (
    "note: --plain: the run takes the reading path (docs/reading-path.txt): the plain sampler loop on the weights "
    "as they are, the plain log-prob function, attention as SDPA computes it; the same to rounding as the fast "
    "paths, and slower"
)


def check_with_data(
    cfg: TrainConfig, env, rows: list[dict], tok, device, dtype
) -> tuple[TrainConfig, object]:
    """What needs the training rows, still before the model loads: --env's template, a reset on the first
    row and its first message (the workers forked while the process is small), --epochs (the number of
    steps), the memory plan (--memory-check; it may pick a micro-batch), the run folder (every rank checks it:
    --resume, the saved config; else no run there yet; one rank writes config.json and environment.json)."""
    if env is not None:
        episodes = cfg.prompts_per_step // dist.world() * cfg.grpo.group_size  # a rollout's
        env = env_spec.check_start(env, tok, rows, cfg.data.system_prompt, *prompt_limit(cfg), episodes, cfg.sampling.decode)  # fmt: skip
    cfg = with_epochs(cfg, len(rows))  # --epochs: the number of steps
    cfg = fit_to_memory(cfg, device, dtype, rows)  # --memory-check: the plan against the free memory
    prepare_run_dir(cfg, write=dist.is_main())
    if dist.is_main():  # environment.json: the resolved device and dtype, versions, git commit, CPU
        write_environment(Path(cfg.out_dir), device, dtype, resume=cfg.resume)
    return cfg, env


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


def resume(run: Run) -> int:
    """--resume: the run's state back from its newest complete checkpoint (the weights, the optimizer, the
    schedule, the data order, every rank's RNG) and its logs cut back to that step; returns the step."""
    cfg, logger = run.cfg, run.logger
    out, rank, world = Path(cfg.out_dir), dist.rank(), dist.world()
    step0 = 0
    # the newest complete checkpoint, whatever ckpt/latest says: a damaged one is passed over, by name
    point = ckpt.find_resume_point(out / "ckpt")
    if point.path is not None:
        state = point.state
        run.policy.load_checkpoint(point.path, run.opt, state["optimizer"])
        run.sched.load_state_dict(state["scheduler"])
        run.order.load_state_dict(state["data"])
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


def after_step(run: Run, step: int, m: dict, bar: tqdm) -> None:
    """After step `step` (0-based) was logged: stop on a loss or gradient that is not finite (NonFiniteStep,
    before its weights are saved), print its line (and the notes of summary.StepNotes: the entropy bonus paused
    in a step without reward spread, episodes that make no tool call, episodes cut by a budget), and save a
    checkpoint every --save-every steps and at the end."""
    cfg, out = run.cfg, Path(run.cfg.out_dir)
    if bad := {k: m[k] for k in ("loss", "grad_norm") if m.get(k) is not None and not math.isfinite(m[k])}:
        run.logger.close()
        release_run_dir(out)
        raise NonFiniteStep(step + 1, bad, ckpt.latest_checkpoint(out / "ckpt"))
    if dist.is_main():
        line = console_line(m)
        bar.set_postfix_str(line.split(" | ")[1])  # the reward (or the SFT loss)
        tqdm.write(line)
        for note in run.notes(m) if run.notes is not None else ():  # once when a condition begins
            tqdm.write(note)
    if (cfg.save_every and (step + 1) % cfg.save_every == 0) or step + 1 == cfg.steps:
        save(run, step + 1)


def save(run: Run, step: int) -> None:
    """A checkpoint after `step` steps (atomic: nanogrpo/infra/checkpoint.py), with the logs up to it on the
    disk first, every rank's RNG, the data order, and what --resume checks the run against."""
    out = Path(run.cfg.out_dir)
    rngs = dist.gather_objects(ckpt.rng_state())  # every rank restores its own dropout/sampling RNG
    save_weights, opt_state = run.policy.checkpoint_parts(run.opt)  # every rank: FSDP gathers to rank 0
    if dist.is_main():
        for log in ("metrics.jsonl", "samples.jsonl"):  # the logs up to this step are on the disk before it
            if (out / log).is_file():
                fsync_path(out / log)
        extra = {"data": run.order.state_dict(), "rng_all": rngs}
        # what the run trains with (config and data fingerprints: checked on --resume), and the step's log
        # line, which --resume restores if a crash tore it
        extra.update(run=started_record(out), metrics_line=step_line(out / "metrics.jsonl", step))
        ckpt.save_checkpoint(out / "ckpt", step, save_weights, opt_state, run.sched, extra)
    dist.barrier()


def finish(run: Run) -> dict:
    """The end of a run: the final adapter (or model), the held-out eval, the plots and the run page, and
    summary.json; then the logs closed, the folder's lock released and the environment's workers stopped."""
    cfg, policy = run.cfg, run.policy
    out = Path(cfg.out_dir)
    summary: dict = {"steps": cfg.steps, "out_dir": str(out)}
    policy.save_final(out / ("adapter" if cfg.lora.r > 0 else "model"))  # every rank: FSDP gathers
    if cfg.eval_prompts > 0 and dist.is_main():
        summary["eval"] = final_eval(cfg, policy, out, run.held_out, run.env)
    if dist.is_main():
        if cfg.plots:
            write_report(out)  # the PNGs (nanogrpo/infra/plots.py) and index.html, which embeds them
        (out / "summary.json").write_text(json.dumps(json_safe(summary), indent=2, allow_nan=False))
    run.logger.close()
    release_run_dir(out)  # the folder's lock (nanogrpo/infra/run_dir.py)
    if run.env is not None:  # --env: the worker processes (on an error, they go at exit)
        run.env.workers.close()
    dist.shutdown()
    return summary
