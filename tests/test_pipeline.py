"""The seeds' pipelines end to end on the tiny model: CPT -> SFT -> GRPO, each stage starting from the
previous one's output, the last adapter loading in PEFT on the model it was trained on."""

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from nanogrpo.recipes.demo import demo_rows
from nanogrpo.recipes.presets import PRESETS

TEXT = (
    "The heart pumps blood through the arteries. The veins bring it back to the heart.\n\n"
    "Red blood cells carry oxygen; white blood cells fight infection.\n\n"
    "The lungs exchange oxygen and carbon dioxide with the blood.\n"
)


def tiny(out, **kw):
    return replace(PRESETS["tiny"][1], out_dir=str(out), plots=False, **kw)


def steps_of(run) -> list[int]:
    return [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("cpt_lora", [True, False], ids=["cpt-lora", "cpt-full"])
def test_cpt_then_sft_then_grpo(tmp_path, tiny_model_dir, cpt_lora):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from nanogrpo.model import lora
    from nanogrpo.model.transformer import Transformer
    from train import main

    (tmp_path / "book.txt").write_text(TEXT)
    rows = tmp_path / "qa.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in demo_rows()[:6]))
    p = PRESETS["tiny"][1]
    data = lambda path, **kw: replace(p.data, train=str(path), **kw)  # noqa: E731

    # 1. CPT on raw text: LoRA (an adapter the next stage merges) or a full fine-tune (an HF folder)
    cpt = tiny(tmp_path / "cpt", algo="cpt", epochs=2, prompts_per_step=2)
    cpt = replace(cpt, data=data(tmp_path / "book.txt", seq_len=16, overlap=4))
    if not cpt_lora:
        cpt = replace(cpt, lora=replace(p.lora, r=0))
    main(cpt)
    base = str(tiny_model_dir) if cpt_lora else str(tmp_path / "cpt" / "model")
    # 2. SFT on the references, starting from CPT's output
    sft = tiny(tmp_path / "sft", algo="sft", steps=2, model=replace(p.model, path=base))
    sft = replace(sft, data=data(rows))
    if cpt_lora:
        sft = replace(sft, lora=replace(p.lora, init_from=str(tmp_path / "cpt" / "adapter")))
    main(sft)
    # 3. GRPO from the SFT model: its reference (adapters off) is the SFT model
    grpo = tiny(tmp_path / "grpo", steps=2, model=replace(p.model, path=base), data=data(rows))
    grpo = replace(grpo, lora=replace(p.lora, init_from=str(tmp_path / "sft" / "adapter")))
    main(grpo)
    assert steps_of(tmp_path / "grpo") == [1, 2]

    # each stage's adapter holds the one before it: stacked ranks, the earlier ranks' A rows unchanged
    r = p.lora.r
    ranks = {"cpt": r, "sft": 2 * r, "grpo": 3 * r} if cpt_lora else {"sft": r, "grpo": 2 * r}
    for stage, rank in ranks.items():
        assert json.loads((tmp_path / stage / "adapter" / "adapter_config.json").read_text())["r"] == rank
    final = load_file(str(tmp_path / "grpo" / "adapter" / "adapter_model.safetensors"))
    earlier = load_file(str(tmp_path / "sft" / "adapter" / "adapter_model.safetensors"))
    for name, a in earlier.items():
        if name.endswith("lora_A.weight"):
            torch.testing.assert_close(final[name][: a.shape[0]], a.float())

    # the final adapter loads in PEFT on the model GRPO trained on, and is our model's
    ids = torch.tensor([[1, 17, 230, 5, 9, 2, 44, 7]])
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, tmp_path / "grpo" / "adapter").eval()
    ours = lora.load_adapter(Transformer.from_pretrained(base), tmp_path / "grpo" / "adapter")
    with torch.no_grad():
        theirs, mine, plain = peft_model(ids).logits, ours(ids), Transformer.from_pretrained(base)(ids)
    torch.testing.assert_close(theirs, mine, atol=1e-4, rtol=1e-4)
    assert float((mine - plain).abs().max()) > 1e-3  # the stages trained something
