"""LoRA by hand: inject adapters, switch them off (the KL reference), merge, save/load in PEFT's layout.

LoRA (Hu et al. 2021) adds a low-rank update to a frozen linear layer: y = W x + (alpha / r) * B A x, with
A (r, in) initialised like nn.Linear (kaiming-uniform, a = sqrt(5)) and B (out, r) initialised to zero, so
training starts exactly at the base model. Everything that is not an adapter is frozen by `inject_lora`.

Where this departs from PEFT (on purpose, for a smaller and faster trainer):
- One adapter per layer, no adapter names: `disabled(model)` switches all of them off at once, which is
  the GRPO reference model without a second copy of the weights.
- Adapter weights live in float32 (the master copy) while the frozen base may be bfloat16; in the forward
  the adapter runs in the activation dtype (as autocast would), so bf16 activations hit bf16 matmuls.
- Saved files use PEFT's layout and key names (adapter_config.json + adapter_model.safetensors with keys
  `base_model.model.<module path>.lora_{A,B}.weight`), so `peft.PeftModel.from_pretrained` loads them on
  the matching transformers model, and `load_adapter` reads adapters trained with PEFT.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PEFT_PREFIX = "base_model.model."  # what PeftModel puts in front of the wrapped model's module paths
CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"


class LoraLinear(nn.Module):
    """A frozen nn.Linear plus a trainable low-rank update (alpha / r) * B @ A."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float = 0.0, dtype=torch.float32):
        super().__init__()
        assert r > 0, "LoRA rank must be positive"
        self.base_layer = base  # same attribute name as PEFT, so full state dicts line up too
        self.r, self.alpha = r, float(alpha)
        self.scaling = self.alpha / r
        dev = base.weight.device
        self.lora_A = nn.Linear(base.in_features, r, bias=False, device=dev, dtype=dtype)
        self.lora_B = nn.Linear(r, base.out_features, bias=False, device=dev, dtype=dtype)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.enabled = True  # False inside `disabled(model)`
        self.merged = False  # True after `merge(model)`: the update lives in base_layer.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        if self.enabled and not self.merged:
            # weights cast to the activation dtype: bf16 matmuls on bf16 activations, grads flow to fp32
            a = self.lora_A.weight.to(x.dtype)  # (r, in)
            b = self.lora_B.weight.to(x.dtype)  # (out, r)
            y = y + F.linear(F.linear(self.dropout(x), a), b) * self.scaling
        return y

    # code that reads `.weight` / `.bias` of a projection keeps working on a wrapped one
    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base_layer.bias

    @property
    def in_features(self) -> int:
        return self.base_layer.in_features

    @property
    def out_features(self) -> int:
        return self.base_layer.out_features

    def merged_weight(self, sign: float = 1.0, out: torch.Tensor | None = None) -> torch.Tensor:
        """W + sign * (alpha / r) B A: computed in float32 (one fused matmul-add), rounded once to W's dtype;
        or written into `out` (float32, W's shape), left in float32."""
        w = self.base_layer.weight
        a, b = self.lora_A.weight.float(), self.lora_B.weight.float()  # (r, in), (out, r)
        if out is not None:
            return out.copy_(w).addmm_(b, a, alpha=sign * self.scaling)  # (out, in)
        return w.to(torch.float32, copy=True).addmm_(b, a, alpha=sign * self.scaling).to(w.dtype)  # (out, in)

    def extra_repr(self) -> str:
        return f"r={self.r}, alpha={self.alpha:g}, merged={self.merged}"


def lora_modules(model: nn.Module) -> dict[str, LoraLinear]:
    """Module path -> LoraLinear, in model order."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLinear)}


def _matches(name: str, targets: Sequence[str] | str) -> bool:
    # PEFT's rule: a string is a regex on the full module path; a list matches the path's last parts
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith("." + t) for t in targets)


def inject_lora(
    model: nn.Module,
    r: int = 16,
    alpha: float = 32.0,
    dropout: float = 0.0,
    targets: Sequence[str] | str = DEFAULT_TARGETS,
) -> nn.Module:
    """Wrap every nn.Linear whose name matches `targets` in a LoraLinear; freeze all other parameters.

    Modifies `model` in place and returns it. Adapters start at B = 0, so the output is unchanged.
    """
    if r <= 0:
        raise ValueError(f"LoRA rank r={r}: use r >= 1, or skip inject_lora for full fine-tuning")
    if lora_modules(model):
        raise ValueError("model already has LoRA adapters; inject_lora once per model")
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and _matches(n, targets)]
    if not names:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ValueError(f"no linear layer matches LoRA targets {targets!r}; this model has {linear}")
    for p in model.parameters():
        p.requires_grad_(False)
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoraLinear(getattr(parent, child), r, alpha, dropout))
    return model


@contextlib.contextmanager
def disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Inside this block the model is exactly its base (adapters off): the reference policy for the KL."""
    mods = lora_modules(model).values()
    if not mods:
        raise ValueError(
            "disabled(model) needs LoRA adapters; with full fine-tuning keep a frozen copy as the reference"
        )
    if any(m.merged for m in mods):
        raise ValueError("adapters are merged into the weights; unmerge(model) before disabled(model)")
    before = [m.enabled for m in mods]
    for m in mods:
        m.enabled = False
    try:
        yield model
    finally:
        for m, e in zip(mods, before):
            m.enabled = e


@torch.no_grad()
def merge(model: nn.Module) -> nn.Module:
    """Add each adapter's update into its base weight (faster inference); `unmerge` takes it back out.

    With a bfloat16 base the round trip is exact only up to bf16 rounding of the weights.
    """
    for m in lora_modules(model).values():
        if not m.merged:
            w = m.base_layer.weight
            w.copy_(m.merged_weight())
            m.merged = True
    return model


@torch.no_grad()
def unmerge(model: nn.Module) -> nn.Module:
    """Subtract each merged adapter's update from its base weight."""
    for m in lora_modules(model).values():
        if m.merged:
            w = m.base_layer.weight
            w.copy_(m.merged_weight(-1.0))
            m.merged = False
    return model


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters with requires_grad: the adapters after inject_lora, every weight otherwise."""
    return [p for p in model.parameters() if p.requires_grad]


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Adapter weights under PEFT's key names (`base_model.model.<path>.lora_A.weight`)."""
    sd = {}
    for name, m in lora_modules(model).items():
        sd[f"{PEFT_PREFIX}{name}.lora_A.weight"] = m.lora_A.weight.detach()
        sd[f"{PEFT_PREFIX}{name}.lora_B.weight"] = m.lora_B.weight.detach()
    return sd


def save_adapter(model: nn.Module, out_dir: str | Path, base_model_name_or_path: str = "") -> Path:
    """Write adapter_config.json + adapter_model.safetensors in PEFT's layout; returns the folder."""
    mods = lora_modules(model)
    if not mods:
        raise ValueError("model has no LoRA adapters to save; for full fine-tuning save the weights instead")
    first = next(iter(mods.values()))
    if any(m.r != first.r or m.alpha != first.alpha for m in mods.values()):
        raise ValueError("adapters with different ranks/alphas per layer are not supported by save_adapter")
    dropout = next((m.dropout.p for m in mods.values() if isinstance(m.dropout, nn.Dropout)), 0.0)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": first.r,
        "lora_alpha": int(first.alpha) if first.alpha.is_integer() else first.alpha,
        "lora_dropout": dropout,
        "target_modules": sorted({n.rsplit(".", 1)[-1] for n in mods}),
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    tensors = {k: v.contiguous().cpu() for k, v in adapter_state_dict(model).items()}
    from nanogrpo_base.files import save_tensors  # here, as safetensors in read_adapter

    save_tensors(tensors, out / WEIGHTS_NAME, metadata={"format": "pt"})  # mode by the umask, not 0600
    return out


def read_adapter(adapter_dir: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """A PEFT-layout adapter folder -> (adapter_config, tensors under `...lora_{A,B}.weight` keys)."""
    d = Path(adapter_dir)
    if not (d / CONFIG_NAME).is_file() or not (d / WEIGHTS_NAME).is_file():
        raise ValueError(f"{d} is not a LoRA adapter folder: expected {CONFIG_NAME} and {WEIGHTS_NAME}")
    cfg = json.loads((d / CONFIG_NAME).read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{d / CONFIG_NAME}: peft_type {cfg['peft_type']!r}; only LORA adapters load here")
    for unsupported in ("use_dora", "use_rslora", "rank_pattern", "alpha_pattern", "modules_to_save"):
        if cfg.get(unsupported):
            raise ValueError(f"{d / CONFIG_NAME}: {unsupported}={cfg[unsupported]!r} is not supported")
    from safetensors.torch import load_file  # here: the sampler imports this module, and needs no files

    # PEFT strips the adapter name when saving; tolerate files that kept it (`lora_A.default.weight`)
    state = {
        re.sub(r"\.(lora_[AB])\.[^.]+\.weight$", r".\1.weight", k): v
        for k, v in load_file(d / WEIGHTS_NAME).items()
    }
    return cfg, state


def load_adapter(model: nn.Module, adapter_dir: str | Path) -> nn.Module:
    """Load a PEFT-layout LoRA adapter into `model`, injecting adapters first if it has none."""
    d = Path(adapter_dir)
    cfg, state = read_adapter(d)
    r, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    mods = lora_modules(model)
    if not mods:
        inject_lora(model, r, alpha, float(cfg.get("lora_dropout", 0.0)), cfg["target_modules"])
        mods = lora_modules(model)
    elif any(m.merged for m in mods.values()):
        raise ValueError("adapters are merged into the weights; unmerge(model) before load_adapter")
    elif any(m.r != r or m.alpha != alpha for m in mods.values()):
        raise ValueError(f"{d}: adapter has r={r}, alpha={alpha:g}; the model's adapters differ")
    expected = adapter_state_dict(model)
    missing, unexpected = sorted(expected.keys() - state.keys()), sorted(state.keys() - expected.keys())
    if missing or unexpected:
        raise ValueError(
            f"{d}: adapter keys do not fit this model: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    with torch.no_grad():
        for name, m in mods.items():
            for part in ("lora_A", "lora_B"):
                src = state[f"{PEFT_PREFIX}{name}.{part}.weight"]
                dst = getattr(m, part).weight
                if src.shape != dst.shape:
                    raise ValueError(
                        f"{d}: {name}.{part} has shape {tuple(src.shape)}, model wants {tuple(dst.shape)}"
                    )
                dst.copy_(src)
    return model


def merge_into_base(model: torch.nn.Module) -> None:
    """Fold every LoRA adapter into its base weight for good and take the adapters out of the model."""
    merge(model)
    for name, m in lora_modules(model).items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, m.base_layer)


@torch.no_grad()
def stack_adapters(first: Path, folder: Path) -> None:
    """Rewrite the adapter in `folder` (trained on base + `first` merged) as one adapter on the base.

    B1 A1 s1 + B2 A2 s2 = [B1 s1 | B2 s2] @ [A1 ; A2]: rank r1 + r2, alpha = r (scale 1); a layer that
    only one of the two adapts gets zeros in the other's rows. Exact in float32; with a bf16 base, the
    training saw base + SFT rounded to bf16 once, the stacked adapter the unrounded sum.
    """
    from nanogrpo_base.files import save_tensors

    (cfg1, sd1), (cfg2, sd2) = read_adapter(first), read_adapter(folder)
    r1, r2 = int(cfg1["r"]), int(cfg2["r"])
    s1, s2 = float(cfg1["lora_alpha"]) / r1, float(cfg2["lora_alpha"]) / r2
    paths = sorted({k.rsplit(".lora_", 1)[0] for k in [*sd1, *sd2]})
    out = {}
    for p in paths:
        a1, b1 = sd1.get(f"{p}.lora_A.weight"), sd1.get(f"{p}.lora_B.weight")
        a2, b2 = sd2.get(f"{p}.lora_A.weight"), sd2.get(f"{p}.lora_B.weight")
        ref_a, ref_b = (a1, b1) if a1 is not None else (a2, b2)
        n_in, n_out = ref_a.shape[1], ref_b.shape[0]
        a1 = a1.float() if a1 is not None else torch.zeros(r1, n_in)  # (r1, in)
        b1 = b1.float() * s1 if b1 is not None else torch.zeros(n_out, r1)  # (out, r1)
        a2 = a2.float() if a2 is not None else torch.zeros(r2, n_in)  # (r2, in)
        b2 = b2.float() * s2 if b2 is not None else torch.zeros(n_out, r2)  # (out, r2)
        out[f"{p}.lora_A.weight"] = torch.cat([a1, a2]).contiguous()  # (r1+r2, in)
        out[f"{p}.lora_B.weight"] = torch.cat([b1, b2], dim=1).contiguous()  # (out, r1+r2)
    targets = sorted({*cfg1["target_modules"], *cfg2["target_modules"]})
    cfg = {**cfg2, "r": r1 + r2, "lora_alpha": r1 + r2, "target_modules": targets}
    cfg["base_model_name_or_path"] = cfg1.get("base_model_name_or_path") or cfg2.get(
        "base_model_name_or_path"
    )
    (folder / CONFIG_NAME).write_text(json.dumps(cfg, indent=2) + "\n")
    save_tensors(out, folder / WEIGHTS_NAME, metadata={"format": "pt"})
