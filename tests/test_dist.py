"""torchrun on the CPU (gloo): 2 ranks give the single-process update on the same global batch.

The runs come from tests/dist_runs.py (the session fixture `dist_runs`: one launch of each kind for the
suite); dist_runs.RUNS names each run's flags."""

import json
from pathlib import Path

import pytest
from dist_runs import AGGS, KL, folder, ok
from safetensors.torch import load_file

pytestmark = pytest.mark.slow


def pair(root: Path, name: str) -> tuple[Path, Path]:
    """The one-process and the two-rank folders of run `name`, both made without an error."""
    ok(root, "one", name)
    ok(root, "two", name)
    return root / "one" / folder(name), root / "two" / folder(name)


def _adapter(run: Path) -> dict:
    return load_file(str(run / "adapter" / "adapter_model.safetensors"))


@pytest.mark.parametrize("kl", list(KL))
@pytest.mark.parametrize("agg", AGGS)
def test_two_ranks_equal_one_process(dist_runs, agg, kl):
    """Micro-batches of 2 rows cut every group of 4 in two (and DDP syncs only the last one of a pass).

    Each rank's rows are rows 0-7 and 8-15 of the one process, so with 2-row micro-batches both runs put the
    same rows through the same forward shapes: what is compared is the distributed arithmetic (the global
    normalisation, the gradient sum), not float rounding that differs with a matmul's batch size (which a
    KL in the reward turns into advantages once a group's task rewards tie: the std normalisation scales a
    1e-4 KL spread, and its rounding, up to unit size). For the same reason the advantages are not divided by
    the group std: a group whose rewards tie to within rounding otherwise gets unit advantages from that
    rounding (on the demo prompts 0.7% apart in the gradient norm at step 2, 1.6e-4 in the adapter; 2.6e-8
    without the division). lr 1e-4: the tiny preset's 1e-3 with its low sampling temperature (logits / 0.15)
    lets the reduction order's rounding reach 1.7e-6 after 3 steps."""
    one, two = pair(dist_runs, f"equal-{agg}-{kl}")
    a, b = _adapter(one), _adapter(two)
    assert a.keys() == b.keys()
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst < 1e-6, worst
    assert any(float(a[k].abs().max()) > 0 for k in a if "lora_B" in k)  # it trained


def _metrics(run: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in m.items() if not k.startswith(("t_", "tok_per_s"))} for m in rows]


def test_two_ranks_with_dynamic_sampling_equal_one_process(dist_runs):
    """Every round's global batch is the same list on every rank; the informative groups are chosen in
    global order and moved to the rank that trains them, so the ranks train, and log, what one process does.

    lr 1e-5: Adam's first steps move a weight by ~lr * sign(g), so a weight whose gradient is at rounding
    level (~1e-8, o_proj's here) moves by up to lr either way depending on the reduction order: 1.2e-6 after
    3 steps at 1e-4, 1.3e-8 at 1e-5. A wrong group moves every weight by ~lr, far above the bound."""
    one_run, two_run = pair(dist_runs, "dynamic")
    a, b = _adapter(one_run), _adapter(two_run)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6
    one, two = _metrics(one_run), _metrics(two_run)
    assert any(m["resample_rounds"] > 0 and m["groups_kept"] > 0 for m in one)  # groups moved between ranks
    for x, y in zip(one, two, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            if isinstance(x[k], float) and isinstance(y[k], float):
                assert abs(x[k] - y[k]) <= 1e-6 * max(1.0, abs(x[k])), (x["step"], k, x[k], y[k])
            else:
                assert x[k] == y[k], (x["step"], k, x[k], y[k])
    texts = lambda run: [  # noqa: E731
        [[c["text"] for c in grp["completions"]] for grp in json.loads(line)["groups"]]
        for line in (run / "samples.jsonl").read_text().splitlines()
    ]
    # rank 0 logs the groups it trained: the first half of the step's, as one process trains them
    assert [step[:2] for step in texts(one_run)] == texts(two_run)


def test_two_ranks_log_once_checkpoint_once_and_resume(dist_runs):
    """A 2-step run as it ends (log-once), and the same run resumed to 4 steps (log-once-resumed)."""
    stdout, run = ok(dist_runs, "two", "log-once"), dist_runs / "two" / "log-once"
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2]  # rank 0 logs, once per step
    assert stdout.count("step 2 |") == 1
    assert sorted(p.name for p in (run / "ckpt").iterdir() if p.name.startswith("step_")) == ["step_000002"]
    ok(dist_runs, "two", "log-once-resumed")
    stdout, run = ok(dist_runs, "two", "log-once-resumed+"), dist_runs / "two" / "log-once-resumed"
    assert "resumed from" in stdout
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


def test_full_fine_tune_with_ddp_equals_one_process(dist_runs):
    """--model.parallel ddp keeps the replicated path for small full fine-tunes (FSDP: tests/test_fsdp.py)."""
    ok(dist_runs, "one", "full")
    assert "replicated with DDP" in ok(dist_runs, "two", "full-ddp")
    a = load_file(str(dist_runs / "one" / "full" / "model" / "model.safetensors"))
    b = load_file(str(dist_runs / "two" / "full-ddp" / "model" / "model.safetensors"))
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6


@pytest.mark.parametrize("name", ["batch-std", "entropy-quantile"])
def test_step_wide_statistics_span_the_ranks(dist_runs, name):
    """The batch std of --grpo.scale-rewards batch and the entropy quantile of --grpo.top-entropy-quantile are
    taken over every rank's rows (summed moments, gathered entropies): 2 ranks train what one process does."""
    a, b = (_adapter(run) for run in pair(dist_runs, f"stats-{name}"))
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6


@pytest.mark.parametrize("algo", ["cpt", "ppo"])
def test_two_ranks_train_each_stage_as_one_process(dist_runs, algo):
    """CPT (windows split between the ranks, the NLL over every rank's tokens) and PPO (whitening over every
    rank's tokens, the value head inside the DDP-wrapped forward): 2 ranks train and log what one process
    does. (DPO's: tests/test_stage_dpo.py.)"""
    one, two = pair(dist_runs, f"stage-{algo}")
    a, b = _adapter(one), _adapter(two)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6
    assert any(float(a[k].abs().max()) > 0 for k in a if "lora_B" in k)  # it trained
    if algo == "ppo":
        va, vb = (load_file(str(r / "adapter" / "value_head.safetensors")) for r in (one, two))
        assert float(va["weight"].abs().max()) > 0 and torch_close(va, vb)
    for x, y in zip(_metrics(one), _metrics(two), strict=True):
        assert x.keys() == y.keys()
        for k in x:
            if isinstance(x[k], float) and isinstance(y[k], float):
                assert abs(x[k] - y[k]) <= 1e-5 * max(1.0, abs(x[k])), (x["step"], k, x[k], y[k])


def torch_close(a: dict, b: dict, atol: float = 1e-6) -> bool:
    return a.keys() == b.keys() and all(float((a[k] - b[k]).abs().max()) < atol for k in a)


def test_parallel_mode(monkeypatch):
    from dataclasses import replace

    from nanogrpo.infra import dist
    from nanogrpo.policy import parallel_mode
    from nanogrpo.recipes.presets import PRESETS

    cfg = PRESETS["tiny"][1]
    full = replace(cfg, lora=replace(cfg.lora, r=0))
    assert parallel_mode(full) == "none"  # one process: no wrapper whatever the flag
    monkeypatch.setattr(dist, "world", lambda: 2)
    assert parallel_mode(cfg) == "ddp" and parallel_mode(full) == "fsdp"
    assert parallel_mode(replace(full, model=replace(cfg.model, parallel="ddp"))) == "ddp"
    with pytest.raises(ValueError, match="--lora.r 0"):
        parallel_mode(replace(cfg, model=replace(cfg.model, parallel="fsdp")))
    with pytest.raises(ValueError, match="adamw"):
        parallel_mode(replace(full, optim=replace(cfg.optim, name="muon")))
