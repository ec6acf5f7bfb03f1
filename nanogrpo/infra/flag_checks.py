"""The checks of a run's flags before any model loads (`check_config`): each number in its declared range
(the Range on each field of nanogrpo/config.py's dataclasses, read by nanogrpo_base/ranges.py's check_ranges),
then the flags among themselves: settings the trainer would get wrong or silently ignore. The side commands
built on dataclasses (eval.py's subcommands, nanogrpo.reward_data, nanogrpo.lab.rlvrr) call the same
check_ranges on their own fields; the tables below are the ranges of the commands without a dataclass (a
function's arguments, argparse). tests/test_flag_ranges.py walks every numeric field of every command and
fails on one without a range."""

from __future__ import annotations

from nanogrpo.config import GRPOConfig, SamplingConfig, TrainConfig
from nanogrpo_base.ranges import Range, above, at_least, check_ranges, within


def check_config(cfg: TrainConfig) -> None:
    """Refuse, before any model loads, settings the trainer would get wrong or silently ignore, from the flags
    alone (train.py also checks --eval-every's held-out rows and --model.attn flash's flash-attn)."""
    check_ranges(cfg)  # every number finite and in its field's range; no option means 'no limit' by inf
    if not cfg.out_dir.strip():
        raise ValueError("--out-dir '': name the run's folder (e.g. --out-dir runs/my-run)")
    if cfg.plain:
        _check_plain(cfg)
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


def _check_plain(cfg: TrainConfig) -> None:
    """--plain runs the reading path: a fast path asked for beside it is refused, not silently skipped."""
    if cfg.model.attn == "flash":
        raise ValueError("--plain computes attention as SDPA does; drop --model.attn flash (or --plain)")
    if cfg.sampling.decode not in ("eager", "plain"):
        raise ValueError(
            f"--plain samples with the plain loop; drop --sampling.decode {cfg.sampling.decode} (or --plain)"
        )


def _check_env(cfg: TrainConfig) -> None:
    """--env.*: what episodes cannot do yet, and a budget that cannot hold one turn."""
    e = cfg.env
    e.check_used()  # --env.* flags without an environment
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


# ----------------------------------------------------------------------------- commands without a dataclass
# (a function's arguments; argparse's Namespace, by dest): their tables

PROBE_COMPARE = {  # python -m nanogrpo.eval.probe compare
    "folds": Range(2, also=0, note="0 = one train/dev/test split"),
    "test_frac": within(0, 1, lo_open=True, hi_open=True),
    "dev_frac": within(0, 1, "the share of questions held out", lo_open=True, hi_open=True),
    "seed": at_least(0),
    "probe_l2": above(0),
    "resamples": at_least(1),
    "batch_size": at_least(1),
    "max_len": at_least(1),
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
