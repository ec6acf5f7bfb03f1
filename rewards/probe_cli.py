"""Command line of the probes: `train` and `eval`, run by `python -m rewards.probe` (model folders) and
`python -m nanogrpo.eval.probe` (also nanogrpo's model names).

rewards/ imports nothing of nanogrpo, so a model name such as 'tiny' or 'smollm2' resolves only through
the backend registered in rewards.local_client; `python -m nanogrpo.eval.probe` registers nanogrpo's and then
runs `main` below, with the same subcommands and flags. Without a backend `--model` must be a folder,
and a name is refused with that fix before anything loads.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import tyro

from nanogrpo_base.ranges import at_least, check_ranges, within
from rewards.probe import Probe, evaluate_probe, read_rows, train_probe

NAMES = "python -m nanogrpo.eval.probe takes the same flags and the model names train.py takes ('tiny', 'smollm2')"


def check_model(model: str, flag: str) -> None:
    """ValueError with the fix when `model` is neither a folder nor a name the registered backend knows."""
    from rewards.local_client import resolve_model

    try:
        resolve_model(model)
    except ValueError as e:
        raise ValueError(f"{flag} {model!r}: {e}; or run it through nanogrpo: {NAMES}") from None


def check_data(data: str, flag: str = "--data") -> None:
    """ValueError naming the flag when the labels file is not there (before any model loads)."""
    p = Path(data)
    if not data.strip() or not p.exists():
        raise ValueError(f"{flag} {data!r}: no such file; give the labels JSONL")
    if not p.is_file():
        raise ValueError(f"{flag} {data}: a folder, not a file; give the labels JSONL")


def check_device(device: str, flag: str = "--device") -> None:
    """ValueError naming the flag for a device torch does not know, or one this machine does not have (cuda
    on a CPU build of torch, a GPU index past the last), before any model loads."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"{flag} {device!r}: not a device; give cpu, cuda or cuda:N") from None
    if dev.type == "cpu":
        return
    if dev.type == "mps":
        ok = torch.backends.mps.is_available()
    else:
        ok = bool(getattr(getattr(torch, dev.type, None), "is_available", lambda: False)())
    if not ok:
        build = " (this torch is a CPU build)" if dev.type == "cuda" and torch.version.cuda is None else ""
        raise ValueError(f"{flag} {device}: no {dev.type} device here{build}; use --device cpu")
    count = getattr(getattr(torch, dev.type, None), "device_count", None)
    if dev.index is not None and callable(count) and dev.index >= count():
        raise ValueError(
            f"{flag} {device}: this machine has {count()} {dev.type} device(s), 0 to {count() - 1}"
        )


def check_out(out: str, overwrite: bool) -> None:
    """ValueError naming --out for '' (it would write here), a file, or a folder with a probe already in it
    (unless --overwrite), before any model loads."""
    if not out.strip():
        raise ValueError("--out '': name the probe's folder (e.g. --out probes/mytask)")
    p = Path(out)
    if p.exists() and not p.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder: name a folder for probe.json and its weights")
    if (p / "probe.json").exists() and not overwrite:
        raise ValueError(
            f"--out {out} holds a probe already: pass --overwrite to replace it, or another --out"
        )


PROBE_TRAIN = {  # train's arguments (and nanogrpo.eval.probe's): a function has no fields to carry its ranges
    "dev_frac": within(0, 1, "the share of questions held out", lo_open=True, hi_open=True),
    "seed": at_least(0),
    "l2": at_least(0, "0 = no penalty"),
    "batch_size": at_least(1),
    "max_len": at_least(1),
}
PROBE_EVAL = {"batch_size": at_least(1)}


def train(
    data: str, model: str, out: str = "probe", dev_frac: float = 0.2, seed: int = 0, l2: float = 1e-3,
    batch_size: int = 8, device: str = "cpu", max_len: int = 2048, overwrite: bool = False,
) -> None:  # fmt: skip
    """Train a linear probe on a frozen LM's last-token hidden state; save it (safetensors + JSON).

    Args:
        data: labels.jsonl: {"prompt", "response", "criterion", "label"} (or {"text", "label"}) per line.
        model: HF model folder of the frozen LM; through `python -m nanogrpo.eval.probe` also 'tiny' or 'smollm2'.
        out: Folder to write probe.safetensors and probe.json into.
        dev_frac: Share of the questions held out to choose the layer and the threshold (rows without 'split').
        seed: Seed of the train/dev split.
        l2: L2 penalty on the probe's weights.
        batch_size: Texts per forward pass.
        device: 'cpu' or 'cuda'.
        max_len: Longest input in tokens (longer ones keep their end).
        overwrite: Replace the probe already in --out.
    """
    check_ranges(locals(), PROBE_TRAIN)  # the flags' numbers, first (nanogrpo_base/ranges.py)
    check_data(data)
    check_out(out, overwrite)
    check_device(device)
    rows = read_rows(data)
    check_model(model, "--model")  # before the model loads
    probe = train_probe(rows, model, dev_frac=dev_frac, seed=seed, l2=l2, batch_size=batch_size,
                        device=device, max_len=max_len)  # fmt: skip
    probe.save(out)
    m = probe.meta
    print(json.dumps({"out": out, "layer": m["layer"], "threshold": m["threshold"], "dev": m["dev"]}))


def eval(data: str, probe: str, batch_size: int = 8, device: str = "cpu") -> None:  # noqa: A001
    """Report a probe's accuracy, macro-F1 and pairwise accuracy on labelled rows (one JSON line).

    Args:
        data: labels.jsonl in the training format.
        probe: Folder written by `train` (its LM is the model it was trained on, a folder or a name).
        batch_size: Texts per forward pass.
        device: 'cpu' or 'cuda'.
    """
    check_ranges(locals(), PROBE_EVAL)
    check_data(data)
    check_device(device)
    p = Probe.load(probe)
    rows = read_rows(data)
    check_model(p.meta["model"], f"the probe {probe}'s model")
    print(json.dumps(evaluate_probe(p, rows, batch_size, device)))


def main(
    argv: Sequence[str] | None = None,
    prog: str = "python -m rewards.probe",
    extra: dict[str, Callable] | None = None,
) -> None:
    """Parse the subcommand and its flags and run it; bad data or flags exit 2 with one line. `extra`: more
    subcommands (nanogrpo adds `compare`, which needs its judge backend)."""
    try:
        tyro.extras.subcommand_cli_from_dict(
            {"train": train, "eval": eval, **(extra or {})}, prog=prog, args=argv
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
