"""train.py end to end on the tiny preset: a subprocess run, exact resume, SFT, and start-up errors."""

import json
from dataclasses import replace

import pytest
import torch
from helpers import metrics, run_train, run_train_here, tiny

from nanogrpo.recipes.presets import PRESETS

PRESET = PRESETS["tiny"][1]


def test_tiny_run_from_the_command_line(tmp_path):
    r = run_train("tiny", "--out-dir", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr[-3000:]
    run = tmp_path / "run"
    ms = metrics(run)
    assert [m["step"] for m in ms] == [1, 2, 3, 4]
    for key in (
        "reward",
        "reward/rouge_l",
        "frac_zero_std",
        "entropy",
        "clip_low",
        "clip_high",
        "len_mean",
        "trunc_rate",
        "grad_norm",
        "lr",
        "loss",
    ):
        assert key in ms[0], key
    assert all(0 <= m["reward"] <= 1 for m in ms)
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert (
        len(samples) == 4
        and len(samples[0]["groups"]) == 2
        and len(samples[0]["groups"][0]["completions"]) == 4
    )
    assert (run / "adapter" / "adapter_config.json").exists() and (run / "reward.png").exists()
    assert json.loads((run / "config.json").read_text())["grpo"]["group_size"] == 4
    assert "step 4 | reward" in r.stdout


def test_resume_is_exact(tmp_path):
    from train import main

    main(tiny(tmp_path / "straight", steps=4))
    main(tiny(tmp_path / "resumed", steps=2))
    main(tiny(tmp_path / "resumed", steps=4, resume=True))
    a, b = metrics(tmp_path / "straight"), metrics(tmp_path / "resumed")
    assert [m["step"] for m in b] == [1, 2, 3, 4]
    assert a == b


def test_sft_lowers_the_loss_and_its_adapter_starts_grpo(tmp_path):
    from nanogrpo.recipes.demo import demo_rows
    from train import main

    rows = tmp_path / "four.jsonl"  # four rows seen every step: SFT must fit them
    rows.write_text("".join(json.dumps(r) + "\n" for r in demo_rows()[:4]))
    cfg = tiny(tmp_path / "sft", algo="sft", steps=12, prompts_per_step=4)
    main(replace(cfg, data=replace(cfg.data, train=str(rows)), optim=replace(cfg.optim, lr=1e-2)))
    ms = metrics(tmp_path / "sft")
    first, last = sum(m["loss"] for m in ms[:3]) / 3, sum(m["loss"] for m in ms[-3:]) / 3
    assert last < first - 0.3, (first, last)  # nats per token
    adapter = tmp_path / "sft" / "adapter"
    cfg = tiny(tmp_path / "grpo", steps=1)
    cfg = replace(cfg, lora=replace(cfg.lora, init_from=str(adapter)))
    main(cfg)
    assert metrics(tmp_path / "grpo")[0]["step"] == 1


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--grpo.group-size", "1"], "group-size 1"),
        (["--reward.spec", "nonsense:1"], "nonsense"),
        (["--data.train", "MISSING.jsonl"], "no such file"),
    ],
)
def test_startup_errors_are_one_line(tmp_path, args, needle):
    r = run_train_here("tiny", "--out-dir", str(tmp_path / "x"), *args)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines[-1].startswith("error:") and needle in lines[-1], r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def test_bad_data_and_unknown_architecture(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "q", "reference": "a"}\n{"prompt": "", "reference": "b"}\n')
    r = run_train_here("tiny", "--out-dir", str(tmp_path / "x"), "--data.train", str(bad))
    assert r.returncode == 2 and f"{bad}:2: field 'prompt' is empty" in r.stderr
    arch = tmp_path / "foo"
    arch.mkdir()
    (arch / "config.json").write_text(json.dumps({"architectures": ["FooForCausalLM"], "model_type": "foo"}))
    r = run_train_here("tiny", "--out-dir", str(tmp_path / "y"), "--model.path", str(arch))
    assert r.returncode == 2 and "FooForCausalLM" in r.stderr.splitlines()[-1] and "Llama" in r.stderr


def test_kl_is_null_without_a_reference_and_a_number_with_one(tmp_path):
    from train import main

    main(tiny(tmp_path / "none", steps=2, plots=True))  # kl_placement 'none': no reference, no KL
    main(tiny(tmp_path / "kl", steps=2, grpo=replace(PRESET.grpo, kl_placement="reward")))
    assert [m["kl"] for m in metrics(tmp_path / "none")] == [None, None]
    kl = [m["kl"] for m in metrics(tmp_path / "kl")]
    assert kl[0] == 0.0 and kl[1] > 0  # the policy starts at the reference, then moves away
    assert (tmp_path / "none" / "index.html").exists() and (tmp_path / "none" / "kl_entropy.png").exists()


def test_full_fine_tune_saves_an_hf_folder(tmp_path, tiny_model_dir):
    """model/ loads with our loader and with transformers, and it is the trained model, not the base."""
    from transformers import AutoModelForCausalLM

    from nanogrpo.model.transformer import Transformer
    from train import main

    main(tiny(tmp_path, steps=2, lora=replace(PRESET.lora, r=0)))
    folder = tmp_path / "model"
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (folder / name).exists(), name
    ids = torch.tensor([[1, 17, 230, 5, 9, 2]])
    with torch.no_grad():
        ours = Transformer.from_pretrained(folder)(ids)
        theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)(ids).logits
        base = Transformer.from_pretrained(tiny_model_dir)(ids)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    assert float((ours - base).abs().max()) > 1e-3


def test_init_from_makes_the_sft_model_the_reference(tmp_path, tiny_model_dir):
    """With --lora.init-from the KL reference (adapters off) is the SFT model, the policy starts there,
    and the final adapter (SFT stacked with the new one) reproduces the policy on the original base."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from nanogrpo.model import lora
    from nanogrpo.model.logprobs import completion_logprobs
    from nanogrpo.model.sampling import pad_left
    from nanogrpo.model.transformer import Transformer
    from nanogrpo.policy import load_policy
    from nanogrpo.rollout import make_batch

    torch.manual_seed(0)
    sft = Transformer.from_pretrained(tiny_model_dir)
    lora.inject_lora(sft, r=2, alpha=4, targets=("q_proj", "v_proj", "up_proj"))  # not the preset's targets
    for m in lora.lora_modules(sft).values():
        torch.nn.init.normal_(m.lora_B.weight, std=0.5)
    lora.save_adapter(sft, tmp_path / "sft")
    p_ids, p_mask = pad_left([[1, 5, 9], [3, 4]], 0)
    batch = make_batch(p_ids, p_mask, torch.randint(3, 1000, (2, 5)), torch.ones(2, 5))
    lp = lambda m: completion_logprobs(m, batch)[0].detach()  # noqa: E731
    want, base = lp(sft), lp(Transformer.from_pretrained(tiny_model_dir))
    assert float((want - base).abs().max()) > 0.05  # the SFT adapter matters

    cfg = tiny(tmp_path / "run")
    policy = load_policy(
        replace(cfg, lora=replace(cfg.lora, init_from=str(tmp_path / "sft"))), "cpu", torch.float32
    )
    torch.testing.assert_close(policy.reference_logprobs(batch, 1.0), want, atol=1e-5, rtol=0)
    torch.testing.assert_close(lp(policy.core), want, atol=1e-5, rtol=0)  # a fresh adapter: starts at SFT

    for m in lora.lora_modules(policy.core).values():  # stands in for training
        torch.nn.init.normal_(m.lora_B.weight, std=0.5)
    trained = lp(policy.core)
    policy.save_final(tmp_path / "final")
    saved = json.loads((tmp_path / "final" / "adapter_config.json").read_text())
    assert saved["r"] == 2 + cfg.lora.r and set(saved["target_modules"]) == set(cfg.lora.targets)
    fresh = lora.load_adapter(Transformer.from_pretrained(tiny_model_dir), tmp_path / "final")
    torch.testing.assert_close(lp(fresh), trained, atol=1e-4, rtol=0)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, tmp_path / "final").eval()
    with torch.no_grad():
        ids = batch.ids[:1]
        ours = fresh(ids)
        torch.testing.assert_close(peft_model(ids).logits, ours, atol=1e-4, rtol=1e-4)


def test_sft_template_renders_the_target_and_max_len_cuts_it(tmp_path):
    """--data.template builds the target from row fields; --data.max-len cuts it, and the cut is counted."""
    from nanogrpo.data import sft_target, template_fields
    from train import main

    template = "<spiegazione>{explanation}</spiegazione><risposta>{answer}</risposta>"
    assert template_fields(template) == ["explanation", "answer"]
    row = {"prompt": "2+2?", "explanation": "two and two", "answer": "4"}
    assert sft_target(row, template) == "<spiegazione>two and two</spiegazione><risposta>4</risposta>"
    assert sft_target({"reference": "r"}) == "r" and sft_target(row, "{{x}} {answer}") == "{x} 4"
    for bad in ("{", "{0}", "{a.b}"):
        with pytest.raises(ValueError, match="--data.template"):
            template_fields(bad)

    data = tmp_path / "rows.jsonl"
    rows = [{"prompt": f"q{i}?", "explanation": f"because {i} is {i}", "answer": str(i)} for i in range(4)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = tiny(tmp_path / "sft", algo="sft", steps=2, prompts_per_step=4)
    main(replace(cfg, data=replace(cfg.data, train=str(data), template=template, max_len=5)))
    ms = metrics(tmp_path / "sft")
    assert [m["truncated"] for m in ms] == [1.0, 1.0]  # every target is longer than 5 tokens
    assert [m["tokens"] for m in ms] == [20.0, 20.0]  # 4 rows x 5 tokens: the loss covers the cut target

    no_answer = tmp_path / "bad.jsonl"
    no_answer.write_text(json.dumps({"prompt": "q?", "explanation": "e"}) + "\n")
    with pytest.raises(
        ValueError, match=r"bad.jsonl:1: field 'answer' is missing or empty, and --data.template"
    ):
        main(
            replace(
                cfg,
                out_dir=str(tmp_path / "x"),
                data=replace(cfg.data, train=str(no_answer), template=template),
            )
        )
