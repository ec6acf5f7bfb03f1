"""Random models of real shapes (nanogrpo.model.zoo 'random:SHAPE'): shapes, loading, tokenizer, cache."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from nanogrpo.model.hf_config import ModelArgs
from nanogrpo.model.transformer import Transformer
from nanogrpo.model.zoo import RANDOM_SHAPES, random_config, random_transformer, resolve_model

# a Qwen2.5-0.5B with every dimension shrunk (bias on q/k/v, tied embeddings and GQA kept)
SMALL = "qwen2.5-0.5b:layers=2,hidden_size=64,intermediate_size=128,num_attention_heads=4,num_key_value_heads=2,vocab_size=1024"  # noqa: E501
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setenv("NANOGRPO_CACHE", str(tmp_path_factory.mktemp("cache")))
    return resolve_model(f"random:{SMALL}")


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.mark.parametrize(
    "shape, params",
    # the published parameter counts (tied embeddings counted once)
    [("qwen2.5-0.5b", 494_032_768), ("qwen2.5-1.5b", 1_543_714_304), ("llama-3-8b", 8_030_261_248)],
)
def test_full_shapes_have_the_published_parameter_count(shape: str, params: int) -> None:
    with torch.device("meta"):
        model = Transformer(ModelArgs.from_hf(random_config(shape)))
    assert sum(p.numel() for p in model.parameters()) == params
    assert set(RANDOM_SHAPES) == {"qwen2.5-0.5b", "qwen2.5-1.5b", "llama-3-8b"}


def test_overrides_and_bad_specs() -> None:
    cfg = random_config("llama-3-8b:layers=1,vocab_size=512")
    assert (cfg["num_hidden_layers"], cfg["vocab_size"], cfg["hidden_size"]) == (1, 512, 4096)
    for bad in ("gpt-5", "qwen2.5-0.5b:layers=0", "qwen2.5-0.5b:depth=2", "qwen2.5-0.5b:layers"):
        with pytest.raises(ValueError, match="random:"):
            random_config(bad)
    with pytest.raises(ValueError, match="random:SHAPE"):
        resolve_model("no-such-model-folder")


def test_folder_loads_with_the_right_shapes(small_dir) -> None:
    cfg = json.loads((small_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["num_hidden_layers"] == 2 and cfg["rope_theta"] == 1e6
    model = Transformer.from_pretrained(small_dir)
    assert len(model.model.layers) == 2
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.q_proj.weight.shape == (64, 64)
    assert attn.k_proj.weight.shape == (32, 64)  # 2 kv heads x head_dim 16
    assert model.lm_head.weight is model.model.embed_tokens.weight
    w = attn.q_proj.weight.double()
    assert abs(w.std().item() - 0.02) < 0.002 and abs(w.mean().item()) < 0.002
    assert torch.equal(model.model.norm.weight, torch.ones(64))


def test_built_once(small_dir) -> None:
    weights = small_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert resolve_model(f"random:{SMALL}") == small_dir
    assert weights.stat().st_mtime_ns == before


def test_in_memory_model_equals_the_folder(small_dir) -> None:
    ids = torch.tensor([[1, 5, 9, 300, 2, 7]])  # (1, 6)
    a = Transformer.from_pretrained(small_dir, dtype=torch.bfloat16)
    b = random_transformer(SMALL, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(a(ids), b(ids))


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
def test_matches_transformers_and_tokenizer_loads(small_dir) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(small_dir)
    assert (tok.eos_token_id, tok.pad_token_id) == (2, 0)
    msgs = [{"role": "user", "content": "What is 12 + 35?"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nWhat is 12 + 35?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    x = torch.tensor([ids])  # (1, T)
    hf = AutoModelForCausalLM.from_pretrained(small_dir, dtype=torch.float32)
    ours = Transformer.from_pretrained(small_dir, dtype=torch.float32)
    with torch.no_grad():
        assert type(hf).__name__ == "Qwen2ForCausalLM"
        torch.testing.assert_close(ours(x), hf(x).logits, rtol=1e-4, atol=1e-5)


def test_tokenizer_added_later_when_built_without_tokenizers(tmp_path, monkeypatch) -> None:
    import nanogrpo.model.zoo as zoo

    monkeypatch.setenv("NANOGRPO_CACHE", str(tmp_path))
    spec = "random:qwen2.5-0.5b:layers=1,hidden_size=32,intermediate_size=64,num_attention_heads=2,num_key_value_heads=1,vocab_size=512"  # noqa: E501
    monkeypatch.setattr(zoo, "_has_tokenizers", lambda: False)
    path = resolve_model(spec)
    assert (path / "model.safetensors").is_file() and not (path / "tokenizer.json").exists()
    monkeypatch.undo()
    monkeypatch.setenv("NANOGRPO_CACHE", str(tmp_path))
    assert resolve_model(spec) == path
    assert (path / "tokenizer.json").is_file() and (path / "tokenizer_config.json").is_file()
