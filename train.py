"""nanogrpo: train a language model with GRPO (or SFT) on the CPU, one GPU, or many with torchrun.

    python train.py                       # the demo: SmolLM2-135M-Instruct + LoRA on the built-in task
    python train.py tiny                  # a random tiny model, seconds (what the tests run)
    python train.py --help                # every flag

One step: sample G completions for each of P prompts, score them, turn rewards into group advantages,
then take `num_iterations` optimizer passes over the batch with the clipped surrogate (+ KL) loss. The
loop reads top to bottom; the pieces live in nanogrpo/ (README "Layout").
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import tyro
from tqdm import tqdm

from nanogrpo import checkpoint as ckpt
from nanogrpo import dist, grpo
from nanogrpo.config import PRESETS, TrainConfig, check_config
from nanogrpo.data import PromptOrder, load_task, prompt_text, tokenize_prompts
from nanogrpo.device import resolve_device_dtype, seed_everything
from nanogrpo.logprobs import completion_logprobs, make_batch, micro_slices, pad_left
from nanogrpo.metrics import Logger, console_line, plot_metrics
from nanogrpo.policy import load_policy, prompt_budget
from nanogrpo.resume import check_resume, load_config, prepare_run_dir, release_run_dir
from nanogrpo.sampling import generate
from rewards import Sample, build_reward, mean_metrics
from rewards.judge import with_run_dir


def main(cfg: TrainConfig) -> dict:
    # ---------------------------------------------------------------- checks that need no model
    check_config(cfg)
    device, dtype = resolve_device_dtype(cfg.model)
    dist.init(device.type)
    rank, world = dist.rank(), dist.world()
    if cfg.prompts_per_step % world:
        raise ValueError(f"--prompts-per-step {cfg.prompts_per_step} must be a multiple of the {world} ranks")
    rows, source = load_task(cfg.data.train, "train")
    # a judge keeps its cache in the run folder, so a resumed run does not pay twice
    reward_fn = build_reward(with_run_dir(cfg.reward, cfg.out_dir)) if cfg.algo == "grpo" else None
    if reward_fn is not None:
        reward_fn.validate(rows, source)
    elif any(not r.get("reference") for r in rows):
        raise ValueError(f"{source}: --algo sft trains on 'reference'; every row needs one")
    tok, limit = prompt_budget(cfg)  # the prompts are tokenized once, here, and checked against the model
    if n_cut := tokenize_prompts(rows, tok, cfg.data.system_prompt, limit, cfg.data.long_prompts, source):
        if dist.is_main():
            print(
                f"{n_cut} prompts of {source} cut to their last {limit} tokens (--data.long-prompts truncate)"
            )
    out = Path(cfg.out_dir)
    # every rank checks the folder (--resume: the saved config; else: no run there yet), one saves config.json
    prepare_run_dir(cfg, write=dist.is_main())
    seed_everything(cfg.seed + rank)

    # ---------------------------------------------------------------- model, tokenizer, optimizer
    policy = load_policy(cfg, device, dtype)
    model, tok = policy.model, policy.tokenizer
    if world > 1 and dist.is_main():
        how = "sharded with FSDP2" if policy.fsdp else "replicated with DDP"
        print(f"torchrun: {world} ranks, the policy {how}")
    pad_id, eos_ids = policy.pad_id, policy.eos_ids
    params = [p for p in model.parameters() if p.requires_grad]
    from nanogrpo.optim import build_optimizer, build_scheduler

    opt = build_optimizer(params, cfg.optim)
    sched = build_scheduler(opt, cfg.optim, cfg.steps * cfg.grpo.num_iterations)
    order = PromptOrder(len(rows), cfg.seed, cfg.data.shuffle)
    logger = Logger(
        out, enabled=dist.is_main(), wandb_project=cfg.wandb, tensorboard=cfg.tensorboard, config=asdict(cfg)
    )
    step0 = 0
    if cfg.resume:
        # the newest complete checkpoint, whatever ckpt/latest says: a damaged one is passed over, by name
        point = ckpt.find_resume_point(out / "ckpt")
        if point.path is not None:
            state = point.state
            policy.load_checkpoint(point.path, opt, state["optimizer"])
            sched.load_state_dict(state["scheduler"])
            order.load_state_dict(state["data"])
            ckpt.set_rng_state(state["rng_all"][rank] if world == len(state["rng_all"]) else state["rng"])
            step0 = state["step"]
        # steps logged after it will run again: dropped (with a torn last line), so none appears twice
        dropped = ", ".join(f"{name} {k}" for name, k in logger.truncate_after(step0).items() if k)
        if dist.is_main():
            for note in point.notes:
                print(f"note: {note}")
            cut = f"; logs cut back to it (lines dropped: {dropped})" if dropped else ""
            if point.path is not None:
                print(f"resumed from {point.path} at step {step0}{cut}")
            else:  # the run died before its first checkpoint: its logged steps will be run again
                print(f"no complete checkpoint in {out / 'ckpt'} yet: starting again from step 0{cut}")

    G = cfg.grpo.group_size if cfg.algo == "grpo" else 1
    P_local = cfg.prompts_per_step // world
    temp = cfg.sampling.temperature
    bar = tqdm(
        range(step0, cfg.steps),
        initial=step0,
        total=cfg.steps,
        disable=not dist.is_main(),
        dynamic_ncols=True,
    )
    for step in bar:
        t0 = time.perf_counter()
        # every rank draws the same global prompt list and keeps its own slice: whole groups stay on one rank
        idx = order.take(cfg.prompts_per_step)[rank * P_local : (rank + 1) * P_local]
        batch_rows = [rows[i] for i in idx]
        prompts = [r["_prompt_ids"] for r in batch_rows]  # (P,) token lists, rendered at start-up
        m: dict = {"step": step + 1}

        if cfg.algo == "sft":
            # ---------------------------------------------------- SFT: NLL of the reference given the prompt
            comp = [
                tok(r["reference"], add_special_tokens=False)["input_ids"] + eos_ids[:1] for r in batch_rows
            ]
            Tc = max(len(c) for c in comp)
            completion_ids = torch.tensor([c + [pad_id] * (Tc - len(c)) for c in comp])  # (P, Tc)
            cmask = torch.tensor([[1.0] * len(c) + [0.0] * (Tc - len(c)) for c in comp])  # (P, Tc)
            p_ids, p_mask = pad_left(prompts, pad_id)
            batch = make_batch(p_ids, p_mask, completion_ids, cmask).to(device)
            n_tok = dist.sum_floats({"n": float(cmask.sum())})["n"]
            t1 = time.perf_counter()
            model.train()
            loss_sum = 0.0
            slices = micro_slices(len(batch), cfg.micro_batch)
            for k, sl in enumerate(slices):
                mb = batch.rows(sl)
                with policy.no_sync(last=k == len(slices) - 1):  # DDP: one all-reduce per step
                    logp, _ = completion_logprobs(model, mb, 1.0, policy.autocast)
                    loss = -(logp * mb.mask).sum() / n_tok
                    policy.backward(loss)
                loss_sum += loss.item()
            m.update(loss=dist.sum_floats({"l": loss_sum})["l"], t_sample=0.0, t_score=0.0, tokens=n_tok)
            m["len_mean"] = n_tok / cfg.prompts_per_step
        else:
            # ---------------------------------------------------- 1. sample G completions per prompt
            model.eval()
            # one stream per prompt, seeded by (seed, step, index in the global batch): resume needs no
            # generator state, and a prompt samples the same on any rank or in any batch
            gens = [
                torch.Generator(device=device).manual_seed(
                    (cfg.seed * 1_000_003 + step) * 4099 + rank * P_local + i
                )
                for i in range(len(prompts))
            ]
            with policy.gathered(), torch.inference_mode():  # FSDP: full weights for the sampler
                gen = generate(
                    policy.core,
                    prompts,
                    group_size=G,
                    max_new_tokens=cfg.sampling.max_new_tokens,
                    temperature=temp,
                    top_p=cfg.sampling.top_p,
                    top_k=cfg.sampling.top_k,
                    eos_ids=eos_ids,
                    stop_strings=cfg.sampling.stop,
                    tokenizer=tok,
                    generator=gens,
                    pad_id=pad_id,
                )
            completion_ids, cmask = gen.completion_ids.clone(), gen.mask.float().clone()  # (N, Tc)
            lengths = cmask.sum(1)  # (N,)
            texts = gen.texts(
                tok, cfg.sampling.stop
            )  # a stop string ends the text, kept (sampling.finish_text)
            t1 = time.perf_counter()

            # ---------------------------------------------------- 2. score
            samples = [
                Sample(prompt=prompt_text(r), completion=texts[i * G + j], group=i, row=r)
                for i, r in enumerate(batch_rows)
                for j in range(G)
            ]
            rewards, components = reward_fn(samples)
            n_valid = dist.sum_floats({"n": float(sum(r is not None for r in rewards))})["n"]
            reward_fn.empty_steps.update(n_valid)  # --reward.max-empty-steps in a row without a reward: stop
            reward = torch.tensor([float("nan") if r is None else r for r in rewards])  # (N,)
            t2 = time.perf_counter()

            # ---------------------------------------------------- 3. advantages (KL in the reward first)
            p_ids, p_mask = pad_left(prompts, pad_id)
            p_ids, p_mask = p_ids.repeat_interleave(G, 0), p_mask.repeat_interleave(G, 0)  # (N, Tp)
            batch = make_batch(p_ids, p_mask, completion_ids, cmask).to(device)
            sampler_logp = gen.logp.float().to(device) * batch.mask  # (N, Tc) what the sampler drew with
            slices = micro_slices(len(batch), cfg.micro_batch)
            ref_logp = kl_pen = None
            if cfg.grpo.kl_placement != "none":
                ref_logp = torch.cat(
                    [policy.reference_logprobs(batch.rows(sl), temp) for sl in slices]
                )  # (N, Tc)
            score = reward  # (N,) NaN where no grader applied: such rows are left out of their group
            if cfg.grpo.kl_placement == "reward":
                # both sides on the trainer's path (not the sampler's log-probs): pi == ref gives exactly 0
                pi_logp = torch.cat(
                    [policy.trainer_logprobs(batch.rows(sl), temp) for sl in slices]
                )  # (N, Tc)
                kl_pen = grpo.kl_penalty(pi_logp, ref_logp, batch.mask, cfg.grpo).cpu()  # (N,)
                score = reward - cfg.grpo.beta * kl_pen  # (N,)
            adv, zero_std = grpo.compute_advantages(score, cfg.grpo)  # (N,), (P,)
            adv = adv.to(device)

            # ---------------------------------------------------- 4-6. loss, backward, mu passes
            counts = dist.sum_floats({"seqs": float(len(batch)), "tokens": float(batch.mask.sum())})
            model.train()
            old_logp = torch.zeros_like(sampler_logp)  # (N, Tc) the trainer's log-probs before the update
            stats_sum: dict[str, float] | None = None
            ent_sum = loss_sum = 0.0
            for it in range(cfg.grpo.num_iterations):
                if it > 0:
                    policy.step(opt, sched, cfg.optim.grad_clip)  # passes after the first are off-policy
                for k, sl in enumerate(slices):
                    mb = batch.rows(sl)
                    with policy.no_sync(last=k == len(slices) - 1):  # DDP: one all-reduce per pass
                        logp, ent = completion_logprobs(model, mb, temp, policy.autocast)  # (n, Tc)
                        if it == 0:  # pi_old: the first pass runs the weights the samples came from
                            old_logp[sl] = logp.detach()
                        loss, stats = grpo.grpo_loss(
                            logp,
                            old_logp[sl],
                            None if ref_logp is None else ref_logp[sl],
                            adv[sl],
                            mb.mask,
                            cfg.grpo,
                            num_seqs=counts["seqs"],
                            num_tokens=counts["tokens"],
                            max_len=cfg.sampling.max_new_tokens,
                            sampler_logp=sampler_logp[sl],  # the sampler-trainer gap: logged, corrected
                        )
                        policy.backward(loss)
                    if it == 0:  # metrics describe the on-policy pass
                        ent_sum += float((ent * mb.mask).sum())
                        stats_sum = grpo.accumulate_stats(stats_sum, stats)
                        loss_sum += float(loss.detach())
            # ---------------------------------------------------- metrics of the step (summed over ranks)
            valid = ~reward.isnan()
            sums = {
                "r": float(reward[valid].sum()),
                "r2": float((reward[valid] ** 2).sum()),
                "n_r": float(valid.sum()),
                "zero": float(zero_std.sum()),
                "groups": float(len(zero_std)),
                "ent": ent_sum,
                "len": float(lengths.sum()),
                "trunc": float(gen.truncated.sum()),
                "loss": loss_sum,
                **{f"s/{k}": v for k, v in stats_sum.items() if not grpo.is_max_stat(k)},
            }
            for name, vals in components.items():
                ok = [v for v in vals if v is not None]
                sums[f"c/{name}"], sums[f"cn/{name}"] = float(sum(ok)), float(len(ok))
            sums = dist.sum_floats(sums)
            len_max = dist.max_floats({"len": float(lengths.max())})["len"]
            n_r = sums["n_r"]  # completions with a reward: 0 when the judge scored nothing this step
            mean_r = sums["r"] / n_r if n_r else None  # null in metrics.jsonl, not a measured 0
            m.update(
                reward=mean_r,
                reward_std=max(0.0, sums["r2"] / n_r - mean_r**2) ** 0.5 if n_r else None,
                **{
                    f"reward/{k[2:]}": (sums[k] / sums["cn/" + k[2:]] if sums["cn/" + k[2:]] else None)
                    for k in sums
                    if k.startswith("c/")
                },
                frac_zero_std=sums["zero"] / sums["groups"],
                entropy=sums["ent"] / counts["tokens"],
                len_mean=sums["len"] / counts["seqs"],
                len_max=len_max,
                trunc_rate=sums["trunc"] / counts["seqs"],
                reward_none=counts["seqs"] - sums["n_r"],
                tokens=counts["tokens"],
                loss=sums["loss"],
                **grpo.finalize_stats(
                    {
                        **{k[2:]: v for k, v in sums.items() if k.startswith("s/")},
                        **dist.max_floats({k: v for k, v in stats_sum.items() if grpo.is_max_stat(k)}),
                    }
                ),
            )
            if ref_logp is None:
                m["kl"] = None  # no reference, no KL: null in metrics.jsonl, not a measured 0
            if kl_pen is not None:
                m["kl_reward"] = dist.sum_floats({"k": float(kl_pen.sum())})["k"] / counts["seqs"]
            m.update(t_sample=t1 - t0, t_score=t2 - t1)
            m.update(
                mean_metrics(dist.sum_floats(reward_fn.metrics()))
            )  # judge tokens, seconds, retries, unparsable, ...

            if dist.is_main() and cfg.log_samples_every and (step + 1) % cfg.log_samples_every == 0:
                logger.log_samples(
                    step + 1, _groups(batch_rows, texts, reward, components, adv, lengths, G, reward_fn)
                )

        # -------------------------------------------------------------------- 7. optimizer step, log, save
        gn = policy.step(opt, sched, cfg.optim.grad_clip)
        t_end = time.perf_counter()
        m.update(
            grad_norm=gn,
            lr=sched.get_last_lr()[0],
            t_train=t_end - (t1 if cfg.algo == "sft" else t2),
            t_step=t_end - t0,
            tok_per_s=m["tokens"] / max(t_end - t0, 1e-9),
        )
        logger.log(m)
        if dist.is_main():
            bar.set_postfix_str(console_line(m).split(" | ")[1])  # the reward (or the SFT loss)
            tqdm.write(console_line(m))
        if (cfg.save_every and (step + 1) % cfg.save_every == 0) or step + 1 == cfg.steps:
            _save(policy, out, step + 1, opt, sched, order)
    bar.close()

    # ------------------------------------------------------------------------ end: adapter, plots, eval, page
    summary: dict = {"steps": cfg.steps, "out_dir": str(out)}
    policy.save_final(out / ("adapter" if cfg.lora.r > 0 else "model"))  # every rank: FSDP gathers
    if dist.is_main():
        plot_metrics(out)
    if cfg.eval_prompts > 0 and dist.is_main():
        summary["eval"] = final_eval(cfg, policy, out)
    if dist.is_main():
        try:
            from nanogrpo.report import write_report

            write_report(out)
        except ImportError:
            pass
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    logger.close()
    release_run_dir(out)  # the folder's lock (nanogrpo/resume.py)
    dist.shutdown()
    return summary


def final_eval(cfg: TrainConfig, policy, out: Path) -> dict | None:
    """Greedy answers of the base model (LoRA off: with --lora.init-from, the SFT model) and the trained
    one on held-out prompts, scored with the training graders; prints both means and the paired bootstrap
    95% CI of the difference."""
    from nanogrpo.evaluate import base_vs_trained, format_paired_table, save_eval

    source = cfg.data.eval or ("demo" if cfg.data.train == "demo" else "")
    if not source or not policy.use_lora:
        print("final eval skipped: it needs --data.eval (or the demo task) and LoRA (the base is LoRA off)")
        return None
    rows = load_task(source, "eval")[0][: cfg.eval_prompts]
    policy.core.eval()
    res = base_vs_trained(
        policy.core,
        policy.tokenizer,
        rows,
        graders=",".join(n.split(":")[0] for n in cfg.reward.spec.split(",") if n.strip()),
        reward_cfg=cfg.reward,
        seed=cfg.seed,
        max_new_tokens=cfg.sampling.max_new_tokens,
        stop=cfg.sampling.stop,  # the texts end as in training: right after a stop string
        system_prompt=cfg.data.system_prompt,
        progress=False,
    )
    save_eval(out, rows, res)
    base = "the SFT model of --lora.init-from" if cfg.lora.init_from else "LoRA off"
    print(f"\nheld-out: {len(rows)} prompts, greedy, base ({base}) vs trained; * = 95% CI excludes 0")
    print(format_paired_table(res["summary"]))
    return res["summary"]


def _groups(batch_rows, texts, reward, components, adv, lengths, G, reward_fn) -> list[dict]:
    """The step's groups for samples.jsonl and the run page."""
    details = reward_fn.details()  # {'judge': [marks and reason per completion], ...}
    groups = []
    for i, r in enumerate(batch_rows):
        comps = []
        for j in range(G):
            k = i * G + j
            c = {
                "text": texts[k],
                "reward": None if reward[k].isnan() else float(reward[k]),
                "scores": {name: vals[k] for name, vals in components.items()},
                "advantage": float(adv[k]),
                "length": int(lengths[k]),
            }
            for name, vals in details.items():
                if vals[k] is not None:
                    c[name] = vals[k]
            comps.append(c)
        groups.append(
            {
                "id": r.get("id"),
                "prompt": prompt_text(r),
                "reference": r.get("reference"),
                "completions": comps,
            }
        )
    return groups


def _save(policy, out: Path, step: int, opt, sched, order: PromptOrder) -> None:
    rngs = dist.gather_objects(ckpt.rng_state())  # every rank restores its own dropout/sampling RNG
    save_weights, opt_state = policy.checkpoint_parts(opt)  # every rank: FSDP gathers to rank 0
    if dist.is_main():
        extra = {"data": order.state_dict(), "rng_all": rngs}
        ckpt.save_checkpoint(out / "ckpt", step, save_weights, opt_state, sched, extra)
    dist.barrier()


def cli(argv: list[str] | None = None) -> TrainConfig:
    """`train.py [PRESET] [--flags]`: the preset (default 'demo') sets the defaults that flags override.

    With --resume the defaults are the run's own config.json instead, so flags name only what changes, and
    a change that would break exact resumption is refused (nanogrpo/resume.py)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    name = argv.pop(0) if argv and argv[0] in PRESETS else None
    presets = "; ".join(f"'{k}': {desc}" for k, (desc, _) in PRESETS.items())
    description = (
        f"nanogrpo: GRPO (or SFT) for language models. Presets (first argument): {presets}. Defaults below "
        f"are the '{name or 'demo'}' preset's; with --resume they are the run's config.json."
    )
    cfg = tyro.cli(TrainConfig, default=PRESETS[name or "demo"][1], args=argv, description=description)
    saved = None
    if cfg.resume:
        # the run's config is its preset: the one named here only chose the default --out-dir
        if name and os.environ.get("RANK", "0") == "0":
            print(f"note: --resume continues {cfg.out_dir}/config.json; the '{name}' preset is not applied")
        saved = load_config(cfg.out_dir)
        cfg = tyro.cli(TrainConfig, default=saved, args=argv, description=description)
    beta_given = any(a == "--grpo.beta" or a.startswith("--grpo.beta=") for a in argv)
    if beta_given and cfg.grpo.kl_placement == "none":
        raise ValueError(
            "--grpo.beta has no effect with --grpo.kl-placement none: "
            "add --grpo.kl-placement loss|reward or drop --grpo.beta"
        )
    if saved is not None:
        check_resume(saved, cfg)  # before anything loads (main checks again, for callers of main())
    return cfg


if __name__ == "__main__":
    try:
        main(cli())
    except ValueError as e:  # bad flags or data: one line that says what to fix (NANOGRPO_DEBUG=1: traceback)
        if os.environ.get("NANOGRPO_DEBUG"):
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
