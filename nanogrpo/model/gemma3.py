"""Gemma 3 (the text models: gemma-3-270m, gemma-3-1b) in nanogrpo's model: what differs from transformer.py's
blocks, with Hugging Face's names, so a Gemma3ForCausalLM safetensors folder loads as is and LoRA adapters get
PEFT's key names.

- RMSNorm scales by (1 + w), in float32 before the cast (`GemmaRMSNorm`; w starts at 0);
- a block normalises the attention's and the MLP's outputs too ("sandwich" norms: post_attention_layernorm
  on the attention's output, pre_ and post_feedforward_layernorm around the MLP);
- q and k are RMS-normalised per head (as Qwen3, with Gemma's norm); the MLP is GeGLU (tanh GELU);
- the embeddings are scaled by sqrt(hidden_size), in the weights' dtype;
- two kinds of layer: 'sliding_attention' layers (five in six) rotate with the local RoPE base
  (rope_local_base_freq, 10k), 'full_attention' ones with the global base and its scaling (1M; linear x8 on
  the larger models): local_rope.py's two tables, stacked; a block takes its own.

Departure from transformers: the sliding window (512 tokens) is not applied: a local layer attends to every
earlier token, which is exact while a sequence is no longer than the window. So nanogrpo gives a Gemma 3 run
the window as its context (policy.model_positions): prompt + completion at most 512 tokens, refused or cut as
--data.long-prompts says. Logit soft-capping (None in the released configs) and a query scale other than
head_dim**-0.5 are refused by hf_config.ModelArgs.from_hf.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from nanogrpo.model.hf_config import ModelArgs
from nanogrpo.model.local_rope import LocalRope
from nanogrpo.model.transformer import MLP, Attention, RMSNorm


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + w), computed in float32 and cast back after the weight (Gemma3RMSNorm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).type_as(x)


class GemmaBlock(nn.Module):
    """A Gemma 3 decoder layer: attention and MLP each between two norms; `local`: a sliding-window layer,
    which rotates with the local RoPE table (index 1 of the stacked tables)."""

    def __init__(self, a: ModelArgs, layer: int):
        super().__init__()
        H, eps = a.hidden_size, a.rms_norm_eps
        self.local = a.layer_types[layer] == "sliding_attention"
        self.input_layernorm = GemmaRMSNorm(H, eps)
        self.self_attn = Attention(a)
        self.self_attn.q_norm, self.self_attn.k_norm = (
            GemmaRMSNorm(a.head_dim, eps),
            GemmaRMSNorm(a.head_dim, eps),
        )
        self.post_attention_layernorm = GemmaRMSNorm(H, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(H, eps)
        self.mlp = MLP(a)
        self.mlp.act = functools.partial(F.gelu, approximate="tanh")  # gelu_pytorch_tanh: GeGLU
        self.post_feedforward_layernorm = GemmaRMSNorm(H, eps)

    def forward(self, x, cos, sin, mask, kv_cache=None, layer=0) -> torch.Tensor:
        cos, sin = cos[int(self.local)], sin[int(self.local)]  # (B, T, 1, rot) this layer's RoPE
        h = self.self_attn(self.input_layernorm(x), cos, sin, mask, kv_cache, layer)
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Transformer(LocalRope):
    """transformer.Transformer with Gemma 3's layers, final norm, embedding scale and two RoPE tables."""

    def __init__(self, config: ModelArgs, attn: str = "sdpa"):
        super().__init__(config, attn)
        self.model.layers = nn.ModuleList(GemmaBlock(config, i) for i in range(config.num_hidden_layers))
        self.model.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.embed_scale = config.hidden_size**0.5

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # (B, T, H)
        return x * torch.tensor(self.embed_scale).to(x.dtype)  # as Gemma3TextScaledWordEmbedding
