"""Multi-turn episodes (nanogrpo/envs/): the trajectory layout the trainer reads, the seeds, the budgets,
failing environments, the built-ins, and whole runs (one process = two ranks, resume exact)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from env_examples import Endless, Faulty, Tools, Vowels
from helpers import ROOT, free_port, run_train_here

from nanogrpo import grpo
from nanogrpo.config import EnvConfig
from nanogrpo.data import prompt_budget, tokenize_prompts
from nanogrpo.envs import make_factory
from nanogrpo.envs.builtin import Calc, Guess, Search, arith
from nanogrpo.envs.episode import episode_rollout
from nanogrpo.envs.render import TurnFormat
from nanogrpo.envs.spec import build_spec, check_start, resolve
from nanogrpo.model import lora
from nanogrpo.model.logprobs import completion_logprobs
from nanogrpo.policy import load_policy, prompt_limit
from nanogrpo.recipes.presets import PRESETS
from nanogrpo.rollout import rollout

TINY = replace(PRESETS["tiny"][1], plots=False)
SPEC = str(Path(__file__).with_name("env_examples.py"))
CPU = torch.device("cpu")


def env_cfg(max_turns: int = 2, max_tokens: int = 64, **kw):
    return replace(
        TINY, env=EnvConfig(spec=f"{SPEC}:Vowels", max_turns=max_turns, max_tokens=max_tokens, **kw)
    )


def tiny_policy(dtype: torch.dtype):
    """The tiny policy (LoRA B non-zero, so LoRA matters), four prompts, and the run's config."""
    cfg = env_cfg()
    tok, limit = prompt_budget(cfg)
    rows = [{"prompt": f"Question {i}: what is {i} + {i}?", "answer": str(2 * i)} for i in range(4)]
    tokenize_prompts(rows, tok, "", limit, "refuse", "test")
    torch.manual_seed(0)
    policy = load_policy(cfg, CPU, dtype, tok)
    for m in lora.lora_modules(policy.core).values():
        torch.nn.init.normal_(m.lora_B.weight, std=0.1)
    return policy, rows, cfg


@pytest.fixture(scope="module")
def tiny():
    return tiny_policy(torch.float32)


def spec_of(tiny, factory, cfg):
    """The EnvSpec of a test environment class under cfg's --env.* budgets, checked as train.py checks it."""
    policy, rows, _ = tiny
    env = build_spec(factory, factory.__name__, cfg.env, cfg.sampling.max_new_tokens)
    return check_start(env, policy.tokenizer, rows, "", *prompt_limit(cfg), 8)


def play(tiny, factory, step: int = 0, **env):
    policy, rows, cfg = tiny
    cfg = replace(cfg, env=replace(cfg.env, **env)) if env else cfg
    return episode_rollout(policy, rows[:2], step, 0, cfg, CPU, spec_of(tiny, factory, cfg))


def max_gap(policy, roll, temp: float) -> float:
    logp = policy.trainer_logprobs(roll.batch, temp)  # (N, T)
    return float(((logp - roll.sampler_logp).abs() * roll.batch.mask).max())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_trainer_and_sampler_agree_on_the_sampled_tokens_of_multi_turn_trajectories(tiny, dtype) -> None:
    """The sampler continues each episode's cache; the trainer reads the whole trajectory at once: on the
    sampled tokens they agree within the gap single completions show (fp32 and bf16)."""
    if dtype == "bfloat16":
        tiny = tiny_policy(torch.bfloat16)
    policy, rows, cfg = tiny
    roll = play(tiny, Vowels)
    mask = roll.batch.mask  # (N, T)
    # every trajectory has an observation between its turns: 0s inside the 1s
    inner_zeros = [(m[: int(m.nonzero().max()) + 1] == 0).any() for m in mask]
    assert all(inner_zeros) and all(len(s.turns) == 4 for s in roll.samples)
    single = rollout(policy, rows[:2], 0, 0, replace(cfg, env=EnvConfig()), CPU)
    gap, gap1 = (
        max_gap(policy, roll, cfg.sampling.temperature),
        max_gap(policy, single, cfg.sampling.temperature),
    )
    assert gap < 3 * gap1 + 1e-6, (gap, gap1)  # measured: fp32 0.7x, bf16 1.3x the single-turn gap
    assert float((roll.sampler_logp * (1 - mask)).abs().max()) == 0.0  # observations: log-prob 0


def test_observation_tokens_carry_no_gradient(tiny) -> None:
    """The loss and its gradient are the same whatever the log-probs at the observation tokens are."""
    policy, _, cfg = tiny
    roll = play(tiny, Vowels)
    adv = torch.linspace(-1, 1, len(roll.samples))  # (N,)
    params = lora.trainable_parameters(policy.model)

    def loss_and_grad(noise: torch.Tensor):
        policy.model.zero_grad()
        logp, _ = completion_logprobs(policy.model, roll.batch, cfg.sampling.temperature)  # (N, T)
        logp = logp + noise * (1 - roll.batch.mask)  # changes only the observations' log-probs
        n = roll.batch.mask.sum()
        loss, _ = grpo.grpo_loss(logp, logp.detach(), None, adv, roll.batch.mask, cfg.grpo, num_seqs=len(adv),
                                 num_tokens=n, max_len=cfg.completion_tokens)  # fmt: skip
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in params]

    a, ga = loss_and_grad(torch.zeros_like(roll.sampler_logp))
    b, gb = loss_and_grad(torch.randn_like(roll.sampler_logp) * 5)
    assert torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(ga, gb))
    assert any(float(g.abs().sum()) > 0 for g in ga)  # there was a gradient to change


def test_a_groups_members_see_the_same_first_observation(tiny) -> None:
    roll = play(tiny, Vowels)
    G = len(roll.samples) // 2
    firsts = [s.turns[0]["content"] for s in roll.samples]  # (N,)
    assert len(set(firsts[:G])) == 1 and len(set(firsts[G:])) == 1 and firsts[0] != firsts[G]
    # the same again at the same step (resume, another rank); another step is another situation
    assert [s.turns[0]["content"] for s in play(tiny, Vowels).samples] == firsts
    assert [s.turns for s in play(tiny, Vowels).samples] == [s.turns for s in roll.samples]
    assert play(tiny, Vowels, step=1).samples[0].turns[0] != roll.samples[0].turns[0]


def test_max_turns_budget_and_truncation(tiny) -> None:
    roll = play(tiny, Endless, max_turns=3, max_tokens=200)
    assert [s.env_info["turns"] for s in roll.samples] == [3] * len(roll.samples)
    assert bool(roll.truncated.all())
    # cut by a budget: the lowest reward of the range, never above an episode played to its end
    assert [s.env_reward for s in roll.samples] == [0.0] * len(roll.samples)
    assert all(s.env_info["truncated"] and not s.env_info["done"] for s in roll.samples)
    own = play(tiny, Endless, max_turns=3, max_tokens=200, truncated_score=-1)  # -1: its steps' own sum
    assert all(math.isclose(s.env_reward, 0.3) for s in own.samples)  # three steps of 0.1
    high = play(tiny, Endless, max_turns=3, max_tokens=200, truncated_score=0.5)
    assert [s.env_reward for s in high.samples] == [0.5] * len(roll.samples)
    ends = [int(m.nonzero().max()) + 1 for m in roll.batch.mask]
    short = play(tiny, Endless, max_turns=5, max_tokens=20)  # the token budget ends it first
    assert all(int(m.nonzero().max()) + 1 <= 20 for m in short.batch.mask) and bool(short.truncated.all())
    assert max(ends) > 20 and all(s.env_info["turns"] < 5 for s in short.samples)
    done = play(tiny, Vowels, max_turns=2, max_tokens=200)  # the environment ends it: not truncated
    assert not bool(done.truncated.any()) and all(s.env_info["done"] for s in done.samples)


def test_a_tool_environments_calls_and_parse_failures_add_up_over_its_episodes(tiny) -> None:
    """Each step's info counts the turn's calls and names a call it could not parse: the episode adds them up
    (env_info), and the step logs them per episode with the share of episodes that made no call."""
    from nanogrpo.summary import episode_summary

    roll = play(tiny, Tools, max_turns=3, max_tokens=200)
    said = [[t["content"] for t in s.turns if t["role"] == "assistant"] for s in roll.samples]
    calls = [sum(len(x) % 3 == 0 for x in turns) for turns in said]
    errors = [sum(len(x) % 3 == 1 for x in turns) for turns in said]
    assert sum(calls) > 0 and sum(errors) > 0 and [s.env_info["tool_calls"] for s in roll.samples] == calls
    assert [s.env_info["tool_parse_errors"] for s in roll.samples] == errors
    m, n = episode_summary(roll), len(said)
    assert (m["env/tool_calls"], m["env/tool_parse_errors"]) == (sum(calls) / n, sum(errors) / n)
    assert m["env/no_tool_call"] == sum(c == 0 for c in calls) / n
    assert "env/tool_calls" not in episode_summary(play(tiny, Endless, max_turns=2, max_tokens=200))


@pytest.mark.parametrize("mode", ["raise", "hang", "nan"])
def test_a_failing_environment_ends_its_episode_only(tiny, mode, monkeypatch) -> None:
    monkeypatch.setattr(Faulty, "mode", mode)  # set before the workers fork: they inherit it
    roll = play(tiny, Faulty, step_timeout_s=0.5)
    failed = roll.failed.tolist()
    bad = [
        len(s.turns[1]["content"]) % 2 == 1 for s in roll.samples
    ]  # Faulty fails on a first turn of odd length
    assert failed == bad and 0 < sum(bad) < len(bad), [s.env_info["error"] for s in roll.samples]
    assert all((s.env_reward is None) == f for s, f in zip(roll.samples, failed))
    assert all(s.env_reward == 1.0 for s, f in zip(roll.samples, failed) if not f)
    why = [s.env_info["error"] for s, f in zip(roll.samples, failed) if f]
    assert all(
        {"raise": "RuntimeError", "hang": "over 0.5 s", "nan": "not a finite number"}[mode] in w for w in why
    )


def test_chat_suffix_and_refusal_of_a_template_that_rewrites_turns(tiny) -> None:
    tok = tiny[0].tokenizer
    fmt = TurnFormat.of(tok, "tool")
    assert (
        fmt.observation_text("42", ended_on_eos=True)
        == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    )
    assert fmt.observation_text("42", ended_on_eos=False).startswith("<|im_end|>\n<|im_start|>tool\n")
    rewriting = type(tok)(tokenizer_object=tok.backend_tokenizer, eos_token=tok.eos_token)
    # a template that drops earlier assistant turns (as some reasoning models' templates drop <think>)
    rewriting.chat_template = (
        "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
        "{{ m['role'] + ': ' + m['content'] + '\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    with pytest.raises(ValueError, match="--env.format plain"):
        TurnFormat.of(rewriting, "user")
    assert TurnFormat.of(rewriting, "user", "plain").observation_text("hi", True) == "\nuser: hi\nassistant: "


def test_builtins_play_by_their_rules() -> None:
    g = Guess()
    g.reset({"lo": 1, "hi": 8}, seed=3)
    target = g.target
    assert g.step(str(target - 1)).observation == "Higher. Guess again: one number." if target > 1 else True
    assert g.step("no number").info["invalid"]
    win = g.step(f"I guess {target}.")
    assert win.done and math.isclose(win.reward, 0.8)  # found on the third turn
    c = Calc()
    c.reset({"answer": "1404"}, 0)
    assert c.step("<calc>27 * 52</calc>").observation == "1404"
    assert c.step("<calc>__import__('os')</calc>").info["invalid"]
    assert c.step("so <answer>1404</answer>").reward == 1.0
    assert arith("2 ** 10 - (3 + 4) * 2") == 1010 and arith("7 / 2") == 3.5
    for bad in ("x + 1", "2 ** 1000", "(1).real", "1 / 0", "9" * 300):
        with pytest.raises((ValueError, SyntaxError)):
            arith(bad)
    s = Search()
    s.reset({"answer": "6650", "sources": ["nile"]}, 0)
    hits = s.step("<search>how long is the Nile km</search>").observation
    assert hits.startswith("[nile]")
    assert math.isclose(s.step("<answer>6650 km [nile]</answer>").reward, 1.0)


def test_bad_environment_flags_are_refused_before_the_model_loads() -> None:
    with pytest.raises(ValueError, match="allow-user-code"):
        make_factory(spec=f"{SPEC}:Vowels")
    with pytest.raises(ValueError, match="unknown environment; use one of"):
        make_factory(name="no-such-env")
    with pytest.raises(ValueError, match="defines no class"):
        make_factory(spec=f"{SPEC}:Nope", allow_user_code=True)
    cfg, env = resolve(replace(TINY, env=EnvConfig(name="calc", max_turns=9)))
    assert (cfg.env.max_turns, cfg.env.max_tokens) == (3, 3 * (TINY.sampling.max_new_tokens + 64))
    assert cfg.completion_tokens == cfg.env.max_tokens and env.factory is Calc


# ---------------------------------------------------------------------------- whole runs

RUN = ["tiny", "--env.spec", f"{SPEC}:Vowels", "--reward.allow-user-code", "--reward.spec", "env:1",
       "--data.train", "recipe:calc", "--prompts-per-step", "2", "--grpo.group-size", "4",
       "--sampling.max-new-tokens", "8", "--env.max-tokens", "48", "--optim.lr", "0.01", "--no-plots"]  # fmt: skip


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _adapter(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run / "adapter" / "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("envs") / "straight"
    r = run_train_here(*RUN, "--steps", "4", "--save-every", "2", "--out-dir", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    return run


def test_a_run_learns_from_its_episodes(straight) -> None:
    ms = _metrics(straight)
    assert [m["step"] for m in ms] == [1, 2, 3, 4]
    assert all(m["env/turns"] == 2 and m["env/failed"] == 0 and m["env/obs_tokens"] > 0 for m in ms)
    assert any(m["grad_norm"] > 0 for m in ms) and ms[0]["reward_std"] > 0
    group = json.loads((straight / "samples.jsonl").read_text().splitlines()[0])["groups"][0]
    assert [t["role"] for t in group["completions"][0]["turns"]] == ["assistant", "user", "assistant"]


def test_resume_mid_run_is_exact(straight, tmp_path) -> None:
    run = tmp_path / "resumed"
    r = run_train_here(*RUN, "--steps", "2", "--save-every", "2", "--out-dir", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_train_here("tiny", "--out-dir", str(run), "--resume", "--steps", "4", "--reward.allow-user-code")
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = _metrics(straight), _metrics(run)
    keys = ("reward", "loss", "grad_norm", "env/obs_tokens", "len_mean")
    assert [[m[k] for k in keys] for m in a] == [[m[k] for k in keys] for m in b]
    sa, sb = _adapter(straight), _adapter(run)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_kill_9_anywhere_in_an_episode_run_then_resume_is_exact(straight, tmp_path) -> None:
    """SIGKILL at two seeded random moments of an episode run (sampling, an environment call, a checkpoint):
    no worker process outlives the trainer, and --resume ends with the uninterrupted run's metrics and adapter."""
    import random
    import signal
    import time

    run, rng = tmp_path / "killed", random.Random(51)
    cmd = [
        sys.executable,
        str(ROOT / "train.py"),
        *RUN,
        "--steps",
        "4",
        "--save-every",
        "1",
        "--out-dir",
        str(run),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for kill in range(2):
        args = (
            cmd
            if kill == 0
            else [*cmd[:2], "tiny", "--out-dir", str(run), "--resume", "--reward.allow-user-code"]
        )
        p = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        while not list((run / "ckpt").glob(f"step_00000{kill + 1}")) and p.poll() is None:
            assert time.monotonic() < deadline, "no checkpoint"
            time.sleep(0.05)
        time.sleep(rng.uniform(0, 0.12))  # into the next step: its episodes, its update or its checkpoint
        assert p.poll() is None, "the run ended before it was killed"
        p.send_signal(signal.SIGKILL)
        p.wait()
        gone = time.monotonic() + 5  # each keeper sees the trainer die (a pidfd) and kills its worker's tree
        while left := [d for d in Path("/proc").iterdir() if d.name.isdigit() and str(run) in _cmdline(d)]:
            assert time.monotonic() < gone, [_cmdline(d) for d in left]
            time.sleep(0.05)
    r = run_train_here("tiny", "--out-dir", str(run), "--resume", "--reward.allow-user-code")
    assert r.returncode == 0, r.stderr[-3000:]
    keys = ("reward", "loss", "grad_norm", "env/obs_tokens", "len_mean")
    assert [[m[k] for k in keys] for m in _metrics(straight)] == [[m[k] for k in keys] for m in _metrics(run)]
    sa, sb = _adapter(straight), _adapter(run)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_two_ranks_equal_one_process(straight, tmp_path) -> None:
    port = free_port()
    run = tmp_path / "two"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(port), str(ROOT / "train.py"), *RUN, "--steps", "4", "--save-every", "2",
           "--out-dir", str(run)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = _metrics(straight), _metrics(run)
    for x, y in zip(a, b):
        assert (
            x["reward"] == pytest.approx(y["reward"], abs=1e-6) and x["env/obs_tokens"] == y["env/obs_tokens"]
        )
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-4, abs=1e-6)
    sa, sb = _adapter(straight), _adapter(run)
    assert all(torch.allclose(sa[k], sb[k], rtol=1e-4, atol=1e-6) for k in sa)


def test_eval_generate_plays_episodes_and_score_reads_them(tmp_path) -> None:
    from helpers import run_eval

    out = tmp_path / "gen.jsonl"
    r = run_eval("generate", "--data", "recipe:guess", "--model", "tiny", "--env.name", "guess",
                 "--max-new-tokens", "6", "--limit", "3", "--out", out, cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 3 and all(row["turns"][0]["content"].startswith("I am thinking") for row in rows)
    assert all(row["completion"] == row["turns"][-1]["content"] for row in rows)
    assert all(row["env_info"]["turns"] == (len(row["turns"]) // 2) for row in rows)
    r = run_eval("score", out, "--graders", "env,valid", "--json", "-", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout)["metrics"]["valid"]["n"] == 3


def test_the_episode_budget_replaces_max_new_tokens_where_the_run_sizes_itself(tmp_path) -> None:
    """The memory plan and the prompt limit read --env.max-tokens in place of --sampling.max-new-tokens."""
    from nanogrpo.model.memory_fit import run_step

    cfg, _ = resolve(replace(TINY, env=EnvConfig(name="calc", max_tokens=300)))
    assert run_step(cfg, CPU, torch.float32, prompt_len=20).new_tokens == 300
    assert (
        run_step(replace(cfg, env=EnvConfig()), CPU, torch.float32, prompt_len=20).new_tokens
        == TINY.sampling.max_new_tokens
    )
    positions = json.loads((Path(resolve_model_dir()) / "config.json").read_text())["max_position_embeddings"]
    assert prompt_budget(cfg)[1] == positions - 300


def resolve_model_dir():
    from nanogrpo.model.zoo import resolve_model

    return resolve_model("tiny")


def test_the_run_page_and_the_sample_table_show_turn_boundaries(straight) -> None:
    from nanogrpo.eval.report import write_report
    from nanogrpo.infra.sample_table import samples_markdown

    groups = json.loads((straight / "samples.jsonl").read_text().splitlines()[0])["groups"]
    table = samples_markdown(groups)
    assert "assistant: " in table and "<br><br>user: go on<br><br>assistant: " in table
    write_report(straight)
    page = (straight / "index.html").read_text()
    assert "\n\nuser: go on\n\nassistant: " in page


@pytest.mark.parametrize("decode", ["static"])
def test_episodes_are_the_same_with_the_fixed_shape_decode_loop(tiny, decode) -> None:
    eager = play(tiny, Vowels)
    policy, rows, cfg = tiny
    fixed = episode_rollout(policy, rows[:2], 0, 0, replace(cfg, sampling=replace(cfg.sampling, decode=decode)),
                            CPU, spec_of(tiny, Vowels, cfg))  # fmt: skip
    assert [s.turns for s in fixed.samples] == [s.turns for s in eager.samples]
    assert torch.equal(fixed.batch.ids, eager.batch.ids)
    torch.testing.assert_close(fixed.sampler_logp, eager.sampler_logp, rtol=0, atol=1e-5)


def test_episode_graders_exact_and_on_odd_columns() -> None:
    from rewards import Sample, make
    from rewards.options import RewardConfig

    turns = [{"role": "user", "content": "p"}, {"role": "assistant", "content": "a"}]
    info = {"reward_range": (-1.0, 1.0), "turns": 3, "max_turns": 5, "invalid": 1}
    good = Sample("p", "a", turns=turns, env_reward=0.5, env_info=info)
    failed = Sample("p", "a", turns=turns, env_reward=None, env_info=info)
    single = Sample("p", "a")  # no episode: the graders do not apply
    odd = Sample(
        "p", "a", row={"turns": turns, "env_reward": "x", "env_info": {"reward_range": "ab", "turns": "3"}}
    )
    got = {
        name: make(name, RewardConfig())([good, failed, single, odd]) for name in ("env", "turns", "valid")
    }
    assert got["env"] == [0.75, None, None, None]
    assert got["turns"] == [0.5, 0.5, None, None] and got["valid"][:3] == [pytest.approx(2 / 3)] * 2 + [None]
    assert got["valid"][3] is None


def test_dynamic_sampling_mask_truncated_and_eval_every_run_episodes(tmp_path) -> None:
    """The options that draw, drop or evaluate completions take episodes as they take single completions:
    dynamic sampling regroups whole trajectories (their observations and transcripts), --grpo.mask-truncated
    drops the ones a budget ended, --eval-every plays greedy held-out episodes."""
    run = tmp_path / "dyn"
    args = [*RUN, "--steps", "2", "--grpo.dynamic-sampling", "--grpo.mask-truncated", "--env.max-tokens", "16",
            "--eval-every", "1", "--eval-prompts", "2", "--data.eval", "recipe:calc", "--out-dir", str(run)]  # fmt: skip
    r = run_train_here(*args)
    assert r.returncode == 0, r.stderr[-3000:]
    ms = [m for m in _metrics(run) if m["step"] > 0]
    assert [m["step"] for m in ms] == [1, 2] and all(m["env/truncated"] > 0 for m in ms)
    assert all("frac_masked" in m and m["groups_drawn"] >= 2 for m in ms)
    assert all(m["eval/env"] is not None for m in _metrics(run))
    group = json.loads((run / "samples.jsonl").read_text().splitlines()[0])["groups"][0]
    assert all(c["turns"][0]["role"] == "assistant" for c in group["completions"])
