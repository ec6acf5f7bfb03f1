"""The KL checker on a language model: Monte Carlo expected gradients of nanogrpo's KL terms on a real LM with a
LoRA policy, against the reverse-KL gradient (and the forward and per-prefix ones), with 95% CIs.

    python -m nanogrpo.lab.klcheck lm [--json] [--model smollm2] [--lengths 4 16 64] [--distances 0.5 1.5]
                                       [--samples 256] [--batch 16] [--regimes on off]

The policy pi is the model (SmolLM2-135M-Instruct by default) with LoRA adapters (rank `rank` on every linear
layer of its last `layers` blocks) set at `distance` from the reference, the model with its adapters off: B =
distance x a fixed random direction (A random too), so KL(pi || ref) grows about as distance^2; each line of
the table says the KL it measured. Off-policy the rows come from pi_old, pi's adapters plus `old_shift` x a
fixed noise, and the trainer's importance ratio pi / pi_old is live, as in the toy checker.

A row is a demo prompt and exactly T sampled tokens (no EOS stop: the distribution of a completion's first T
tokens), two rows a prompt (the group-baseline variants' groups), sampled by nanogrpo's plain sampler. For each
batch of `batch` rows (its own prompts and generators):
- the trainer's log-probs: LogprobHead's forward (with grad through the adapters) and plain_token_logprobs on
  its hidden states; the reference's with the adapters off (lora.disabled); pi_old's off-policy;
- each variant's loss through grpo.kl_penalty, compute_advantages and grpo_loss, called exactly as the toy
  checker calls them (klcheck.variants: every estimator x placement), differentiated w.r.t. the adapters per
  sequence and per unit beta;
- each target's estimate, every one unbiased (KL_t: the KL at position t over the whole vocabulary, given the
  sampled prefix; u_t, v_t: the exact gradients of the reverse and forward KL_t; s_t = grad log pi(y_t)):
    tok_rev  E_s[sum_t u_t]                   the per-prefix reverse KL, the prefixes' distribution held fixed
    tok_fwd  E_s[sum_t v_t]                   the same, forward (the toy checker's visit weights: the sampler's)
    rev      E_s[rho (sum_t u_t + sum_t s_t (sum_{t'>t} KL_t' - b_t))]   = grad KL(pi || ref): the derivative of
             E_pi[sum_t KL_t] (the sequence KL), its score term with each token's future KL in place of the
             sampled log-ratios (their expectation given the prefix), less a baseline b_t from the other rows;
             rho = pi(y) / pi_s(y), 1 on-policy
    fwd      E_s[sum_t (ref(y<t) / pi_s(y<t)) v_t]   = E_ref[sum_t v_t] = grad KL(ref || pi)
    away     E_s[sum_t s_t] = -grad KL(pi_s || pi)     (off-policy)
  The gradient of a row's log-prob w.r.t. its final hidden state is taken once through the LM head; each
  variant and target is then one backward pass from the hidden states through the adapted blocks (the
  chain rule, exact: a token's log-prob depends only on its own hidden state).

Comparing noisy vectors: with K independent batches and per-batch estimates a_k, b_k of E a and E b, the mean
of <a_k, b_l> over pairs k != l is an unbiased estimate of <E a, E b>. So |E g - E t|^2, |E t|^2 and
<E g, E t> are estimated without the noise floor that |mean g - mean t| would carry; relative error, cosine
and norm ratio are their ratios. The 95% CIs are delete-one-batch jackknife intervals, on the squares for the
error and the norm ratio (a squared error whose interval reaches 0 covers the target: `matches`).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch

from nanogrpo.grpo import compute_advantages, grpo_loss, kl_penalty
from nanogrpo.model import lora
from nanogrpo.model.logprobs import LogprobHead, plain_token_logprobs
from nanogrpo.model.sampling import generate, pad_left

TARGETS = ("rev", "fwd", "tok_rev", "tok_fwd", "rev-tokfwd", "away")
GROUP = 2  # rows a prompt: the group-baseline variants' groups
Z = 1.959964  # the 95% normal quantile


@dataclass(frozen=True)
class LMCheck:
    """One run of the checker (module docstring)."""

    model: str = "smollm2"
    """The model: a name nanogrpo knows ('smollm2', 'tiny') or an HF folder of an architecture it runs."""
    lengths: tuple[int, ...] = (4, 16, 64)
    """Completion lengths T (tokens sampled a row)."""
    distances: tuple[float, ...] = (0.5, 1.5)
    """Scales of the adapters' B (the policy's distance from the reference)."""
    regimes: tuple[str, ...] = ("on", "off")
    """'on': rows from pi; 'off': from pi_old, pi's adapters shifted by old_shift x a fixed noise."""
    samples: int = 256
    """Rows a (regime, distance, length): its batches x batch."""
    batch: int = 16
    """Rows a batch (an even number: two rows a prompt); the CIs come from the spread between batches."""
    rank: int = 4
    """The adapters' rank."""
    layers: int = 1
    """The last `layers` blocks get adapters on every linear layer."""
    old_shift: float = 0.3
    """Off-policy: the noise added to the adapters' B for pi_old, relative to the direction's scale."""
    seed: int = 0


def adapted_model(name: str, rank: int, layers: int):
    """(model in float32 with LoRA on every linear layer of its last `layers` blocks, tokenizer)."""
    from nanogrpo.model.transformer import Transformer
    from nanogrpo.model.zoo import load_tokenizer, resolve_model

    path = resolve_model(name)
    model = Transformer.from_pretrained(path, dtype=torch.float32)
    n = model.config.num_hidden_layers
    last = "|".join(str(i) for i in range(max(0, n - layers), n))
    lora.inject_lora(
        model, r=rank, alpha=rank, targets=rf"model\.layers\.({last})\.(self_attn|mlp)\.\w+_proj"
    )
    return model.eval(), load_tokenizer(path)


def adapter_weights(model, gen: torch.Generator) -> tuple[dict, dict]:
    """A fixed random A and B direction for every adapter, and a fixed noise of B's shape (pi_old)."""
    direction, noise = {}, {}
    for name, m in lora.lora_modules(model).items():
        out_f, r = m.lora_B.weight.shape
        a = torch.randn(m.lora_A.weight.shape, generator=gen) / math.sqrt(m.lora_A.weight.shape[1])
        direction[name] = (a, torch.randn(out_f, r, generator=gen) / math.sqrt(r))
        noise[name] = torch.randn(out_f, r, generator=gen) / math.sqrt(r)
    return direction, noise


def set_adapters(
    model, direction: dict, distance: float, noise: dict | None = None, shift: float = 0.0
) -> None:
    """A = the direction's A, B = distance x (its B + shift x noise): pi, or pi_old with the noise."""
    with torch.no_grad():
        for name, m in lora.lora_modules(model).items():
            a, b = direction[name]
            m.lora_A.weight.copy_(a)
            m.lora_B.weight.copy_(distance * (b + shift * noise[name] if noise is not None else b))


def batch_vectors(model, prompts, gens, T: int, variants, off: bool, direction, noise, c: LMCheck, d: float):
    """One batch: {name: the flat gradient estimate over the adapters} for every variant and target, and the
    batch's estimate of the sequence KL(pi || ref) (the mean of rho L)."""
    from nanogrpo.rollout import make_batch

    params = lora.trainable_parameters(model)
    set_adapters(model, direction, d, noise if off else None, c.old_shift)  # the sampling policy
    gen = generate(model, prompts, group_size=GROUP, max_new_tokens=T, temperature=1.0, generator=gens)
    assert int(gen.lengths.min()) == T  # no EOS stop: every row has T tokens
    ids, attn = pad_left(prompts, 0)
    rows = torch.arange(len(prompts)).repeat_interleave(GROUP)
    b = make_batch(
        ids[rows], attn[rows], gen.completion_ids.clone(), gen.mask.clone()
    )  # out of inference mode
    N, Tp = len(b), b.prompt_len
    head, W = LogprobHead(model), model.lm_head.weight.detach()  # W (V, H)
    forward = lambda: head.completion_hidden(b.ids, b.attn, b.pos, Tp, T, b.group, b.mask)  # noqa: E731 (N, T, H)
    token_logp = lambda h: plain_token_logprobs(h.reshape(N * T, -1), W, b.targets.reshape(-1), 1.0)[0].view(
        N, T
    )  # noqa: E731
    with torch.no_grad():
        old_logp = token_logp(forward()) if off else None  # (N, T) pi_old's, the sampler's
        with lora.disabled(model):
            ref_logq = (forward() @ W.T).float().log_softmax(-1)  # (N, T, V)
    set_adapters(model, direction, d)  # pi
    hidden = forward()  # (N, T, H), with grad through the adapters
    h0 = hidden.detach().requires_grad_(True)  # (N, T, H)
    logp = token_logp(h0)  # (N, T) the trainer's log-probs
    (score,) = torch.autograd.grad(logp.sum(), h0)  # (N, T, H): d log pi(y_t) / d h_t
    logq = (h0 @ W.T).float().log_softmax(-1)  # (N, T, V)
    kl_rev = (logq.exp() * (logq - ref_logq)).sum(-1)  # (N, T) KL(pi(.|y<t) || ref(.|y<t))
    kl_fwd = (ref_logq.exp() * (ref_logq - logq)).sum(-1)  # (N, T) KL(ref(.|y<t) || pi(.|y<t))
    (u,) = torch.autograd.grad(kl_rev.sum(), h0, retain_graph=True)  # (N, T, H): logq is shared
    (v,) = torch.autograd.grad(kl_fwd.sum(), h0)  # (N, T, H)
    logp = logp.detach()
    ref_logp = ref_logq.gather(-1, b.targets[..., None])[..., 0]  # (N, T)
    old_logp = old_logp if off else logp
    L = (logp - ref_logp).sum(-1)  # (N,) log pi(y) / ref(y)
    rho = (logp - old_logp).sum(-1).exp()  # (N,) pi(y) / pi_s(y): 1 on-policy
    future = kl_rev.detach().flip(-1).cumsum(-1).flip(-1) - kl_rev.detach()  # (N, T) sum_{t' > t} KL_t'
    future = future - (future.sum(0, keepdim=True) - future) / (N - 1)  # less the other rows' mean (baseline)
    to_ref = torch.exp(
        (ref_logp - old_logp).cumsum(-1) - (ref_logp - old_logp)
    )  # (N, T) ref(y<t) / pi_s(y<t)
    row = rho[:, None, None] / N  # (N, 1, 1) a row's share, reweighted to pi
    outputs = {
        "rev": row * (u + future[..., None] * score),
        "fwd": to_ref[..., None] * v / N,
        "tok_rev": u / N,
        "tok_fwd": v / N,
        **({"away": score / N} if off else {}),
    }
    for var in variants:
        outputs[var.name] = variant_coefficients(var, logp, old_logp, ref_logp, b.mask)[..., None] * score
    vectors = {}
    for name, dh in outputs.items():  # one backward each, from the hidden states through the adapted blocks
        grads = torch.autograd.grad(hidden, params, grad_outputs=dh, retain_graph=True)
        vectors[name] = torch.cat([g.reshape(-1) for g in grads])
    vectors["rev-tokfwd"] = vectors["rev"] - vectors["tok_fwd"]
    return vectors, float((rho * L).mean())


def variant_coefficients(var, logp, old_logp, ref_logp, mask) -> torch.Tensor:
    """d loss / d log pi(y_t) (N, T) of one variant, per sequence and per unit beta: the toy checker's call of
    kl_penalty, compute_advantages and grpo_loss on this batch's rows (klcheck.expected_grad)."""
    c = var.cfg
    N, T = logp.shape
    leaf = logp.detach().requires_grad_(True)
    if c.kl_placement == "reward":
        rewards = -c.beta * kl_penalty(old_logp, ref_logp, mask, c)  # (N,) the penalty is the only reward
        adv = compute_advantages(rewards, c)[0] if var.baseline == "adv" else rewards
    else:
        adv = torch.zeros(N)
    loss, _ = grpo_loss(leaf, old_logp, ref_logp, adv, mask, c, num_seqs=N, num_tokens=N * T, max_len=T)
    (g,) = torch.autograd.grad(loss, leaf)
    return g * T / c.beta  # token-mean divides by N * T: times T, the mean over rows of each row's sum


def gram_stats(vectors: list[dict[str, torch.Tensor]], names: list[str]) -> dict:
    """U-statistics <E a, E b> (mean of <a_k, b_l>, k != l) for every pair of names, and their delete-one
    jackknife replicates: {'full': (Q, Q), 'loo': (K, Q, Q)}."""
    K = len(vectors)
    X = torch.stack([torch.stack([vec[n].double() for n in names]) for vec in vectors])  # (K, Q, P)
    G = torch.einsum("kap,lbp->kalb", X, X)  # (K, Q, K, Q)
    total = G.sum((0, 2))  # (Q, Q) sum over all k, l
    same = torch.einsum("kakb->ab", G)  # (Q, Q) sum over k == l
    full = (total - same) / (K * (K - 1))
    row = G.sum(2)  # (K, Q, Q): sum over l of <a_k, b_l>
    col = G.sum(0).permute(1, 0, 2)  # (K, Q, Q): sum over k of <a_k, b_l>, indexed by l
    own = torch.einsum("kakb->kab", G)  # (K, Q, Q)
    loo = (total - same - (row - own) - (col - own)) / ((K - 1) * (K - 2))  # pairs without batch k
    return {"full": full, "loo": loo}


def jackknife(full: float, loo: torch.Tensor) -> tuple[float, float]:
    """(lo, hi) of the 95% delete-one jackknife interval of a statistic and its replicates (K,)."""
    K = loo.numel()
    loo = loo[torch.isfinite(loo)]
    if loo.numel() < 2 or not math.isfinite(full):
        return float("nan"), float("nan")
    se = math.sqrt((K - 1) / K * float(((loo - loo.mean()) ** 2).sum()))
    return full - Z * se, full + Z * se


def compare(stats: dict, names: list[str], g: str, t: str) -> dict[str, float]:
    """Relative error, cosine and norm ratio of variant g against target t, each with its 95% CI."""
    i, j = names.index(g), names.index(t)

    def parts(m: torch.Tensor):
        gg, tt, gt = m[..., i, i], m[..., j, j], (m[..., i, j] + m[..., j, i]) / 2
        return gg - 2 * gt + tt, tt, gg, gt  # |g - t|^2, |t|^2, |g|^2, <g, t>

    def ratios(m: torch.Tensor):
        err2, tt, gg, gt = parts(m)
        both = (gg > 0) & (tt > 0)  # a cosine needs both squared norms estimated above 0
        cos = torch.where(both, gt / (gg * tt).clamp(min=1e-300).sqrt(), torch.full_like(gt, float("nan")))
        return err2 / tt, cos, gg / tt

    out = {}
    for key, full, loo in zip(("err2", "cos", "norm2"), ratios(stats["full"]), ratios(stats["loo"])):
        out[key], (out[key + "_lo"], out[key + "_hi"]) = float(full), jackknife(float(full), loo)
    root = lambda x: math.sqrt(x) if x > 0 else 0.0 if math.isfinite(x) else float("nan")  # noqa: E731
    return {
        "rel_err": root(out["err2"]), "rel_err_lo": root(out["err2_lo"]), "rel_err_hi": root(out["err2_hi"]),
        "cos": out["cos"], "cos_lo": out["cos_lo"], "cos_hi": out["cos_hi"],
        "norm_ratio": root(out["norm2"]), "norm_ratio_lo": root(out["norm2_lo"]),
        "norm_ratio_hi": root(out["norm2_hi"]), "covers": out["err2_lo"] <= 0.0, "zero": out["norm2_lo"] <= 0.0,
    }  # fmt: skip


def run(c: LMCheck, progress: bool = True) -> list[dict]:
    """One record per (regime, distance, length, variant)."""
    from tqdm import tqdm

    from nanogrpo.data import load_task, render_prompt
    from nanogrpo.lab.klcheck import variants

    if c.batch % GROUP or c.samples < 3 * c.batch:
        raise ValueError(f"--batch {c.batch} must be even and --samples {c.samples} at least 3 batches")
    model, tok = adapted_model(c.model, c.rank, c.layers)
    direction, noise = adapter_weights(model, torch.Generator().manual_seed(c.seed))
    prompts = [render_prompt(tok, row) for row in load_task("demo", "train")[0]]
    vs = variants(GROUP)
    K = c.samples // c.batch
    work = [(r, d, T) for r in c.regimes for d in c.distances for T in c.lengths]
    bar = tqdm(total=len(work) * K, desc="klcheck lm", disable=not progress)
    records = []
    for regime, d, T in work:
        per_batch, kls = [], []
        for k in range(K):
            first = (k * c.batch // GROUP) % len(prompts)
            ps = [prompts[(first + i) % len(prompts)] for i in range(c.batch // GROUP)]
            seed = zlib.crc32(repr((c.seed, regime, d, T, k)).encode())  # the same in every process
            gens = [torch.Generator().manual_seed(seed + i) for i in range(len(ps))]
            vec, kl = batch_vectors(model, ps, gens, T, vs, regime == "off", direction, noise, c, d)
            per_batch.append(vec)
            kls.append(kl)
            bar.update(1)
        targets = [t for t in TARGETS if t in per_batch[0]]
        names = targets + [v.name for v in vs]
        stats = gram_stats(per_batch, names)
        # the targets themselves first (their estimates have far less noise than a variant's): how far the
        # per-prefix gradients, which per-token forms recover, are from the sequence's
        rows = [(f"target {t}", t) for t in ("tok_rev", "tok_fwd", "fwd")] + [(v.name, v.name) for v in vs]
        for label, name in rows:
            cmp = {t: compare(stats, names, name, t) for t in targets}
            records.append({
                "regime": regime, "distance": d, "length": T, "kl_rev": sum(kls) / len(kls), "batches": K,
                "samples": K * c.batch, "variant": label,
                "matches": [t for t, m in cmp.items() if m["covers"]], "zero": cmp["rev"]["zero"],
                **{f"{t}/{k}": val for t, m in cmp.items() for k, val in m.items() if k not in ("covers", "zero")},
            })  # fmt: skip
    bar.close()
    return records


def _ci(r: dict, key: str) -> str:
    x, lo, hi = r[key], r[key + "_lo"], r[key + "_hi"]
    return "-" if math.isnan(x) else f"{x:.3f} [{lo:.3f},{hi:.3f}]"


def table(records: list[dict]) -> str:
    """Plain text: one line per (regime, distance, length, variant), each number with its 95% CI."""
    head = f"{'regime':6} {'dist':>4} {'T':>3} {'KL':>7}  {'variant':30} {'err rev':>21} {'cos rev':>21} "
    head += f"{'|g|/|rev|':>21} {'err tokrev':>21} {'err tokfwd':>21}  matches"
    lines = [head, "-" * len(head)]
    for r in records:
        lines.append(
            f"{r['regime']:6} {r['distance']:4.2f} {r['length']:3d} {r['kl_rev']:7.3f}  {r['variant']:30} "
            f"{_ci(r, 'rev/rel_err'):>21} {_ci(r, 'rev/cos'):>21} {_ci(r, 'rev/norm_ratio'):>21} "
            f"{_ci(r, 'tok_rev/rel_err'):>21} {_ci(r, 'tok_fwd/rel_err'):>21}  "
            + (",".join(r["matches"]) or ("0" if r["zero"] else "-"))
        )
    return "\n".join(lines)
