"""LoRA by hand against PEFT on the transformers model, and its own invariants (disable, merge, save/load)."""

import json

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from nanogrpo.model.lora import (
    DEFAULT_TARGETS,
    LoraLinear,
    disabled,
    inject_lora,
    load_adapter,
    lora_modules,
    merge,
    save_adapter,
    trainable_parameters,
    unmerge,
)
from nanogrpo.model.transformer import Transformer
from nanogrpo.model.zoo import resolve_model

IDS = torch.tensor([[5, 17, 300, 42, 8, 99, 7], [1, 2, 3, 4, 5, 6, 7]])


@pytest.fixture(scope="module")
def tiny_dir():
    return resolve_model("tiny")


def randomize_adapters(model, seed=0):
    """B starts at zero (a no-op adapter); give A and B random values so the adapters change the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_A.weight.normal_(0, 0.5, generator=g)
            m.lora_B.weight.normal_(0, 0.5, generator=g)


@pytest.fixture()
def lora_model(tiny_dir):
    model = Transformer.from_pretrained(tiny_dir)
    base = model(IDS).detach()
    inject_lora(model, r=4, alpha=8, dropout=0.0)
    return model, base


def test_inject_starts_at_base_and_freezes_the_rest(lora_model):
    model, base = lora_model
    assert torch.equal(model(IDS), base)  # B = 0: exactly the base model
    mods = lora_modules(model)
    assert len(mods) == 7 * model.config.num_hidden_layers
    assert {n.rsplit(".", 1)[-1] for n in mods} == set(DEFAULT_TARGETS)
    trainable = trainable_parameters(model)
    assert sum(p.numel() for p in trainable) == sum(
        4 * (m.in_features + m.out_features) for m in mods.values()
    )
    assert all(p.dtype == torch.float32 for p in trainable)
    # gradients reach the adapters only
    randomize_adapters(model)
    model(IDS).square().mean().backward()
    names = {n for n, p in model.named_parameters() if p.grad is not None}
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)


def test_full_finetuning_without_inject(tiny_dir):
    model = Transformer.from_pretrained(tiny_dir)
    assert len(trainable_parameters(model)) == len(list(model.parameters()))
    with pytest.raises(ValueError, match="frozen copy"):
        with disabled(model):
            pass


def test_disabled_gives_exactly_base_logits(lora_model):
    model, base = lora_model
    randomize_adapters(model)
    with_lora = model(IDS).detach()
    assert not torch.allclose(with_lora, base, atol=1e-3)
    with disabled(model):
        assert torch.equal(model(IDS), base)
    assert torch.equal(model(IDS), with_lora)  # back on after the block


def test_merge_equals_unmerged(lora_model):
    model, base = lora_model
    randomize_adapters(model)
    w0 = model.model.layers[0].self_attn.q_proj.weight.clone()
    unmerged = model(IDS).detach()
    merge(model)
    assert all(m.merged for m in lora_modules(model).values())
    torch.testing.assert_close(model(IDS), unmerged, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="unmerge"):
        with disabled(model):
            pass
    unmerge(model)
    torch.testing.assert_close(model.model.layers[0].self_attn.q_proj.weight, w0, atol=1e-6, rtol=0)
    torch.testing.assert_close(model(IDS), unmerged, atol=1e-4, rtol=0)


def test_saved_adapter_loads_in_peft_with_same_logits(lora_model, tiny_dir, tmp_path):
    model, _ = lora_model
    randomize_adapters(model)
    ours = model(IDS).detach()
    save_adapter(model, tmp_path, base_model_name_or_path=str(tiny_dir))
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["lora_alpha"] == 8

    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, tmp_path).eval()
    with torch.no_grad():
        theirs = peft_model(IDS).logits
        torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=1e-4)
        with peft_model.disable_adapter():  # and PEFT's base is our base
            with disabled(model):
                torch.testing.assert_close(peft_model(IDS).logits, model(IDS), atol=1e-4, rtol=1e-4)


def test_peft_adapter_loads_into_ours(tiny_dir, tmp_path):
    """The other direction: an adapter trained/saved by PEFT itself."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    cfg = LoraConfig(
        r=2, lora_alpha=6, target_modules=["q_proj", "v_proj", "down_proj"], task_type="CAUSAL_LM"
    )
    peft_model = get_peft_model(hf, cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.5, generator=g)
    peft_model.save_pretrained(tmp_path)
    with torch.no_grad():
        theirs = peft_model.eval()(IDS).logits

    model = load_adapter(Transformer.from_pretrained(tiny_dir), tmp_path)
    assert {n.rsplit(".", 1)[-1] for n in lora_modules(model)} == {"q_proj", "v_proj", "down_proj"}
    torch.testing.assert_close(model(IDS), theirs, atol=1e-4, rtol=1e-4)


def test_load_back_restores_logits(lora_model, tiny_dir, tmp_path):
    model, _ = lora_model
    randomize_adapters(model, seed=3)
    ours = model(IDS).detach()
    save_adapter(model, tmp_path)
    fresh = load_adapter(Transformer.from_pretrained(tiny_dir), tmp_path)  # injects, then loads
    assert torch.equal(fresh(IDS), ours)
    # into a model that already has (different) adapters of the same shape
    again = inject_lora(Transformer.from_pretrained(tiny_dir), r=4, alpha=8)
    assert torch.equal(load_adapter(again, tmp_path)(IDS), ours)
    wrong = inject_lora(Transformer.from_pretrained(tiny_dir), r=2, alpha=8)
    with pytest.raises(ValueError, match="r=4"):
        load_adapter(wrong, tmp_path)


def test_bf16_base_with_fp32_adapters(tiny_dir):
    model = Transformer.from_pretrained(tiny_dir, dtype=torch.bfloat16)
    inject_lora(model, r=4, alpha=8)
    randomize_adapters(model)
    m = model.model.layers[0].mlp.up_proj
    assert (
        isinstance(m, LoraLinear)
        and m.weight.dtype == torch.bfloat16
        and m.lora_A.weight.dtype == torch.float32
    )
    out = model(IDS)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    out.float().square().mean().backward()
    assert m.lora_B.weight.grad is not None and m.lora_B.weight.grad.dtype == torch.float32


def test_bad_config(tiny_dir):
    model = Transformer.from_pretrained(tiny_dir)
    with pytest.raises(ValueError, match="no linear layer matches"):
        inject_lora(model, targets=("qkv",))
    with pytest.raises(ValueError, match="r=0"):
        inject_lora(model, r=0)
    inject_lora(model, r=2)
    with pytest.raises(ValueError, match="already"):
        inject_lora(model, r=2)


def test_sampling_with_adapters_and_disabled(tiny_dir):
    """The sampler runs through the adapters, and under disabled() samples exactly the base model."""
    from nanogrpo.model.fast.sampler import generate

    model = Transformer.from_pretrained(tiny_dir)
    prompts = [[5, 17, 300], [42, 8]]
    base = generate(model, prompts, max_new_tokens=8, temperature=0)
    inject_lora(model, r=4, alpha=8, dropout=0.1)
    randomize_adapters(model, seed=5)
    model.train()  # generate switches dropout off for sampling and restores the mode
    lora = generate(model, prompts, max_new_tokens=8, temperature=0)
    assert model.training
    assert not torch.equal(lora.logp, base.logp)
    with disabled(model):
        ref = generate(model, prompts, max_new_tokens=8, temperature=0)
    assert torch.equal(ref.completion_ids, base.completion_ids) and torch.equal(ref.logp, base.logp)
    model.eval()
    with torch.no_grad():
        full = model(torch.tensor([prompts[0] + lora.completion_ids[0].tolist()]))[0, 2:-1]
    torch.testing.assert_close(
        lora.logp[0], full.log_softmax(-1).gather(1, lora.completion_ids[0][:, None])[:, 0]
    )
