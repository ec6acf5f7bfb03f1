"""OLMo 3 (Olmo3ForCausalLM) in nanogrpo's model: what differs from transformer.py's blocks, with Hugging Face's
names, so its safetensors load as they are and LoRA adapters get PEFT's key names.

- no norm before the attention or the MLP: each output is normalised before it joins the residual
  (post_attention_layernorm, post_feedforward_layernorm);
- RMSNorm multiplies by its weight in float32, then casts (`OlmoRMSNorm`);
- q and k are RMS-normalised over the whole projection, every head at once (`FlatRMSNorm`), before RoPE;
- sliding-window layers (three in four) and full-attention ones, each kind with its RoPE (local_rope.py).

Departure from transformers: the sliding window (4,096 tokens) is not applied, exact while a sequence is no
longer than it, so an OLMo 3 run's context is the window (policy.model_positions). A sliding layers' RoPE of
a type other than 'default' is refused (hf_config.olmo3_fields).
"""

from __future__ import annotations

import torch
from torch import nn

from nanogrpo.model.hf_config import ModelArgs
from nanogrpo.model.local_rope import LocalRope
from nanogrpo.model.transformer import MLP, Attention, RMSNorm


class OlmoRMSNorm(RMSNorm):
    """x / rms(x) * w, the product in float32 before the cast (Olmo3RMSNorm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf).to(x.dtype)


class FlatRMSNorm(OlmoRMSNorm):
    """OlmoRMSNorm over all heads of q or k at once: x (B, T, heads, D) normalised as (B, T, heads * D)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.flatten(-2)).view_as(x)


class OlmoBlock(nn.Module):
    """An OLMo 3 decoder layer: attention and MLP each followed by its norm; `local`: a sliding-window layer."""

    def __init__(self, a: ModelArgs, layer: int):
        super().__init__()
        H, eps = a.hidden_size, a.rms_norm_eps
        self.local = a.layer_types[layer] == "sliding_attention"
        self.self_attn = Attention(a)
        self.self_attn.q_norm = FlatRMSNorm(a.num_attention_heads * a.head_dim, eps)
        self.self_attn.k_norm = FlatRMSNorm(a.num_key_value_heads * a.head_dim, eps)
        self.post_attention_layernorm = OlmoRMSNorm(H, eps)
        self.mlp = MLP(a)
        self.post_feedforward_layernorm = OlmoRMSNorm(H, eps)

    def forward(self, x, cos, sin, mask, kv_cache=None, layer=0) -> torch.Tensor:
        cos, sin = cos[int(self.local)], sin[int(self.local)]  # (B, T, 1, rot) this layer's RoPE
        x = x + self.post_attention_layernorm(self.self_attn(x, cos, sin, mask, kv_cache, layer))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class Olmo3Transformer(LocalRope):
    """transformer.Transformer with OLMo 3's layers, final norm and two RoPE tables."""

    def __init__(self, config: ModelArgs, attn: str = "sdpa"):
        super().__init__(config, attn)
        self.model.layers = nn.ModuleList(OlmoBlock(config, i) for i in range(config.num_hidden_layers))
        self.model.norm = OlmoRMSNorm(config.hidden_size, config.rms_norm_eps)
