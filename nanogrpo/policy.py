"""From token ids to per-token log-probs of the completions: the one path the loss, the KL reference and
the metrics share.

The model returns final hidden states; only the positions that predict a completion token are gathered,
and kernels.logprobs turns them into log-probs and entropies without a [N, V] float32 logits tensor.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from kernels.logprobs import token_logprobs


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

    def __len__(self) -> int:
        return self.ids.shape[0]

    def to(self, device: torch.device | str) -> Batch:
        t = lambda x: x.to(device)
        return Batch(t(self.ids), t(self.attn), t(self.pos), self.prompt_len, t(self.targets), t(self.mask))

    def rows(self, sl: slice) -> Batch:
        return Batch(
            self.ids[sl], self.attn[sl], self.pos[sl], self.prompt_len, self.targets[sl], self.mask[sl]
        )


def make_batch(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor, mask: torch.Tensor
) -> Batch:
    """prompt_ids/prompt_mask [N, Tp] (already repeated per completion), completion ids/mask [N, Tc]."""
    ids = torch.cat([prompt_ids, completion_ids], dim=1)  # (N, Tp+Tc)
    # tokens after a completion's end only attend backwards (causal), so they cannot change earlier ones
    attn = torch.cat([prompt_mask, torch.ones_like(completion_ids)], dim=1)  # (N, Tp+Tc)
    pos = (attn.cumsum(dim=1) - 1).clamp(min=0)  # (N, Tp+Tc)
    return Batch(ids, attn, pos, prompt_ids.shape[1], completion_ids, mask.float())


class LogprobHead(torch.nn.Module):
    """The Transformer and the fused log-prob head in one forward.

    DDP and FSDP only see parameters used inside a module's forward: with the LM head applied here (and
    not after the wrapped forward returns) a trained or sharded LM head behaves under torchrun too.
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(
        self,
        ids: torch.Tensor,
        attn: torch.Tensor,
        pos: torch.Tensor,
        targets: torch.Tensor,
        mask: torch.Tensor,
        prompt_len: int,
        temperature: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.model(ids, attention_mask=attn, position_ids=pos, return_hidden=True)  # (N, T, H)
        Tp, Tc = prompt_len, targets.shape[1]
        hidden = hidden[:, Tp - 1 : Tp + Tc - 1]  # (N, Tc, H): position t predicts completion token t
        sel = mask.bool()  # (N, Tc)
        h = hidden[sel]  # (n_tok, H)
        weight = self.model.lm_head_weight  # (V, H)
        if h.dtype != weight.dtype:
            h = h.to(weight.dtype)
        lp, ent = token_logprobs(h, weight, targets[sel], temperature)  # (n_tok,), (n_tok,)
        logp = torch.zeros(mask.shape, dtype=torch.float32, device=ids.device)  # (N, Tc)
        entropy = torch.zeros_like(logp)  # (N, Tc)
        logp = logp.masked_scatter(sel, lp.float())
        entropy[sel] = ent.detach().float()
        return logp, entropy


def completion_logprobs(
    model: torch.nn.Module, batch: Batch, temperature: float = 1.0, autocast_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(y_t | y_<t, x) and the entropy of pi(. | y_<t, x) for every completion token.

    `model` is a Transformer or a LogprobHead (possibly inside DDP/FSDP). Returns logp (N, Tc) float32
    (differentiable) and entropy (N, Tc) float32 (detached); both are 0 where mask is 0. Only masked-in
    positions go through the LM head, so no [N, V] float32 logits tensor is ever built.
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
            batch.ids, batch.attn, batch.pos, batch.targets, batch.mask, batch.prompt_len, temperature
        )
