"""The runs the torchrun tests compare (tests/test_dist.py, test_fsdp.py, test_eval_every.py, test_stage_dpo.py),
made by two launches for the whole suite: one process makes every one-process run, one torchrun launch of two
ranks (gloo, one thread each) every two-rank run, each run a `train.main` of its own in that process, in the
order of RUNS. Starting Python, torch and the process group once instead of once per run is most of what each
run cost; what a run trains is what `train.py tiny ARGS --no-plots` trains.

`launch(root)` (the session fixture `dist_runs` in conftest.py) makes them: root/one/NAME and root/two/NAME are
the run folders, `result(root, mode, NAME)` a run's console output (both ranks') and, if it raised, the
error. A run that raises ends its launch (a rank left waiting in a collective would wait for its peer), so
the runs after it have no result and their tests say so."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# the data files some runs train on, written into the launch's root
FILES = {
    "book.txt": " ".join(f"word{i % 37} of line {i}." for i in range(200)),
    "pairs.jsonl": "".join(
        json.dumps(r) + "\n"
        for r in [
            {
                "id": "a",
                "prompt": "Capital of France?",
                "options": ["Paris", "Rome", "Madrid"],
                "answer": "Paris",
            },
            {
                "id": "b",
                "prompt": "2 + 2?",
                "options": {"A": "three", "B": "four", "C": "five"},
                "answer": "B",
            },
            {
                "id": "c",
                "prompt": "Which animal says moo?",
                "options": ["dog", "cow", "cat", "owl"],
                "answer": 1,
            },
            {"id": "d", "prompt": "The opposite of hot?", "chosen": "cold", "rejected": "warm and sunny"},
        ]
    ),
}

KL = {
    "none": [],
    "loss": ["--grpo.kl-placement", "loss", "--grpo.beta", "0.1"],
    "reward": ["--grpo.kl-placement", "reward", "--grpo.beta", "0.1"],
}
AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
# full fine-tuning at a realistic lr (test_fsdp.py says why this one)
FULL = ["--lora.r", "0", "--prompts-per-step", "4", "--log-samples-every", "0", "--optim.lr", "1e-4"]
FSDP_KL = ["--grpo.kl-placement", "loss", "--grpo.beta", "0.5"]
EVAL = ["--steps", "2", "--prompts-per-step", "4", "--log-samples-every", "0", "--eval-prompts", "3"]
EVAL += ["--eval-every", "2", "--eval-samples", "2"]
BOTH, TWO = ("one", "two"), ("two",)


def _runs() -> dict[str, tuple[list[str], tuple[str, ...]]]:
    """name -> (train.py flags after `tiny`, the launches that make it: 'one', 'two' or both). {root} in a
    flag is the launch's root (where FILES are)."""
    runs: dict[str, tuple[list[str], tuple[str, ...]]] = {}
    # test_dist.py
    for kl in KL:
        for agg in AGGS:
            common = [
                "--steps",
                "3",
                "--prompts-per-step",
                "4",
                "--grpo.loss-agg",
                agg,
                "--log-samples-every",
            ]
            common += [
                "0",
                "--micro-batch",
                "2",
                "--optim.lr",
                "1e-4",
                "--grpo.scale-rewards",
                "none",
                *KL[kl],
            ]
            runs[f"equal-{agg}-{kl}"] = (common, BOTH)
    dyn = ["--steps", "3", "--prompts-per-step", "4", "--micro-batch", "2", "--optim.lr", "1e-5"]
    dyn += ["--grpo.dynamic-sampling", "--grpo.zero-spread-tol", "0.3", "--log-samples-every", "1"]
    runs["dynamic"] = (dyn, BOTH)
    runs["log-once"] = (["--steps", "2"], TWO)  # a 2-step run, as it ends
    runs["log-once-resumed"] = (["--steps", "2"], TWO)  # the same run ...
    runs["log-once-resumed+"] = (["--steps", "4", "--resume"], TWO)  # ... resumed to 4 steps
    common = ["--lora.r", "0", "--optim.lr", "1e-4", "--steps", "2", "--prompts-per-step", "4"]
    runs["full"] = (common, ("one",))
    runs["full-ddp"] = ([*common, "--model.parallel", "ddp"], TWO)
    for name, flags in (
        ("batch-std", ["--grpo.scale-rewards", "batch"]),
        ("entropy-quantile", ["--grpo.top-entropy-quantile", "0.3", "--grpo.entropy-coef", "0.01"]),
    ):
        common = [
            "--steps",
            "3",
            "--prompts-per-step",
            "4",
            "--micro-batch",
            "2",
            "--optim.lr",
            "1e-4",
            *flags,
        ]
        runs[f"stats-{name}"] = ([*common, "--log-samples-every", "0"], BOTH)
    for algo in ("cpt", "ppo"):
        common = ["--algo", algo, "--steps", "3", "--prompts-per-step", "4", "--micro-batch", "2"]
        common += ["--optim.lr", "1e-4", "--log-samples-every", "0"]
        if algo == "cpt":
            common += ["--data.train", "{root}/book.txt", "--data.seq-len", "16", "--data.overlap", "4"]
        runs[f"stage-{algo}"] = (common, BOTH)
    # test_fsdp.py: two steps (test_fsdp.py says why not three)
    for kl in ("none", "loss"):
        beta = ["--grpo.beta", "0.5"] if kl != "none" else []  # train.py refuses a beta that has no effect
        runs[f"fsdp-{kl}"] = ([*FULL, "--steps", "2", "--grpo.kl-placement", kl, *beta], BOTH)
    runs["fsdp-transformers"] = ([*FULL, *FSDP_KL, "--steps", "2", "--model.impl", "transformers"], TWO)
    runs["fsdp-straight"] = ([*FULL, *FSDP_KL, "--steps", "4"], TWO)
    runs["fsdp-two-steps"] = ([*FULL, *FSDP_KL, "--steps", "2"], TWO)  # a 2-step run, as it ends
    runs["fsdp-resumed"] = ([*FULL, *FSDP_KL, "--steps", "2"], TWO)  # the same run ...
    runs["fsdp-resumed+"] = ([*FULL, *FSDP_KL, "--steps", "4", "--resume"], TWO)  # ... resumed to 4 steps
    # test_eval_every.py
    runs["eval-ddp"] = (EVAL, BOTH)
    runs["eval-fsdp"] = ([*EVAL, "--lora.r", "0"], BOTH)
    # test_stage_dpo.py
    dpo = ["--algo", "dpo", "--data.train", "{root}/pairs.jsonl", "--prompts-per-step", "4", "--steps", "3"]
    runs["dpo"] = ([*dpo, "--micro-batch", "2", "--optim.lr", "1e-3", "--log-samples-every", "0"], BOTH)
    return runs


RUNS = _runs()


def folder(name: str) -> str:
    """A run's folder name: 'X+' (X resumed) is X's folder."""
    return name.removesuffix("+")


def result(root: Path, mode: str, name: str) -> dict:
    """{'stdout': both ranks' console output, 'error': the traceback or None} of a run; a run its launch never
    got to fails the test that reads it."""
    if name not in RUNS or mode not in RUNS[name][1]:
        raise KeyError(f"{name!r} is not a run of the {mode!r} launch: add it to RUNS in tests/dist_runs.py")
    logs = root / mode / "_logs"
    outs = sorted(logs.glob(f"{name}.rank*.out"))
    if not outs:
        launch_err = (root / mode / "_launch.err").read_text()[-4000:]
        raise AssertionError(f"the {mode} launch never ran {name!r}: an earlier run ended it\n{launch_err}")
    errors = [p.read_text() for p in sorted(logs.glob(f"{name}.rank*.err"))]
    return {"stdout": "".join(p.read_text() for p in outs), "error": "\n".join(errors) or None}


def ok(root: Path, mode: str, name: str) -> str:
    """The run's console output; it must have run without an error."""
    res = result(root, mode, name)
    assert res["error"] is None, res["error"][-4000:]
    return res["stdout"]


def launch(root: Path, timeout: float = 1800) -> Path:
    """Both launches, at the same time, into root; returns root."""
    root.mkdir(parents=True, exist_ok=True)
    for name, text in FILES.items():
        (root / name).write_text(text)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    me = [str(Path(__file__).resolve()), str(root)]
    cmds = {
        "one": [sys.executable, *me, "one"],
        "two": [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                "127.0.0.1", "--master-port", str(port), *me, "two"],
    }  # fmt: skip
    procs = {}
    for mode, cmd in cmds.items():
        (root / mode).mkdir(exist_ok=True)
        err = open(root / mode / "_launch.err", "w")  # noqa: SIM115 (closed below)
        procs[mode] = (subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err), err)
    for proc, err in procs.values():
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        err.close()
    return root


def _make(root: Path, mode: str) -> None:
    """This process's part of the `mode` launch: every run of RUNS made by it, in order."""
    from nanogrpo.infra import dist
    from train import cli, main

    # the process group outlives each run (a group torn down and made again can hang at its rendezvous): a
    # run's end meets the other rank at a barrier instead, and the group is left after the last run
    leave, dist.shutdown = dist.shutdown, _meet
    rank = int(os.environ.get("RANK", "0"))
    logs = root / mode / "_logs"
    logs.mkdir(parents=True, exist_ok=True)
    for name, (flags, modes) in RUNS.items():
        if mode not in modes:
            continue
        argv = ["tiny", *(f.replace("{root}", str(root)) for f in flags), "--no-plots"]
        out = open(logs / f"{name}.rank{rank}.out", "w")  # noqa: SIM115 (closed below)
        try:
            with contextlib.redirect_stdout(out):
                main(cli([*argv, "--out-dir", str(root / mode / folder(name))]))
        except BaseException:
            (logs / f"{name}.rank{rank}.err").write_text(traceback.format_exc())
            out.close()
            os._exit(1)  # the other rank may wait in a collective: end the launch, which ends it too
        out.close()
    leave()


def _meet() -> None:
    """The end of a run in a launch of several: the ranks meet, and the process group stays for the next."""
    import torch.distributed as td

    if td.is_initialized():
        td.barrier()


if __name__ == "__main__":  # python tests/dist_runs.py ROOT one|two (two: under torchrun)
    _make(Path(sys.argv[1]), sys.argv[2])
