"""The general path (model/hf_model.py): transformers' own model behind nanogrpo's interface, on a small random
Qwen3.5 checkpoint that transformers builds here (three Gated DeltaNet layers, then a gated full-attention
one; the tiny model's tokenizer): log-probs equal to transformers' forward, the sampler's tokens scored as
transformers scores them, an episode continuing its hybrid cache equal to prefilling its history again, GRPO
steps at float32 rounding, a resumed run equal to the straight one, the adapter in PEFT giving eval.py
generate's greedy text; and --model.impl's choices, lines and refusals, with the tiny Llama trained through
transformers' model equal to nanogrpo's own."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import run_train_here

from nanogrpo.model.hf_model import HFModel, model_impl

LAYERS = ["linear_attention"] * 3 + ["full_attention"]


@pytest.fixture(scope="module")
def qwen35_dir(tmp_path_factory, tiny_model_dir) -> Path:
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    folder = tmp_path_factory.mktemp("qwen3_5")
    cfg = Qwen3_5TextConfig(
        vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, max_position_embeddings=512,
        layer_types=LAYERS, eos_token_id=2, pad_token_id=0, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # matrices spread enough that a group's completions differ (and so their rewards)
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(folder)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(tiny_model_dir / f, folder / f)
    return folder


def theirs(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_auto_takes_transformers_for_qwen35_and_nanogrpos_own_model_where_it_has_one(
    qwen35_dir, tiny_model_dir
):
    assert model_impl(qwen35_dir) == "transformers" and model_impl(tiny_model_dir) == "own"
    assert model_impl(tiny_model_dir, "transformers") == "transformers"
    with pytest.raises(ValueError, match="unsupported model.*transformers .* has it"):
        model_impl(qwen35_dir, "own")


def test_a_folder_transformers_cannot_load_either_is_one_line(tmp_path, tiny_model_dir):
    shutil.copytree(tiny_model_dir, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg.update(architectures=["NoSuchForCausalLM"], model_type="no_such")
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    for impl in ("auto", "own", "transformers"):
        with pytest.raises(ValueError, match="no_such"):
            model_impl(tmp_path / "m", impl)
    r = run_train_here("tiny", "--model.path", tmp_path / "m", "--out-dir", tmp_path / "run")
    assert r.returncode == 2 and "cannot load it either" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists()  # refused before anything loads or is written


def test_log_probs_equal_transformers_forward(qwen35_dir):
    """A left-padded batch (prompt, completion, trailing pads) through LogprobHead on HFModel: each row's
    log-probs are transformers' log-softmax of that row alone."""
    from nanogrpo.model.logprobs import LogprobHead

    ours, ref = HFModel.from_pretrained(qwen35_dir), theirs(qwen35_dir)
    prompts, completions = [[5, 6, 7, 8, 9], [11, 12, 13]], [[20, 21, 22, 23], [30, 31]]
    Tp, Tc = 5, 4
    ids = torch.zeros(2, Tp + Tc, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for r, (p, c) in enumerate(zip(prompts, completions)):
        ids[r, Tp - len(p) : Tp + len(c)] = torch.tensor(p + c)
        attn[r, Tp - len(p) : Tp + len(c)] = 1
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    targets, mask = ids[:, Tp:], attn[:, Tp:].float()
    with torch.no_grad():
        logp, _ = LogprobHead(ours)(ids, attn, pos, targets, mask, Tp, 1.0)
        for r, (p, c) in enumerate(zip(prompts, completions)):
            lq = ref(torch.tensor([p + c])).logits[0].log_softmax(-1)  # (T, V)
            want = torch.stack([lq[len(p) - 1 + t, c[t]] for t in range(len(c))])
            torch.testing.assert_close(logp[r, : len(c)], want, atol=2e-6, rtol=0)


def test_an_episode_continues_the_hybrid_cache_as_a_prefill_of_its_history(qwen35_dir):
    """Three turns of sampled tokens and observations of different lengths, rows ending at different steps:
    the logits after each observation equal transformers' forward over the row's whole history (the Gated
    DeltaNet states hold each row's real tokens only), and the sampler's log-probs are transformers'."""
    from nanogrpo.model.sampling import Episodes

    ours, ref = HFModel.from_pretrained(qwen35_dir), theirs(qwen35_dir)
    ep = Episodes(ours, turn=6)
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13, 14, 15, 16, 17, 18]]
    logits = ep.prefill(prompts, [0, 0, 1, 1])
    gens = [torch.Generator().manual_seed(s) for s in (1, 2)]
    history = [list(prompts[r // 2]) for r in range(4)]
    ended_early = 0
    for turn in range(3):
        gen = ep.decode(logits, 6, gens, group=2, eos_ids=list(range(2, 1024, 9)), pad_id=0)
        ended_early += int((gen.lengths < gen.completion_ids.shape[1]).sum())
        for r in range(4):
            n = int(gen.lengths[r])
            done = gen.completion_ids[r, :n].tolist()
            with torch.no_grad():
                lq = ref(torch.tensor([history[r] + done])).logits[0].log_softmax(-1)
            want = torch.stack([lq[len(history[r]) - 1 + t, done[t]] for t in range(n)])
            torch.testing.assert_close(gen.logp[r, :n], want, atol=5e-6, rtol=0)
            history[r] += done
        observations = [[40 + r] * (r + 1 + turn) for r in range(4)]
        logits = ep.extend(observations)
        for r in range(4):
            history[r] += observations[r]
            with torch.no_grad():
                want = ref(torch.tensor([history[r]])).logits[0, -1]
            torch.testing.assert_close(logits[r], want, atol=5e-6, rtol=0)
    assert ended_early > 0  # some row rode along after its end: its states must not have moved


def steps(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


FLAGS = ["tiny", "--model.dtype", "float32", "--eval-prompts", "0", "--no-plots", "--reward.spec", "random:1"]


def test_grpo_on_qwen35_resumes_exactly_and_its_adapter_generates_as_in_peft(qwen35_dir, tmp_path):
    from helpers import check_resume_and_peft_generate

    a, said = check_resume_and_peft_generate(qwen35_dir, tmp_path, [*FLAGS, "--model.path", qwen35_dir])
    assert all(m["sampler_kl"] < 1e-9 for m in a) and any(m["grad_norm"] > 0 for m in a)
    assert "Qwen3_5ForCausalLM runs as transformers' model" in said


def test_an_episode_run_on_qwen35(qwen35_dir, tmp_path):
    r = run_train_here(*FLAGS, "--model.path", qwen35_dir, "--env.name", "guess", "--data.train", "recipe:guess",
                       "--reward.spec", "env:1", "--steps", "1", "--prompts-per-step", "2",
                       "--sampling.max-new-tokens", "8", "--out-dir", tmp_path / "run")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    (m,) = steps(tmp_path / "run")
    assert m["sampler_kl"] < 1e-9 and m["env/obs_tokens"] > 0


def test_the_tiny_llama_through_transformers_trains_as_nanogrpos_own(tmp_path):
    """The general path against the own model's plain path on the same folder: the same samples, losses equal
    to float32 rounding."""
    for name, more in (("own", ["--plain"]), ("transformers", ["--model.impl", "transformers"])):
        r = run_train_here(
            *FLAGS, "--steps", "2", "--log-samples-every", "1", "--out-dir", tmp_path / name, *more
        )
        assert r.returncode == 0, r.stderr[-3000:]
    own, general = steps(tmp_path / "own"), steps(tmp_path / "transformers")
    for a, b in zip(own, general):
        assert b["sampler_kl"] < 1e-9 and b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)
    texts = [(tmp_path / n / "samples.jsonl").read_text() for n in ("own", "transformers")]
    assert texts[0] == texts[1]


def test_fast_path_flags_are_refused_on_the_general_path(qwen35_dir, tmp_path):
    r = run_train_here(
        *FLAGS, "--model.path", qwen35_dir, "--sampling.decode", "compiled", "--out-dir", tmp_path / "a"
    )
    assert r.returncode == 2 and "--sampling.decode compiled needs nanogrpo's own model" in r.stderr


def test_a_published_qwen35_folder_loads_its_text_model(tmp_path):
    """Qwen3.5's released folders are Qwen3_5ForConditionalGeneration (model_type qwen3_5, the text config
    nested): transformers loads the causal LM from one, and the general path gives its logits and context."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from nanogrpo.policy import model_positions

    text = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, layer_types=LAYERS,
                max_position_embeddings=300)  # fmt: skip
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64)
    torch.manual_seed(0)
    full = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision)).eval()
    full.save_pretrained(tmp_path)
    assert model_impl(tmp_path) == "transformers" and model_positions(tmp_path) == 300
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(
            HFModel.from_pretrained(tmp_path)(ids), full(input_ids=ids).logits, atol=0, rtol=0
        )


def test_a_model_with_other_module_names_trains_and_its_adapter_loads_in_peft(tmp_path, tiny_model_dir):
    """GPT-NeoX (its backbone `gpt_neox`, fused `query_key_value`): the adapter goes where --lora.targets says,
    under transformers' own module paths, so PEFT loads it and gives nanogrpo's logits."""
    from peft import PeftModel
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from nanogrpo.model.lora import load_adapter

    cfg = GPTNeoXConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=512, eos_token_id=2, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    GPTNeoXForCausalLM(cfg).save_pretrained(tmp_path / "m")
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(tiny_model_dir / f, tmp_path / "m" / f)
    r = run_train_here(*FLAGS, "--model.path", tmp_path / "m", "--steps", "2", "--optim.lr", "1e-2",
                       "--lora.targets", "query_key_value", "dense", "--out-dir", tmp_path / "run")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert all(m["sampler_kl"] < 1e-9 for m in steps(tmp_path / "run"))
    ids = torch.randint(3, 1024, (2, 9), generator=torch.Generator().manual_seed(0))
    peft = PeftModel.from_pretrained(theirs(tmp_path / "m"), tmp_path / "run" / "adapter").eval()
    ours = load_adapter(HFModel.from_pretrained(tmp_path / "m"), tmp_path / "run" / "adapter").eval()
    with torch.no_grad():
        assert (ours(ids) - theirs(tmp_path / "m")(ids).logits).abs().max() > 1e-4  # it trained
        torch.testing.assert_close(ours(ids), peft(ids).logits, atol=1e-5, rtol=0)
