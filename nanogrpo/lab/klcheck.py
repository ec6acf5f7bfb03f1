"""Exact expected gradients of nanogrpo's KL terms, against the true KL gradients.

    python -m nanogrpo.lab.klcheck [--json] [--distances 0.1 0.3 1 3] [--old-shift 0.1] [--group 2]
    python -m nanogrpo.lab.klcheck lm [--json] [--samples N] ...   (the same on a language model: klcheck_lm.py)

On the enumerable tabular policy (nanogrpo.lab.toy: vocabulary 3, length 4, 81 sequences) every expectation is a
finite sum, so the EXPECTED gradient of a loss is computed exactly: all sequences (or all groups of G
sequences) go through the trainer's own code -- grpo.kl_penalty, grpo.compute_advantages and grpo.grpo_loss --
and each row's gradient is weighted by its sampling probability. A row's weight enters as a gradient scale
(value unchanged), which is exact because grpo_loss is a sum of independent per-row terms.

Targets (gradients w.r.t. the policy's logits; the loss gradient is compared per unit beta, per sequence):
  rev      grad KL(pi || ref)                    the reverse KL that GRPO's objective means
  fwd      grad KL(ref || pi)                    the forward KL
  tok_rev  grad sum_c w(c) KL(pi(.|c) || ref(.|c)), visit weights w(c) of the SAMPLING policy held fixed
  tok_fwd  the same with the forward per-prefix KL
  rev-tokfwd  rev - tok_fwd: what k3 summed into the reward estimates (E[k3(l_t)] = KL, minus its pathwise part)
  away     -grad KL(pi_old || pi) (off-policy only): descending it moves pi away from pi_old
On-policy the samples come from pi; off-policy from pi_old = pi with logits shifted by `old_shift` * noise,
with the trainer's importance ratio (clipped surrogate, kl_is_weight).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, replace

import torch

from nanogrpo.config import GRPOConfig
from nanogrpo.grpo import compute_advantages, grpo_loss, kl_penalty
from nanogrpo.infra.flag_checks import LAB
from nanogrpo.lab.toy import TabularPolicy
from nanogrpo_base.ranges import check_or_exit

TARGETS = ("rev", "fwd", "tok_rev", "tok_fwd", "rev-tokfwd", "away")
MATCH_TOL = 1e-6  # relative error under which a row "matches" a target


@dataclass(frozen=True)
class Variant:
    """One way of putting KL into the trainer; `name` is what the table prints."""

    name: str
    cfg: GRPOConfig
    baseline: str = "none"  # placement 'reward': 'none' (the bare score function) or the trainer's advantages


def variants(group: int) -> list[Variant]:
    """Every estimator x placement the trainer offers (in the loss: per token / sequence, with / without IS)."""
    base = GRPOConfig(beta=1.0, loss_agg="token-mean")
    out = []
    for est in ("k1", "k2", "k3"):
        for seq in (False, True):
            for iw in (False, True):
                name = f"loss {est} {'seq' if seq else 'token'}{' +IS' if iw else ''}"
                c = replace(base, kl_placement="loss", kl_estimator=est, kl_reward_to_go=seq, kl_is_weight=iw)
                out.append(Variant(name, c))
    for est in ("k1", "k2", "k3"):
        out.append(
            Variant(f"reward {est} sum, no baseline", replace(base, kl_placement="reward", kl_estimator=est))
        )
    rew = replace(base, kl_placement="reward", kl_estimator="k1", group_size=group)
    out += [
        Variant(
            f"reward k1 sum, rloo G={group}", replace(rew, adv_estimator="rloo", scale_rewards="none"), "adv"
        ),
        Variant(f"reward k1 sum, grpo G={group}", replace(rew, scale_rewards="none"), "adv"),
        Variant(f"reward k1 sum, grpo/std G={group}", rew, "adv"),
    ]
    return out


def expected_grad(
    pol: TabularPolicy, theta: torch.Tensor, theta_s: torch.Tensor, theta_ref: torch.Tensor, v: Variant
) -> torch.Tensor:
    """E_{y ~ pi_s}[ d loss / d theta ] per unit beta and per sequence, through grpo's own functions.

    theta_s: the sampling policy (== theta on-policy). Loss rows are whole sequences of length T.
    """
    T, c = pol.T, v.cfg
    theta = theta.detach().requires_grad_(True)
    p_s = torch.exp(pol.seq_logp(theta_s)).detach()  # (S,)
    if v.cfg.kl_placement == "reward" and v.baseline == "adv":
        G = c.group_size  # every ordered group of G sequences, rows laid out group by group
        idx = torch.cartesian_prod(*[torch.arange(pol.n_seq)] * G).reshape(-1)  # (S^G * G,)
        w_row = p_s[idx].view(-1, G).prod(-1).repeat_interleave(G) / G  # (S^G * G,) group prob / G
    else:
        idx, w_row = torch.arange(pol.n_seq), p_s  # (S,)
    logp = pol.token_logp(theta, idx)  # (N, T)
    old_logp = pol.token_logp(theta_s, idx).detach()  # (N, T) what the sampler recorded
    ref_logp = pol.token_logp(theta_ref, idx).detach()  # (N, T)
    mask = torch.ones_like(logp)
    N = logp.shape[0]
    if c.kl_placement == "reward":
        rewards = -c.beta * kl_penalty(old_logp, ref_logp, mask, c)  # (N,) the penalty is the only reward
        adv = compute_advantages(rewards, c)[0] if v.baseline == "adv" else rewards
    else:
        adv = torch.zeros(N, dtype=logp.dtype)
    # Weight row i by w_i * N * T: token-mean divides by N * T, so the result is sum_i w_i sum_t dterm_it.
    scale = (w_row * N * T)[:, None]  # (N, 1)
    logp_w = logp.detach() + (logp - logp.detach()) * scale  # value logp, gradient scaled per row
    loss, _ = grpo_loss(logp_w, old_logp, ref_logp, adv, mask, c, num_seqs=N, num_tokens=N * T, max_len=T)
    (g,) = torch.autograd.grad(loss, theta)
    return g / c.beta


def target_grads(
    pol: TabularPolicy, theta: torch.Tensor, theta_s: torch.Tensor, theta_ref: torch.Tensor, off_policy: bool
) -> dict[str, torch.Tensor]:
    """Exact gradients of the reference quantities (module docstring) w.r.t. theta."""

    def grad(f) -> torch.Tensor:
        th = theta.detach().requires_grad_(True)
        return torch.autograd.grad(f(th), th)[0]

    w = pol.visits(theta_s)  # (n_ctx,) prefix visit probabilities of the sampler, held fixed
    out = {
        "rev": grad(lambda th: pol.kl(th, theta_ref)),
        "fwd": grad(lambda th: pol.kl(theta_ref, th)),
        "tok_rev": grad(lambda th: (w * pol.ctx_kl(th, theta_ref)).sum()),
        "tok_fwd": grad(lambda th: (w * pol.ctx_kl(theta_ref, th)).sum()),
    }
    out["rev-tokfwd"] = out["rev"] - out["tok_fwd"]
    if off_policy:
        out["away"] = -grad(lambda th: pol.kl(theta_s, th))
    return out


def compare(g: torch.Tensor, t: torch.Tensor) -> dict[str, float]:
    """Relative error |g - t| / |t|, cosine and norm ratio |g| / |t| (|g| alone when t = 0)."""
    gn, tn = g.norm().item(), t.norm().item()
    cos = (g * t).sum().item() / (gn * tn) if gn > 0 and tn > 0 else float("nan")
    return {
        "rel_err": (g - t).norm().item() / tn if tn > 0 else float("nan"),
        "cos": cos,
        "norm_ratio": gn / tn if tn > 0 else float("nan"),
    }


def run(
    distances: tuple[float, ...] = (0.1, 0.3, 1.0, 3.0), old_shift: float = 0.1, group: int = 2, seed: int = 0
) -> list[dict]:
    """One record per (regime, distance, variant): grad norm, KL(pi||ref), comparisons with each target."""
    pol = TabularPolicy(V=3, T=4)
    gen = torch.Generator().manual_seed(seed)
    theta_ref = pol.init(1.0, gen)  # a non-uniform reference
    direction = pol.init(1.0, gen)
    old_noise = pol.init(1.0, gen)
    records = []
    for regime in ("on", "off"):
        for d in distances:
            theta = theta_ref + d * direction
            theta_s = theta + old_shift * old_noise if regime == "off" else theta
            targets = target_grads(pol, theta, theta_s, theta_ref, regime == "off")
            kl = pol.kl(theta, theta_ref).item()
            for v in variants(group):
                g = expected_grad(pol, theta, theta_s, theta_ref, v)
                cmp = {k: compare(g, t) for k, t in targets.items()}
                matches = [k for k, m in cmp.items() if m["rel_err"] < MATCH_TOL]
                records.append(
                    {
                        "regime": regime,
                        "distance": d,
                        "kl_rev": kl,
                        "variant": v.name,
                        "grad_norm": g.norm().item(),
                        "matches": matches,
                        **{f"{k}/{m}": val for k, c in cmp.items() for m, val in c.items()},
                    }
                )
    return records


def _fmt(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.2e}" if abs(x) < 1e-3 or abs(x) >= 1e3 else f"{x:.4f}"


def table(records: list[dict]) -> str:
    """Plain-text table: one line per (regime, distance, variant)."""
    head = f"{'regime':6} {'dist':>5} {'KL(pi|ref)':>10}  {'variant':34} {'|g|':>9} "
    head += f"{'err rev':>9} {'cos rev':>8} {'|g|/|rev|':>9} {'err fwd':>9} {'err tokrev':>10} {'err tokfwd':>10}  matches"
    lines = [head, "-" * len(head)]
    for r in records:
        lines.append(
            f"{r['regime']:6} {r['distance']:5.2f} {r['kl_rev']:10.4f}  {r['variant']:34} {_fmt(r['grad_norm']):>9} "
            f"{_fmt(r['rev/rel_err']):>9} {_fmt(r['rev/cos']):>8} {_fmt(r['rev/norm_ratio']):>9} "
            f"{_fmt(r['fwd/rel_err']):>9} {_fmt(r['tok_rev/rel_err']):>10} {_fmt(r['tok_fwd/rel_err']):>10}  "
            + (",".join(r["matches"]) or "-")
        )
    return "\n".join(lines)


def main_lm(argv: list[str]) -> None:
    """`klcheck lm`: the checker on a language model (nanogrpo/lab/klcheck_lm.py)."""
    from nanogrpo.lab import klcheck_lm

    d = klcheck_lm.LMCheck()
    ap = argparse.ArgumentParser(
        prog="python -m nanogrpo.lab.klcheck lm", description="the KL checker on an LM"
    )
    ap.add_argument("--json", action="store_true", help="print the records as JSON instead of the table")
    ap.add_argument(
        "--model", default=d.model, help="'smollm2', 'tiny' or an HF folder nanogrpo's model runs"
    )
    ap.add_argument("--lengths", type=int, nargs="+", default=list(d.lengths), help="completion lengths T")
    ap.add_argument("--distances", type=float, nargs="+", default=list(d.distances), help="adapter B scales")
    ap.add_argument("--regimes", nargs="+", choices=("on", "off"), default=list(d.regimes))
    ap.add_argument("--samples", type=int, default=d.samples, help="rows a (regime, distance, length)")
    ap.add_argument("--batch", type=int, default=d.batch, help="rows a batch (even; the CIs' unit)")
    ap.add_argument("--rank", type=int, default=d.rank, help="the adapters' rank")
    ap.add_argument("--layers", type=int, default=d.layers, help="adapters on the last LAYERS blocks")
    ap.add_argument("--old-shift", type=float, default=d.old_shift, help="off-policy: pi_old's noise scale")
    ap.add_argument("--seed", type=int, default=d.seed)
    a = ap.parse_args(argv)
    c = klcheck_lm.LMCheck(a.model, tuple(a.lengths), tuple(a.distances), tuple(a.regimes), a.samples, a.batch, a.rank,
                a.layers, a.old_shift, a.seed)  # fmt: skip
    try:
        recs = klcheck_lm.run(c, progress=not a.json)
    except ValueError as e:
        raise SystemExit(f"klcheck lm: {e}") from None
    print(json.dumps(recs, indent=1) if a.json else klcheck_lm.table(recs))


def main(argv: list[str] | None = None) -> None:
    import sys

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["lm"]:
        return main_lm(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m nanogrpo.lab.klcheck", description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print the records as JSON instead of the table")
    ap.add_argument(
        "--distances", type=float, nargs="+", default=[0.1, 0.3, 1.0, 3.0], help="theta - theta_ref scales"
    )
    ap.add_argument(
        "--old-shift", type=float, default=0.1, help="off-policy: logit noise scale of pi_old vs pi"
    )
    ap.add_argument(
        "--group", type=int, default=2, help="G for the group-baseline rows (81^G groups enumerated)"
    )
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    check_or_exit(a, LAB["klcheck"])  # each number in its range (nanogrpo/infra/flag_checks.py)
    torch.set_num_threads(1)  # tensors of a few hundred numbers: threads only add overhead
    recs = run(tuple(a.distances), a.old_shift, a.group, a.seed)
    print(json.dumps(recs, indent=1) if a.json else table(recs))


if __name__ == "__main__":
    main()
