"""--wandb and --tensorboard: the completions table each logs, the run page artifact, and the start-up error
when the package is missing. W&B runs offline only (WANDB_MODE=offline): nothing here touches the network.

What is asserted for W&B: an offline run cannot be read back through wandb.Api (that needs the server), so
the test reads the files wandb writes for it under the run folder: a logged table is also written as JSON
(wandb/offline-run-*/files/media/table/samples_*.table.json, {"columns": [...], "data": [[...]]}), and the
artifact's record (its name and the file index.html) is in the run's transaction log (run-*.wandb)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nanogrpo.infra.metrics import Logger, check_logger_packages
from nanogrpo.infra.sample_table import samples_markdown

ROOT = Path(__file__).resolve().parents[1]

GROUPS = [
    {
        "id": "q1",
        "prompt": "What is 2+2?",
        "reference": "4",
        "completions": [
            {
                "text": "The answer | is 4\nsurely",
                "reward": 1.0,
                "scores": {"acc": 1.0, "fmt": 1.0},
                "advantage": 0.71,
            },
            {"text": "five", "reward": 0.0, "scores": {"acc": 0.0, "fmt": None}, "advantage": -0.71},
        ],
    }
]


def _require(package: str, extra: str):
    return pytest.importorskip(package, reason=f"needs {package}: pip install -e '.[{extra}]'")


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    wandb = _require("wandb", "wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):  # nothing written outside tmp_path
        monkeypatch.setenv(var, str(tmp_path / "wandb_home"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return wandb


def test_samples_markdown_is_one_table_row_per_completion():
    md = samples_markdown(GROUPS).split("\n")
    assert md[0] == "| prompt | completion | acc | fmt | advantage | reward |"
    assert len(md) == 2 + 2  # header, rule, two completions
    assert "The answer \\| is 4<br>surely" in md[2] and "| 0.710 | 1.000 |" in md[2]
    assert "| - |" in md[3]  # fmt gave no score


def test_wandb_offline_logs_the_completions_table_and_the_run_page(tmp_path, offline_wandb):
    out = tmp_path / "run"
    out.mkdir()
    logger = Logger(out, wandb_project="nanogrpo-test", config={"steps": 1})
    logger.log_samples(1, GROUPS)
    logger.log({"step": 1, "reward": 0.5, "loss": 0.1})
    (out / "index.html").write_text("<html>run page</html>")
    logger.close()
    offline_wandb.teardown()  # the wandb service process writes the run's files: stopped, they are complete

    (run_dir,) = (out / "wandb").glob("offline-run-*")
    tables = list((run_dir / "files" / "media" / "table").glob("samples_*.table.json"))
    assert len(tables) == 1
    table = json.loads(tables[0].read_text())
    assert table["columns"] == ["prompt", "completion", "acc", "fmt", "advantage", "reward"]
    assert table["data"][0] == ["What is 2+2?", "The answer | is 4\nsurely", 1.0, 1.0, 0.71, 1.0]
    assert table["data"][1][1] == "five" and table["data"][1][3] is None
    (log,) = run_dir.glob("run-*.wandb")
    raw = log.read_bytes()
    assert b"run-page-" in raw and b"index.html" in raw  # the run page artifact's record
    assert (
        json.loads((out / "samples.jsonl").read_text())["groups"] == GROUPS
    )  # the file is written as before


def test_tensorboard_text_summary_holds_the_completions(tmp_path):
    _require("tensorboard", "tensorboard")
    from tensorboard.backend.event_processing import event_accumulator

    logger = Logger(tmp_path, tensorboard=True)
    logger.log_samples(5, GROUPS)
    logger.log({"step": 5, "reward": 0.5})
    logger.close()

    acc = event_accumulator.EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    (tag,) = [t for t in acc.Tags()["tensors"] if t.startswith("samples")]
    (event,) = acc.Tensors(tag)
    text = event.tensor_proto.string_val[0].decode()
    assert event.step == 5
    assert "| prompt | completion | acc | fmt | advantage | reward |" in text
    assert "The answer \\| is 4<br>surely" in text and "five" in text
    assert [s.value for s in acc.Scalars("reward")] == [0.5]


def test_a_missing_package_is_a_start_up_error_with_the_pip_line(monkeypatch):
    check_logger_packages("", False)  # nothing asked: nothing imported
    for package, extra, kw in (
        ("wandb", "wandb", {"wandb_project": "p"}),
        ("tensorboard", "tensorboard", {}),
    ):
        monkeypatch.setitem(sys.modules, package, None)  # `import package` raises ImportError
        with pytest.raises(ValueError, match=rf"pip install -e '\.\[{extra}\]'"):
            check_logger_packages(**(kw or {"tensorboard": True}))


def test_train_refuses_a_missing_wandb_in_one_line_before_the_model_loads(tmp_path):
    out = tmp_path / "run"
    code = (  # train.py as `python train.py --wandb p`, its one-line error included, without wandb
        "import runpy, sys\n"
        "sys.modules['wandb'] = None\n"  # as if wandb were not installed: `import wandb` raises ImportError
        "import nanogrpo.policy\n"
        "nanogrpo.policy.load_policy = lambda *a, **k: sys.exit('the model was loaded')\n"
        f"sys.argv = ['train.py', '--wandb', 'p', '--out-dir', {str(out)!r}]\n"
        "runpy.run_path('train.py', run_name='__main__')\n"
    )
    env = {**os.environ, "WANDB_MODE": "offline"}
    env.pop("NANOGRPO_DEBUG", None)
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    err = res.stderr.strip().splitlines()
    assert res.returncode == 2, res.stderr
    assert len(err) == 1 and err[0].startswith("error: --wandb needs the wandb package")
    assert "pip install -e '.[wandb]'" in err[0]
    assert not out.exists()  # no run folder either


def test_tensorboard_on_resume_hides_the_steps_that_run_again(tmp_path):
    _require("tensorboard", "tensorboard")
    from tensorboard.backend.event_processing import event_accumulator

    first = Logger(tmp_path, tensorboard=True)
    for step in (1, 2, 3):
        first.log({"step": step, "reward": float(step)})
    first.close()  # the run died after step 3; its checkpoint is step 2
    again = Logger(tmp_path, tensorboard=True)
    again.truncate_after(2)
    again.log({"step": 3, "reward": 30.0})
    again.close()

    acc = event_accumulator.EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [(s.step, s.value) for s in acc.Scalars("reward")] == [(1, 1.0), (2, 2.0), (3, 30.0)]
