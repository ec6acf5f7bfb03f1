"""--algo dpo (nanogrpo/stages/dpo.py): the loss against a hand computation on a tiny model, pairs drawn
from multiple-choice rows, micro-batch invariance, start-up errors, and tiny runs that learn their pairs."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import write_rows

from nanogrpo.data import DataError, load_rows, prompt_budget, tokenize_prompts
from nanogrpo.model import lora
from nanogrpo.policy import load_policy
from nanogrpo.recipes.presets import PRESETS
from nanogrpo.stages import Run, dpo

TINY = replace(
    PRESETS["tiny"][1],
    algo="dpo",
    prompts_per_step=4,
    optim=replace(PRESETS["tiny"][1].optim, grad_clip=0.0),
    plots=False,
)
TIMING = ("t_", "tok_per_s")

# every form a row can take: an MCQ as a list (by text, by index), as an object (by key), and a pair
ROWS = [
    {"id": "a", "prompt": "Capital of France?", "options": ["Paris", "Rome", "Madrid"], "answer": "Paris"},
    {"id": "b", "prompt": "2 + 2?", "options": {"A": "three", "B": "four", "C": "five"}, "answer": "B"},
    {"id": "c", "prompt": "Which animal says moo?", "options": ["dog", "cow", "cat", "owl"], "answer": 1},
    {"id": "d", "prompt": "The opposite of hot?", "chosen": "cold", "rejected": "warm and sunny"},
]


def metrics(run: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


# ---------------------------------------------------------------------------------------- the loss itself


def test_dpo_loss_is_the_papers_formula():
    beta = 0.1
    c, r, rc, rr = [-3.0, -5.0, -2.5], [-4.0, -4.0, -9.0], [-3.5, -4.0, -2.5], [-4.0, -5.0, -3.0]
    margin = [beta * ((c[i] - rc[i]) - (r[i] - rr[i])) for i in range(3)]
    assert margin == pytest.approx([0.05, -0.2, 0.6])
    pi_c = torch.tensor(c, dtype=torch.float64, requires_grad=True)
    pi_r, ref_c, ref_r = (torch.tensor(x, dtype=torch.float64) for x in (r, rc, rr))
    want = sum(math.log1p(math.exp(-m)) for m in margin) / 3  # -log sigmoid(m) = log(1 + e^-m)

    loss, stats = dpo.dpo_loss(pi_c, pi_r, ref_c, ref_r, beta)
    assert loss.item() == pytest.approx(want, rel=1e-12)
    assert stats["pairs"] == 3 and stats["loss"] == pytest.approx(3 * want, rel=1e-12)
    assert stats["reward_margin"] == pytest.approx(sum(margin)) and stats["reward_acc"] == 2  # two wins
    assert stats["reward_chosen"] == pytest.approx(beta * (0.5 + -1 + 0))
    assert stats["reward_rejected"] == pytest.approx(beta * (0 + 1 - 6))
    assert stats["logp_chosen"] == pytest.approx(-10.5) and stats["logp_rejected"] == pytest.approx(-17)
    # d loss / d log pi(chosen) = -beta * sigmoid(-margin) / P: a pair already won pulls less
    loss.backward()
    want_grad = [-beta / (1 + math.exp(m)) / 3 for m in margin]
    assert pi_c.grad.tolist() == pytest.approx(want_grad, rel=1e-12)

    # num_pairs: the pair count of every rank and micro-batch, so the parts add up to the batch's mean
    half, _ = dpo.dpo_loss(pi_c, pi_r, ref_c, ref_r, beta, num_pairs=6)
    assert half.item() == pytest.approx(want / 2, rel=1e-12)
    # a huge margin either way stays finite (logsigmoid, not log(sigmoid))
    far, _ = dpo.dpo_loss(
        torch.tensor([0.0, -1e4]), torch.tensor([-1e4, 0.0]), torch.zeros(2), torch.zeros(2), 1.0
    )
    assert float(far) == pytest.approx(1e4 / 2)


# ------------------------------------------------------------------------------------ pairs from the rows


@pytest.mark.parametrize(
    "options, answer, correct",
    [
        (["Paris", "Rome", "Oslo"], "Rome", "Rome"),  # the option's text
        (["Paris", "Rome", "Oslo"], " Rome ", "Rome"),  # compared without surrounding spaces
        (["Paris", "Rome", "Oslo"], "c", "Oslo"),  # a letter, any case: A = the first
        (["Paris", "Rome", "Oslo"], 0, "Paris"),  # a 0-based index
        ({"A": "Paris", "B": "Rome"}, "B", "Rome"),  # an object's key
        ({"A": "Paris", "B": "Rome"}, "Paris", "Paris"),  # or its text
        (["0.5", "1.5"], 1.5, "1.5"),  # a number written as the option's text
        (["C", "B", "A"], "A", None),  # the text of option C and the letter of option A: refused
        (["1", "2"], 1, None),  # index 1 ("2") or the text "1": refused
    ],
)
def test_the_answer_names_one_option(options, answer, correct):
    row = {"id": 7, "prompt": "q", "options": options, "answer": answer}
    if correct is None:
        with pytest.raises(DataError, match="could name"):
            dpo.check_rows([row], "f.jsonl")
        return
    dpo.check_rows([row], "f.jsonl")
    chosen, rejected = dpo.preference_pair(row, seed=0)
    texts = list(options.values()) if isinstance(options, dict) else options
    assert chosen == correct and rejected in texts and rejected != correct


def test_rejected_is_a_wrong_option_drawn_by_seed_and_row_id():
    options = ["alpha", "beta", "gamma", "delta"]
    rows = [{"id": i, "prompt": f"q{i}", "options": options, "answer": i % 4} for i in range(60)]
    draws = {seed: [dpo.preference_pair(r, seed) for r in rows] for seed in (0, 1)}
    for r, (chosen, rejected) in zip(rows, draws[0]):
        assert chosen == options[r["answer"]] and rejected in options and rejected != chosen
    # the same on any rank, batch or resume: a function of (seed, id) alone, whatever else the row holds
    copies = [json.loads(json.dumps({**r, "_prompt_ids": [1, 2], "_line": 99})) for r in reversed(rows)]
    assert [dpo.preference_pair(r, 0) for r in reversed(copies)] == draws[0]
    # a stable hash (blake2b), not Python's hash() (salted per process): these values hold in any process
    assert [dpo.draw_index(0, "a", 3), dpo.draw_index(1, "a", 3), dpo.draw_index(0, 5, 7)] == [2, 0, 1]
    assert dpo.draw_index(42, "medqa-17", 3) == 2
    changed = sum(a != b for a, b in zip(draws[0], draws[1]))
    assert 20 < changed < 60  # another seed, other draws (2 of 3 rows on average)
    # uniform over the wrong options: each of the 3 drawn for some of the 15 rows with answer 0
    assert {rej for r, (_, rej) in zip(rows, draws[0]) if r["answer"] == 0} == {"beta", "gamma", "delta"}
    pair = {"id": 1, "prompt": "q", "chosen": "yes", "rejected": "no", "options": ["x", "y"], "answer": "x"}
    assert dpo.preference_pair(pair, 3) == ("yes", "no")  # a row's own pair wins over its options


@pytest.mark.parametrize(
    "row, needle",
    [
        ({"prompt": "q", "answer": "a"}, "needs 'chosen' and 'rejected' texts, or a multiple-choice"),
        ({"prompt": "q", "chosen": "a"}, "field 'rejected' is missing or empty"),
        ({"prompt": "q", "chosen": " ", "rejected": "b"}, "field 'chosen' is missing or empty"),
        ({"prompt": "q", "chosen": "a", "rejected": "a "}, "the same text"),
        ({"prompt": "q", "chosen": 3, "rejected": "b"}, "field 'chosen' must be a string"),
        ({"prompt": "q", "options": ["a"], "answer": "a"}, "has 1 option"),
        ({"prompt": "q", "options": ["a", "b"]}, "field 'answer' is missing"),
        ({"prompt": "q", "options": ["a", "b"], "answer": "c"}, "'c' is not among the 2 options"),
        ({"prompt": "q", "options": ["a", "b"], "answer": 2}, "not among"),
        ({"prompt": "q", "options": ["a", "b"], "answer": True}, "field 'answer' is missing or not a string"),
        ({"prompt": "q", "options": ["a", ""], "answer": "a"}, "option B must be a non-empty string"),
        ({"prompt": "q", "options": ["a", 1], "answer": "a"}, "option B must be a non-empty string"),
        ({"prompt": "q", "options": ["a", "b", "a"], "answer": "a"}, "the text of 2 options"),
        ({"prompt": "q", "options": {"A": "x", "B": "x "}, "answer": "A"}, "no wrong option to reject"),
        ({"prompt": "q", "options": "a or b", "answer": "a"}, "field 'options' must be a list"),
    ],
)
def test_bad_rows_are_refused_with_file_and_line(tmp_path, row, needle):
    path = write_rows(tmp_path / "pairs.jsonl", [ROWS[0], row])
    with pytest.raises(DataError, match=rf"pairs.jsonl:2: .*{needle}"):
        dpo.check_rows(load_rows(path), str(path))  # (the type checks are load_rows', with file:line too)


def test_train_refuses_a_bad_row_before_the_model_loads(tmp_path):
    from train import cli, main

    path = write_rows(
        tmp_path / "pairs.jsonl", [*ROWS, {"prompt": "q", "options": ["a", "b"], "answer": "z"}]
    )
    with pytest.raises(DataError, match=r"pairs.jsonl:5: the answer 'z' is not among"):
        main(cli(["tiny", "--algo", "dpo", "--data.train", str(path), "--out-dir", str(tmp_path / "run")]))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_beta_of_zero_is_refused_before_anything_loads(tmp_path):
    from nanogrpo.infra.flag_checks import check_config
    from train import cli

    with pytest.raises(ValueError, match=r"--dpo.beta 0: must be > 0 \(the paper's is 0.1\)"):
        check_config(cli(["tiny", "--algo", "dpo", "--dpo.beta", "0", "--out-dir", str(tmp_path / "run")]))


# ------------------------------------------------------------------------------ the step on a tiny policy


@pytest.fixture(scope="module")
def tokenized():
    tok, limit = prompt_budget(TINY)
    rows = [dict(r) for r in ROWS]
    tokenize_prompts(rows, tok, "", limit, "refuse", "rows")
    return tok, rows


def make_run(tok, rows: list[dict], r: int, noise: float, lr: float = 1.0, micro: int = 0) -> Run:
    """A DPO Run on the tiny model with plain SGD (lr 1: the update is minus the gradient); noise moves the
    policy off its reference (LoRA: B ~ N(0, noise); full fine-tune: every weight, the frozen copy not)."""
    cfg = replace(TINY, lora=replace(TINY.lora, r=r), micro_batch=micro)
    torch.manual_seed(0)
    policy = load_policy(cfg, torch.device("cpu"), torch.float32, tok)
    with torch.no_grad():
        if r > 0:
            for m in lora.lora_modules(policy.core).values():
                torch.nn.init.normal_(m.lora_B.weight, std=noise)
        else:
            for p in policy.core.parameters():
                p.add_(noise * torch.randn_like(p))
    opt = torch.optim.SGD(lora.trainable_parameters(policy.model), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return Run(cfg, policy, opt, sched, None, None, torch.device("cpu"), None, rows)


def sequence_logprob(model: torch.nn.Module, prompt: list[int], answer: list[int]) -> float:
    """log p(answer | prompt) from a plain full forward (no padding, no shared prompt, no fused kernel),
    log_softmax in float64."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + answer])).double()  # (1, T, V)
    logp = logits[0, len(prompt) - 1 : -1].log_softmax(-1)  # (len(answer), V): position t predicts answer[t]
    return float(logp.gather(1, torch.tensor(answer)[:, None]).sum())


def hand_computation(run: Run, rows: list[dict]) -> dict[str, list[float]]:
    policy, tok = run.policy, run.policy.tokenizer
    out: dict[str, list[float]] = {"pi_c": [], "pi_r": [], "ref_c": [], "ref_r": [], "tokens": []}
    for row in rows:
        for side, text in zip("cr", dpo.preference_pair(row, run.cfg.seed)):
            ids = tok(text, add_special_tokens=False)["input_ids"] + policy.eos_ids[:1]
            out[f"pi_{side}"].append(sequence_logprob(policy.core, row["_prompt_ids"], ids))
            if policy.use_lora:
                with lora.disabled(policy.core):
                    out[f"ref_{side}"].append(sequence_logprob(policy.core, row["_prompt_ids"], ids))
            else:  # the frozen copy of the starting weights
                out[f"ref_{side}"].append(sequence_logprob(policy.ref_model, row["_prompt_ids"], ids))
            out["tokens"].append(len(ids))
    return out


@pytest.mark.parametrize("r", [4, 0], ids=["lora", "full"])
def test_step_logs_the_hand_computed_loss_and_margins(tokenized, r):
    tok, rows = tokenized
    run = make_run(tok, rows, r, noise=0.3 if r else 0.02)
    h = hand_computation(run, rows)  # before the step's update
    beta = run.cfg.dpo.beta
    rc = [beta * (p - q) for p, q in zip(h["pi_c"], h["ref_c"])]
    rr = [beta * (p - q) for p, q in zip(h["pi_r"], h["ref_r"])]
    margin = [c - x for c, x in zip(rc, rr)]
    assert min(abs(x) for x in margin) > 1e-3  # the policy is off its reference: a real test
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731

    m = dpo.step(run, 0, rows, 0)
    want = {
        "loss": mean([math.log1p(math.exp(-x)) for x in margin]),
        "reward_margin": mean(margin),
        "reward_chosen": mean(rc),
        "reward_rejected": mean(rr),
        "logp_chosen": mean(h["pi_c"]),
        "logp_rejected": mean(h["pi_r"]),
    }
    for key, value in want.items():
        assert m[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    assert m["reward_acc"] == mean([float(x > 0) for x in margin])
    assert m["tokens"] == sum(h["tokens"]) and m["len_mean"] == sum(h["tokens"]) / 8
    assert (
        m["step"] == 1 and m["t_sample"] == m["t_score"] == 0 and m["grad_norm"] > 0
    )  # lr: train.py's loop logs it
    as64 = lambda k: torch.tensor(h[k], dtype=torch.float64)  # noqa: E731
    loss, _ = dpo.dpo_loss(as64("pi_c"), as64("pi_r"), as64("ref_c"), as64("ref_r"), beta)
    assert float(loss) == pytest.approx(m["loss"], rel=1e-4)
    # the step trained: a second one on the same pairs has a lower loss and a larger margin
    m2 = dpo.step(run, 1, rows, 0)
    assert m2["loss"] < m["loss"] and m2["reward_margin"] > m["reward_margin"]


def test_step_zero_with_a_fresh_adapter_is_log_2(tokenized):
    """B = 0: the policy IS its reference, on the same path, so every margin is exactly 0."""
    tok, rows = tokenized
    m = dpo.step(make_run(tok, rows, r=4, noise=0.0), 0, rows, 0)
    assert m["loss"] == pytest.approx(math.log(2), abs=1e-7)
    assert m["reward_margin"] == m["reward_chosen"] == m["reward_rejected"] == m["reward_acc"] == 0.0
    assert m["logp_chosen"] < 0 and m["grad_norm"] > 0  # the gradient at B = 0 still moves B


def test_micro_batches_keep_pairs_whole_and_change_nothing(tokenized):
    """The loss and the update are the full batch's for any --micro-batch (odd ones round down to pairs)."""
    assert [dpo.pair_micro(k) for k in (0, 1, 2, 3, 4, 7)] == [0, 2, 2, 2, 4, 6]
    tok, rows = tokenized
    results = {}
    for micro in (0, 2, 3, 6):
        run = make_run(tok, rows, r=4, noise=0.3, micro=micro)
        params = lora.trainable_parameters(run.policy.model)
        before = [p.detach().clone() for p in params]
        m = dpo.step(run, 0, rows, 0)
        delta = torch.cat([(p.detach() - b).flatten() for p, b in zip(params, before)])  # -grad (SGD lr 1)
        results[micro] = (m, delta)
    m0, d0 = results[0]
    assert float(d0.abs().max()) > 1e-4
    for micro, (m, d) in results.items():
        for key in ("loss", "reward_margin", "reward_acc", "logp_chosen", "logp_rejected", "tokens"):
            assert m[key] == pytest.approx(m0[key], rel=1e-5, abs=1e-6), (micro, key)
        torch.testing.assert_close(d, d0, rtol=1e-4, atol=1e-6)


# --------------------------------------------------------------------------------- train.py, end to end


@pytest.mark.parametrize("r, lr", [(4, "1e-2"), (0, "1e-3")], ids=["lora", "full"])
def test_a_tiny_run_learns_its_pairs(tmp_path, capsys, r, lr):
    """Four pairs seen every step: the loss starts at log 2 (policy = reference: LoRA off at B = 0, or
    the frozen copy) and falls, while the chosen answers pull ahead of the rejected ones."""
    from train import cli, main

    data = write_rows(tmp_path / "pairs.jsonl", ROWS)
    args = [
        "tiny",
        "--algo",
        "dpo",
        "--data.train",
        str(data),
        "--no-plots",
        "--out-dir",
        str(tmp_path / "run"),
    ]
    main(cli([*args, "--prompts-per-step", "4", "--steps", "8", "--optim.lr", lr, "--lora.r", str(r)]))
    ms = metrics(tmp_path / "run")
    assert [m["step"] for m in ms] == list(range(1, 9))
    assert ms[0]["loss"] == pytest.approx(math.log(2), abs=1e-6) and ms[0]["reward_margin"] == 0.0
    assert ms[-1]["loss"] < ms[0]["loss"] - 0.1, [m["loss"] for m in ms]
    assert ms[-1]["reward_acc"] == 1.0 and ms[-1]["reward_margin"] > 0.2
    assert ms[-1]["reward_chosen"] > 0 > ms[-1]["reward_rejected"]
    assert (tmp_path / "run" / ("adapter" if r else "model")).is_dir()
    assert "step 8 | loss" in capsys.readouterr().out  # the console line: loss, acc, margin


def test_dpo_resume_is_exact(tmp_path):
    """The rejected draws and the data order survive a resume: the metrics are those of a straight run."""
    from train import cli, main

    data = write_rows(tmp_path / "pairs.jsonl", ROWS)
    base = ["tiny", "--algo", "dpo", "--data.train", str(data), "--optim.lr", "1e-2", "--no-plots"]
    main(cli([*base, "--out-dir", str(tmp_path / "straight"), "--steps", "4"]))
    main(cli([*base, "--out-dir", str(tmp_path / "resumed"), "--steps", "2"]))
    main(cli(["--out-dir", str(tmp_path / "resumed"), "--steps", "4", "--resume"]))
    assert metrics(tmp_path / "straight") == metrics(tmp_path / "resumed")


@pytest.mark.slow
def test_two_ranks_equal_one_process(dist_runs):
    """torchrun, 2 ranks on gloo, two pairs each: the loss is normalised by the pairs of BOTH ranks and
    the metrics summed over them, so the run logs and trains what one process does on the same batch. The
    runs (dpo: ROWS, --prompts-per-step 4 --steps 3 --micro-batch 2 --optim.lr 1e-3) come from
    tests/dist_runs.py."""
    from dist_runs import FILES, ok
    from safetensors.torch import load_file

    assert FILES["pairs.jsonl"] == "".join(json.dumps(r) + "\n" for r in ROWS)  # the pairs trained on
    ok(dist_runs, "one", "dpo")
    ok(dist_runs, "two", "dpo")
    one, two = metrics(dist_runs / "one" / "dpo"), metrics(dist_runs / "two" / "dpo")
    assert [m["step"] for m in two] == [1, 2, 3] and one[-1]["reward_acc"] == two[-1]["reward_acc"] == 1.0
    for a, b in zip(one, two):
        assert a.keys() == b.keys()
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key
    wa = load_file(str(dist_runs / "one" / "dpo" / "adapter" / "adapter_model.safetensors"))
    wb = load_file(str(dist_runs / "two" / "dpo" / "adapter" / "adapter_model.safetensors"))
    for key in wa:
        torch.testing.assert_close(wb[key], wa[key], rtol=0, atol=1e-5)
