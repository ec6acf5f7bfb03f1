"""Muon as its authors use it: each parameter in the right group, and one step of each group moves it."""

import pytest
import torch

from nanogrpo.config import OptimConfig
from nanogrpo.model import lora
from nanogrpo.model.transformer import Transformer
from nanogrpo.optim import build_optimizer, muon_groups

needs_muon = pytest.mark.skipif(
    not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9"
)


def _names(model, params) -> set[str]:
    ids = {id(p) for p in params}
    return {n for n, p in model.named_parameters() if id(p) in ids}


def test_full_fine_tune_groups(tiny_model_dir):
    """Hidden-layer matrices to Muon; embeddings, the LM head, norms (and biases) to AdamW."""
    m = Transformer.from_pretrained(tiny_model_dir)
    named = list(m.named_parameters())
    mats, rest = muon_groups(named)
    muon, adamw = _names(m, mats), _names(m, rest)
    assert muon | adamw == {n for n, _ in named} and not muon & adamw  # every parameter exactly once
    assert muon and all(".layers." in n and n.endswith("_proj.weight") for n in muon)
    assert "model.embed_tokens.weight" in adamw and "model.norm.weight" in adamw
    assert all(p.ndim == 1 for n, p in named if n in adamw and "embed_tokens" not in n and "lm_head" not in n)
    proj = {n for n, p in named if p.ndim == 2 and ".layers." in n}
    assert muon == proj  # every projection of every layer, nothing else


def test_lora_groups_are_the_adapters(tiny_model_dir):
    m = Transformer.from_pretrained(tiny_model_dir)
    lora.inject_lora(m, r=4, alpha=8)
    named = [(n, p) for n, p in m.named_parameters() if p.requires_grad]
    mats, rest = muon_groups(named)
    assert not rest and _names(m, mats) == {n for n, _ in named}
    assert all("lora_A" in n or "lora_B" in n for n in _names(m, mats))


@needs_muon
def test_muon_steps_both_groups(tiny_model_dir):
    torch.manual_seed(0)
    m = Transformer.from_pretrained(tiny_model_dir)
    opt = build_optimizer(m, OptimConfig(name="muon", lr=1e-2))
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    ids = torch.randint(0, m.config.vocab_size, (2, 6))
    m(ids).float().logsumexp(-1).mean().backward()
    opt.step()
    moved = {n for n, p in m.named_parameters() if not torch.equal(p, before[n])}
    assert "model.embed_tokens.weight" in moved  # AdamW's group
    assert "model.layers.0.self_attn.q_proj.weight" in moved  # Muon's group
    assert len(opt.optimizers) == 2 and isinstance(opt.optimizers[0], torch.optim.Muon)
