"""--eval-every: held-out scores at step 0 (before any update) and every K steps, for LoRA and full
fine-tunes alike, without changing training, refused without a held-out set, logged once across --resume."""

import json
import shutil
from dataclasses import replace

import pytest
from helpers import metrics, run_train_here, tiny

from nanogrpo import startup
from nanogrpo.data import load_task
from nanogrpo.eval.during import eval_line, eval_seed, means
from nanogrpo.eval.evaluate import pass_and_mean
from train import cli, main


def evals(run) -> dict[int, dict]:
    """{step: its eval/* metrics} of the lines that have some."""
    out = {}
    for m in metrics(run):
        if ev := {k: v for k, v in m.items() if k.startswith("eval/")}:
            out[m["step"]] = ev
    return out


def training(run) -> list[dict]:
    """metrics.jsonl without the evaluation (step 0's line, eval/*) and the timings."""
    return [{k: v for k, v in m.items() if not k.startswith("eval/")} for m in metrics(run) if m["step"] > 0]


def with_eval(path, every=2, prompts=3, samples=0, **kw):
    return tiny(path, eval_every=every, eval_prompts=prompts, eval_samples=samples, **kw)


def test_lora_run_logs_step_0_and_every_k_steps_the_same_training_and_the_final_table(tmp_path):
    main(tiny(tmp_path / "plain", eval_prompts=3))
    main(with_eval(tmp_path / "eval", samples=2, eval_pass_threshold=0.3, plots=True))
    ev = evals(tmp_path / "eval")
    assert sorted(ev) == [0, 2, 4]
    keys = {"eval/reward", "eval/rouge_l", "eval/consistency", "eval/em", "eval/f1", "eval/seqm"}
    assert all(keys | {"eval/pass@2", "eval/avg@2"} == set(e) for e in ev.values()), ev
    assert all(0 <= v <= 1 for e in ev.values() for v in e.values())
    first = json.loads((tmp_path / "eval" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 0 and set(first) == {"step", "t_eval", *ev[0]}  # a line of its own
    # the evaluation samples from generators of its own and restores the RNG: training is untouched
    assert training(tmp_path / "eval") == training(tmp_path / "plain")
    # the final base-vs-trained table is as without --eval-every; its base is step 0, its trained the last step
    table = json.loads((tmp_path / "eval" / "eval.json").read_text())["metrics"]
    assert table == json.loads((tmp_path / "plain" / "eval.json").read_text())["metrics"]
    for m in ("rouge_l", "consistency", "em"):
        assert table[m]["mean_a"] == pytest.approx(ev[0][f"eval/{m}"])
        assert table[m]["mean_b"] == pytest.approx(ev[4][f"eval/{m}"])
    assert (tmp_path / "eval" / "eval.png").exists()
    page = (tmp_path / "eval" / "index.html").read_text()
    assert 'data-title="held-out eval"' in page and "eval/pass@2: last" in page


def test_full_fine_tune_gets_its_base_model_evaluated_at_step_0(tmp_path):
    """--lora.r 0 has no final base-vs-trained table (its base would be the adapters off); step 0 is the
    base model: the same scores as a LoRA run's step 0, whose zero-initialised adapters change nothing."""
    full = with_eval(tmp_path / "full", every=3, samples=2)
    main(replace(full, lora=replace(full.lora, r=0)))
    main(with_eval(tmp_path / "lora", every=3, samples=2, steps=1))
    ev = evals(tmp_path / "full")
    assert sorted(ev) == [0, 3, 4]  # step 0, every 3rd, and the last
    assert ev[0] == evals(tmp_path / "lora")[0]
    assert not (tmp_path / "full" / "eval.json").exists()


@pytest.mark.parametrize("kept", ["step_000002", None])  # resume from step 2, or before any checkpoint
def test_resume_logs_each_evaluation_once(tmp_path, kept):
    cfg = with_eval(tmp_path / "straight", samples=2, save_every=2)
    main(cfg)
    run = tmp_path / "crashed"
    shutil.copytree(tmp_path / "straight", run)
    for ckpt in (run / "ckpt").glob("step_*"):  # a crash after step 4's line, before its checkpoint
        if ckpt.name != kept:
            shutil.rmtree(ckpt)
    (run / "ckpt" / "latest").unlink(missing_ok=True)
    main(replace(cfg, out_dir=str(run), resume=True))
    steps = [m["step"] for m in metrics(run)]
    assert steps == [0, 1, 2, 3, 4]
    assert metrics(run) == metrics(tmp_path / "straight")


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--eval-every", "2", "--eval-prompts", "3", "--data.train", "{rows}"], "add --data.eval FILE"),
        (["--eval-every", "2", "--eval-prompts", "0"], "add --eval-prompts N"),
        (["--eval-samples", "2"], "add --eval-every K"),
        (["--eval-every", "-1"], "--eval-every -1: must be >= 0 (0 = off)"),
    ],
)
def test_refused_at_start_up_saying_how_to_fix(tmp_path, args, needle):
    rows = tmp_path / "train.jsonl"
    rows.write_text('{"prompt": "q", "reference": "a"}\n')
    args = [a.replace("{rows}", str(rows)) for a in args]
    r = run_train_here("tiny", "--out-dir", str(tmp_path / "x"), *args)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].startswith("error:") and needle in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "x").exists()  # refused before the run folder, and the model, were touched


def test_a_held_out_file_enables_it_beside_any_training_data(tmp_path):
    rows = tmp_path / "train.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"q{i}", "reference": "a"}) + "\n" for i in range(4)))
    cfg = cli(["tiny", "--data.train", str(rows), "--data.eval", str(rows), "--eval-every", "2"])
    cfg = replace(cfg, out_dir=str(tmp_path / "run"), eval_prompts=2, steps=2)
    main(cfg)
    assert sorted(evals(tmp_path / "run")) == [0, 2]


def test_the_held_out_file_is_read_once_at_start_up(tmp_path, monkeypatch):
    """The evaluations during training and the final table score the rows read and checked before the model
    loaded: the file removed right after that read, the run still evaluates at steps 0 and 2 and at its end."""

    rows, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"q{i}", "reference": "a"}) + "\n" for i in range(4)))
    shutil.copy(rows, held)
    reads = []

    def read_then_remove(name, split="train", columns=None):
        out = load_task(name, split, columns)
        reads.append(split)
        if split == "eval":
            held.unlink()
        return out

    monkeypatch.setattr(startup, "load_task", read_then_remove)
    cfg = cli(["tiny", "--data.train", str(rows), "--data.eval", str(held), "--eval-every", "2"])
    main(replace(cfg, out_dir=str(tmp_path / "run"), eval_prompts=2, steps=2))
    assert reads.count("eval") == 1 and not held.exists()
    assert sorted(evals(tmp_path / "run")) == [0, 2]
    assert json.loads((tmp_path / "run" / "eval.json").read_text())["metrics"]["em"]["n"] == 2


def test_pass_and_mean_seeds_means_and_the_console_line():
    assert pass_and_mean([[0.2, 1.0], [0.5, None], [None, None]], 1.0) == (0.5, pytest.approx(0.55))
    assert pass_and_mean([[None]], 1.0) is None
    assert means([{"em": 1.0, "reward": 0.5}, {"em": None, "reward": 0.0}]) == {"reward": 0.25, "em": 1.0}
    assert eval_seed(0, 2, 1) == eval_seed(0, 2, 1) != eval_seed(0, 4, 1)
    line = eval_line(2, 3, {"eval/reward": 0.25, "eval/em": 1.0, "eval/pass@2": 0.5, "t_eval": 1.23})
    assert line == "eval step 2 | 3 held-out, greedy: reward 0.250 (em 1.000) | pass@2 0.500 | 1.2s"


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_torchrun_evaluates_on_the_main_rank_as_one_process_does(dist_runs, parallel):
    """Two ranks (DDP with LoRA, FSDP with a full fine-tune: every rank gathers the weights, the main rank
    evaluates): step 0 scores the same model as one process, so the same numbers. The runs (eval-ddp,
    eval-fsdp: --steps 2 --eval-every 2 --eval-prompts 3 --eval-samples 2) come from tests/dist_runs.py."""
    from dist_runs import ok

    ok(dist_runs, "one", f"eval-{parallel}")
    stdout = ok(dist_runs, "two", f"eval-{parallel}")
    assert ("FSDP2" in stdout) == (parallel == "fsdp")
    one, two = (evals(dist_runs / mode / f"eval-{parallel}") for mode in ("one", "two"))
    assert sorted(two) == [0, 2] and two[0] == one[0]
    assert stdout.count("eval step 0 |") == 1  # one rank prints
