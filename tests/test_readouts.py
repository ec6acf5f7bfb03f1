"""Small-LM Judges's readout comparison (python -m nanogrpo.eval.probe compare): metrics by hand, the paired bootstrap,
the splits, and the command end to end on the tiny model with labels the probe can read."""

from __future__ import annotations

import json
import random

import pytest
import torch

from nanogrpo.eval.readouts import (
    assign_folds,
    format_table,
    paired_bootstrap,
    parse_layer,
    read_label_rows,
    scores,
)
from rewards.probe import macro_f1, pooled

WORDS = "alpha beta gamma delta sun moon tree river stone cloud fish bird".split()
CRITERIA = ("Names a warm colour", "Names the colour red")


def labelled(questions: int = 6, seed: int = 0) -> list[dict]:
    """2 criteria x 2 responses per question (12 responses for 6): a response ending in 'red red' meets
    both criteria, one ending in 'blue blue' neither, so the label is a plain function of the text."""
    rng = random.Random(seed)
    rows = []
    for q in range(questions):
        for colour in ("red", "blue"):
            resp = " ".join(rng.choice(WORDS) for _ in range(4)) + f" {colour} {colour}"
            for c in CRITERIA:
                rows.append({"prompt": f"Question {q}: name a thing and a colour.", "response": resp,
                             "criterion": c, "label": int(colour == "red")})  # fmt: skip
    return rows


def write(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_metrics_by_hand():
    pred, label, weight = [1, 1, 0, 0, 1], [1, 0, 0, 1, 1], [2, 1, 1, -3, 1]
    # TP 2 (rows 0, 4), FP 1 (row 1), FN 1 (row 3), TN 1 (row 2)
    # F1(met) = 2*2 / (2*2 + 1 + 1) = 2/3; F1(not met) = 2*1 / (2*1 + 1 + 1) = 1/2; macro = 7/12
    # weighted accuracy: right on rows 0 (w 2), 2 (w 1), 4 (w 1) of |w| 2+1+1+3+1 = 8 -> 4/8
    s = scores(pred, label, weight)
    assert s["macro_f1"] == pytest.approx(7 / 12)
    assert s["weighted_accuracy"] == pytest.approx(0.5)
    assert s["accuracy"] == pytest.approx(3 / 5)
    assert s["balanced_accuracy"] == pytest.approx((2 / 3 + 1 / 2) / 2)  # recall 2/3 (met), 1/2 (not met)
    assert scores(pred, label)["weighted_accuracy"] == pytest.approx(3 / 5)  # no weights: plain accuracy
    assert scores([1, 1], [1, 1])["macro_f1"] == 1.0  # class 'not met' absent everywhere: left out
    assert scores([0, 0], [1, 1])["macro_f1"] == 0.0
    rng = random.Random(0)
    for _ in range(20):  # the same macro-F1 as the probe's own evaluation
        p, y = [rng.randint(0, 1) for _ in range(15)], [rng.randint(0, 1) for _ in range(15)]
        assert scores(p, y)["macro_f1"] == pytest.approx(macro_f1(p, y))


def test_paired_bootstrap():
    rng = random.Random(1)
    label = [rng.randint(0, 1) for _ in range(60)]
    good = [y if rng.random() < 0.9 else 1 - y for y in label]
    bad = [rng.randint(0, 1) for _ in label]
    cluster = [str(i // 3) for i in range(60)]
    res = paired_bootstrap({"bad": bad, "good": good, "same": good}, label, None, cluster, n_resamples=2000)
    d = res["differences"]["same - good"]
    for m in ("macro_f1", "weighted_accuracy"):
        assert d[m]["diff"] == 0.0 and d[m]["ci"] == [0.0, 0.0]  # a readout against itself
        lo, hi = res["differences"]["good - bad"][m]["ci"]
        assert 0 < lo <= res["differences"]["good - bad"][m]["diff"] <= hi
        v = res["readouts"]["good"][m]
        assert v["ci"][0] <= v["value"] <= v["ci"][1]
    assert res["clusters"] == 20
    assert res == paired_bootstrap(
        {"bad": bad, "good": good, "same": good}, label, None, cluster, n_resamples=2000
    )


def test_splits_go_by_question():
    rows = labelled(7)
    folds = assign_folds(rows, folds=3, seed=0)
    held = sorted(i for f in folds for i in f["test"])
    assert held == list(range(len(rows)))  # every row held out exactly once
    for f in folds:
        qs = {s: {rows[i]["prompt"] for i in f[s]} for s in ("train", "dev", "test")}
        assert not (qs["train"] & qs["dev"] or qs["train"] & qs["test"] or qs["dev"] & qs["test"])
        assert len(f["train"]) + len(f["dev"]) + len(f["test"]) == len(rows)
    one = assign_folds(rows, test_frac=0.3)
    assert len(one) == 1 and len({rows[i]["prompt"] for i in one[0]["test"]}) == 2
    marked = [{**r, "split": ("train", "dev", "test")[i % 3]} for i, r in enumerate(rows)]
    assert assign_folds(marked)[0]["dev"] == list(range(1, len(rows), 3))
    with pytest.raises(ValueError, match="some rows have a 'split'"):
        assign_folds(marked[:-1] + rows[-1:])
    with pytest.raises(ValueError, match="give at least 4"):
        assign_folds(labelled(3), folds=2)


def test_weights_from_rubrics_and_layers(tmp_path):
    rows = labelled(2)
    rubric = [{"criterion": CRITERIA[0], "weight": 3}, {"criterion": CRITERIA[1], "weight": -2}]
    rubrics = write(tmp_path / "rubrics.jsonl", [{"prompt": f"Question {q}: name a thing and a colour.",
                                                  "rubric": rubric} for q in range(2)])  # fmt: skip
    got = read_label_rows(write(tmp_path / "labels.jsonl", rows), [rubrics])
    assert [r["weight"] for r in got[:2]] == [3.0, 2.0]  # a pitfall counts |w|
    with pytest.raises(ValueError, match="no weight in --rubrics"):
        read_label_rows(write(tmp_path / "more.jsonl", labelled(3)), [rubrics])
    with pytest.raises(ValueError, match="'text' rows cannot be compared"):
        read_label_rows(write(tmp_path / "text.jsonl", [{"text": "a", "label": 1}]))
    assert parse_layer("dev", 3) == (None, 0) and parse_layer("-1", 3) == ([2], 0)
    assert parse_layer("last2", 3) == ([0], 2)
    with pytest.raises(ValueError, match="--probe-layer must be"):
        parse_layer("3", 3)


def test_mean_pooling_leaves_padding_out():
    h = torch.tensor([[[1.0], [3.0], [100.0]], [[2.0], [4.0], [6.0]]])  # (B=2, T=3, H=1)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert pooled(h, mask, "mean").flatten().tolist() == [2.0, 4.0]
    assert pooled(h, mask, "last").flatten().tolist() == [3.0, 6.0]


def test_compare_end_to_end_on_the_tiny_model(tmp_path, capsys):
    from nanogrpo.eval import probe

    rows = [{**r, "weight": 2 if r["criterion"] == CRITERIA[0] else 1} for r in labelled(6)]
    data, out = write(tmp_path / "labels.jsonl", rows), tmp_path / "cmp"
    probe.main(["compare", "--data", data, "--model", "tiny", "--out", str(out), "--folds", "3",
                "--resamples", "500", "--batch-size", "24"])  # fmt: skip
    printed = capsys.readouterr().out
    report = json.loads((out / "readouts.json").read_text())
    cols = ["generative", "logprob", "logprob-tuned", "probe"]
    assert report["columns"] == cols and report["held_out"] == len(rows) == 24
    assert set(report["results"]) == {"overall", *CRITERIA}
    for g, res in report["results"].items():
        assert g in printed
        for c in cols:
            for m in ("macro_f1", "weighted_accuracy"):
                v = res["readouts"][c][m]
                assert 0.0 <= v["value"] <= 1.0 and 0.0 <= v["ci"][0] <= v["ci"][1] <= 1.0, (g, c, m, v)
    assert (
        report["results"]["overall"]["readouts"]["probe"]["macro_f1"]["value"] >= 0.7
    )  # it reads the colour
    assert "probe - generative" in report["results"]["overall"]["differences"]
    assert report["weights"] == "rubric |w|" and len(report["probe"]["folds"]) == 3
    assert format_table(report) in printed
    preds = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert len(preds) == 24 and set(preds[0]["p"]) == set(cols)
