"""From token ids to per-token log-probs of the completions: the one path the loss, the KL reference and
the metrics share.

LogprobHead is the plain path, whose docstring gives the two-line spec it computes: one pass of the model
over prompt + completion for the final hidden states; only the positions that predict a masked-in completion
token are kept, and `plain_token_logprobs` applies the LM head, log-softmax and gather to them, as the spec
says.

The fast path beside it (model/fast/shared_prompt.py's FastLogprobHead, the default; policy.logprob_head
picks) gives the same values and gradients (tests/test_fastpaths.py): rows that share a prompt (a GRPO step's
G completions) run each prompt once for their group, the completions in groups of similar length; and
nanogrpo_kernels.logprobs.token_logprobs applies the LM head a chunk of rows at a time (Triton on GPUs),
without the [n_tok, V] float32 logits.

PPO (--algo ppo) adds a ValueHead to the LogprobHead: the same forward then also returns V(s_t) at every
completion position, from the hidden state that predicts token t. Without a value head every call and
output is what it always was.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch


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


def plain_token_logprobs(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec itself on the masked-in positions: h (n_tok, H), weight (V, H), targets (n_tok,) ->
    log-probs and entropies (n_tok,) float32, through the whole (n_tok, V) float32 logits at once."""
    logits = (h @ weight.T).float() / temperature  # (n_tok, V)
    logq = logits.log_softmax(-1)  # (n_tok, V)
    logp = logq.gather(-1, targets[:, None])[:, 0]  # (n_tok,)
    entropy = -(logq.exp() * logq).sum(-1)  # (n_tok,) H = -sum p log p
    return logp, entropy


class LogprobHead(torch.nn.Module):
    """The Transformer and the log-prob head in one forward (and PPO's value head, when given).

    For N rows of a Tp-token prompt and a Tc-token completion (ids (N, Tp+Tc), targets (N, Tc)) the forward
    computes, where mask is 1 (0 elsewhere):

        logits = model(ids)[:, Tp - 1 : -1] / temperature                       # (N, Tc, V)
        logp = logits.log_softmax(-1).gather(-1, targets[..., None])[..., 0]  # (N, Tc)

    It computes that: one pass over prompt + completion for the hidden states (N, Tc, H) (`completion_hidden`),
    those at the masked-in positions (n_tok, H), then plain_token_logprobs (`token_logprobs`). The fast path
    (fast/shared_prompt.FastLogprobHead) overrides those two: each shared prompt run once, and the LM head
    chunked without the [n_tok, V] float32 logits.

    DDP and FSDP only see parameters used inside a module's forward: with the LM head applied here (and
    not after the wrapped forward returns) a trained or sharded LM head behaves under torchrun too; the
    value head runs here for the same reason.
    """

    def __init__(self, model: torch.nn.Module, value_head: ValueHead | None = None):
        super().__init__()
        self.model = model
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
        hidden = self.completion_hidden(ids, attn, pos, prompt_len, targets.shape[1], group, mask)
        sel = mask.bool()  # (N, Tc)
        weight = self.model.lm_head.weight  # (V, H)
        h = hidden[sel].to(weight.dtype)  # (n_tok, H) of hidden (N, Tc, H)
        lp, ent = self.token_logprobs(h, weight, targets[sel], temperature, entropy_grad)  # (n_tok,) each
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

    def completion_hidden(self, ids, attn, pos, Tp: int, Tc: int, group, mask) -> torch.Tensor:
        """The hidden states that predict the completion tokens (N, Tc, H): one pass over prompt + completion."""
        hidden = self.model(ids, attention_mask=attn, position_ids=pos, return_hidden=True)  # (N, T, H)
        return hidden[:, Tp - 1 : Tp + Tc - 1]  # (N, Tc, H): position t predicts completion token t

    def token_logprobs(self, h, weight, targets, temperature: float, entropy_grad: bool):
        """Log-probs and entropies (n_tok,) of `targets` from hidden states h (n_tok, H): the spec itself."""
        return plain_token_logprobs(h, weight, targets, temperature)


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
    with torch.autocast(batch.ids.device.type, dtype=autocast_dtype) if autocast_dtype else nullcontext():
        return model(
            batch.ids, batch.attn, batch.pos, batch.targets, batch.mask, batch.prompt_len, temperature,
            batch.group, entropy_grad, values,
        )  # fmt: skip
