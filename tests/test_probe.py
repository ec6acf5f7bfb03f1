"""Linear probes on a frozen LM's last-token hidden state (tiny random model, synthetic labels)."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
import torch
from helpers import synthetic

from rewards.probe import (
    FrozenLM,
    Probe,
    best_threshold,
    evaluate_probe,
    macro_f1,
    pairwise_accuracy,
    read_rows,
    train_probe,
)


def shuffled(rows: list[dict], seed: int) -> list[dict]:
    """Labels permuted within each true class (half of each class gets 1): independent of the truth."""
    rng = random.Random(seed)
    out = [dict(r) for r in rows]
    for c in (0, 1):
        idx = [i for i, r in enumerate(rows) if r["label"] == c]
        new = [k % 2 for k in range(len(idx))]
        rng.shuffle(new)
        for i, y in zip(idx, new):
            out[i]["label"] = y
    return out


@pytest.fixture(scope="module")
def lm(tiny_model_dir) -> FrozenLM:
    return FrozenLM(str(tiny_model_dir))


def test_probe_reads_a_linear_label_and_not_a_shuffled_one(lm, tiny_model_dir):
    train, test = synthetic(160, 0), synthetic(120, 1)
    probe = train_probe(train, str(tiny_model_dir), lm=lm, batch_size=32)
    good = evaluate_probe(probe, test, batch_size=32)
    assert good["accuracy"] >= 0.9 and good["macro_f1"] >= 0.9, good
    assert good["pairwise_accuracy"] >= 0.9, good
    assert (
        probe.meta["dev"]["accuracy"] >= 0.9 and len(probe.meta["dev_log_loss_per_layer"]) == 3
    )  # emb + 2 layers
    # control task: labels independent of the text, in training and in the held-out rows alike
    noise = evaluate_probe(train_probe(shuffled(train, 2), str(tiny_model_dir), lm=lm, batch_size=32),
                           shuffled(test, 3), batch_size=32)  # fmt: skip
    assert 0.35 <= noise["accuracy"] <= 0.65, noise
    assert 0.3 <= noise["pairwise_accuracy"] <= 0.7, noise


def test_features_take_the_last_real_token_whatever_the_padding(lm):
    rows = [
        {"text": "a"},
        {"text": "a much longer text with many more tokens in it"},
        {"text": "mid size text"},
    ]
    together = lm.features(rows, batch_size=3)  # (L+1, 3, H), padded
    alone = torch.cat([lm.features([r], batch_size=1) for r in rows], dim=1)  # no padding
    assert together.shape == alone.shape and together.shape[1] == 3
    torch.testing.assert_close(together, alone, atol=1e-4, rtol=1e-4)
    one = lm.features(rows, layer=2, batch_size=2)
    torch.testing.assert_close(one, together[2], atol=1e-4, rtol=1e-4)


def test_probe_save_load_roundtrip(lm, tiny_model_dir, tmp_path):
    probe = train_probe(synthetic(80, 3), str(tiny_model_dir), lm=lm)
    probe.save(tmp_path / "p")
    again = Probe.load(tmp_path / "p")
    rows = synthetic(10, 4)
    assert again.predict_proba(rows) == pytest.approx(probe.predict_proba(rows), abs=1e-5)
    assert (again.layer, again.threshold) == (probe.layer, pytest.approx(probe.threshold))


def test_metrics_on_worked_examples():
    assert macro_f1([1, 1, 0, 0], [1, 0, 0, 0]) == pytest.approx((2 / 3 + 0.8) / 2)
    assert macro_f1([1, 1], [1, 1]) == 1.0  # class 0 absent everywhere: left out
    # group a: (0.9 > 0.2) right, (0.9 > 0.95)? wrong -> 1/2; group b: one tie -> 1/2
    assert pairwise_accuracy(
        [0.9, 0.2, 0.95, 0.5, 0.5], [1, 0, 0, 1, 0], ["a", "a", "a", "b", "b"]
    ) == pytest.approx((1 + 0 + 0.5) / 3)
    assert pairwise_accuracy([0.1, 0.2], [1, 1], ["a", "a"]) is None
    assert best_threshold([0.1, 0.3, 0.6, 0.8], [0, 0, 1, 1]) == 0.5  # perfect at 0.5 and 0.45: nearest 0.5
    assert best_threshold([0.1, 0.3, 0.4, 0.8], [0, 0, 1, 1]) == pytest.approx(0.35)


def test_read_rows_names_the_bad_line(tmp_path):
    path = tmp_path / "labels.jsonl"
    path.write_text('{"text": "ok", "label": 1}\n{"text": "bad", "label": "yes"}\n')
    with pytest.raises(ValueError, match=r"labels.jsonl:2: field 'label'"):
        read_rows(path)


@pytest.mark.slow
def test_command_line_train_and_eval(tiny_model_dir, tmp_path):
    """`train` through the CLI's main in this process (no RuntimeWarning: they raise here), then `eval` as
    `python -m rewards.probe` runs it, in a new interpreter: the module's entry point, end to end."""
    import warnings

    from rewards.probe_cli import main as probe_main

    data, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in synthetic(120, 5)))
    test.write_text("".join(json.dumps(r) + "\n" for r in synthetic(40, 6)))
    out = tmp_path / "probe"
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        probe_main(["train", "--data", str(data), "--model", str(tiny_model_dir), "--out", str(out)])
    assert (out / "probe.safetensors").is_file() and json.loads((out / "probe.json").read_text())[
        "layer"
    ] >= 0
    res = subprocess.run(
        [sys.executable, "-m", "rewards.probe", "eval", "--data", str(test), "--probe", str(out)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report["accuracy"] >= 0.9 and {"macro_f1", "pairwise_accuracy"} <= report.keys()
    assert "RuntimeWarning" not in res.stderr


def test_command_line_takes_model_names_through_nanogrpo(tmp_path, monkeypatch, capsys):
    from nanogrpo.eval import probe as nanogrpo_probe
    from rewards import local_client
    from rewards.probe_cli import main as rewards_main

    monkeypatch.setattr(local_client, "_backend", None)  # whatever other tests registered
    data, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in synthetic(64, 7)))
    test.write_text("".join(json.dumps(r) + "\n" for r in synthetic(24, 8)))
    out = tmp_path / "probe"
    # rewards alone knows no names: refused before any model loads, with the way to run it
    with pytest.raises(SystemExit) as e:
        rewards_main(["train", "--data", str(data), "--model", "tiny", "--out", str(out)])
    assert e.value.code == 2 and not out.exists()
    err = capsys.readouterr().err
    assert "--model 'tiny'" in err and "python -m nanogrpo.eval.probe" in err and len(err.splitlines()) == 1

    nanogrpo_probe.main(
        ["train", "--data", str(data), "--model", "tiny", "--out", str(out), "--batch-size", "32"]
    )
    trained = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert trained["out"] == str(out) and json.loads((out / "probe.json").read_text())["model"] == "tiny"
    nanogrpo_probe.main(["eval", "--data", str(test), "--probe", str(out), "--batch-size", "32"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["accuracy"] >= 0.9 and {"macro_f1", "pairwise_accuracy"} <= report.keys()

    monkeypatch.setattr(local_client, "_backend", None)  # the probe names 'tiny': rewards alone says how
    with pytest.raises(SystemExit):
        rewards_main(["eval", "--data", str(test), "--probe", str(out)])
    assert "python -m nanogrpo.eval.probe" in capsys.readouterr().err


@pytest.mark.parametrize("pool", ["last", "mean"])
def test_a_probe_runs_only_the_layers_it_reads(tiny_model_dir, lm, pool) -> None:
    """A model cut after layer k (its final norm dropped) gives layer k's hidden states as the whole model
    does: the probe's judge runs k layers, not all of them. The last layer (normed) is never cut."""
    rows = synthetic(6, 1)
    cut = FrozenLM(str(tiny_model_dir), upto=1)
    assert len(cut.model.layers) == 1 and len(lm.model.layers) == 2
    assert torch.allclose(cut.features(rows, 1, pool=pool), lm.features(rows, 1, pool=pool), atol=1e-6)
    assert not torch.allclose(cut.features(rows, 1), lm.features(rows, 2), atol=1e-3)  # not the normed last
    whole = FrozenLM(str(tiny_model_dir), upto=2)
    assert len(whole.model.layers) == 2 and torch.equal(whole.features(rows, 2), lm.features(rows, 2))
