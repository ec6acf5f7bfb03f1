"""Parity of nanogrpo.model.Transformer with transformers' AutoModelForCausalLM, and its cache/mask paths."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from nanogrpo.model import Transformer


def test_tiny_matches_transformers(tiny_model_dir):
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ours = Transformer.from_pretrained(tiny_model_dir)
    ids = torch.randint(0, ours.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), ref(ids).logits, atol=1e-4, rtol=0)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    assert ours.config.eos_token_ids == [ref.config.eos_token_id]


@pytest.mark.parametrize("split", [3, 5])
def test_tiny_kv_cache_equals_full(tiny_model_dir, split):
    m = Transformer.from_pretrained(tiny_model_dir)
    ids = torch.randint(0, m.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = m(ids)
        cache = m.new_kv_cache(2, 16)
        first = m(ids[:, :split], kv_cache=cache)
        steps = [m(ids[:, t : t + 1], kv_cache=cache) for t in range(split, 8)]
    torch.testing.assert_close(torch.cat([first, *steps], 1), full, atol=1e-5, rtol=0)
    assert cache.length == 8
