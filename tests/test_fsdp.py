"""FSDP2 full fine-tuning under torchrun on the CPU (gloo): 2 sharded ranks give the single-process update,
with and without a (sharded) KL reference, and a sharded run checkpoints and resumes exactly.

The runs come from tests/dist_runs.py (the session fixture `dist_runs`), each `train.py tiny` with
--lora.r 0 --prompts-per-step 4 --log-samples-every 0 and lr 1e-4: Adam divides by sqrt(v) + eps, so where a
gradient is ~1e-8 the float32 rounding of the rank sum (a few ulps) moves the update by a visible fraction of
lr; at lr 1e-3 a handful of the 90k weights differ by ~1.3e-6, at this lr (a realistic one for full
fine-tuning) by ~1.3e-7."""

import json

import pytest
import torch
from dist_runs import ok
from safetensors.torch import load_file

pytestmark = pytest.mark.slow


def _weights(run) -> dict[str, torch.Tensor]:
    return load_file(str(run / "model" / "model.safetensors"))


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("kl", ["none", "loss"])
def test_fsdp_two_ranks_equal_one_process(dist_runs, tiny_model_dir, kl):
    """Two steps (--grpo.beta 0.5 with the KL): the second runs the KL term against a policy that has moved. A
    third would sample from weights that differ by the rounding of the rank sum (~1e-7), and a T=1 draw whose
    uniform falls that close to a token's edge picks another token (seen on an AMD EPYC at step 3): the runs
    then part ways."""
    ok(dist_runs, "one", f"fsdp-{kl}")
    assert "the policy sharded with FSDP2" in ok(dist_runs, "two", f"fsdp-{kl}")
    one, two = (_weights(dist_runs / mode / f"fsdp-{kl}") for mode in ("one", "two"))
    assert _max_diff(one, two) < 1e-6
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    assert _max_diff(one, {k: base[k] for k in one}) > 1e-4  # it trained
    m1, m2 = (
        [json.loads(x) for x in (dist_runs / mode / f"fsdp-{kl}" / "metrics.jsonl").read_text().splitlines()]
        for mode in ("one", "two")
    )
    for a, b in zip(m1, m2):
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)  # the full norm, not a shard's
        if kl == "none":
            assert a["kl"] is None and b["kl"] is None
        else:
            assert b["kl"] == pytest.approx(a["kl"], rel=1e-3, abs=1e-9)
    assert m2[-1]["kl"] is None or m2[-1]["kl"] > 0  # the policy moved away from the reference


def test_fsdp_shards_transformers_model_per_decoder_layer(dist_runs):
    """The general path (--model.impl transformers: transformers' LlamaForCausalLM for the tiny model) under
    FSDP2 with its sharded KL reference: two ranks give the single-process run of nanogrpo's own model."""
    out = ok(dist_runs, "two", "fsdp-transformers")
    assert "runs as transformers' model" in out and "the policy sharded with FSDP2" in out
    own, general = (
        _weights(dist_runs / m / n) for m, n in (("one", "fsdp-loss"), ("two", "fsdp-transformers"))
    )
    assert _max_diff(own, general) < 1e-6


def test_fsdp_checkpoint_resume_equals_straight_run(dist_runs):
    """Two ranks, --grpo.kl-placement loss --grpo.beta 0.5: 4 steps straight (fsdp-straight), and 2 steps
    (fsdp-two-steps as it ends) resumed to 4 (fsdp-resumed)."""
    from nanogrpo.model.transformer import Transformer

    two = dist_runs / "two"
    ok(dist_runs, "two", "fsdp-straight")
    ok(dist_runs, "two", "fsdp-two-steps")
    ckpt = two / "fsdp-two-steps" / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step_")) == ["step_000002"]
    ok(dist_runs, "two", "fsdp-resumed")
    assert "resumed from" in ok(dist_runs, "two", "fsdp-resumed+")
    run = two / "fsdp-resumed"
    assert _max_diff(_weights(two / "fsdp-straight"), _weights(run)) == 0.0
    drop = ("t_", "tok_per_s")
    a, b = (
        [
            {k: v for k, v in json.loads(x).items() if not k.startswith(drop)}
            for x in (p / "metrics.jsonl").read_text().splitlines()
        ]
        for p in (two / "fsdp-straight", run)
    )
    assert a == b
    # the final folder is a complete HF model: our loader reads it (transformers: tests/test_train.py)
    model = Transformer.from_pretrained(run / "model")
    ids = torch.tensor([[1, 5, 9, 2]])
    assert torch.isfinite(model(ids)).all()
