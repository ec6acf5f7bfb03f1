"""The checks of a run's flags before any model loads (`check_config`): each number in its declared range
(TRAIN below: every numeric field of nanogrpo/config.py's dataclasses, by dotted path, checked by
rewards/ranges.py's check_ranges), then the flags among themselves: settings the trainer would get wrong
or silently ignore. The side commands' tables are here too (EVAL, RLVRR, PROBE_COMPARE, REWARD_DATA, ...):
each command calls the same check_ranges with its own table. tests/test_flag_ranges.py walks every numeric
field of every command and fails on one without a range."""

from __future__ import annotations

from nanogrpo.config import MIN_STEP_TIMEOUT_S, GRPOConfig, SamplingConfig, TrainConfig
from rewards.ranges import (
    ANY,
    GRADE,
    JUDGE,
    PROBE_TRAIN,
    REWARD,
    Range,
    above,
    at_least,
    check_ranges,
    nested,
    within,
)

ENV = {
    "max_turns": at_least(0, "0 = the environment's own"),
    "max_tokens": at_least(0, "0 = from the environment's max_turns"),
    "step_timeout_s": Range(MIN_STEP_TIMEOUT_S, also=0, note="0 = no limit; below it a call cannot return"),
}
SAMPLING = {
    "max_new_tokens": at_least(1),
    "temperature": at_least(0, "0 = greedy"),
    "top_p": within(0, 1, "1 = off", lo_open=True),
    "top_k": at_least(0, "0 = off"),
}
TRAIN: dict[str, Range] = {  # TrainConfig: python train.py --FLAG
    "steps": at_least(1),
    "epochs": at_least(0, "0 = use --steps"),
    "prompts_per_step": at_least(1),
    "micro_batch": at_least(0, "0 = all at once"),
    "seed": at_least(0),
    "save_every": at_least(0, "0 = only at the end"),
    "log_samples_every": at_least(0, "0 = never"),
    "eval_prompts": at_least(0, "0 = skip"),
    "eval_every": at_least(0, "0 = off"),
    "eval_samples": at_least(0, "0 = greedy only"),
    "eval_pass_threshold": ANY,
    "lora.r": at_least(0, "0 = full fine-tune"),
    "lora.alpha": above(0),
    "lora.dropout": within(0, 1, hi_open=True),
    **nested("sampling", SAMPLING),
    "grpo.group_size": at_least(2, "GRPO compares the completions of one prompt"),
    "grpo.adv_eps": at_least(0),
    "grpo.eps_low": within(0, 1, "the ratio's lower clip is 1 - eps-low"),
    "grpo.eps_high": at_least(0),
    "grpo.dual_clip": Range(1, lo_open=True, also=0, note="C of the bound -C * adv, e.g. 3; 0 = off"),
    "grpo.entropy_coef": at_least(0, "0 = off"),
    "grpo.top_entropy_quantile": within(0, 1, "1 = every token", lo_open=True),
    "grpo.num_iterations": at_least(1),
    "grpo.beta": at_least(0),
    "grpo.is_cap": at_least(1, "--grpo.is-correction tis|mis needs > 1"),
    "grpo.zero_spread_tol": at_least(0),
    "grpo.max_resample_rounds": at_least(0, "0 = no extra rounds"),
    "optim.lr": above(0),
    "optim.weight_decay": at_least(0),
    "optim.betas": within(0, 1, hi_open=True),
    "optim.warmup_steps": at_least(0),
    "optim.lr_min_ratio": within(0, 1),
    "optim.grad_clip": at_least(0, "0 = off"),
    "data.max_prompt_tokens": at_least(0, "0 = the model's positions less --sampling.max-new-tokens"),
    "data.max_len": at_least(0, "0 = no limit"),
    "data.seq_len": at_least(2),
    "data.overlap": at_least(0),
    "dpo.beta": above(0, "the paper's is 0.1"),
    "ppo.gamma": within(0, 1, "GAE's; 1 is the usual"),
    "ppo.lam": within(0, 1, "GAE's; 0.95 is the usual"),
    "ppo.value_clip": at_least(0, "0 = no clipping"),
    "ppo.vf_coef": above(0, "the value head learns only from it"),
    "ppo.kl_coef": at_least(0, "0 = none"),
    "ppo.samples_per_prompt": at_least(1),
    "ppo.epochs": at_least(1),
    **nested("env", ENV),
    **nested("reward", REWARD),
}


def check_config(cfg: TrainConfig) -> None:
    """Refuse, before any model loads, settings the trainer would get wrong or silently ignore, from the flags
    alone (train.py also checks --eval-every's held-out rows and --model.attn flash's flash-attn)."""
    check_ranges(cfg, TRAIN)  # every number finite and in its range; no option means 'no limit' by inf
    if not cfg.out_dir.strip():
        raise ValueError("--out-dir '': name the run's folder (e.g. --out-dir runs/my-run)")
    if cfg.algo == "ppo":
        _check_ppo(cfg)
        return
    if cfg.algo != "grpo":
        return
    g, s = cfg.grpo, cfg.sampling
    _check_env(cfg)
    _check_ratio_sampling(s, "GRPO")
    if g.kl_placement != "none" and g.beta == 0:
        raise ValueError(
            f"--grpo.kl-placement {g.kl_placement} with --grpo.beta 0 computes a KL that does nothing: set "
            "--grpo.beta > 0, or --grpo.kl-placement none"
        )
    if g.is_correction != "none" and not g.is_cap > 1:
        raise ValueError(f"--grpo.is-cap {g.is_cap}: the cap of an importance weight must be > 1 (e.g. 2)")
    _check_loss_variants(g)


def _check_env(cfg: TrainConfig) -> None:
    """--env.*: what episodes cannot do yet, and a budget that cannot hold one turn."""
    e = cfg.env
    if not e.on:
        return
    if cfg.algo != "grpo":
        raise ValueError(f"--env.* trains episodes with GRPO; --algo {cfg.algo} samples single completions")
    if e.max_tokens and e.max_tokens < cfg.sampling.max_new_tokens:
        raise ValueError(
            f"--env.max-tokens {e.max_tokens} is below --sampling.max-new-tokens {cfg.sampling.max_new_tokens}: "
            "one turn could not fit the episode; raise --env.max-tokens or lower --sampling.max-new-tokens"
        )


def _check_ratio_sampling(s: SamplingConfig, algo: str) -> None:
    """GRPO's and PPO's ratio and KL are taken under the sampling distribution: it must have log-probs (a
    temperature > 0) and be the full one (no top-k, no top-p)."""
    if not s.temperature > 0:
        raise ValueError(
            f"--sampling.temperature {s.temperature}: {algo}'s ratio and KL need the sampling distribution's "
            "log-probs, and greedy decoding has none; use a temperature > 0, e.g. 1.0"
        )
    if s.top_k > 0 or s.top_p < 1.0:
        raise ValueError(
            f"--sampling.top-k {s.top_k} / --sampling.top-p {s.top_p}: completions would come from the "
            "truncated distribution while the ratio and the KL use the full one, which biases the policy "
            "gradient (docs/KL.md); use --sampling.top-k 0 --sampling.top-p 1 for training (eval.py generate "
            "accepts both), and a lower --sampling.temperature to sample less widely"
        )


def _check_ppo(cfg: TrainConfig) -> None:
    """--algo ppo: the sampling its ratio needs, and the GRPO-only options it would ignore."""
    s, g = cfg.sampling, cfg.grpo
    _check_ratio_sampling(s, "PPO")
    if g.num_iterations != 1:
        raise ValueError(
            f"--grpo.num-iterations {g.num_iterations} is GRPO's; PPO's passes are --ppo.epochs: use that"
        )
    if g.kl_placement != "none":
        raise ValueError(
            f"--grpo.kl-placement {g.kl_placement} is GRPO's; PPO's KL is a per-token reward, weighted by "
            "--ppo.kl-coef: drop --grpo.kl-placement"
        )
    grpo_only = {
        "--grpo.dynamic-sampling": g.dynamic_sampling,
        "--grpo.mask-truncated": g.mask_truncated,
        "--grpo.top-entropy-quantile": g.top_entropy_quantile < 1,
    }
    if used := [flag for flag, on in grpo_only.items() if on]:
        raise ValueError(f"{', '.join(used)}: GRPO only, --algo ppo would ignore it; drop it")
    _check_loss_variants(g)


def _check_loss_variants(g: GRPOConfig) -> None:
    """The policy-loss variants and entropy options: combinations that clash."""
    if g.dual_clip and g.policy_loss != "clip":
        raise ValueError(
            f"--grpo.dual-clip bounds the clipped surrogate, and --grpo.policy-loss {g.policy_loss} already "
            "caps its importance weight at 1 + eps_high: drop --grpo.dual-clip, or use --grpo.policy-loss clip"
        )
    if g.top_entropy_quantile < 1 and g.ratio_level != "token":
        raise ValueError(
            f"--grpo.top-entropy-quantile {g.top_entropy_quantile} keeps the gradient of some tokens, but with "
            "--grpo.ratio-level sequence every token's loss depends on the whole sequence's ratio, so the mask "
            "only reweights sequences: use --grpo.ratio-level token, or --grpo.top-entropy-quantile 1"
        )


# ----------------------------------------------------------------------------- the side commands' tables

SEED_SETS = {"seeds": at_least(0), "resamples": at_least(1), "bootstrap_seed": at_least(0)}
EVAL: dict[str, dict[str, Range]] = {  # python eval.py SUBCOMMAND, by the subcommand's dataclass
    "Generate": {
        "batch_size": at_least(1),
        "num_samples": at_least(1),
        "limit": at_least(0, "0 = all"),
        "seed": at_least(0),
        **SAMPLING,
        **nested("env", ENV),
    },
    "Score": {"resamples": at_least(1), "seed": at_least(0), **nested("reward", REWARD)},
    "GradeArgs": GRADE,
    "Compare": {"resamples": at_least(1), "seed": at_least(0), **nested("reward", REWARD)},
    "Elo": {
        "resamples": at_least(1),
        "prior": above(0, "virtual tied games per pair: keeps every rating finite"),
        "seed": at_least(0),
        **nested("server", JUDGE),
        **nested("reward", REWARD),
    },
    "Report": {"max_sample_steps": at_least(2, "the first logged step and the latest")},
    "SeedsArgs": SEED_SETS,
    "TableArgs": SEED_SETS,
}
RLVRR = {  # python -m nanogrpo.lab.rlvrr
    "seeds": at_least(1, "2 for a std"),
    "steps": at_least(0, "0 = the model's default"),
    "eval_prompts": at_least(1),
    "threads": at_least(1),
    "resamples": at_least(1),
}
PROBE_COMPARE = {  # python -m nanogrpo.probe compare
    "folds": Range(2, also=0, note="0 = one train/dev/test split"),
    "test_frac": within(0, 1, lo_open=True, hi_open=True),
    "dev_frac": PROBE_TRAIN["dev_frac"],
    "seed": at_least(0),
    "probe_l2": above(0),
    "resamples": at_least(1),
    "batch_size": at_least(1),
    "max_len": at_least(1),
}
_DRAFT = {  # every LLM subcommand of python -m nanogrpo.reward_data
    "price_in": at_least(0, "dollars per 1M tokens"),
    "price_out": at_least(0, "dollars per 1M tokens"),
    "limit": at_least(0, "0 = all"),
    "chunk": at_least(0, "0 = 4 x --llm.concurrency"),
    **nested("llm", JUDGE),
}
REWARD_DATA: dict[str, dict[str, Range]] = {  # python -m nanogrpo.reward_data SUBCOMMAND (and .convert)
    "KeypointsArgs": {
        **_DRAFT,
        "share": within(0, 1, lo_open=True),
        "max_words": at_least(1),
        "max_points": at_least(1),
        "max_ref_chars": at_least(1),
    },
    "StyleArgs": {
        **_DRAFT,
        "max_code_checks": at_least(1),
        "check_seconds": above(0),
        "check_memory_mb": at_least(1),
        "max_ref_chars": at_least(1),
    },
    "RubricArgs": {
        **_DRAFT,
        "hard": at_least(0),
        "soft": at_least(0),
        "max_weight": above(0),
        "max_ref_chars": at_least(1),
    },
    "LabelArgs": {**_DRAFT, "max_response_chars": at_least(1)},
    "FilterArgs": {
        "threshold": ANY,
        "batch_size": at_least(1),
        "limit": at_least(0, "0 = all"),
        **nested("reward", REWARD),
    },
    "BaselineArgs": {
        "share": within(0, 1, lo_open=True),
        "seed": at_least(0),
        "limit": at_least(0, "0 = all"),
    },
    "Mcq": {},
    "Split": {"ratios": within(0, 1), "seed": at_least(0)},
}
LAB: dict[str, dict[str, Range]] = {  # python -m nanogrpo.lab.NAME (argparse: by dest)
    "ablate": {
        "betas": at_least(0),
        "seeds": at_least(0),
        "steps": at_least(1),
        "mu": at_least(1),
        "lr": above(0),
        "noise": at_least(0),
        "rows": at_least(1),
        "sft_steps": at_least(0),
        "sft_lr": above(0),
        "threads": at_least(1),
        "jobs": at_least(1),
    },
    "klcheck": {
        "distances": at_least(0),
        "old_shift": at_least(0),
        "group": within(2, 3, "81^G groups are enumerated"),
        "seed": at_least(0),
    },
    "ppo_vs_grpo": {
        "lrs": above(0),
        "kls": at_least(0),
        "grpo_kl": at_least(0, "0 = no KL"),
        "seeds": at_least(0),
        "steps": at_least(1),
        "group": at_least(2),
        "prompts": at_least(1),
        "tokens": at_least(1),
        "ppo_samples": at_least(0, "0 = --group"),
        "threads": at_least(1),
    },
}
