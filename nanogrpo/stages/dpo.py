"""Direct preference optimisation (--algo dpo): Rafailov et al. 2023, "Direct Preference Optimization: Your
Language Model is Secretly a Reward Model".

DPO trains on pairs (prompt x, chosen answer y_c, rejected answer y_r) with no reward model and no sampling.
The policy's implicit reward of an answer is its log-ratio to a frozen reference, r(x, y) = beta *
log(pi(y|x) / pi_ref(y|x)), and the loss is the Bradley-Terry NLL of the chosen answer winning:

    loss = -log sigmoid(r(x, y_c) - r(x, y_r))
         = -log sigmoid(beta * ((log pi(y_c|x) - log ref(y_c|x)) - (log pi(y_r|x) - log ref(y_r|x))))

where log pi(y|x) is the SUM of the answer's token log-probs (EOS included). --dpo.beta (0.1) is the
strength of the implicit KL constraint: the larger it is, the smaller the move away from the reference that
reaches a given margin. At the start pi = pi_ref, so every pair's loss is log 2 and every margin 0.

Pairs. A row holds `chosen` and `rejected` texts, or is a multiple-choice question: `options` (a list of
texts, or an object letter -> text) and `answer` (the correct option's text, its letter or key, or for a
list its 0-based index; when two readings name different options the row is refused). The chosen answer
is the correct option's text, the rejected one a wrong option drawn uniformly by a hash of (--seed, the
row's id): the same on every rank, batch, epoch and resume, and another draw under another seed. This is
seed paper 002's DPO baseline (rejected answers drawn uniformly from an MCQ's incorrect options, beta 0.1).
A row with both forms trains on its `chosen`/`rejected`.

The reference is the model with LoRA off (with --lora.init-from, the SFT model) or, for a full fine-tune,
the frozen copy of the starting weights that load_policy keeps; its log-probs run on the same path as the
policy's (kernels, autocast, batch), so the step-0 loss is log 2 exactly, not up to rounding.

Where this departs from the paper and from Concept Overlap:
- the paper starts from (and refers to) an SFT model on the preferred answers; here the reference is
  whatever the run starts from: pass --lora.init-from with an SFT adapter for the paper's pipeline;
- both answers of a pair share one prompt forward (logprobs.make_batch groups them), and the loss is
  averaged over the step's pairs on all ranks, the same for any --micro-batch (pairs are never split);
- a multiple-choice row keeps one rejected option for the whole run (the seed paper does not say
  whether it redraws); no label smoothing (cDPO) or IPO loss.
"""

from __future__ import annotations

import hashlib
import json
import time

import torch
import torch.nn.functional as F

from nanogrpo.config import TrainConfig
from nanogrpo.data import preference_texts
from nanogrpo.infra import dist
from nanogrpo.model.logprobs import Batch, completion_logprobs
from nanogrpo.model.sampling import pad_left
from nanogrpo.optim import in_slices, step_counts, update
from nanogrpo.policy import Policy
from nanogrpo.rollout import make_batch
from nanogrpo.stages import Run
from nanogrpo.stages.sft import pad_right

# the per-pair means the step logs (dpo_loss's stats, over every rank's pairs)
_MEANS = ("reward_margin", "reward_acc", "reward_chosen", "reward_rejected", "logp_chosen", "logp_rejected")


def step(run: Run, step: int, rows: list[dict], first: int) -> dict:
    """One DPO step on this rank's pairs: the reference's log-probs, then one micro-batched update."""
    t1 = time.perf_counter()
    cfg, policy = run.cfg, run.policy
    batch = pair_batch(policy, rows, cfg.seed).to(run.device)
    micro = pair_micro(cfg.micro_batch)
    ref = in_slices(lambda b: policy.reference_logprobs(b, 1.0), batch, micro)  # (2P, Tc) no grad
    sums, grad_norm = dpo_update(policy, run.opt, run.sched, batch, (ref * batch.mask).sum(1), cfg)
    tot = dist.sum_floats({**sums, "tokens": float(batch.mask.sum())})  # every rank's pairs
    n = tot["pairs"]
    m = {"step": step + 1, "loss": tot["loss"] / n, **{k: tot[k] / n for k in _MEANS}}
    m.update(tokens=tot["tokens"], len_mean=tot["tokens"] / (2 * n), t_sample=0.0, t_score=0.0)
    m.update(grad_norm=grad_norm, t_train=time.perf_counter() - t1)
    return m


def dpo_loss(
    pi_c: torch.Tensor,
    pi_r: torch.Tensor,
    ref_c: torch.Tensor,
    ref_r: torch.Tensor,
    beta: float,
    num_pairs: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The DPO loss of P pairs from their sequence log-probs (each (P,): summed over the answer's tokens).

    pi_c, pi_r: log pi(chosen|x), log pi(rejected|x) (differentiable); ref_c, ref_r: the reference's.
    Returns the loss, sum over pairs of -log sigmoid(margin) divided by `num_pairs` (default P: the mean;
    the step passes the pair count of all ranks, so micro-batch and rank losses add up to the batch's), and
    stats: SUMS over the P pairs ('pairs' counts them), to be added up and divided by the pair count.
    """
    reward_c = beta * (pi_c - ref_c)  # (P,) implicit reward of the chosen answer
    reward_r = beta * (pi_r - ref_r)  # (P,) and of the rejected one
    margin = reward_c - reward_r  # (P,)
    losses = -F.logsigmoid(margin)  # (P,) stable for large |margin|, unlike log(sigmoid(.))
    loss = losses.sum() / (len(margin) if num_pairs is None else num_pairs)
    s = lambda x: float(x.detach().double().sum())  # noqa: E731
    stats = {
        "pairs": float(len(margin)),
        "loss": s(losses),
        "reward_margin": s(margin),
        "reward_acc": s(margin > 0),  # a tie (margin 0, as at step 0) is not a win
        "reward_chosen": s(reward_c),
        "reward_rejected": s(reward_r),
        "logp_chosen": s(pi_c),
        "logp_rejected": s(pi_r),
    }
    return loss, stats


def dpo_update(
    policy: Policy, opt, sched, batch: Batch, ref_seq: torch.Tensor, cfg: TrainConfig
) -> tuple[dict[str, float], float]:
    """The DPO loss over the batch (rows alternate chosen, rejected; ref_seq (2P,) the reference's sequence
    log-probs): one pass of optim.update, micro-batch by micro-batch, then the optimizer step. Returns
    dpo_loss's stats summed over this rank's micro-batches, and the grad norm."""
    counts = step_counts(batch)
    n_pairs = counts["seqs"] / 2  # the loss is the mean over ALL ranks' pairs

    def loss_fn(it: int, sl: slice, mb: Batch) -> tuple[torch.Tensor, dict]:
        logp, _ = completion_logprobs(policy.model, mb, 1.0, policy.autocast)  # (n, Tc)
        seq, ref = (logp * mb.mask).sum(1), ref_seq[sl]  # (n,), (n,)
        return dpo_loss(seq[0::2], seq[1::2], ref[0::2], ref[1::2], cfg.dpo.beta, n_pairs)

    micro = pair_micro(cfg.micro_batch)  # even sizes: a pair stays together
    upd = update(
        policy, opt, sched, batch, counts, loss_fn, passes=1, micro=micro, grad_clip=cfg.optim.grad_clip
    )
    return upd.stats, upd.grad_norm


def pair_micro(micro: int) -> int:
    """--micro-batch in rows, made even (at least 2) so that no micro-batch splits a pair; 0 = all at once."""
    return 0 if micro <= 0 else max(2, micro - micro % 2)


def pair_batch(policy: Policy, rows: list[dict], seed: int) -> Batch:
    """Two adjacent rows per pair, prompt + chosen then prompt + rejected, so the prompt runs once for both.
    Answers are tokenized without special tokens, then EOS, so that where the answer stops counts too."""
    tok = policy.tokenizer
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"] + policy.eos_ids[:1]  # noqa: E731
    prompts, answers = [], []
    for row in rows:
        chosen, rejected = preference_pair(row, seed)
        prompts += [row["_prompt_ids"]] * 2
        answers += [enc(chosen), enc(rejected)]
    p_ids, p_mask = pad_left(prompts, policy.pad_id)  # (2P, Tp)
    return make_batch(p_ids, p_mask, *pad_right(answers, policy.pad_id))


# ----------------------------------------------------------------------------------------------------------
# rows: chosen/rejected pairs, or multiple-choice questions


def check_rows(rows: list[dict], source: str) -> None:
    """Refuse at start-up, naming file and line, a row DPO cannot make a pair from."""
    for row in rows:
        preference_texts(row, f"{source}:{row.get('_line', row.get('id'))}")


def preference_pair(row: dict, seed: int) -> tuple[str, str]:
    """(chosen, rejected) of a row: its own pair, or an MCQ's correct option and a wrong one drawn by
    draw_index(seed, the row's id): the same on every rank, batch and resume."""
    row_id = row.get("id", row.get("_line"))
    chosen, candidates = preference_texts(row, f"row {row_id}")
    return chosen, candidates[draw_index(seed, row_id, len(candidates))]


def draw_index(seed: int, row_id: str | int | None, n: int) -> int:
    """A uniform index in [0, n) from a stable hash of (seed, row id): not Python's hash(), which is salted
    per process, so every rank and every resumed run draws the same."""
    key = json.dumps(["dpo-rejected", seed, row_id]).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") % n
