"""The checks of a run's flags among themselves, made before any model loads (`check_config`): values that
mean nothing, and settings the trainer would get wrong or silently ignore. The dataclasses they check are in
nanogrpo/config.py."""

from __future__ import annotations

import math
from dataclasses import fields, is_dataclass

from nanogrpo.config import GRPOConfig, SamplingConfig, TrainConfig, check_group_size


def _non_finite(obj, prefix: str = "") -> list[str]:
    """The flags of every float field (nested configs included) set to inf or NaN."""
    bad = []
    for f in fields(obj):
        v, name = getattr(obj, f.name), f"{prefix}{f.name}"
        if is_dataclass(v):
            bad += _non_finite(v, name + ".")
        elif isinstance(v, float) and not math.isfinite(v):
            bad.append(f"--{name.replace('_', '-')} {v}")
    return bad


def check_config(cfg: TrainConfig) -> None:
    """Refuse, before any model loads, settings the trainer would get wrong or silently ignore, from the flags
    alone (train.py also checks --eval-every's held-out rows and --model.attn flash's flash-attn)."""
    if bad := _non_finite(cfg):  # an infinite lr or beta trains to NaN; no option means 'no limit' by inf
        raise ValueError(f"{', '.join(bad)}: every number must be finite; give a finite value")
    if not cfg.out_dir.strip():
        raise ValueError("--out-dir '': name the run's folder (e.g. --out-dir runs/my-run)")
    if cfg.algo == "ppo":
        _check_ppo(cfg)
        return
    if cfg.algo == "dpo" and not cfg.dpo.beta > 0:
        raise ValueError(f"--dpo.beta {cfg.dpo.beta}: the DPO loss needs beta > 0 (the paper's is 0.1)")
    if cfg.algo != "grpo":
        return
    g, s = cfg.grpo, cfg.sampling
    check_group_size(g.group_size)
    _check_env(cfg)
    _check_ratio_sampling(s, "GRPO")
    if g.kl_placement != "none" and g.beta == 0:
        raise ValueError(
            f"--grpo.kl-placement {g.kl_placement} with --grpo.beta 0 computes a KL that does nothing: set "
            "--grpo.beta > 0, or --grpo.kl-placement none"
        )
    if g.dynamic_sampling and (g.zero_spread_tol < 0 or g.max_resample_rounds < 0):
        raise ValueError(
            f"--grpo.zero-spread-tol {g.zero_spread_tol} / --grpo.max-resample-rounds {g.max_resample_rounds}:"
            " both must be >= 0"
        )
    if g.is_correction != "none" and not g.is_cap > 1:
        raise ValueError(f"--grpo.is-cap {g.is_cap}: the cap of an importance weight must be > 1 (e.g. 2)")
    _check_loss_variants(g)


def _check_env(cfg: TrainConfig) -> None:
    """--env.*: ranges, and what episodes cannot do yet."""
    e = cfg.env
    if not e.on:
        return
    if cfg.algo != "grpo":
        raise ValueError(f"--env.* trains episodes with GRPO; --algo {cfg.algo} samples single completions")
    if e.max_turns < 0 or e.max_tokens < 0 or not e.step_timeout_s >= 0:
        raise ValueError(
            f"--env.max-turns {e.max_turns} / --env.max-tokens {e.max_tokens} / --env.step-timeout-s "
            f"{e.step_timeout_s}: each must be >= 0 (0: the environment's own, or no limit)"
        )
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
    """--algo ppo: GAE's and the value loss's ranges, and the GRPO-only options it would ignore."""
    p, s, g = cfg.ppo, cfg.sampling, cfg.grpo
    _check_ratio_sampling(s, "PPO")
    for name, v in (("gamma", p.gamma), ("lam", p.lam)):
        if not 0 <= v <= 1:
            raise ValueError(f"--ppo.{name} {v}: GAE's {name} is in [0, 1] (1 and 0.95 are the usual)")
    if not p.value_clip >= 0:
        raise ValueError(f"--ppo.value-clip {p.value_clip}: a distance, >= 0 (0.2 is usual, 0 = no clip)")
    if not p.vf_coef > 0:
        raise ValueError(f"--ppo.vf-coef {p.vf_coef}: the value head learns only from it; use > 0, e.g. 0.1")
    if not p.kl_coef >= 0:
        raise ValueError(
            f"--ppo.kl-coef {p.kl_coef}: a negative KL penalty pays for drift; use >= 0 (0 = none)"
        )
    if p.samples_per_prompt < 1 or p.epochs < 1:
        raise ValueError(
            f"--ppo.samples-per-prompt {p.samples_per_prompt} / --ppo.epochs {p.epochs}: both must be >= 1"
        )
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
    """The policy-loss variants and entropy options: values that mean nothing, and combinations that clash."""
    if g.dual_clip != 0 and not g.dual_clip > 1:
        raise ValueError(
            f"--grpo.dual-clip {g.dual_clip}: the bound -C * adv on a negative-advantage token's loss needs "
            "C > 1 (3 is verl's clip_ratio_c); use 0 for no dual clip"
        )
    if g.dual_clip and g.policy_loss != "clip":
        raise ValueError(
            f"--grpo.dual-clip bounds the clipped surrogate, and --grpo.policy-loss {g.policy_loss} already "
            "caps its importance weight at 1 + eps_high: drop --grpo.dual-clip, or use --grpo.policy-loss clip"
        )
    if not g.entropy_coef >= 0:
        raise ValueError(
            f"--grpo.entropy-coef {g.entropy_coef}: a negative bonus pushes the entropy down, toward collapse; "
            "use a coefficient >= 0 (e.g. 0.001), or 0 for none"
        )
    if not 0 < g.top_entropy_quantile <= 1:
        raise ValueError(
            f"--grpo.top-entropy-quantile {g.top_entropy_quantile}: the fraction of tokens that keep the "
            "policy gradient, in (0, 1]; 0.2 is the paper's, 1 keeps every token"
        )
    if g.top_entropy_quantile < 1 and g.ratio_level != "token":
        raise ValueError(
            f"--grpo.top-entropy-quantile {g.top_entropy_quantile} keeps the gradient of some tokens, but with "
            "--grpo.ratio-level sequence every token's loss depends on the whole sequence's ratio, so the mask "
            "only reweights sequences: use --grpo.ratio-level token, or --grpo.top-entropy-quantile 1"
        )
