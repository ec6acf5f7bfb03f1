"""One decoder-only Transformer for Llama, Mistral, Qwen2, Qwen3, Phi-3 and SmolLM2 (Gemma 3: gemma3.py, its
blocks on this model) (its shape: hf_config.py's ModelArgs), its RoPE (`rope_tables`, `apply_rope`; rope.py:
the scalings HF configs name), its one attention call (`attention`: SDPA, with attention.py's kernels where
they are faster), its KV cache (`KVCache`), and its HF loader.

The module and parameter names are Hugging Face's (`model.layers.{i}.self_attn.q_proj`, ...), so an HF
safetensors state dict loads as is and LoRA adapters get PEFT's key names. The variants differ only in:
Qwen2 has a bias on q/k/v; Qwen3 RMS-normalises q and k per head; Phi-3 stores fused `qkv_proj` and
`gate_up_proj` weights, which `from_pretrained` splits into q/k/v and gate/up (so Phi-3 looks like Llama
to LoRA and to PEFT's key names; a Phi-3 adapter saved by nanogrpo targets q_proj/k_proj/v_proj).

Departures from transformers: sliding-window attention (Mistral, Qwen2) is ignored, which is exact for
sequences shorter than the window (4096+ in the released configs); 'dynamic' NTK RoPE picks its base from
the longest position of the current call (transformers keeps the largest seen so far); like 'longrope' (which
picks short or long factors the same way) it means a KV cache that grows past the original context holds
keys rotated with the old frequencies (transformers re-encodes the prompt at that point). With `attn="flash"`
a block of left-padded rows (an attention_mask, T > 1) runs flash-attn's varlen kernel on the real tokens,
and a float32 call runs SDPA (flash-attn has no float32 kernel): nanogrpo/model/attention.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from nanogrpo.model.attention import kernel_attention, varlen
from nanogrpo.model.hf_config import ModelArgs
from nanogrpo.model.paths import plain
from nanogrpo.model.rope import LENGTH_DEPENDENT, rope_inv_freq


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, T, h, D); cos/sin (B, T, 1, rot) as built by `rope_tables`, rot <= D (partial rotary leaves the
    rest as is). Same values as the papers' x * cos + rotate_half(x) * sin, op for op: `sin` holds its first
    half negated, so rotate_half(x) * sin is a roll of x times it (no split, negation and concatenation)."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + x.roll(rot // 2, -1) * sin
    xr, xp = x[..., :rot], x[..., rot:]
    return torch.cat((xr * cos + xr.roll(rot // 2, -1) * sin, xp), dim=-1)


def rope_tables(
    position_ids: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin (B, T, 1, rot) for `apply_rope`, from position_ids (B, T) and inv_freq (rot/2,)."""
    freqs = position_ids[..., None, None].float() * inv_freq  # (B, T, 1, rot/2)
    cos, sin = freqs.cos() * scale, freqs.sin() * scale
    return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
    """q (B, nh, T, D) against k, v (B, n_kv, S, D) -> (B, T, nh, D): the one attention call of every layer
    and cache. `mask` says which keys each query sees: "causal" (no padding, no cache), "flash" (the same
    through flash-attn, causal aligned bottom-right), a Varlen (left-padded rows through flash-attn's varlen
    kernel), None (one new token per row that sees every key) or a boolean tensor (B, 1, T, S).

    SDPA; attention.py's kernels take the calls where they are faster, with the same results to float32
    rounding (on the CPU every call, in float32; on a GPU grouped-query calls, and flash-attn's), but under
    --plain (model/paths.py)."""
    y = None if plain() else kernel_attention(q, k, v, mask)  # (B, T, nh, D), or None: SDPA as it is
    if y is not None:
        return y
    causal = isinstance(mask, str)  # "causal"
    y = F.scaled_dot_product_attention(
        q, k, v, attn_mask=None if causal else mask, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1]
    )  # (B, nh, T, D)
    return y.transpose(1, 2).to(q.dtype)  # (B, T, nh, D); autocast may run SDPA in its own dtype


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in float32 and cast back before the weight, as the reference implementations do
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.nh, self.nkv, self.hd = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.q_proj = nn.Linear(a.hidden_size, self.nh * self.hd, bias=a.qkv_bias)
        self.k_proj = nn.Linear(a.hidden_size, self.nkv * self.hd, bias=a.qkv_bias)
        self.v_proj = nn.Linear(a.hidden_size, self.nkv * self.hd, bias=a.qkv_bias)
        self.o_proj = nn.Linear(self.nh * self.hd, a.hidden_size, bias=a.o_bias)
        self.packed_qkv: nn.Module | None = None  # q|k|v in one matmul, only inside packed.packed_weights
        if a.qk_norm:
            self.q_norm = RMSNorm(self.hd, a.rms_norm_eps)
            self.k_norm = RMSNorm(self.hd, a.rms_norm_eps)

    def forward(self, x, cos, sin, mask, kv_cache, layer: int) -> torch.Tensor:
        """x (B, T, H); mask as built in Transformer.forward; kv_cache a cache (KVCache, kvcache.py,
        row_sampler.RowKVCache) or None."""
        B, T, _ = x.shape
        nh, nkv, D = self.nh, self.nkv, self.hd
        if self.packed_qkv is not None:
            q, k, v = self.packed_qkv(x).split([nh * D, nkv * D, nkv * D], -1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = q.view(B, T, nh, D), k.view(B, T, nkv, D), v.view(B, T, nkv, D)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # (B, T, nh, D), (B, T, n_kv, D)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, D)
        if kv_cache is None:  # no cache: the block's own keys
            y = attention(q, k, v, mask)  # (B, T, nh, D)
        else:
            k, v = kv_cache.update(layer, k, v)  # (B, n_kv, S, D): the cache's keys so far
            y = kv_cache.attend(layer, q, k, v, mask)  # (B, T, nh, D)
        return self.o_proj(y.reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=a.mlp_bias)
        self.up_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=a.mlp_bias)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=a.mlp_bias)
        self.packed_gate_up: nn.Module | None = None  # gate|up in one matmul, only inside packed_weights
        self.act = F.silu  # SwiGLU (Gemma 3: GeGLU, gemma3.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_gate_up is not None:
            gate, up = self.packed_gate_up(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act(gate) * up)


class Block(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = Attention(a)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = MLP(a)

    def forward(self, x, cos, sin, mask, kv_cache=None, layer=0) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, kv_cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """HF's `model.` prefix: embeddings, layers, final norm."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(Block(a) for _ in range(a.num_hidden_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)


class KVCache:
    """Keys and values for every layer, k/v (L, B, n_kv, max_len, D), rows left-padded to one length, written
    in place as tokens come (the plain sampler's cache; the grouped sampler's prefill). Every cache offers the
    layers `update` (store this block's keys, return those to attend to) and `attend`."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, length: int = 0):
        self.k, self.v, self.length = k, v, length

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new k/v (B, n_kv, T, D) after the filled part; return all keys/values so far."""
        end = self.length + k.shape[2]
        assert end <= self.max_len, f"KV cache full: {end} > max_len {self.max_len}"
        self.k[layer, :, :, self.length : end] = k
        self.v[layer, :, :, self.length : end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]  # (B, n_kv, S, D)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
        return attention(q, k, v, mask)  # (B, T, nh, D)

    def select(self, rows: torch.Tensor) -> KVCache:
        """A new cache holding only the given batch rows (e.g. the unfinished sequences)."""
        return KVCache(self.k[:, rows], self.v[:, rows], self.length)


class Transformer(nn.Module):
    def __init__(self, config: ModelArgs, attn: str = "sdpa"):
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.activation_checkpointing = False
        self._rope_cache: dict = {}  # (rope variant, device) -> (inv_freq, scale); plain attr: stays float32
        self.set_attn(attn)

    def set_attn(self, attn: str) -> None:
        self.check_attn(attn)
        self.attn = attn

    @staticmethod
    def check_attn(attn: str) -> None:
        if attn not in ("sdpa", "flash"):
            raise ValueError(f"attn={attn!r}: use 'sdpa' or 'flash'")
        if attn == "flash":
            try:
                import flash_attn  # noqa: F401
            except (ImportError, OSError) as e:  # OSError: a wheel built against another torch or CUDA
                raise ValueError(
                    f"attn='flash' needs flash-attn, which does not import here ({e}): pip install "
                    "'nanogrpo[gpu]' on a CUDA machine, or use attn='sdpa'"
                ) from e

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.lm_head.weight  # (V, H)

    def new_kv_cache(self, batch: int, max_len: int, dtype: torch.dtype | None = None) -> KVCache:
        c, p = self.config, self.lm_head.weight
        shape = (c.num_hidden_layers, batch, c.num_key_value_heads, max_len, c.head_dim)
        k = torch.zeros(shape, dtype=dtype or p.dtype, device=p.device)
        return KVCache(k, torch.zeros_like(k))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)  # (B, T, H)

    def _rope(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        rs = self.config.rope_scaling
        seq_len, key = 0, "default"
        if rs.get("rope_type") in LENGTH_DEPENDENT:  # these depend on the length: needs a host sync
            seq_len = int(position_ids.max()) + 1
            long = seq_len > rs.get("original_max_position_embeddings", self.config.max_position_embeddings)
            key = seq_len if rs["rope_type"] == "dynamic" and long else long
        if (key, position_ids.device) not in self._rope_cache:
            inv_freq, scale = rope_inv_freq(self.config, seq_len)
            self._rope_cache[(key, position_ids.device)] = (inv_freq.to(position_ids.device), scale)
        inv_freq, scale = self._rope_cache[(key, position_ids.device)]
        return rope_tables(position_ids, inv_freq, scale, dtype)  # each (B, T, 1, rot)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        kv_cache=None,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        """input_ids (B, T); attention_mask (B, S), S = cached + T, 1 = real token, 0 = (left) padding;
        kv_cache: a KVCache (below), GroupedKVCache (grouped.py), RowKVCache (row_sampler.py) or PrefixKV
        (kvcache.py), or None.

        Returns logits (B, T, V), or with return_hidden the final-normed hidden states (B, T, H).
        """
        B, T = input_ids.shape
        past = kv_cache.length if kv_cache is not None else 0
        S, dev = past + T, input_ids.device
        if attention_mask is not None:
            assert attention_mask.shape == (B, S), f"attention_mask {tuple(attention_mask.shape)} != {(B, S)}"
        if position_ids is None:
            if attention_mask is not None:  # left padding: real tokens count from 0
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, past:]  # (B, T)
            else:
                position_ids = torch.arange(past, S, device=dev).expand(B, T)  # (B, T)
        x = self.embed(input_ids)  # (B, T, H)
        cos, sin = self._rope(position_ids, x.dtype)

        # mask: "flash" (no padding), "causal" (SDPA, no padding, no cache), None (one new token sees all), a
        # boolean (B, 1, T, S) tensor, or with flash-attn a Varlen holding one (left padding, T > 1: decode
        # steps keep the tensor); each query also sees itself so pad rows are never fully masked (NaN)
        if self.attn == "flash" and attention_mask is None:
            mask = "flash"
        elif attention_mask is None and past == 0:
            mask = "causal" if T > 1 else None
        elif attention_mask is None and T == 1:
            mask = None
        else:
            qpos = torch.arange(past, S, device=dev)[:, None]  # (T, 1)
            kpos = torch.arange(S, device=dev)[None, :]  # (1, S)
            mask = (kpos <= qpos)[None, None]  # (1, 1, T, S)
            if attention_mask is not None:
                mask = (mask & attention_mask.bool()[:, None, None, :]) | (kpos == qpos)  # (B, 1, T, S)
                if self.attn == "flash" and T > 1:
                    mask = varlen(attention_mask, T, mask)  # once per forward: one host sync

        ckpt = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        for i, layer in enumerate(self.model.layers):
            if ckpt:
                x = checkpoint(layer, x, cos, sin, mask, kv_cache, i, use_reentrant=False)
            else:
                x = layer(x, cos, sin, mask, kv_cache, i)
        if kv_cache is not None:
            kv_cache.length = S
        x = self.model.norm(x)  # (B, T, H)
        return x if return_hidden else self.lm_head(x)  # (B, T, V)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        attn: str = "sdpa",
    ) -> Transformer:
        """Load an HF folder: config.json (+ generation_config.json) and *.safetensors (sharded or not)."""
        from safetensors.torch import load_file

        from nanogrpo.infra.model_cache import private_inductor_cache

        path = Path(path)
        cls.check_attn(attn)  # before any weight is read
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} has no config.json: pass an HF model folder, 'tiny' or 'smollm2'")
        cfg = json.loads((path / "config.json").read_text())
        gen = path / "generation_config.json"
        args = ModelArgs.from_hf(cfg, json.loads(gen.read_text()) if gen.is_file() else None)
        index = path / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{path} has no *.safetensors weights")
        sd: dict[str, torch.Tensor] = {}
        for f in files:
            sd.update(load_file(str(path / f), device=str(device)))
        sd = {k: t.to(dtype) for k, t in sd.items() if "rotary_emb" not in k}
        sd = _split_fused(sd, args)
        if args.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
            sd["lm_head.weight"] = sd["model.embed_tokens.weight"]

        private_inductor_cache()  # the meta device below imports torch's compiler: its cache is ours, not /tmp's
        with torch.device("meta"):  # no random init: every parameter comes from the checkpoint
            model = model_for(args, cls)
        missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
        if missing or unexpected:
            raise ValueError(
                f"{path}: checkpoint does not match the config: missing {missing}, unexpected {unexpected}"
            )
        if args.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        model.set_attn(attn)
        return model.to(device).eval()


def model_for(args: ModelArgs, default: type[Transformer] | None = None) -> Transformer:
    """The model of `args` (random weights): `default` (Transformer), or gemma3.Gemma3Transformer for Gemma 3
    (its blocks, norms, embedding scale and two RoPE tables)."""
    if args.model_type == "gemma3_text":
        from nanogrpo.model.gemma3 import Gemma3Transformer

        return Gemma3Transformer(args)
    if args.model_type == "olmo3":  # its blocks, norms and two RoPE tables
        from nanogrpo.model.olmo3 import Olmo3Transformer

        return Olmo3Transformer(args)
    if args.model_type == "smollm3":  # its NoPE layers
        from nanogrpo.model.smollm3 import SmolLM3Transformer

        return SmolLM3Transformer(args)
    return (default or Transformer)(args)


def _split_fused(sd: dict[str, torch.Tensor], a: ModelArgs) -> dict[str, torch.Tensor]:
    """Phi-3: qkv_proj (q|k|v rows) -> q/k/v_proj, gate_up_proj (gate|up rows) -> gate/up_proj."""
    out = {}
    sizes = [a.num_attention_heads * a.head_dim] + [a.num_key_value_heads * a.head_dim] * 2
    for name, t in sd.items():
        if name.endswith("qkv_proj.weight"):
            for part, w in zip(("q_proj", "k_proj", "v_proj"), t.split(sizes, dim=0)):
                out[name.replace("qkv_proj", part)] = w.contiguous()
        elif name.endswith("gate_up_proj.weight"):
            gate, up = t.chunk(2, dim=0)
            out[name.replace("gate_up_proj", "gate_proj")] = gate.contiguous()
            out[name.replace("gate_up_proj", "up_proj")] = up.contiguous()
        else:
            out[name] = t
    return out
