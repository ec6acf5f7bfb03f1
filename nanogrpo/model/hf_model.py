"""The general path: a causal LM that transformers loads, behind the interface of nanogrpo's own model.

    impl = model_impl(model_dir, cfg.model.impl)   # 'own' (transformer.py) or 'transformers' (this file)
    model = HFModel.from_pretrained(model_dir, dtype, device)

`--model.impl auto` takes nanogrpo's own model where it has the architecture (transformer.py and its families,
tested equal to transformers, with the fast paths) and transformers' model otherwise; `own` and
`transformers` force one. HFModel holds transformers' backbone and LM head under their own names
(`model.layers.{i}...` and `lm_head` for most models), so nanogrpo's LoRA goes into its linear layers by name
(`--lora.targets` names them; projections that are not nn.Linear, as GPT-2's Conv1D, take no adapter) and
the adapter keeps PEFT's key names. Its forward has Transformer.forward's signature: the same plain sampler
(sampling.generate, decode, Episodes), LogprobHead, loss, checkpoints and FSDP run on it.

What the general path does not do: the fast paths of model/fast/ (packed weights, the grouped cache, the row
sampler, the shared-prompt log-prob head, compiled or CUDA-graph decode) and nanogrpo's attention kernels;
a run on it takes the plain path, as --plain does, and says so in one line at start-up. The memory plan is
nanogrpo's own model's (memory.py); --memory-check skips a run on this path, saying so.

The cache (HFCache) is transformers' DynamicCache for the model's config, so a hybrid model (Qwen3.5's Gated
DeltaNet layers, and any linear-attention layer transformers caches the same way) keeps its convolution and
recurrent states in it. Padding is where a recurrent state departs from attention: a pad's key is masked out
later, but a pad fed through a linear-attention layer still decays its state and shifts its convolution
window. Left pads before a row's first token are harmless (the state is still zero and stays zero). Pads after
a row's first token (an ended row riding along in `decode`, the left pads of an episode's next turn) are
fed, for a model with such layers, one column at a time, each row's states put back where its column is a
pad: the states then hold each row's real tokens only, as a prefill of its history does.

Departures: the logits are lm_head(final hidden state); a causal LM whose head does more (a final logit
soft-cap, a logit scale) is refused in one line, as is `--model.attn flash` (transformers' SDPA runs).
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import torch
from torch import nn

from nanogrpo.model.hf_config import ModelArgs, eos_ids

IMPLS = ("auto", "own", "transformers")
HEAD_EXTRAS = ("final_logit_softcapping", "logit_scale", "logits_scaling")  # what lm_head alone would miss


def model_impl(model_dir: str | Path, impl: str = "auto") -> str:
    """'own' or 'transformers': which model runs the folder's config.json under --model.impl `impl`, or a
    ValueError in one line when neither can (checked before anything loads)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    if impl not in IMPLS:
        raise ValueError(f"--model.impl {impl!r}: use one of {IMPLS}")
    if impl != "transformers":
        try:
            ModelArgs.from_hf(cfg)  # an architecture nanogrpo's own model runs, or its refusal
            return "own"
        except ValueError:
            if impl == "own" or transformers_causal_lm(cfg) is None:
                raise
    check_general(cfg, model_dir)
    return "transformers"


def load_model(path, impl: str = "auto", dtype=torch.float32, device="cpu", attn: str = "sdpa") -> nn.Module:
    """The model of an HF folder under --model.impl `impl`: transformer.Transformer (nanogrpo's own, with its
    families) or HFModel (transformers'), in `dtype` on `device`, in eval mode."""
    from nanogrpo.model.transformer import Transformer

    general = model_impl(path, impl) == "transformers"
    return (HFModel if general else Transformer).from_pretrained(path, dtype=dtype, device=device, attn=attn)


def start(model_dir, impl: str, plain: bool, say: bool = True) -> bool:
    """At a run's start-up, before the model loads: which model runs the folder, and so which path the run takes
    (model/paths.py): the plain path for transformers' model (the fast paths need nanogrpo's own), said in
    one line. Returns whether the run is on the general path."""
    from nanogrpo.model.paths import set_plain

    general = model_impl(model_dir, impl) == "transformers"
    set_plain(plain or general)
    if general and say:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        print(
            f"note: {transformers_causal_lm(cfg)} runs as transformers' model (--model.impl {impl}): the plain "
            "sampler and log-prob head on its own modules, as --plain; no packed weights, grouped or row "
            "cache, compiled or CUDA-graph decode, attention or LM-head kernels, memory plan"
        )
    return general


def check_flags(attn: str, decode: str) -> None:
    """The flags of a fast path, refused on the general path (before the model loads)."""
    HFModel.check_attn(attn)
    if decode not in ("eager", "plain"):
        raise ValueError(
            f"--sampling.decode {decode} needs nanogrpo's own model; transformers' samples with the plain "
            "loop: drop it"
        )


def transformers_causal_lm(cfg: dict) -> str | None:
    """The class name AutoModelForCausalLM gives the config's model_type, or None where it has none."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(cfg.get("model_type") or "")


def check_general(cfg: dict, model_dir) -> None:
    """The refusals of the general path, each in one line."""
    import transformers

    mtype = cfg.get("model_type")
    if transformers_causal_lm(cfg) is None:
        raise ValueError(
            f"{model_dir}: model_type {mtype!r} is not a causal LM transformers "
            f"{transformers.__version__} loads (nor one nanogrpo's own model runs)"
        )
    text = cfg.get("text_config") or cfg
    extra = [k for k in HEAD_EXTRAS if text.get(k) not in (None, 1, 1.0)]
    if extra:
        raise ValueError(
            f"{model_dir}: {mtype} sets {extra[0]}={text[extra[0]]}: nanogrpo's log-prob head takes the logits "
            "as lm_head(final hidden state), without it; this model cannot train on the general path"
        )


def general_positions(model_dir) -> int:
    """The positions a folder allows on the general path: its (text) config's max_position_embeddings
    (transformers applies a sliding window itself, so the window is no limit here)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    text = cfg.get("text_config") or cfg
    return int(text.get("max_position_embeddings") or 1 << 30)


class HFCache:
    """transformers' DynamicCache behind the interface of transformer.KVCache: `length` keys so far,
    `select(rows)` and `max_len` (it grows as tokens come, so there is no limit)."""

    max_len = 1 << 62

    def __init__(self, hf_config):
        from transformers import DynamicCache

        self.hf, self.length = DynamicCache(config=hf_config), 0

    def select(self, rows: torch.Tensor) -> HFCache:
        """Only these batch rows (repeats allowed: a prompt's states copied to its G samples), in place."""
        self.hf.reorder_cache(rows)
        return self

    def states(self) -> list[tuple[dict, int]]:
        """The (conv_states | recurrent_states dict, index) of every linear-attention state held now."""
        from transformers.cache_utils import LinearAttentionCacheLayerMixin

        out = []
        for layer in self.hf.layers:
            if isinstance(layer, LinearAttentionCacheLayerMixin):
                for d, done in ((layer.conv_states, layer.is_conv_states_initialized),
                                (layer.recurrent_states, layer.is_recurrent_states_initialized)):  # fmt: skip
                    out += [(d, i) for i in d if done[i]]
        return out

    @property
    def recurrent(self) -> bool:
        """Whether the model has linear-attention layers (known once a forward has filled them)."""
        return bool(self.states())


class HFModel(nn.Module):
    """transformers' causal LM with Transformer.forward's signature (module docstring)."""

    def __init__(self, hf: nn.Module):
        super().__init__()
        # the backbone and the LM head under their names in transformers' model ('model' and 'lm_head' for
        # most; GPT-NeoX's 'gpt_neox' and 'embed_out'), so LoRA and PEFT see the same module paths
        self.backbone_name = hf.base_model_prefix
        self.head_name = next(n for n, m in hf.named_children() if m is hf.get_output_embeddings())
        self.add_module(self.backbone_name, hf.base_model)
        self.add_module(self.head_name, hf.get_output_embeddings())
        self.hf_config = hf.config
        text = hf.config.get_text_config() if hasattr(hf.config, "get_text_config") else hf.config
        self.config = ModelArgs(
            model_type=hf.config.model_type,
            vocab_size=text.vocab_size,
            hidden_size=text.hidden_size,
            num_hidden_layers=text.num_hidden_layers,
            max_position_embeddings=getattr(text, "max_position_embeddings", 1 << 30),
            tie_word_embeddings=bool(getattr(hf.config, "tie_word_embeddings", False)),
            eos_token_ids=eos_ids(
                hf.config.to_dict(), getattr(hf, "generation_config", None) and hf.generation_config.to_dict()
            ),
        )
        self.cache_arg = (
            "cache" if "cache" in inspect.signature(self.backbone.forward).parameters else "past_key_values"
        )
        self.attn = "sdpa"

    @property
    def backbone(self) -> nn.Module:
        return getattr(self, self.backbone_name)

    def __getattr__(self, name: str):
        if name == "lm_head" and self.__dict__.get("head_name", "lm_head") != "lm_head":
            return self._modules[self.head_name]  # the name the sampler and the log-prob head call it by
        return super().__getattr__(name)

    @property
    def activation_checkpointing(self) -> bool:
        return bool(getattr(self.backbone, "gradient_checkpointing", False))

    @activation_checkpointing.setter
    def activation_checkpointing(self, on: bool) -> None:
        if on:
            self.backbone.gradient_checkpointing_enable({"use_reentrant": False})
        elif self.activation_checkpointing:
            self.backbone.gradient_checkpointing_disable()

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.lm_head.weight  # (V, H)

    def set_attn(self, attn: str) -> None:
        self.check_attn(attn)

    @staticmethod
    def check_attn(attn: str) -> None:
        if attn != "sdpa":
            raise ValueError(
                f"--model.attn {attn}: the general path (transformers' model) runs transformers' SDPA; drop it"
            )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.backbone.get_input_embeddings()(input_ids)  # (B, T, H), before the backbone's own scaling

    def new_kv_cache(self, batch: int, max_len: int, dtype: torch.dtype | None = None) -> HFCache:
        return HFCache(self.hf_config)

    def forward(self, input_ids, position_ids=None, attention_mask=None, kv_cache=None, return_hidden=False):
        """Transformer.forward's contract: input_ids (B, T); attention_mask (B, S), S = cached + T; kv_cache
        an HFCache or None. Logits (B, T, V), or the final-normed hidden states (B, T, H)."""
        B, T = input_ids.shape
        past = kv_cache.length if kv_cache is not None else 0
        if position_ids is None:
            if attention_mask is not None:  # left padding: real tokens count from 0
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, past:]  # (B, T)
            else:
                position_ids = torch.arange(past, past + T, device=input_ids.device).expand(B, T)  # (B, T)
        new = attention_mask[:, past:] if attention_mask is not None else None  # (B, T) this call's tokens
        if (
            kv_cache is not None
            and past > 0
            and new is not None
            and kv_cache.recurrent
            and not bool(new.all())
        ):
            h = self._columns(input_ids, position_ids, attention_mask, kv_cache, past)  # pads: states kept
        else:
            h = self._backbone(input_ids, position_ids, attention_mask, kv_cache)  # (B, T, H)
        return h if return_hidden else self.lm_head(h)  # (B, T, V)

    def _backbone(self, ids, pos, mask, cache) -> torch.Tensor:
        kw = {self.cache_arg: cache.hf if cache is not None else None, "use_cache": cache is not None}
        out = self.backbone(input_ids=ids, attention_mask=mask, position_ids=pos, **kw)
        if cache is not None:
            cache.length += ids.shape[1]
        return out.last_hidden_state  # (B, T, H)

    def _columns(self, ids, pos, mask, cache: HFCache, past: int) -> torch.Tensor:
        """The block a column at a time; after each, the linear-attention states of the rows whose column is
        a pad are put back as they were (module docstring). Hidden states (B, T, H)."""
        out = []
        for t in range(ids.shape[1]):
            pad = mask[:, past + t] == 0  # (B,)
            kept = [(d, i, d[i].clone()) for d, i in cache.states()] if bool(pad.any()) else []
            out.append(self._backbone(ids[:, t : t + 1], pos[:, t : t + 1], mask[:, : past + t + 1], cache))
            for d, i, old in kept:
                d[i].copy_(torch.where(pad.view(-1, *[1] * (old.dim() - 1)), old, d[i]))
        return torch.cat(out, 1)  # (B, T, H)

    @classmethod
    def from_pretrained(cls, path, dtype=torch.float32, device="cpu", attn: str = "sdpa") -> HFModel:
        """transformers' AutoModelForCausalLM of an HF folder, in `dtype` on `device`, in eval mode."""
        from transformers import AutoModelForCausalLM

        cls.check_attn(attn)  # before any weight is read
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa")
        return cls(hf).to(device).eval()
