"""From token ids to per-token log-probs of the completions: the one path the loss, the KL reference and
the metrics share.

The model returns final hidden states; only the positions that predict a completion token are gathered,
and nanogrpo_kernels.logprobs turns them into log-probs and entropies without a [N, V] float32 logits tensor.

The G completions of a prompt share it: the forward runs each prompt once, expands its keys/values to the
group (kvcache.PrefixKV) and runs only the completion tokens. The result is the same as running every
row's prompt + completion (up to float rounding), at a fraction of the cost when prompts are long or G is
large; gradients of all G completions add up in the one prompt pass. (With LoRA dropout, the completions
of a group then share one dropout mask over the prompt.) The completion tokens run in groups of rows of
similar length, each group padded to its own longest row rather than the batch's: a long completion no
longer makes every short one run its length. (Removing the padding altogether takes variable-length
attention kernels, such as flash-attn's on GPUs; this needs none and runs on any device, at one forward
per group.) Under FSDP every rank runs one group, since each forward all-gathers the blocks.

PPO (--algo ppo) adds a ValueHead to the LogprobHead: the same forward then also returns V(s_t) at every
completion position, from the hidden state that predicts token t. Without a value head every call and
output is what it always was.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanogrpo.model.kvcache import PrefixKV
from nanogrpo_kernels.logprobs import token_logprobs


def pad_left(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists into ids [B, T] and an attention mask [B, T] (1 real, 0 pad)."""
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, T - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, T - len(s) :] = 1
    return ids, mask


@dataclass
class Batch:
    """Prompts + completions of one step (or one micro-batch), on the model's device."""

    ids: torch.Tensor  # (N, Tp+Tc) left-padded prompt then completion
    attn: torch.Tensor  # (N, Tp+Tc) 1 real, 0 padding
    pos: torch.Tensor  # (N, Tp+Tc) position ids (0 at the first real token)
    prompt_len: int  # Tp
    targets: torch.Tensor  # (N, Tc) completion ids
    mask: torch.Tensor  # (N, Tc) float, 1 on completion tokens
    group: torch.Tensor  # (N,) long: rows with the same value share their prompt (and are adjacent)

    def __len__(self) -> int:
        return self.ids.shape[0]

    def to(self, device: torch.device | str) -> Batch:
        t = lambda x: x.to(device)
        b = self
        return Batch(t(b.ids), t(b.attn), t(b.pos), b.prompt_len, t(b.targets), t(b.mask), t(b.group))

    def rows(self, sl: slice) -> Batch:
        b = self
        return Batch(b.ids[sl], b.attn[sl], b.pos[sl], b.prompt_len, b.targets[sl], b.mask[sl], b.group[sl])


def last_sampled(mask: torch.Tensor) -> torch.Tensor:
    """(N,) each row's columns up to and including its last masked-in token (0 for a row with none): a
    completion's length, an episode's extent (its observations lie between turns, and it ends on a turn)."""
    return torch.where(mask.bool(), torch.arange(1, mask.shape[1] + 1, device=mask.device), 0).amax(1)


def make_batch(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor, mask: torch.Tensor
) -> Batch:
    """prompt_ids/prompt_mask [N, Tp] (already repeated per completion), completion ids/mask [N, Tc].

    Adjacent rows with the same prompt form a group (their prompt runs once in the forward).
    """
    ids = torch.cat([prompt_ids, completion_ids], dim=1)  # (N, Tp+Tc)
    # tokens after a completion's end only attend backwards (causal), so they cannot change earlier ones
    attn = torch.cat([prompt_mask, torch.ones_like(completion_ids)], dim=1)  # (N, Tp+Tc)
    pos = (attn.cumsum(dim=1) - 1).clamp(min=0)  # (N, Tp+Tc)
    new = torch.ones(len(ids), dtype=torch.bool)  # (N,) row starts a new group
    new[1:] = ((prompt_ids[1:] != prompt_ids[:-1]) | (prompt_mask[1:] != prompt_mask[:-1])).any(1).cpu()
    group = new.long().cumsum(0) - 1  # (N,)
    return Batch(ids, attn, pos, prompt_ids.shape[1], completion_ids, mask.float(), group.to(ids.device))


def micro_slices(n: int, micro: int) -> list[slice]:
    """Row slices of at most `micro` rows (0 = one slice with everything)."""
    micro = n if micro <= 0 else micro
    return [slice(i, min(i + micro, n)) for i in range(0, n, micro)]


class ValueHead(torch.nn.Module):
    """PPO's critic on the policy's trunk: V(s) = w . h + b on the final-normed hidden state h (H,).

    Zero-initialised, so every value starts at 0 (no random baseline in the first advantages); the trunk
    gets the value loss's gradient through h once w has moved. Float32 whatever the trunk's dtype: it is a
    regression onto returns, not a matmul worth rounding. `weight` is 1-D on purpose: --optim.name muon
    gives 2-D matrices to Muon, which would orthogonalise a 1 x H regression row into a unit vector every
    step; a vector stays on AdamW."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size))  # (H,)
        self.bias = torch.nn.Parameter(torch.zeros(1))  # (1,)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h (n, H) -> values (n,) float32; autocast off, so a bf16 run still regresses in float32."""
        with torch.autocast(h.device.type, enabled=False):
            return h.float() @ self.weight + self.bias  # (n,)


class LogprobHead(torch.nn.Module):
    """The Transformer and the fused log-prob head in one forward (and PPO's value head, when given).

    DDP and FSDP only see parameters used inside a module's forward: with the LM head applied here (and
    not after the wrapped forward returns) a trained or sharded LM head behaves under torchrun too; the
    value head runs here for the same reason.
    """

    def __init__(self, model: torch.nn.Module, value_head: ValueHead | None = None):
        super().__init__()
        self.model = model
        self.bucket_lengths = True  # completion tokens in groups of similar length (off under FSDP)
        if value_head is not None:  # no value head: no submodule, the state dict stays the Transformer's
            self.value_head = value_head

    def forward(
        self,
        ids: torch.Tensor,
        attn: torch.Tensor,
        pos: torch.Tensor,
        targets: torch.Tensor,
        mask: torch.Tensor,
        prompt_len: int,
        temperature: float,
        group: torch.Tensor | None = None,
        entropy_grad: bool = False,
        values: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        Tp, Tc = prompt_len, targets.shape[1]
        first = None  # (N,) bool: the rows whose prompt runs (the first row of each group)
        if group is not None and Tp > 0:
            first = torch.ones_like(group, dtype=torch.bool)
            first[1:] = group[1:] != group[:-1]
        if first is None or bool(first.all()):  # no prompt is shared: one pass over prompt + completion
            hidden = self.model(ids, attention_mask=attn, position_ids=pos, return_hidden=True)  # (N, T, H)
            hidden = hidden[:, Tp - 1 : Tp + Tc - 1]  # (N, Tc, H): position t predicts completion token t
        else:
            hidden = self._shared_prompt_hidden(ids, attn, pos, Tp, Tc, first, mask)  # (N, Tc, H)
        sel = mask.bool()  # (N, Tc)
        h = hidden[sel]  # (n_tok, H)
        weight = self.model.lm_head_weight  # (V, H)
        if h.dtype != weight.dtype:
            h = h.to(weight.dtype)
        lp, ent = token_logprobs(h, weight, targets[sel], temperature, entropy_grad)  # (n_tok,), (n_tok,)
        logp = torch.zeros(mask.shape, dtype=torch.float32, device=ids.device)  # (N, Tc)
        entropy = torch.zeros_like(logp)  # (N, Tc)
        logp = logp.masked_scatter(sel, lp.float())
        if entropy_grad:
            entropy = entropy.masked_scatter(sel, ent.float())
        else:
            entropy[sel] = ent.detach().float()
        if not values:
            return logp, entropy
        if getattr(self, "value_head", None) is None:
            raise ValueError("values=True needs a value head: LogprobHead(model, ValueHead(H)) (--algo ppo)")
        v = torch.zeros_like(logp).masked_scatter(sel, self.value_head(h))  # (N, Tc) V(s_t), 0 on padding
        return logp, entropy, v

    def _shared_prompt_hidden(
        self, ids, attn, pos, Tp: int, Tc: int, first: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """The hidden states that predict the completion tokens, each prompt run once for its group; the
        completion tokens run in groups of rows of similar length (`length_buckets`), each padded only to
        its own longest row. Positions after a row's last masked-in token are zeros (never read)."""
        heads = first.nonzero().squeeze(1)  # (P,) one row per prompt
        owner = first.long().cumsum(0) - 1  # (N,) row -> its prompt in 0..P-1
        prefix = PrefixKV(len(self.model.model.layers))
        h_prompt = self.model(
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
        last = last_sampled(mask)  # (N,)
        need = (last - 1).clamp(min=0)  # (N,) completion tokens row i must run
        if self.bucket_lengths:
            buckets = length_buckets(need, group_cost(self.model.lm_head_weight))
        else:  # one group: every row, as long as the longest completion
            buckets = [(torch.arange(len(ids), device=ids.device), Tc - 1)]

        def run(rows: torch.Tensor | slice, n: int) -> torch.Tensor:  # the first n completion tokens of rows
            return self.model(
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


# The completion tokens of a batch run in groups of rows of similar length (length_buckets). A group costs
# one forward and backward more, which bench/length_groups.py measures in token positions (SmolLM2 + LoRA,
# 2-core Xeon): ~35 in float32 on the AVX2 code paths, ~200 in bf16 with AMX, whose matmuls are faster
# while the fixed cost of each op is not. So a new group must save at least BUCKET_MIN positions in float32
# on a CPU, BUCKET_MIN_FAST elsewhere (bf16, and GPUs, where that value is a guess, not measured), and
# 1/BUCKET_SHARE of the positions that one group for the batch would run.
BUCKET_MIN = 32
BUCKET_MIN_FAST = 256
BUCKET_SHARE = 8


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


def completion_logprobs(
    model: torch.nn.Module,
    batch: Batch,
    temperature: float = 1.0,
    autocast_dtype: torch.dtype | None = None,
    entropy_grad: bool = False,
    values: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """log pi(y_t | y_<t, x) and the entropy of pi(. | y_<t, x) for every completion token.

    `model` is a Transformer or a LogprobHead (possibly inside DDP/FSDP). Returns logp (N, Tc) float32
    (differentiable) and entropy (N, Tc) float32 (detached, or differentiable with entropy_grad: an entropy
    bonus in the loss); both are 0 where mask is 0. Only masked-in positions go through the LM head, so no
    [N, V] float32 logits tensor is ever built. With `values` (a LogprobHead with a value head: PPO) a
    third tensor, the values V(s_t) (N, Tc) float32, differentiable, 0 where mask is 0.
    """
    if not isinstance(getattr(model, "module", model), LogprobHead):
        model = LogprobHead(model)
    ctx = (
        torch.autocast(batch.ids.device.type, dtype=autocast_dtype)
        if autocast_dtype is not None
        else nullcontext()
    )
    with ctx:
        return model(
            batch.ids, batch.attn, batch.pos, batch.targets, batch.mask, batch.prompt_len, temperature,
            batch.group, entropy_grad, values,
        )  # fmt: skip
