"""`python -m nanogrpo.eval.probe` on bad input that is not a number out of range (those are nanogrpo_base/ranges.py's,
tests/test_flag_ranges.py): a missing --data file, a device this machine does not have or torch does not know,
--out '' or a file or an existing probe, a split that --dev-frac left with one label, a damaged probe.json
or probe.safetensors. Each is one line naming the flag or the file, exit status 2, before any model loads
(FrozenLM is made to fail here, so a test that reached it would say so), and the current folder stays empty."""

from __future__ import annotations

import json

import pytest
import torch

from nanogrpo.eval import probe as nanogrpo_probe
from rewards import probe as rewards_probe
from rewards.probe import Probe


@pytest.fixture
def here(tmp_path, monkeypatch):
    """An empty current folder, and no model that could load."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)

    def no_model(*a, **k):
        raise AssertionError("a model loaded before the bad input was refused")

    monkeypatch.setattr(rewards_probe, "FrozenLM", no_model)
    return cwd


def labels(path, n: int = 8, split: bool = True):
    rows = [
        {"prompt": f"q{i}", "response": f"r{y}", "criterion": "c", "label": y}
        | ({"split": "dev" if i < 3 else "train"} if split else {})
        for i in range(n)
        for y in (0, 1)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def refused(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        nanogrpo_probe.main([str(a) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_a_missing_data_file_names_the_flag(here, tmp_path, capsys):
    err = refused(["train", "--data", "nowhere.jsonl", "--model", "tiny"], capsys)
    assert "--data 'nowhere.jsonl': no such file" in err
    probe = Probe({"weight": torch.zeros(2), "bias": torch.zeros(()), "mean": torch.zeros(2), "std": torch.ones(2)},
                  {"layer": 0, "threshold": 0.5, "model": "tiny", "text_format": rewards_probe.TEXT_FORMAT})  # fmt: skip
    probe.save(tmp_path / "p")
    assert "--data 'nowhere.jsonl'" in refused(
        ["eval", "--data", "nowhere.jsonl", "--probe", tmp_path / "p"], capsys
    )
    assert list(here.iterdir()) == []


@pytest.mark.parametrize("device", ["banana", "cuda:x"])
def test_a_device_torch_does_not_know_names_the_flag(device, here, tmp_path, capsys):
    err = refused(
        ["train", "--data", labels(tmp_path / "l.jsonl"), "--model", "tiny", "--device", device], capsys
    )
    assert f"--device {device!r}: not a device" in err and list(here.iterdir()) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_on_a_machine_without_it_names_the_flag(here, tmp_path, capsys):
    data = labels(tmp_path / "l.jsonl")
    err = refused(["train", "--data", data, "--model", "tiny", "--device", "cuda"], capsys)
    assert "--device cuda: no cuda device here" in err and "--device cpu" in err
    refused(
        ["compare", "--data", data, "--model", "tiny", "--device", "cuda", "--out", tmp_path / "r"], capsys
    )
    assert list(here.iterdir()) == []


def test_output_folder_refusals(here, tmp_path, capsys):
    data = labels(tmp_path / "l.jsonl")
    train = ["train", "--data", data, "--model", "tiny"]
    assert "--out '': name the probe's folder" in refused([*train, "--out", ""], capsys)
    (tmp_path / "file").write_text("")
    assert f"--out {tmp_path / 'file'} is a file" in refused([*train, "--out", tmp_path / "file"], capsys)
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "probe.json").write_text("{}")
    assert "holds a probe already: pass --overwrite" in refused([*train, "--out", tmp_path / "old"], capsys)
    compare = ["compare", "--data", data, "--model", "tiny", "--readouts", "probe"]
    assert "--out '': name the output folder" in refused([*compare, "--out", ""], capsys)
    assert "is a file, not a folder" in refused([*compare, "--out", tmp_path / "file"], capsys)
    assert list(here.iterdir()) == []


def test_a_split_dev_frac_leaves_with_one_label_says_so(here, tmp_path, capsys):
    """Rows without a 'split' field are split by --dev-frac: one that leaves the dev split empty is said to,
    not reported as if the labels were wrong."""
    data = labels(tmp_path / "l.jsonl", n=3, split=False)
    err = refused(["train", "--data", data, "--model", "tiny", "--dev-frac", "0.01"], capsys)
    assert "the dev split needs both labels (0 and 1), and it has 0 rows" in err
    assert "--dev-frac 0.01 sent 0 of the 6 rows without a 'split' field to dev" in err


@pytest.mark.parametrize(
    "damage",
    ["torn json", "not an object", "no weights", "torn weights"],
)
def test_a_damaged_probe_names_its_file(damage, here, tmp_path, capsys):
    folder = tmp_path / "p"
    Probe({"weight": torch.zeros(2), "bias": torch.zeros(()), "mean": torch.zeros(2), "std": torch.ones(2)},
          {"layer": 0, "threshold": 0.5, "model": "tiny", "text_format": rewards_probe.TEXT_FORMAT}).save(folder)  # fmt: skip
    meta, weights = folder / "probe.json", folder / "probe.safetensors"
    if damage == "torn json":
        meta.write_text(meta.read_text()[:20])
    elif damage == "not an object":
        meta.write_text("[1, 2]")
    elif damage == "no weights":
        weights.unlink()
    else:
        weights.write_bytes(weights.read_bytes()[:30])
    err = refused(["eval", "--data", labels(tmp_path / "l.jsonl"), "--probe", folder], capsys)
    named = str(meta) if "json" in damage or "object" in damage else str(folder)
    assert named in err and "retrain it" in err and list(here.iterdir()) == []


def test_a_probe_that_is_not_finite_is_refused_and_probe_json_is_strict(tmp_path):
    bad = Probe({"weight": torch.tensor([float("nan"), 0.0]), "bias": torch.zeros(()), "mean": torch.zeros(2),
                 "std": torch.ones(2)}, {"layer": 0, "threshold": 0.5})  # fmt: skip
    with pytest.raises(ValueError, match="not finite; nothing written"):
        bad.save(tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
    ok = Probe({"weight": torch.zeros(2), "bias": torch.zeros(()), "mean": torch.zeros(2), "std": torch.ones(2)},
               {"layer": 0, "threshold": 0.5, "dev": {"macro_f1": float("inf")}})  # fmt: skip
    ok.save(tmp_path / "ok")

    def refuse(name):
        raise AssertionError(f"{name} in probe.json")

    assert json.loads((tmp_path / "ok" / "probe.json").read_text(), parse_constant=refuse)["dev"] == {
        "macro_f1": None
    }
