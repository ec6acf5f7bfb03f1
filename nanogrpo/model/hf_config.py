"""ModelArgs: what the forward pass needs of a Hugging Face config.json, and the architectures nanogrpo runs.

`ModelArgs.from_hf(config)` reads Llama, Mistral, Qwen2, Qwen3, Phi-3, SmolLM2 (a Llama), SmolLM3, OLMo 3 and
Gemma 3 (text) configs and refuses any other architecture, activation or RoPE type with the list of those it supports; the
variants' differences become flags the model reads (q/k/v and o biases, Qwen3's q/k norms, the RoPE
scaling: rope.py; Gemma 3's layer types and local RoPE base: gemma3.py; SmolLM3's NoPE layers: smollm3.py; OLMo 3's: olmo3.py). transformer.py builds the model from
it.
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
    "Gemma3ForCausalLM": "gemma3_text",
    "SmolLM3ForCausalLM": "smollm3",
    "Olmo3ForCausalLM": "olmo3",
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
    layer_types: list[str] = field(default_factory=list)  # Gemma 3: 'sliding_attention' | 'full_attention'
    sliding_window: int = 0  # Gemma 3: the local layers' window (0: none)
    rope_local_theta: float = 0.0  # Gemma 3: the local layers' RoPE base (rope_local_base_freq)
    rope_layers: list[int] = field(default_factory=list)  # SmolLM3: 1 a layer with RoPE, 0 without (NoPE)

    @classmethod
    def from_hf(cls, cfg: dict, generation_config: dict | None = None) -> ModelArgs:
        archs = cfg.get("architectures") or []
        mtype = cfg.get("model_type") or (ARCHITECTURES.get(archs[0]) if archs else None)
        unknown = [a for a in archs if a not in ARCHITECTURES]
        if mtype not in ARCHITECTURES.values() or unknown:
            raise ValueError(
                f"unsupported model: architectures={archs} model_type={mtype!r}; nanogrpo supports "
                f"{sorted(ARCHITECTURES)} (model_type {sorted(set(ARCHITECTURES.values()))}); "
                + transformers_knows(mtype)
            )
        # the fields of the families built on transformer.py's model (gemma3.py, smollm3.py)
        extra = {"gemma3_text": gemma3_fields, "smollm3": smollm3_fields, "olmo3": olmo3_fields}.get(
            mtype, lambda cfg: {}
        )(cfg)
        if cfg.get("hidden_act", "silu") != "silu" and mtype != "gemma3_text":  # Gemma 3: gemma3_fields
            raise ValueError(
                f"hidden_act={cfg['hidden_act']!r} is not supported; nanogrpo implements SwiGLU (silu)"
            )
        heads = cfg["num_attention_heads"]
        # transformers >= 5 writes rope_parameters (with rope_theta inside); older configs rope_scaling
        rope = dict(extra.pop("rope", None) or cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
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
        same = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "rms_norm_eps")
        same += ("max_position_embeddings", "bos_token_id", "pad_token_id", "tie_word_embeddings")
        return cls(
            **{**{k: cfg[k] for k in same if k in cfg}, **extra},
            model_type=mtype,
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim")
            or (256 if mtype == "gemma3_text" else cfg["hidden_size"] // heads),  # Gemma3's default
            qkv_bias=mtype == "qwen2" or (bias and mtype in ("llama", "qwen3", "smollm3")),
            o_bias=bias and mtype in ("llama", "qwen3", "smollm3"),
            mlp_bias=bool(cfg.get("mlp_bias", False)) and mtype in ("llama", "smollm3"),
            qk_norm=mtype in ("qwen3", "gemma3_text"),
            rope_theta=float(theta),
            rope_scaling=rope,
            partial_rotary_factor=float(partial),
            eos_token_ids=eos_ids(cfg, generation_config),
        )


def eos_ids(*configs: dict | None) -> list[int]:
    """The EOS ids of these configs (config.json, then generation_config.json), in order, once each."""
    eos: list[int] = []
    for src in configs:
        e = (src or {}).get("eos_token_id")
        for t in [e] if isinstance(e, int) else (e or []):
            if t not in eos:
                eos.append(t)
    return eos


def transformers_knows(model_type: str | None) -> str:
    """Whether the installed transformers has `model_type`, said for the refusal of an architecture."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type in CONFIG_MAPPING_NAMES:
        return (
            f"transformers {transformers.__version__} has it, but nanogrpo does not run transformers' models"
        )
    return (
        f"transformers {transformers.__version__} cannot load it either (it has no model_type {model_type!r})"
    )


def olmo3_fields(cfg: dict) -> dict:
    """An OLMo 3 config's layer types, window and two RoPE settings (olmo3.py), its full-attention layers' RoPE
    as `rope`, read as transformers' Olmo3Config reads them: rope_parameters per layer type (transformers >= 5),
    or rope_scaling for the full-attention layers with rope_theta, the sliding ones at the default base."""
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(n)
    ]
    per_type = cfg.get("rope_parameters") or {}
    if "full_attention" in per_type:
        rope, local = dict(per_type["full_attention"]), per_type.get("sliding_attention") or {}
    else:
        rope = {**(cfg.get("rope_scaling") or {}), "rope_theta": cfg.get("rope_theta", 500_000.0)}
        local = {}
    if (local.get("rope_type") or "default") != "default":
        raise ValueError(
            f"OLMo 3 with a sliding layers' RoPE of type {local['rope_type']!r} is not supported"
        )
    return dict(layer_types=list(types), sliding_window=int(cfg.get("sliding_window") or 0), rope=rope,
                rope_local_theta=float(local.get("rope_theta", 500_000.0)))  # fmt: skip


def smollm3_fields(cfg: dict) -> dict:
    """A SmolLM3 config's NoPE layers (no_rope_layers: 1 with RoPE, 0 without; by default every
    no_rope_layer_interval-th layer without) and its sliding window when on (smollm3.py)."""
    n, every = cfg["num_hidden_layers"], cfg.get("no_rope_layer_interval") or 4
    layers = cfg.get("no_rope_layers") or [int((i + 1) % every != 0) for i in range(n)]
    window = int(cfg.get("sliding_window") or 0) if cfg.get("use_sliding_window") else 0
    return dict(rope_layers=[int(x) for x in layers], sliding_window=window)


def gemma3_fields(cfg: dict) -> dict:
    """A Gemma 3 text config's layer types, window and two RoPE bases (gemma3.py), its global RoPE as `rope`
    (transformers >= 5 writes rope_parameters per layer type; older configs rope_theta, rope_local_base_freq
    and rope_scaling); what nanogrpo's model does not compute is refused here, before any weight loads."""
    head_dim = cfg.get("head_dim") or 256  # Gemma3TextConfig's default
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if cfg.get(key) is not None:
            raise ValueError(
                f"Gemma 3 with {key}={cfg[key]} is not supported (the released configs set None)"
            )
    if cfg.get("query_pre_attn_scalar", head_dim) != head_dim:
        raise ValueError(
            f"Gemma 3 with query_pre_attn_scalar={cfg['query_pre_attn_scalar']} != head_dim {head_dim} is not "
            "supported (nanogrpo's attention scales by head_dim ** -0.5, as the released configs do)"
        )
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("Gemma 3 with use_bidirectional_attention (an embedding model) is not a causal LM")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"Gemma 3 with hidden_activation={act!r} is not supported: its MLP is GeGLU (tanh)")
    n, every = (
        cfg["num_hidden_layers"],
        cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6,
    )
    types = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)
    ]
    per_type = cfg.get("rope_parameters") or {}
    if "full_attention" in per_type:  # transformers >= 5
        rope, local = dict(per_type["full_attention"]), per_type.get("sliding_attention") or {}
    else:
        rope = {**(cfg.get("rope_scaling") or {}), "rope_theta": cfg.get("rope_theta", 1_000_000.0)}
        local = {"rope_theta": cfg.get("rope_local_base_freq", 10_000.0)}
    if (local.get("rope_type") or "default") != "default":
        raise ValueError(f"Gemma 3 with a local RoPE of type {local['rope_type']!r} is not supported")
    return dict(layer_types=list(types), sliding_window=int(cfg.get("sliding_window") or 0), rope=rope,
                rope_local_theta=float(local.get("rope_theta", 10_000.0)),
                tie_word_embeddings=cfg.get("tie_word_embeddings", True))  # fmt: skip
