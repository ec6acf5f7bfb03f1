"""The reward's options against collapse and hacking: the overlong penalty, normalize-then-sum, gates,
the reward-hacking diagnostics (and their summary keys), and train.py running with the new flags."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rewards import RewardConfig, RewardFunction, Sample, build_reward, mean_metrics
from rewards.base import Grader, combine
from rewards.blend import normalize_in_groups, parse_gates
from rewards.diagnostics import best_is_longest, hacking_totals, len_corr
from rewards.options import with_max_tokens
from rewards.overlong import overlong_limits, overlong_penalty

ROOT = Path(__file__).resolve().parents[1]
S3 = 1 / math.sqrt(3)


class Column(Grader):
    """A stand-in grader: the score is the row's field `key` (None when absent)."""

    def __init__(self, key: str):
        self.name, self.key = key, key

    def score(self, batch):
        return [s.row.get(self.key) for s in batch]


def rows(groups: list[int], **cols: list) -> list[Sample]:
    """Samples whose rows hold the given columns ('a': [...], 'b': [...]) and the given groups."""
    return [
        Sample("p", "c", g, {k: v[i] for k, v in cols.items() if v[i] is not None})
        for i, g in enumerate(groups)
    ]


def reward_of(*names: str, **kw) -> RewardFunction:
    return RewardFunction({n: Column(n) for n in names}, {n: 1.0 for n in names}, **kw)


# ------------------------------------------------------------------------------------------- overlong


def test_overlong_penalty_by_hand():
    L, B = 100, 20  # the ramp starts after 80 tokens
    assert [overlong_penalty(n, L, B) for n in (0, 50, 80)] == [0.0, 0.0, 0.0]
    assert overlong_penalty(81, L, B) == pytest.approx(-0.05)
    assert overlong_penalty(90, L, B) == pytest.approx(-0.5)
    assert overlong_penalty(100, L, B) == -1.0 and overlong_penalty(130, L, B) == -1.0


def test_overlong_grader_reads_sample_tokens():
    cfg = with_max_tokens(RewardConfig(spec="overlong:1", overlong_buffer=20), 100)
    fn = build_reward(cfg)
    batch = [Sample("p", "c", 0, {}, tokens=n) for n in (10, 80, 90, 100)] + [Sample("p", "c", 0, {})]
    rewards, parts = fn(batch)
    assert parts["overlong"] == [0.0, 0.0, pytest.approx(-0.5), -1.0, None]  # not clipped to [0, 1]
    assert rewards == parts["overlong"]  # tokens None: the grader does not apply, no reward


def test_overlong_default_buffer_and_max_tokens():
    assert overlong_limits(with_max_tokens(RewardConfig(), 100)) == (100, 25)  # a quarter of L
    assert overlong_limits(RewardConfig()) == (0, 0)  # not filled in yet: returns None for every row
    cfg = RewardConfig(overlong_max_tokens=64)
    assert with_max_tokens(cfg, 512) is cfg  # an explicit L is kept
    assert with_max_tokens(RewardConfig(), 512).overlong_max_tokens == 512
    fn = build_reward(RewardConfig(spec="rouge_l:1,overlong:1"))  # what train.py builds today
    assert fn([Sample("p", "the cat", 0, {"reference": "the cat"})])[1]["overlong"] == [None]


def test_overlong_refuses_nonsense():
    for kw in ({"overlong_buffer": 100}, {"overlong_buffer": 150}, {"overlong_buffer": -1}):
        with pytest.raises(ValueError, match="overlong-buffer"):
            build_reward(with_max_tokens(RewardConfig(spec="overlong:1", **kw), 100))
    with pytest.raises(ValueError, match="overlong-buffer"):  # L // 4 is 0: set the buffer
        build_reward(with_max_tokens(RewardConfig(spec="overlong:1"), 3))
    with pytest.raises(ValueError, match="max-new-tokens must be >= 1"):
        with_max_tokens(RewardConfig(), 0)
    fn = build_reward(RewardConfig(spec="overlong:1"))  # tokens counted, limit never filled in
    with pytest.raises(ValueError, match="with_max_tokens"):
        fn([Sample("p", "c", 0, {}, tokens=5)])


# ---------------------------------------------------------------------------------------- aggregation


def test_normalize_then_sum_by_hand():
    # group 0: a = 0, .5, 1 (mean .5, unbiased std .5): z = -1, 0, 1
    #          b = .2, .2, .8 (mean .4, std sqrt(.24 / 2) = .2 sqrt 3): z = -1/sqrt3, -1/sqrt3, 2/sqrt3
    # reward = 2 * (z_a / 2 + z_b / 2) = z_a + z_b (the weights 1, 1 keep their total)
    fn = reward_of("a", "b", aggregate="normalize-then-sum")
    batch = rows([0, 0, 0], a=[0.0, 0.5, 1.0], b=[0.2, 0.2, 0.8])
    rewards, parts = fn(batch)
    assert rewards == pytest.approx([-1 - S3, -S3, 1 + 2 * S3])
    assert parts == {"a": [0.0, 0.5, 1.0], "b": [0.2, 0.2, 0.8]}  # the logged components stay raw


def test_normalize_then_sum_leaves_none_out():
    # group 1: a = .3, None, .9 -> z = -1/sqrt2, None, 1/sqrt2; b = .5, .5, .5: no spread -> 0, 0, 0
    # group 2: a = .7, None (one scored row -> 0); b = None, None
    fn = reward_of("a", "b", aggregate="normalize-then-sum")
    batch = rows([1, 1, 1, 2, 2], a=[0.3, None, 0.9, 0.7, None], b=[0.5, 0.5, 0.5, None, None])
    rewards, _ = fn(batch)
    h = 1 / math.sqrt(2)
    assert rewards[:4] == pytest.approx([2 * (-h / 2), 0.0, 2 * (h / 2), 0.0])
    assert rewards[4] is None  # every component None: no reward
    assert normalize_in_groups([0.1, 0.1, 0.1], [0, 0, 0]) == [0.0, 0.0, 0.0]  # exactly, no rounding noise
    # groups are told apart by Sample.group, not by position
    assert normalize_in_groups([0.0, 5.0, 1.0, 7.0], [0, 1, 0, 1]) == pytest.approx([-h, -h, h, h])


def test_sum_is_unchanged():
    batch = rows([0, 0, 1, 1], a=[0.1, 0.9, None, 0.3], b=[0.7, None, None, 0.3])
    want = [combine([s.row.get("a"), s.row.get("b")], [0.7, 0.3]) for s in batch]
    for kw in ({}, {"aggregate": "sum"}):
        fn = RewardFunction({"a": Column("a"), "b": Column("b")}, {"a": 0.7, "b": 0.3}, **kw)
        assert fn(batch)[0] == want  # bitwise: == on floats
    assert want[2] is None and want[1] == 0.9


# ---------------------------------------------------------------------------------------------- gates


def test_gate_closes_rows_and_counts_them():
    gates = parse_gates("a<b>=0.5")
    fn = RewardFunction({"a": Column("a"), "b": Column("b")}, {"a": 1.0, "b": 0.0}, gates=gates)
    batch = rows([0, 0, 0, 0], a=[0.8, 0.6, None, 0.4], b=[1.0, 0.0, 0.0, None])
    rewards, parts = fn(batch)
    # b passes (0.8 kept), b fails (0.6 -> 0), a does not apply (None), b does not apply (0.4 kept)
    assert rewards == [0.8, 0.0, None, 0.4]
    assert parts["a"] == [0.8, 0.6, None, 0.4]  # raw for logging
    assert fn.metrics() == {"gate/a<b>=0.5/closed_sum": 1.0, "gate/a<b>=0.5/closed_n": 3.0}
    assert mean_metrics(fn.metrics()) == {"gate/a<b>=0.5/closed": pytest.approx(1 / 3)}


def test_gate_with_real_graders_adds_the_gating_grader_at_weight_0():
    fn = build_reward(RewardConfig(spec="rouge_l:1", gate="rouge_l<format"))
    assert fn.weights == {"rouge_l": 1.0, "format": 0.0}
    ref = {"reference": "the cat sat"}
    good = "<think>hmm</think><answer>the cat sat</answer>"
    batch = [Sample("p", good, 0, ref), Sample("p", "the cat sat", 0, ref)]
    rewards, parts = fn(batch)
    assert parts["format"] == [1.0, 0.0] and parts["rouge_l"][1] == 1.0
    assert rewards == [parts["rouge_l"][0], 0.0]  # the untagged answer is closed
    assert mean_metrics(fn.metrics()) == {"gate/rouge_l<format/closed": 0.5}


def test_gate_parser_and_its_errors():
    gates = parse_gates(" a<b ; c<d>=0.25, e<f>=-1 ")
    assert [(g.target, g.gate, g.threshold) for g in gates] == [
        ("a", "b", 1.0),
        ("c", "d", 0.25),
        ("e", "f", -1.0),
    ]
    assert [g.key for g in gates] == ["a<b", "c<d>=0.25", "e<f>=-1"]
    assert parse_gates("") == []
    for bad in ("rouge_l", "rouge_l<", "<format", "rouge_l<format>0.5", "a<b<c"):
        with pytest.raises(ValueError, match=r"cannot read .*'A<B>=0.5'"):
            parse_gates(bad)
    for bad in ("a<b>=x", "a<b>=nan"):
        with pytest.raises(ValueError, match="not a number"):
            parse_gates(bad)
    with pytest.raises(ValueError, match="on itself"):
        parse_gates("a<a")


def test_build_reward_refuses_bad_gates_and_aggregates():
    with pytest.raises(ValueError, match=r"unknown grader 'nope' in --reward.gate.*known graders: .*format"):
        build_reward(RewardConfig(spec="rouge_l:1", gate="rouge_l<nope"))
    with pytest.raises(ValueError, match="'exact' is not in --reward.spec"):
        build_reward(RewardConfig(spec="rouge_l:1", gate="exact<format"))
    with pytest.raises(ValueError, match="use 'sum' or 'normalize-then-sum'"):
        build_reward(RewardConfig(aggregate="mean"))


# ---------------------------------------------------------------------------------------- diagnostics


def test_len_corr_plus_and_minus_one():
    lengths = [10, 20, 30, 40] * 2
    up, down = [0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1]
    assert len_corr(up + up, lengths, 4) == (pytest.approx(2.0), 2)
    assert len_corr(down + down, lengths, 4) == (pytest.approx(-2.0), 2)
    total, n = len_corr(up + down, lengths, 4)
    assert n == 2 and total == pytest.approx(0.0)


def test_len_corr_skip_rules():
    lengths = [10, 20, 30, 40]
    assert len_corr([0.1, None, None, 0.4], lengths, 4) == (0.0, 0)  # 2 scored rows
    assert len_corr([0.5, 0.5, 0.5, None], lengths, 4) == (0.0, 0)  # no spread in score
    assert len_corr([0.1, 0.2, 0.3, 0.4], [7, 7, 7, 7], 4) == (0.0, 0)  # no spread in length
    # None rows drop out: the other three still correlate perfectly
    assert len_corr([0.1, None, 0.3, 0.4], lengths, 4) == (pytest.approx(1.0), 1)


def test_best_is_longest_and_its_ties():
    lengths = [10, 20, 30, 40]
    assert best_is_longest([0.1, 0.2, 0.3, 0.4], lengths, 4) == (1, 1)
    assert best_is_longest([0.4, 0.3, 0.2, 0.1], lengths, 4) == (0, 1)
    assert best_is_longest([1, 1, 0, 0], [5, 9, 9, 3], 4) == (1, 1)  # one of the longest is among the best
    assert best_is_longest([1, 0, 0, 0], [5, 9, 9, 3], 4) == (0, 1)
    assert best_is_longest([0.5, 0.5, 0.5, 0.5], lengths, 4) == (0, 0)  # no best: not counted
    assert best_is_longest([0.1, 0.2, 0.3, 0.4], [5, 5, 5, 5], 4) == (0, 0)  # no longest: not counted
    assert best_is_longest([0.1, None, None, None], lengths, 4) == (0, 0)  # one scored row


def test_hacking_totals_keys_and_means():
    parts = {"a": [0.1, 0.2, 0.3, 0.4, None, None, None, None]}
    out = hacking_totals(parts, [0.4, 0.3, 0.2, 0.1, 1.0, 1.0, 1.0, 1.0], [10, 20, 30, 40] * 2, 4)
    assert set(out) == {f"{k}/{n}_{e}" for k in ("len_corr", "best_is_longest") for n in ("a", "reward") for e in ("sum", "n")}  # fmt: skip
    m = mean_metrics(out)
    assert m["len_corr/a"] == pytest.approx(1.0) and m["best_is_longest/a"] == 1.0
    assert (
        m["len_corr/reward"] == pytest.approx(-1.0) and m["best_is_longest/reward"] == 0.0
    )  # 2nd group: flat


def test_grpo_summary_logs_the_diagnostics():
    from nanogrpo.summary import grpo_summary

    reward = torch.tensor([0.1, 0.2, 0.3, 0.4, float("nan"), 0.5, 0.5, 0.5])  # 2 groups of 4
    parts = {"a": [0.1, 0.2, 0.3, 0.4, None, 0.5, 0.5, 0.5]}
    roll = SimpleNamespace(
        texts=["x"] * 8, rows=[{}, {}], lengths=torch.tensor([10.0, 20, 30, 40, 5, 6, 7, 8]),
        truncated=torch.zeros(8, dtype=torch.bool),
    )  # fmt: skip
    stats = {k: 0.0 for k in ("tokens", "clip_low", "clip_high", "kl", "pg_loss", "kl_loss", "ratio_max")}
    upd = SimpleNamespace(loss=0.0, tokens=100.0, seqs=8, stats={**stats, "entropy": 1.0}, later=None)
    m = grpo_summary(roll, reward, parts, torch.zeros(2, dtype=torch.bool), upd, None, False)
    assert m["hack/len_corr/a"] == pytest.approx(1.0) and m["hack/best_is_longest/a"] == 1.0
    assert m["hack/len_corr/reward"] == pytest.approx(1.0)  # the second group has no spread: skipped
    assert "hack/len_corr/a_n" not in m
    parts = {"a": [None] * 8}
    m = grpo_summary(roll, reward * float("nan"), parts, torch.zeros(2, dtype=torch.bool), upd, None, False)
    assert m["hack/len_corr/a"] is None and m["hack/best_is_longest/reward"] is None  # no group counted


# ------------------------------------------------------------------------------------------- train.py


def test_train_runs_with_the_new_flags(tmp_path):
    run = tmp_path / "run"
    args = ["tiny", "--steps", "2", "--out-dir", str(run), "--reward.spec", "rouge_l:1,overlong:1",
            "--reward.aggregate", "normalize-then-sum", "--reward.gate", "rouge_l<format"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    ms = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in ms] == [1, 2]
    for m in ms:
        assert m["gate/rouge_l<format/closed"] == 1.0  # a random tiny model writes no tags
        assert "reward/format" in m
        # the trainer fills in the limit (--sampling.max-new-tokens 12) and each completion's token count;
        # the tiny model never stops, so every completion sits at the limit
        assert m["reward/overlong"] == -1.0 and m["trunc_rate"] == 1.0
        for name in ("rouge_l", "overlong", "format", "reward"):
            assert f"hack/len_corr/{name}" in m and f"hack/best_is_longest/{name}" in m
    assert json.loads((run / "config.json").read_text())["reward"]["aggregate"] == "normalize-then-sum"
    assert (run / "reward_vs_length.png").exists() and "reward vs completion length" in (
        run / "index.html"
    ).read_text()
    bad = subprocess.run([sys.executable, str(ROOT / "train.py"), "tiny", "--out-dir", str(tmp_path / "bad"),
                          "--reward.gate", "rouge_l<nope"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert bad.returncode != 0 and "unknown grader 'nope' in --reward.gate" in bad.stderr
