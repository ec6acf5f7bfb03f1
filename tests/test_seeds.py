"""eval.py seeds / seeds-table (nanogrpo/eval/seeds.py): tiny runs over two seeds give a mean ± std table
equal to the one computed by hand from their eval files, finished seeds are skipped, and the comparison
with a baseline run set equals stats.py's paired bootstrap and McNemar on the pooled (seed, prompt) pairs."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from helpers import run_eval, train_py_here

from nanogrpo.eval import seeds, stats

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ["tiny", "--steps", "2", "--eval-prompts", "4", "--no-plots"]  # LoRA is the tiny preset's default


@pytest.fixture(scope="module")
def run_sets(tmp_path_factory):
    """Two run sets over seeds 42 and 123: GRPO with a large learning rate (so the trained model's answers
    move away from the base's in two steps) and SFT, the baseline."""
    root = tmp_path_factory.mktemp("seeds")
    with train_py_here():  # each seed's run as train.py would, in this process
        return _run_sets(root)


def _run_sets(root):
    grpo = run_eval(
        "seeds", "--out", root / "grpo", "--seeds", 42, 123, "--", *TRAIN, "--optim.lr", 0.05, cwd=root
    )
    assert grpo.returncode == 0, grpo.stdout[-3000:] + grpo.stderr[-3000:]
    sft = run_eval(
        "seeds", "--out", root / "sft", "--seeds", 42, 123, "--", *TRAIN, "--algo", "sft", cwd=root
    )
    assert sft.returncode == 0, sft.stdout[-3000:] + sft.stderr[-3000:]
    return root, grpo


def eval_scores(run: Path, side: str) -> dict:
    rows = [json.loads(line) for line in (run / f"eval_{side}.jsonl").read_text().splitlines()]
    return {r["id"]: r["scores"] for r in rows}


def by_hand(folder: Path, seed_list=(42, 123)) -> dict:
    """metric -> side -> (mean, sample std) over seeds of each seed's mean over its prompts."""
    per: dict = {}
    for s in seed_list:
        base, trained = eval_scores(folder / f"seed{s}", "base"), eval_scores(folder / f"seed{s}", "trained")
        for m in next(iter(trained.values())):
            a = [base[i][m] for i in trained]
            b = [trained[i][m] for i in trained]
            d = per.setdefault(m, {"base": [], "trained": [], "delta": []})
            d["base"].append(sum(a) / len(a))
            d["trained"].append(sum(b) / len(b))
            d["delta"].append(sum(y - x for x, y in zip(a, b)) / len(a))
    return {m: {k: (statistics.mean(v), statistics.stdev(v)) for k, v in d.items()} for m, d in per.items()}


def test_table_over_seeds_matches_the_runs(run_sets):
    root, res = run_sets
    for s in (42, 123):
        assert (root / "grpo" / f"seed{s}" / "summary.json").is_file()
        config = json.loads((root / "grpo" / f"seed{s}" / "config.json").read_text())
        assert config["seed"] == s and config["optim"]["lr"] == 0.05
    assert "[seeds 2/2] seed 123: done" in res.stdout
    hand = by_hand(root / "grpo")
    table = json.loads((root / "grpo" / "seeds.json").read_text())
    assert table["seeds"] == [42, 123] and table["config_differs"] == []
    assert list(table["metrics"]) == ["em", "f1", "seqm", "rouge_l", "consistency"]
    for m, sides in hand.items():
        assert table["metrics"][m]["n"] == {"42": 4, "123": 4}
        for side, (mean, std) in sides.items():
            assert table["metrics"][m][side]["mean"] == pytest.approx(mean, abs=1e-12)
            assert table["metrics"][m][side]["std"] == pytest.approx(std, abs=1e-12)
        b, t, d = sides["base"], sides["trained"], sides["delta"]
        row = f"| {m} | 4 | {b[0]:.3f} ± {b[1]:.3f} | {t[0]:.3f} ± {t[1]:.3f} | {d[0]:+.3f} ± {d[1]:.3f} |"
        assert row in res.stdout
    assert row in (root / "grpo" / "seeds.md").read_text()
    assert any(hand[m]["trained"][0] != hand[m]["base"][0] for m in hand)  # not a table of zeros only


def test_finished_seeds_are_skipped(run_sets):
    root, _ = run_sets
    stamp = (root / "grpo" / "seed42" / "summary.json").stat().st_mtime_ns
    res = run_eval("seeds", "--out", root / "grpo", "--seeds", 42, 123, "--", *TRAIN, cwd=root)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("finished already") == 2 and "running" not in res.stdout
    assert (root / "grpo" / "seed42" / "summary.json").stat().st_mtime_ns == stamp


def test_baseline_comparison_matches_stats(run_sets):
    root, _ = run_sets
    res = run_eval(
        "seeds-table", root / "grpo", "--baseline", root / "sft", "--resamples", 2000, "--json", "-", cwd=root
    )
    assert res.returncode == 0, res.stderr
    cmp = json.loads(res.stdout)["baseline"]
    assert cmp["seeds"] == [42, 123] and cmp["ids_dropped"] == 0
    ours = {s: eval_scores(root / "grpo" / f"seed{s}", "trained") for s in (42, 123)}
    theirs = {s: eval_scores(root / "sft" / f"seed{s}", "trained") for s in (42, 123)}
    for m, got in cmp["metrics"].items():
        pairs = [(theirs[s][i][m], ours[s][i][m]) for s in (42, 123) for i in ours[s]]  # by seed and id
        a, b = [x for x, _ in pairs], [y for _, y in pairs]
        want = stats.paired_bootstrap(a, b, 2000, 0)
        assert {k: got[k] for k in want} == pytest.approx(want)
        if all(v in (0.0, 1.0) for v in a + b):
            assert got["mcnemar"] == stats.mcnemar_exact([x == 1 for x in a], [y == 1 for y in b])
        else:
            assert "mcnemar" not in got
    assert "em" in cmp["metrics"] and "mcnemar" in cmp["metrics"]["em"]
    md = (root / "grpo" / "seeds_vs_sft.md").read_text()
    assert "| metric | pairs | sft | grpo | diff | 95% CI | McNemar p |" in md


# ------------------------------------------------------------------------------------- without training


def fake_run(folder: Path, seed: int, base: list, trained: list, lr: float = 1e-3) -> None:
    """A finished run folder: eval files with the given {metric: score} per prompt, config, summary."""
    run = folder / f"seed{seed}"
    run.mkdir(parents=True)
    for side, scores in (("base", base), ("trained", trained)):
        lines = [
            json.dumps({"id": f"p{i}", "prompt": "q", "completion": "c", "scores": s})
            for i, s in enumerate(scores)
        ]
        (run / f"eval_{side}.jsonl").write_text("\n".join(lines) + "\n")
    (run / "config.json").write_text(json.dumps({"seed": seed, "out_dir": str(run), "optim": {"lr": lr}}))
    (run / "summary.json").write_text("{}")


def test_table_by_hand_with_missing_scores(tmp_path):
    fake_run(
        tmp_path,
        1,
        [{"em": 0, "f1": 0.5}, {"em": 1, "f1": 0.2}],
        [{"em": 1, "f1": 0.9}, {"em": 1, "f1": None}],
    )
    fake_run(
        tmp_path,
        2,
        [{"em": 0, "f1": 0.1}, {"em": 0, "f1": 0.3}],
        [{"em": 0, "f1": 0.4}, {"em": 1, "f1": 0.6}],
    )
    fake_run(
        tmp_path,
        3,
        [{"em": 1, "f1": 0.2}, {"em": 0, "f1": 0.2}],
        [{"em": 1, "f1": 0.2}, {"em": 1, "f1": 0.8}],
        0.1,
    )
    (tmp_path / "seed4").mkdir()  # an unfinished run: no summary.json, left out
    res = seeds.table(tmp_path)
    assert res["seeds"] == [1, 2, 3] and res["config_differs"] == ["optim.lr"]
    f1 = res["metrics"]["f1"]
    assert f1["n"] == {"1": 1, "2": 2, "3": 2}  # seed 1's second prompt has no trained f1: the pair drops
    per_seed = [0.9 - 0.5, (0.4 + 0.6 - 0.1 - 0.3) / 2, (0.2 + 0.8 - 0.2 - 0.2) / 2]
    assert f1["delta"]["mean"] == pytest.approx(statistics.mean(per_seed))
    assert f1["delta"]["std"] == pytest.approx(statistics.stdev(per_seed))
    assert res["metrics"]["em"]["trained"]["mean"] == pytest.approx((1 + 0.5 + 1) / 3)
    assert "differ in config optim.lr" in seeds.format_markdown(res)
    one = seeds.table(tmp_path, seeds=(2,))
    assert one["seeds"] == [2] and one["metrics"]["f1"]["base"]["std"] is None  # one seed: no std
    assert "| f1 | 2 | 0.200 | 0.500 | +0.300 |" in seeds.format_markdown(one)


def test_comparison_pairs_by_seed_and_id(tmp_path):
    fake_run(tmp_path / "a", 1, [{"em": 0}] * 3, [{"em": 1}, {"em": 0}, {"em": 1}])
    fake_run(tmp_path / "a", 2, [{"em": 0}] * 3, [{"em": 1}, {"em": 1}, {"em": 1}])
    fake_run(tmp_path / "b", 2, [{"em": 0}] * 2, [{"em": 0}, {"em": 1}])  # prompt p2 and seed 1 missing
    fake_run(tmp_path / "b", 5, [{"em": 0}], [{"em": 0}])
    res = seeds.table(tmp_path / "a", tmp_path / "b", n_resamples=500)["baseline"]
    assert res["seeds"] == [2] and res["seeds_dropped"] == [1, 5] and res["ids_dropped"] == 1
    em = res["metrics"]["em"]
    assert em["n"] == 2 and em["diff"] == pytest.approx(0.5)
    assert em["mcnemar"] == stats.mcnemar_exact([False, True], [True, True])
    with pytest.raises(ValueError, match="share no seed"):
        seeds.compare_sets(seeds.load_runs(tmp_path / "a", (1,)), seeds.load_runs(tmp_path / "b"))
    with pytest.raises(ValueError, match="no finished runs of seeds 1 "):
        seeds.table(tmp_path / "a", tmp_path / "b", seeds=(1,))


def test_refusals(tmp_path):
    for flag in ("--seed=3", "--out-dir", "--resume"):
        with pytest.raises(ValueError, match="set for every run by the seeds command"):
            seeds.check_train_args(["tiny", flag])
    run = tmp_path / "seed7"
    run.mkdir()
    (run / "summary.json").write_text("{}")
    with pytest.raises(ValueError, match="eval_base.jsonl not found: .*--eval-prompts N"):
        seeds.load_runs(tmp_path)
    with pytest.raises(ValueError, match="no finished runs"):
        seeds.load_runs(tmp_path / "seed7")
