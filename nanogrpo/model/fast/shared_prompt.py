"""The training forward's fast path: the hidden states of model/logprobs.py's plain path, each prompt run once.

The plain path runs every row's prompt + completion. But the G completions of a prompt share it, so the
prompt's tokens run G times for one result. Here each prompt runs once, its keys/values are expanded to
the rows of its group (kvcache.PrefixKV) and only the completion tokens run against them: the same hidden
states up to float rounding (tests/test_fastpaths.py checks log-probs, entropies and LoRA gradients against
the plain path), at a fraction of the cost when prompts are long or G is large. The gradients of all G
completions add up in the one prompt pass. (With LoRA dropout, the completions of a group then share one
dropout mask over the prompt.)

The completion tokens run in groups of rows of similar length (`length_buckets`), each padded to its own
longest row rather than the batch's: a long completion no longer makes every short one run its length
(one 16-token completion among 3-token ones costs 38% less, docs/BENCHMARKS.md). Removing the padding
altogether takes variable-length attention kernels, such as flash-attn's on GPUs; this needs none and runs
on any device, at one forward per group. Under FSDP every rank runs one group (LogprobHead.bucket_lengths
off, set by infra/fsdp.py), since each forward all-gathers the blocks.

FastLogprobHead takes it wherever adjacent rows of a batch share a prompt (`Batch.group`, from make_batch):
the G completions of a GRPO step, in the policy's, pi_old's and the reference's passes alike. A batch whose
rows each have their own prompt (or none) runs as LogprobHead's plain pass. Its LM head is
nanogrpo_kernels.logprobs.token_logprobs, a chunk of rows at a time (Triton on GPUs), without the
[n_tok, V] float32 logits (nanogrpo_kernels/logprobs.py says what it keeps instead).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanogrpo.model.fast.kvcache import PrefixKV
from nanogrpo.model.logprobs import LogprobHead, ValueHead, last_sampled
from nanogrpo_kernels.logprobs import token_logprobs

# The completion tokens of a batch run in groups of rows of similar length (length_buckets). A group costs
# one forward and backward more, which bench/length_groups.py measures in token positions (SmolLM2 + LoRA,
# 2-core Xeon): ~35 in float32 on the AVX2 code paths, ~200 in bf16 with AMX, whose matmuls are faster
# while the fixed cost of each op is not. So a new group must save at least BUCKET_MIN positions in float32
# on a CPU, BUCKET_MIN_FAST elsewhere (bf16, and GPUs, where that value is a guess, not measured), and
# 1/BUCKET_SHARE of the positions that one group for the batch would run.
BUCKET_MIN = 32
BUCKET_MIN_FAST = 256
BUCKET_SHARE = 8


class FastLogprobHead(LogprobHead):
    """LogprobHead's values and gradients (tests/test_fastpaths.py), each shared prompt run once for its rows
    (`shared_prompt_hidden`) and the LM head chunked (token_logprobs)."""

    def __init__(self, model: torch.nn.Module, value_head: ValueHead | None = None):
        super().__init__(model, value_head)
        self.bucket_lengths = True  # the completions in length groups (infra/fsdp.py: off)

    def completion_hidden(self, ids, attn, pos, Tp: int, Tc: int, group, mask) -> torch.Tensor:
        first = prompt_heads(group, Tp)  # (N,) bool, the first row of each shared prompt; None: none shared
        if first is None:
            return super().completion_hidden(ids, attn, pos, Tp, Tc, group, mask)
        return shared_prompt_hidden(
            self.model, ids, attn, pos, Tp, Tc, first, last_sampled(mask), self.bucket_lengths
        )

    def token_logprobs(self, h, weight, targets, temperature: float, entropy_grad: bool):
        return token_logprobs(h, weight, targets, temperature, entropy_grad)


def prompt_heads(group: torch.Tensor | None, prompt_len: int) -> torch.Tensor | None:
    """(N,) bool: the rows whose prompt runs (the first row of each group); None where no prompt is shared
    (no groups, no prompt, or every row its own group): then the plain path runs."""
    if group is None or prompt_len == 0:
        return None
    first = torch.ones_like(group, dtype=torch.bool)  # (N,)
    first[1:] = group[1:] != group[:-1]
    return None if bool(first.all()) else first


def shared_prompt_hidden(
    model: torch.nn.Module,
    ids: torch.Tensor,
    attn: torch.Tensor,
    pos: torch.Tensor,
    Tp: int,
    Tc: int,
    first: torch.Tensor,
    last: torch.Tensor,
    bucket_lengths: bool = True,
) -> torch.Tensor:
    """The hidden states that predict the completion tokens (N, Tc, H), as the plain path's
    `model(ids)[:, Tp - 1 : Tp + Tc - 1]`, each prompt run once for its group.

    ids/attn/pos (N, Tp+Tc) as in Batch; first (N,) from `prompt_heads`; last (N,) each row's columns up to
    its last masked-in token (logprobs.last_sampled). The completion tokens run in groups of rows of similar
    length (`length_buckets`), each padded only to its own longest row; bucket_lengths=False: one group of
    every row (FSDP). Positions after a row's last masked-in token are zeros (never read)."""
    heads = first.nonzero().squeeze(1)  # (P,) one row per prompt
    owner = first.long().cumsum(0) - 1  # (N,) row -> its prompt in 0..P-1
    prefix = PrefixKV(len(model.model.layers))
    h_prompt = model(
        ids[heads, :Tp],
        attention_mask=attn[heads, :Tp],
        position_ids=pos[heads, :Tp],
        kv_cache=prefix,
        return_hidden=True,
    )  # (P, Tp, H)
    h_first = h_prompt[:, -1:].index_select(0, owner)  # (N, 1, H) predicts completion token 0
    if Tc == 1:
        return h_first
    # completion tokens 0..n-1 predict tokens 1..n; they see the whole prompt and, causally, each other.
    # A row needs its tokens up to the one before its last masked-in target.
    need = (last - 1).clamp(min=0)  # (N,) completion tokens row i must run
    if bucket_lengths:
        buckets = length_buckets(need, group_cost(model.lm_head_weight))
    else:  # one group: every row, as long as the longest completion
        buckets = [(torch.arange(len(ids), device=ids.device), Tc - 1)]

    def run(rows: torch.Tensor | slice, n: int) -> torch.Tensor:  # the first n completion tokens of rows
        return model(
            ids[rows, Tp : Tp + n],
            attention_mask=attn[rows, : Tp + n],
            position_ids=pos[rows, Tp : Tp + n],
            kv_cache=prefix.expand(owner[rows]),
            return_hidden=True,
        )  # (n_b, n, H)

    every = len(buckets) == 1 and len(buckets[0][0]) == len(ids)  # one group holds every row
    if every:  # then the rows run as they are: no gather, no scatter
        n = buckets[0][1]
        h_rest = run(slice(None), n)  # (N, n, H)
        if n < Tc - 1:
            h_rest = F.pad(h_rest, (0, 0, 0, Tc - 1 - n))  # (N, Tc-1, H)
    else:
        h_rest = h_first.new_zeros(len(ids), Tc - 1, h_first.shape[-1])  # (N, Tc-1, H)
        for rows, n in buckets:
            h_rest = h_rest.index_put(
                (rows[:, None], torch.arange(n, device=ids.device)[None, :]), run(rows, n)
            )
    return torch.cat([h_first, h_rest], dim=1)  # (N, Tc, H)


def group_cost(weight: torch.Tensor) -> int:
    """The positions a new group must save for a model whose weights are `weight`'s dtype and device:
    BUCKET_MIN for float32 matmuls on a CPU, BUCKET_MIN_FAST otherwise."""
    slow = (
        weight.device.type == "cpu" and weight.dtype == torch.float32 and not torch.is_autocast_enabled("cpu")
    )
    return BUCKET_MIN if slow else BUCKET_MIN_FAST


def length_buckets(need: torch.Tensor, min_saving: int = BUCKET_MIN) -> list[tuple[torch.Tensor, int]]:
    """Rows grouped so that each group runs padded to its own longest row, not the batch's: [(rows, n)].

    need (N,) long is the number of tokens row i must run; rows that need 0 are in no group. The groups are
    runs of the rows sorted by need, chosen by dynamic programming over the distinct lengths to minimise
    the positions run, sum(len(rows) * n), plus a cost per group: `min_saving` positions, or more for a
    large batch (BUCKET_SHARE)."""
    values, counts = need[need > 0].unique(return_counts=True)  # (D,) ascending, (D,)
    if len(values) == 0:
        return []
    per_group = max(min_saving, int(counts.sum()) * int(values[-1]) // BUCKET_SHARE)
    v, cum = values.double().cpu(), F.pad(counts.cumsum(0), (1, 0)).double().cpu()  # (D,), (D+1,)
    best = torch.zeros(len(v) + 1, dtype=torch.float64)  # best[j]: cheapest cover of the j shortest lengths
    cut = [0] * (len(v) + 1)  # cut[j]: where the last group of that cover starts
    for j in range(1, len(v) + 1):
        cost = best[:j] + per_group + (cum[j] - cum[:j]) * v[j - 1]  # (j,) last group = lengths i..j-1
        best[j], cut[j] = cost.min(), int(cost.argmin())
    groups, j = [], len(v)
    while j > 0:
        lo, hi = int(values[cut[j]]), int(values[j - 1])
        groups.append((((need >= lo) & (need <= hi)).nonzero().squeeze(1), hi))  # (rows,), n
        j = cut[j]
    return groups[::-1]
