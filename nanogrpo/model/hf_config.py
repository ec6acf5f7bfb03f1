"""ModelArgs: what the forward pass needs of a Hugging Face config.json, and the architectures nanogrpo runs.

`ModelArgs.from_hf(config)` reads Llama, Mistral, Qwen2, Qwen3, Phi-3 and SmolLM2 configs (SmolLM2 is a
Llama) and refuses any other architecture, activation or RoPE type with the list of those it supports; the
variants' differences become flags the model reads (q/k/v and o biases, Qwen3's q/k norms, the RoPE
scaling: rope.py). transformer.py builds the model from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# architectures[0] in config.json -> model_type; both spellings are accepted
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
}
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


@dataclass
class ModelArgs:
    """The fields of an HF config.json that the forward pass needs (attribute names are HF's)."""

    model_type: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # bias on q/k/v projections (Qwen2, or Llama/Qwen3 with attention_bias)
    o_bias: bool = False  # bias on o_proj (Llama/Qwen3 with attention_bias)
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    rope_theta: float = 10000.0
    rope_scaling: dict = field(default_factory=dict)  # rope_type + its fields; {} is plain RoPE
    partial_rotary_factor: float = 1.0
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_hf(cls, cfg: dict, generation_config: dict | None = None) -> ModelArgs:
        archs = cfg.get("architectures") or []
        mtype = cfg.get("model_type") or (ARCHITECTURES.get(archs[0]) if archs else None)
        unknown = [a for a in archs if a not in ARCHITECTURES]
        if mtype not in ARCHITECTURES.values() or unknown:
            raise ValueError(
                f"unsupported model: architectures={archs} model_type={mtype!r}; nanogrpo supports "
                f"{sorted(ARCHITECTURES)} (model_type {sorted(set(ARCHITECTURES.values()))})"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(
                f"hidden_act={cfg['hidden_act']!r} is not supported; nanogrpo implements SwiGLU (silu)"
            )
        heads = cfg["num_attention_heads"]
        # transformers >= 5 writes rope_parameters (with rope_theta inside); older configs rope_scaling
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_type = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
        rope.pop("type", None)
        if mtype == "phi3" and rope_type in ("su", "yarn"):
            rope_type = "longrope"  # Phi-3's early configs call longrope 'su' (or 'yarn')
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope type {rope_type!r} is not supported; use one of {ROPE_TYPES}")
        theta = rope.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0
        partial = rope.pop("partial_rotary_factor", None) or cfg.get("partial_rotary_factor") or 1.0
        if rope_type in ("llama3", "yarn", "longrope"):
            # Phi-3 keeps it at top level, and that value wins (as in transformers)
            orig = cfg.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
            rope["original_max_position_embeddings"] = orig or cfg["max_position_embeddings"]
        rope = {"rope_type": rope_type, **rope} if rope_type != "default" else {}
        bias = bool(cfg.get("attention_bias", False))
        eos: list[int] = []
        for src in (cfg, generation_config or {}):
            e = src.get("eos_token_id")
            for t in [e] if isinstance(e, int) else (e or []):
                if t not in eos:
                    eos.append(t)
        same = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "rms_norm_eps")
        same += ("max_position_embeddings", "bos_token_id", "pad_token_id", "tie_word_embeddings")
        return cls(
            **{k: cfg[k] for k in same if k in cfg},
            model_type=mtype,
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            qkv_bias=mtype == "qwen2" or (bias and mtype in ("llama", "qwen3")),
            o_bias=bias and mtype in ("llama", "qwen3"),
            mlp_bias=bool(cfg.get("mlp_bias", False)) and mtype == "llama",
            qk_norm=mtype == "qwen3",
            rope_theta=float(theta),
            rope_scaling=rope,
            partial_rotary_factor=float(partial),
            eos_token_ids=eos,
        )
