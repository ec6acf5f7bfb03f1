"""The memory check at start-up (nanogrpo/model/memory.py, --memory-check): README's GPU command fits an 80 GiB card by
the plan; a run past the free memory (a mocked CUDA figure, or a mocked /proc/meminfo) is fitted in one
printed line, saved in config.json and resumed as saved, or refused before the model loads; a --micro-batch
given is kept, and refused with the flags that fit when it does not; bench/memory_plan.py prints the same
plan."""

from __future__ import annotations

import json
import math
import re
import shlex
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from nanogrpo import startup
from nanogrpo.model import memory, memory_fit
from nanogrpo.recipes.presets import PRESETS

ROOT = Path(__file__).resolve().parents[1]
CARD = 80 * memory.GiB
QWEN = "random:qwen2.5-1.5b"  # Qwen2.5-1.5B-Instruct's shapes (nanogrpo.model.zoo.RANDOM_SHAPES), no weights


def readme_command() -> list[str]:
    """README's Qwen2.5-1.5B training command, continuation lines joined, as argv after `train.py`."""
    lines = (ROOT / "README.md").read_text().splitlines()
    start = next(
        i for i, ln in enumerate(lines) if ln.startswith("python train.py --model.path /models/Qwen2.5-1.5B")
    )
    text = ""
    for ln in lines[start:]:
        text += ln.rstrip().removesuffix("\\") + " "
        if not ln.rstrip().endswith("\\"):
            break
    argv = shlex.split(text.split("#")[0])
    assert argv[:2] == ["python", "train.py"], argv
    return argv[2:]


def readme_config():
    from train import cli

    return cli(readme_command())


def gpu_step(cfg, prompt_len: int) -> memory.Step:
    """cfg's step on a GPU in bf16 with the Triton log-prob kernel (what a CUDA install runs)."""
    return replace(
        memory_fit.run_step(cfg, torch.device("cuda"), torch.bfloat16, prompt_len), logprobs="triton"
    )


def figure_for(budget: int) -> int:
    """A free-memory figure whose usable part (after the margin) is `budget` bytes, give or take one."""
    return math.ceil((budget + memory_fit.MARGIN_BYTES) / (1 - memory_fit.MARGIN_FRACTION)) + 1


def mock_cuda(monkeypatch, free: int) -> list:
    """torch.cuda as if a GPU with `free` bytes free were there; returns the devices asked about."""
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda, "mem_get_info", lambda device=None: (asked.append(device), (free, CARD))[1]
    )
    return asked


def mock_meminfo(monkeypatch, tmp_path, available: int) -> None:
    """/proc/meminfo with MemAvailable = `available` bytes, and no memory cgroup."""
    f = tmp_path / "meminfo"
    f.write_text(f"MemTotal:       99999999 kB\nMemFree:  1 kB\nMemAvailable:   {available // 1024} kB\n")
    monkeypatch.setattr(memory_fit, "MEMINFO", str(f))
    monkeypatch.setattr(memory_fit, "CGROUP_FILES", ())


def no_model_load(monkeypatch) -> None:

    def refuse(*a, **k):
        raise AssertionError("the model loaded before the memory check refused the run")

    monkeypatch.setattr(startup, "load_policy", refuse)


def tiny(tmp_path, **kw):
    return replace(PRESETS["tiny"][1], out_dir=str(tmp_path), plots=False, **kw)


def tiny_plans(cfg, device: str) -> dict[tuple[int, bool], int]:
    """Peak bytes of cfg's run per (micro-batch, checkpointing), as the check plans it."""
    from nanogrpo.startup import training_data

    rows = training_data(cfg)[0]
    prompt_len, new_tokens = memory_fit.lengths(cfg, rows)
    s = memory_fit.run_step(cfg, torch.device(device), torch.float32, prompt_len, new_tokens)
    c = memory.model_config(cfg.model.path)
    return {
        (m, ck): memory.plan(c, replace(s, micro_batch=m, checkpointing=ck)).peak
        for m in memory_fit.micro_batches(s)
        for ck in (False, True)
    }


# ------------------------------------------------------------------------------------------- README's command


def test_readme_gpu_command_fits_an_80_gib_card():
    cfg = readme_config()
    assert cfg.model.path.endswith("Qwen2.5-1.5B-Instruct") and cfg.memory_check == "fit"
    c = memory.model_config(QWEN)
    for prompt_len in (256, 1024):  # README's my.jsonl is anyone's: short and long prompts
        p = memory.plan(c, gpu_step(cfg, prompt_len))
        assert p.peak <= memory_fit.usable(CARD), (prompt_len, p.peak / memory.GiB)
    # all 128 completions at once without checkpointing, what the command ran before, is ~200 GiB
    s = replace(gpu_step(cfg, 256), micro_batch=0, checkpointing=False)
    assert memory.plan(c, s).peak > 2 * CARD


def test_an_episode_run_plans_each_rows_cache_for_its_whole_length():
    """Episodes keep a cache row each for the whole episode (prompt + --env.max-tokens + a turn, counted at
    the twice it may hold as it grows), where single completions share a prompt's keys; README's command
    with 4-turn episodes of 1,024 tokens still fits an 80 GiB card."""
    cfg = readme_config()
    ep = replace(cfg, env=replace(cfg.env, name="guess", max_turns=4, max_tokens=1024))
    c, per_token = memory.model_config(QWEN), memory.kv_bytes_per_token(memory.model_config(QWEN), 2)
    single, episodes = gpu_step(cfg, 256), gpu_step(ep, 256)
    assert memory.kv_cache_bytes(c, single) == per_token * (
        single.prompts * 256 + single.rows * single.new_tokens
    )
    turn = cfg.sampling.max_new_tokens
    assert memory.kv_cache_bytes(c, episodes) == per_token * episodes.rows * 2 * (256 + 1024 + turn)
    assert memory.plan(c, episodes).peak <= memory_fit.usable(CARD)


def test_a_run_past_the_card_is_fitted_in_one_line(monkeypatch, capsys):
    cfg = replace(readme_config(), micro_batch=0, model=replace(readme_config().model, path=QWEN))
    cfg = replace(cfg, model=replace(cfg.model, activation_checkpointing=False))
    asked = mock_cuda(monkeypatch, CARD)
    rows = [{"_prompt_ids": [1] * 256}]
    fitted = memory_fit.fit_to_memory(cfg, torch.device("cuda:0"), torch.bfloat16, rows)
    out = capsys.readouterr().out.strip().splitlines()
    assert asked == [torch.device("cuda:0")]
    assert len(out) == 1 and out[0].startswith("memory: the memory plan"), out
    assert fitted.micro_batch > 0 and f"--micro-batch {fitted.micro_batch}" in out[0]
    assert "cuda:0 has 80.0 GiB free" in out[0]  # the free memory it read
    c = memory.model_config(QWEN)
    before = memory.plan(c, memory_fit.run_step(cfg, torch.device("cuda"), torch.bfloat16, 256)).peak
    after = memory.plan(c, memory_fit.run_step(fitted, torch.device("cuda"), torch.bfloat16, 256)).peak
    assert f"{before / memory.GiB:.1f} GiB" in out[0] and f"{after / memory.GiB:.1f} GiB" in out[0]
    assert after <= memory_fit.usable(CARD) < before
    # whole groups, and without checkpointing when some whole-group micro-batch fits without it
    assert fitted.micro_batch % cfg.grpo.group_size == 0 and not fitted.model.activation_checkpointing


def test_refuse_names_the_flags_that_fit_and_off_reads_nothing(monkeypatch):
    cfg = replace(readme_config(), micro_batch=0, memory_check="refuse")
    cfg = replace(cfg, model=replace(cfg.model, path=QWEN, activation_checkpointing=False))
    asked = mock_cuda(monkeypatch, CARD)
    rows = [{"_prompt_ids": [1] * 256}]
    best = memory_fit.fit(memory.model_config(QWEN), gpu_step(cfg, 256), memory_fit.usable(CARD))
    with pytest.raises(ValueError, match=re.escape(memory_fit.flags(best)) + " fits") as e:
        memory_fit.fit_to_memory(cfg, torch.device("cuda"), torch.bfloat16, rows)
    assert "--memory-check off" in str(e.value)
    asked.clear()
    off = replace(cfg, memory_check="off")
    assert memory_fit.fit_to_memory(off, torch.device("cuda"), torch.bfloat16, rows) is off and not asked
    sft = replace(cfg, algo="sft")  # not planned: passes unchecked
    assert memory_fit.fit_to_memory(sft, torch.device("cuda"), torch.bfloat16, rows) is sft and not asked


def test_the_lora_fold_is_given_up_last_when_only_that_fits(monkeypatch, capsys):
    """A card where even micro-batch 1 with checkpointing fits only without the sampler's folded copy of the
    adapted weights: 'fit' turns the fold off (and says so), 'refuse' names --sampling.no-fold-lora."""
    cfg = replace(readme_config(), micro_batch=0, model=replace(readme_config().model, path=QWEN))
    c, s = memory.model_config(QWEN), gpu_step(cfg, 256)
    assert s.lora_fold
    least = replace(s, micro_batch=min(memory_fit.micro_batches(s)), checkpointing=True)
    folded, unfolded = memory.plan(c, least).peak, memory.plan(c, replace(least, lora_fold=False)).peak
    assert unfolded < folded  # the copy is counted
    budget = (folded + unfolded) // 2
    mock_cuda(monkeypatch, figure_for(budget))
    rows = [{"_prompt_ids": [1] * 256}]
    fitted = memory_fit.fit_to_memory(cfg, torch.device("cuda"), torch.bfloat16, rows)
    out = capsys.readouterr().out
    assert not fitted.sampling.fold_lora and "--sampling.no-fold-lora" in out and fitted.micro_batch > 0
    assert memory.plan(c, gpu_step(fitted, 256)).peak <= budget
    with pytest.raises(ValueError, match="--sampling.no-fold-lora fits"):
        memory_fit.fit_to_memory(
            replace(cfg, memory_check="refuse"), torch.device("cuda"), torch.bfloat16, rows
        )
    # with room for the copy, the fold stays
    mock_cuda(monkeypatch, figure_for(folded + memory.GiB))
    assert memory_fit.fit_to_memory(cfg, torch.device("cuda"), torch.bfloat16, rows).sampling.fold_lora


def test_the_plan_counts_full_fine_tunes_and_the_cpu_paths():
    c = memory.model_config(QWEN)
    n, V, H = memory.param_count(c), c["vocab_size"], c["hidden_size"]
    s = memory.Step(prompts=4, group=4, prompt_len=64, new_tokens=64, micro_batch=4, lora_r=0, reference=True)
    gpu = memory.plan(c, s)
    assert gpu.resident == n * (4 + 12 + 4)  # float32 weights, grads + AdamW, the float32 reference
    assert gpu.parts["autocast weight copies"] == 2 * n and gpu.parts["LM head gradient"] == V * H * 4
    assert gpu.sampling == gpu.resident + gpu.parts["KV cache"] + 2 * n  # samples under the autocast copy
    assert gpu.parts["log-probs"] == 4 * 64 * V * 2  # 256 rows: one bf16 dz chunk, under the 2^28 / V rows
    cpu = memory.plan(c, replace(s, device="cpu", logprobs="torch", cpu_packing=True, dtype_bytes=4))
    assert cpu.parts["autocast weight copies"] == 0 and cpu.parts["packed sampling weights"] > 0
    assert cpu.sampling == cpu.resident + cpu.parts["KV cache"] + cpu.parts["packed sampling weights"]
    rows = (
        memory.TORCH_CHUNK_ELEMS // V
    )  # the reference's chunk; 256 x V is over the kept log-softmax's limit
    assert cpu.parts["log-probs"] == memory.TORCH_TILES * rows * V * 4
    small = memory.plan(c, replace(s, device="cpu", logprobs="torch", micro_batch=1, new_tokens=8))
    kept = 8 * V * 4  # 8 rows: the whole log-softmax is kept for the backward
    assert small.parts["log-probs"] == memory.TORCH_TILES * 8 * V * 4 + kept
    lora = memory.plan(c, replace(s, lora_r=16))
    assert lora.parts["reference"] == 0 and lora.parts["weights"] == 2 * n  # the reference is adapters off
    assert memory.plan(c, replace(s, checkpointing=True)).peak < gpu.peak


# ---------------------------------------------------------------------------- train.main, before the model loads


def test_nothing_fits_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    from train import main

    mock_cuda(monkeypatch, memory.GiB)  # 1 GiB free: less than the margin
    no_model_load(monkeypatch)
    with pytest.raises(
        ValueError, match="nothing fits, even --micro-batch 1 --model.activation-checkpointing"
    ):
        main(tiny(tmp_path / "run"))
    assert not (tmp_path / "run" / "config.json").exists()


def test_a_given_micro_batch_that_does_not_fit_is_refused_with_the_flags_that_fit(tmp_path, monkeypatch):
    from train import main

    cfg = tiny(tmp_path / "run", micro_batch=8)  # P=2 x G=4: all 8 at once
    plans = tiny_plans(cfg, "cuda")
    assert plans[(4, False)] < plans[(8, True)]  # checkpointing does not save micro-batch 8 here
    mock_cuda(monkeypatch, figure_for((plans[(4, False)] + plans[(8, True)]) // 2))
    no_model_load(monkeypatch)
    with pytest.raises(ValueError) as e:
        main(cfg)
    msg = str(e.value)
    assert "--micro-batch is kept as given; --micro-batch 4 fits" in msg, msg
    assert "--micro-batch 8 with" in msg.replace("without", "with")  # what was given, with the plan's numbers
    assert f"{plans[(8, False)] / memory.GiB:.1f} GiB" in msg


def test_a_cpu_run_is_fitted_saved_and_resumed_as_saved(tmp_path, monkeypatch, capsys):
    from train import main

    cfg = tiny(tmp_path / "run", steps=2)
    plans = tiny_plans(cfg, "cpu")
    assert plans[(4, False)] < plans[(8, False)]
    mock_meminfo(monkeypatch, tmp_path, figure_for((plans[(4, False)] + plans[(8, False)]) // 2))
    capsys.readouterr()
    main(cfg)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "memory plan" in ln]
    assert len(lines) == 1 and lines[0].startswith("memory: ") and "MemAvailable" in lines[0], lines
    assert "running with --micro-batch 4 (" in lines[0]
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["micro_batch"] == 4 and saved["model"]["activation_checkpointing"] is False
    # --resume finds micro-batch 4 in config.json; with less memory now it changes nothing, and says so
    mock_meminfo(monkeypatch, tmp_path, figure_for(plans[(1, True)] // 2))
    main(replace(cfg, steps=3, resume=True, micro_batch=4))
    out = capsys.readouterr().out
    assert "note: the memory plan" in out and "--resume keeps the run's settings" in out
    assert json.loads((tmp_path / "run" / "config.json").read_text())["micro_batch"] == 4
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 3


# ------------------------------------------------------------------------------------------ reading free memory


def test_host_available_reads_meminfo_and_a_cgroup_limit(tmp_path, monkeypatch):
    mock_meminfo(monkeypatch, tmp_path, 24 * memory.GiB)
    assert memory_fit.host_available() == 24 * memory.GiB
    (tmp_path / "max").write_text(f"{8 * memory.GiB}\n")
    (tmp_path / "current").write_text(f"{3 * memory.GiB}\n")
    monkeypatch.setattr(memory_fit, "CGROUP_FILES", ((str(tmp_path / "max"), str(tmp_path / "current")),))
    assert memory_fit.host_available() == 5 * memory.GiB  # the cgroup's limit less its usage
    (tmp_path / "max").write_text("max\n")
    assert memory_fit.host_available() == 24 * memory.GiB
    monkeypatch.setattr(memory_fit, "MEMINFO", str(tmp_path / "absent"))  # no /proc: the free pages, or None
    got = memory_fit.host_available()
    assert got is None or got > 0
    found = memory_fit.available_memory(torch.device("cpu"))
    assert found is None or found[1] == "the host has {} available (MemAvailable)"


# ------------------------------------------------------------------------------------------------------- bench


def test_bench_memory_plan_prints_the_library_plan():
    args = ["--model", QWEN, "--prompts-per-step", "16", "--max-new-tokens", "512", "--micro-batch", "16"]
    res = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "memory_plan.py"), *args, "--json", "--fsdp-ranks", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    got = json.loads(res.stdout)["plan"][QWEN]["peak, fused (sampling and training apart)"]
    s = memory.Step(
        prompts=16,
        group=8,
        prompt_len=256,
        new_tokens=512,
        micro_batch=16,
        checkpointing=True,
        lora_fold=True,
    )
    assert got == pytest.approx(memory.plan(memory.model_config(QWEN), s).peak / memory.GiB)
