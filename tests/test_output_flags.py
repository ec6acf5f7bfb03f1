"""The side commands' output flags (nanogrpo/infra/outputs.py): '' (the current folder), a file where a folder
goes, a folder where a file goes, and a folder of someone else's files are refused in one line naming the flag,
exit status 2, before any model loads or run starts; the current folder stays empty. Results are written
whole, and `eval.py generate` keeps its completions when the write fails late. `eval.py report` names the
file it cannot use."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers import run_eval, run_train_here, write_rows

from nanogrpo.eval import generation
from nanogrpo.eval import seeds as seedruns
from nanogrpo.lab import ablate, ppo_vs_grpo, rlvrr


def nothing_runs(*a, **k):
    raise AssertionError("work started before the output flag was refused")


@pytest.fixture
def here(tmp_path):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    return cwd


def one_error(res) -> str:
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), res.stderr[-2000:]
    return lines[0]


@pytest.fixture
def foreign(tmp_path):
    """A folder of the user's own (a checkout, say): no command may mix a run set into it."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "README.md").write_text("mine\n")
    return folder


def test_generate_refuses_its_out_before_the_model_loads(here, tmp_path, monkeypatch, foreign):
    monkeypatch.setattr(generation, "load_model", nothing_runs)
    gen = ["generate", "--model", "tiny", "--data", "demo", "--limit", "2", "--max-new-tokens", "2"]
    assert "--out '': name the file" in one_error(run_eval(*gen, "--out", "", cwd=here))
    assert f"--out {foreign} is a folder" in one_error(run_eval(*gen, "--out", foreign, cwd=here))
    under = foreign / "README.md" / "out.jsonl"
    assert f"{foreign / 'README.md'} is a file" in one_error(run_eval(*gen, "--out", under, cwd=here))
    assert list(here.iterdir()) == [] and [p.name for p in foreign.iterdir()] == ["README.md"]


def test_generate_keeps_its_completions_when_the_write_fails_late(here, tmp_path, monkeypatch):
    """The name is taken by a folder while the model generates: the completions go to a new name beside it,
    and the one line says where, instead of a traceback that loses them."""
    out = tmp_path / "completions.jsonl"

    def generate(model, tok, rows, **kw):
        out.mkdir()  # what the rename will trip over
        return [[f"answer {i}"] for i in range(len(rows))]

    monkeypatch.setattr(generation, "load_model", lambda *a: (None, None))
    monkeypatch.setattr(generation, "generate_completions", generate)
    res = run_eval("generate", "--model", "tiny", "--data", "demo", "--limit", "3", "--out", out, cwd=here)
    err = one_error(res)
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("completions.jsonl.kept-")]
    assert len(kept) == 1 and f"the completions are kept in {kept[0]}" in err
    rows = [json.loads(line) for line in kept[0].read_text().splitlines()]
    assert [r["completion"] for r in rows] == ["answer 0", "answer 1", "answer 2"]
    assert list(here.iterdir()) == []


def test_seeds_refuses_its_out_before_any_run(here, tmp_path, monkeypatch, foreign):
    monkeypatch.setattr(seedruns.subprocess, "run", nothing_runs)
    seeds = ["seeds", "--seeds", "1", "--", "tiny", "--steps", "1"]
    assert "--out '': name the output folder" in one_error(
        run_eval(*seeds[:3], "--out", "", *seeds[3:], cwd=here)
    )
    (tmp_path / "file").write_text("")
    err = one_error(run_eval(*seeds[:3], "--out", tmp_path / "file", *seeds[3:], cwd=here))
    assert "is a file, not a folder" in err
    err = one_error(run_eval(*seeds[:3], "--out", foreign, *seeds[3:], cwd=here))
    assert f"--out {foreign} holds files this command did not write (README.md)" in err
    assert list(here.iterdir()) == []


def test_rlvrr_refuses_its_out_before_anything_is_written(here, tmp_path, monkeypatch, capsys, foreign):
    monkeypatch.chdir(here)
    monkeypatch.setattr(rlvrr.seedruns, "run_seeds", nothing_runs)
    for out, says in (
        ("", "--out '': name the output folder"),
        (foreign, "holds files this command did not"),
    ):
        with pytest.raises(SystemExit) as e:
            rlvrr.main(["--seeds", "1", "--out", str(out)])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and says in err[0], err
    assert list(here.iterdir()) == [] and [p.name for p in foreign.iterdir()] == ["README.md"]


@pytest.mark.parametrize("command", ["ablate", "ppo_vs_grpo"])
def test_the_labs_refuse_their_out(command, here, tmp_path, monkeypatch, capsys, foreign):
    monkeypatch.chdir(here)
    monkeypatch.setattr(ablate, "train_toy", nothing_runs)
    monkeypatch.setattr(ppo_vs_grpo, "run_cells", nothing_runs)
    cheap = ["toy", "--steps", "1", "--variants", "none", "--betas", "0.1", "--seeds", "0"]
    main, argv = (ablate.main, cheap) if command == "ablate" else (ppo_vs_grpo.main, ["--steps", "1"])
    (tmp_path / "file").write_text("")
    for out, says in (("", "--out ''"), (tmp_path / "file", "is a file"), (foreign, "did not write")):
        with pytest.raises(SystemExit) as e:
            main([*argv, "--out", str(out)])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and says in err[0], err
    assert list(here.iterdir()) == []


def test_score_and_elo_refuse_their_out_before_grading(here, tmp_path, monkeypatch, foreign):
    from nanogrpo.eval import evaluate, pairwise

    monkeypatch.setattr(evaluate, "score_rows", nothing_runs)
    monkeypatch.setattr(pairwise, "run_pairwise", nothing_runs)
    c = write_rows(tmp_path / "c.jsonl", [{"id": 1, "prompt": "p", "reference": "a", "completion": "a"}])
    assert f"--out {foreign} is a folder" in one_error(run_eval("score", c, "--out", foreign, cwd=here))
    assert "--out '': name the output prefix" in one_error(run_eval("elo", c, c, "--out", "", cwd=here))
    assert list(here.iterdir()) == []


def test_reward_data_and_convert_refuse_their_out(here, tmp_path, monkeypatch, capsys, foreign):
    """The reward data commands check --out before drafting (an LLM's drafts cost money), convert's split
    refuses --out-dir '' (its files would land here) and mcq a folder as --out."""
    from nanogrpo.reward_data import __main__ as reward_data
    from nanogrpo.reward_data import convert

    monkeypatch.chdir(here)
    rows = write_rows(tmp_path / "rows.jsonl", [{"id": 1, "prompt": "p", "reference": "a b c"}])
    for out, says in (("", "--out '': name the file"), (foreign, "is a folder")):
        with pytest.raises(SystemExit) as e:
            reward_data.main(["baseline", str(rows), "--out", str(out)])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and says in err[0], err
    with pytest.raises(ValueError, match="--out-dir '': name the output folder"):
        convert.run_split(convert.Split(str(rows), "", ""))
    with pytest.raises(ValueError, match=f"--out {foreign} is a folder"):
        convert.run_mcq(convert.Mcq(str(rows), str(foreign)))
    assert list(here.iterdir()) == [] and [p.name for p in foreign.iterdir()] == ["README.md"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    res = run_train_here("tiny", "--steps", "1", "--no-plots", "--out-dir", root / "run", cwd=root)
    assert res.returncode == 0, res.stderr[-2000:]
    return root / "run"


DAMAGE = {  # file -> what it holds
    "metrics.jsonl": b"\xff\xfe not utf-8\n",
    "config.json": b'{"model": {"path": "ti',
    "eval.json": b"[1, 2]\n",
    "samples.jsonl": b'[1]\n{"step": 1}\n',
}


@pytest.mark.parametrize("name", [*DAMAGE, "metrics-step", "metrics-folder"])
def test_report_names_the_file_it_cannot_use(name, finished_run, tmp_path, here):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    if name == "metrics-step":
        name = "metrics.jsonl"
        with open(run / name, "a") as f:
            f.write('{"step": "two", "reward": 1}\n{"step": 3}\n')
    elif name == "metrics-folder":
        name = "metrics.jsonl"
        (run / name).unlink()
        (run / name).mkdir()
    else:
        (run / name).write_bytes(DAMAGE[name])
    page = (run / "index.html").exists()
    err = one_error(run_eval("report", run, cwd=here))
    assert err.startswith(f"error: {run / name}") and "Traceback" not in err, err
    assert (run / "index.html").exists() == page and list(here.iterdir()) == []  # nothing written
