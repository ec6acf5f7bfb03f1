"""--plain: the run takes the reading path (docs/reading-path.txt) and none of the fast paths beside it, and the
two agree to rounding in float32: the same tokens, log-probs and gradients, single completions and episodes.
An edit on the reading path is what a --plain run samples and trains."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_eval, run_train_here

from nanogrpo.model import paths

FLOAT32 = [
    "tiny",
    "--model.dtype",
    "float32",
    "--eval-prompts",
    "0",
    "--no-plots",
    "--log-samples-every",
    "1",
]


@pytest.fixture(autouse=True)
def fast_again():
    """Each in-process run decides the path for itself; the tests after these get the default back."""
    yield
    paths.set_plain(False)


def run(out: Path, *flags, reuse: bool = False) -> tuple[list[dict], list[list[str]]]:
    """A tiny float32 run's metrics and its sampled texts, a list a step (`reuse`: of the run made there)."""
    if not reuse:
        r = run_train_here(*FLOAT32, "--out-dir", out, *flags)
        assert r.returncode == 0, r.stderr[-3000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    return metrics, [[c["text"] for g in s["groups"] for c in g["completions"]] for s in steps]


def test_plain_and_fast_sample_the_same_tokens_and_train_the_same_to_rounding(tmp_path) -> None:
    fast, fast_texts = run(tmp_path / "fast", "--steps", "2")
    plain, plain_texts = run(tmp_path / "plain", "--steps", "2", "--plain")
    assert plain_texts == fast_texts
    for a, b in zip(fast, plain):
        for k in ("reward", "loss", "grad_norm", "entropy", "len_mean"):
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), k
        assert a["sampler_kl"] < 1e-9 and b["sampler_kl"] < 1e-9  # each sampler against its trainer


def test_plain_runs_in_bf16_too(tmp_path) -> None:
    """The CPU's bf16 runs keep a float32 sampler cache for attention's kernels; SDPA as it is takes one dtype:
    under --plain the cache is the weights'."""
    r = run_train_here("tiny", "--model.dtype", "bfloat16", "--plain", "--steps", "1", "--eval-prompts", "0",
                       "--no-plots", "--out-dir", tmp_path / "run")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    (m,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert m["sampler_kl"] < 1e-3 and m["loss"] is not None


def test_plain_episodes_continue_the_same_tokens(tmp_path) -> None:
    env = ["--env.name", "calc", "--data.train", "recipe:calc", "--reward.spec", "env:1", "--steps", "1",
           "--prompts-per-step", "2", "--sampling.max-new-tokens", "8"]  # fmt: skip
    fast, fast_texts = run(tmp_path / "fast", *env)
    plain, plain_texts = run(tmp_path / "plain", *env, "--plain")
    assert plain_texts == fast_texts and plain[0]["env/obs_tokens"] == fast[0]["env/obs_tokens"]
    assert plain[0]["loss"] == pytest.approx(fast[0]["loss"], rel=1e-5, abs=1e-7)


def test_plain_runs_the_reading_path_and_no_fast_path() -> None:
    """A --plain step of the demo (the tiny model in SmolLM2's place), traced: every function
    docs/reading-path.txt lists runs, no function of a fast path does, and the walk through the path in call
    order (docs/ARCHITECTURE.md, "Reading one step") returns to a file it has left at most 50 times."""
    from reading_walk import DEMO, trace, walk

    w = walk(trace(DEMO))
    assert w["never"] == [], "listed in docs/reading-path.txt but never run under --plain"
    assert w["fast"] == [], "fast paths that ran under --plain"
    assert w["returns"] <= 50, "\n".join(f"{f}: {', '.join(names)}" for f, names, _ in w["stays"])


def test_the_default_run_takes_the_fast_paths() -> None:
    from reading_walk import DEMO, trace, walk

    w = walk(trace([a for a in DEMO if a != "--plain"]))
    ran = {f.split(":")[0] for f in w["fast"]}
    for f in ("fast/sampler.py", "fast/grouped.py", "fast/packed.py", "fast/shared_prompt.py"):
        assert f"nanogrpo/model/{f}" in ran, ran
    assert "nanogrpo_kernels/logprobs.py" in ran and "nanogrpo/model/attention.py" in ran, ran


def test_an_edit_on_the_reading_path_is_what_a_plain_run_samples_and_trains(tmp_path, monkeypatch) -> None:
    """A patched plain log-prob function changes a --plain run's loss, not a default run's; a patched LoRA
    forward changes what a --plain run samples, while the fast sampler (LoRA folded into packed weights)
    does not see it and the sampler-trainer gap shows the mismatch."""
    from nanogrpo.model import logprobs, lora

    base_plain, _ = run(tmp_path / "a", "--steps", "1", "--plain")
    base_fast, fast_texts = run(tmp_path / "b", "--steps", "2")
    spec = logprobs.plain_token_logprobs
    monkeypatch.setattr(logprobs, "plain_token_logprobs", lambda h, w, t, T: spec(h, w * 0.5, t, T))
    edited_plain, _ = run(tmp_path / "c", "--steps", "1", "--plain")
    edited_fast, _ = run(tmp_path / "d", "--steps", "1")
    assert edited_plain[0]["entropy"] != pytest.approx(base_plain[0]["entropy"], rel=1e-3)
    assert edited_fast[0]["entropy"] == base_fast[0]["entropy"]
    monkeypatch.undo()

    forward = lora.LoraLinear.forward
    monkeypatch.setattr(lora.LoraLinear, "forward", lambda self, x: forward(self, x) + 0.05)  # a new LoRA
    plain, plain_texts = run(tmp_path / "e", "--steps", "2", "--plain")
    r = run_train_here(*FLOAT32, "--out-dir", tmp_path / "f", "--steps", "2")
    fast, texts = run(tmp_path / "f", reuse=True)
    assert texts[0] == fast_texts[0]  # the fast sampler does not run LoraLinear.forward: it samples as before
    assert plain_texts[0] != fast_texts[0]  # --plain samples with the edit
    assert fast[0]["sampler_kl"] > 1 and plain[0]["sampler_kl"] < 1e-9  # the trainer runs the edit
    notes = [line for line in r.stdout.splitlines() if "disagree far past rounding" in line]
    assert len(notes) == 1 and notes[0].startswith("note: step 1: the sampler and the trainer disagree")
    assert "rerun with --plain, which samples with the code as it reads" in notes[0]


def test_the_gap_note_names_plain_only_where_it_helps() -> None:
    from dataclasses import replace

    import torch
    from helpers import tiny

    from nanogrpo.summary import StepNotes

    cfg = tiny(Path("/tmp"))
    step = {"step": 3, "sampler_kl": 2e-3}
    assert StepNotes(cfg, dtype=torch.bfloat16)(step) == []  # bf16: the default demo's gap reaches 0.13
    (fast,) = StepNotes(cfg, dtype=torch.float32)(step)
    (plain,) = StepNotes(replace(cfg, plain=True), dtype=torch.float32)(step)
    assert "rerun with --plain" in fast and "although under --plain they run the same code" in plain


def test_eval_generate_plain_writes_the_default_completions(tmp_path) -> None:
    common = ["generate", "--data", "recipe:semantic", "--model", "tiny", "--dtype", "float32", "--limit", "4",
              "--max-new-tokens", "8", "--temperature", "1.0"]  # fmt: skip
    outs = []
    for name, more in (("fast", []), ("plain", ["--plain"])):
        r = run_eval(*common, *more, "--out", tmp_path / f"{name}.jsonl", cwd=tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
        outs.append(
            [json.loads(line)["completion"] for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        )
    assert outs[0] == outs[1]
    assert json.loads((tmp_path / "plain.meta.json").read_text())["plain"] is True


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ("--sampling.decode", "static"),
            "--plain samples with the plain loop; drop --sampling.decode static",
        ),
        (("--model.attn", "flash"), "--plain computes attention as SDPA does; drop --model.attn flash"),
    ],
)
def test_a_fast_path_asked_for_beside_plain_is_refused(flags, message, tmp_path) -> None:
    r = run_train_here("tiny", "--plain", *flags, "--out-dir", tmp_path / "run")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [f"error: {message} (or --plain)"]
