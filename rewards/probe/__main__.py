"""Command line of the probes: `python -m rewards.probe train ...` and `python -m rewards.probe eval ...`."""

from __future__ import annotations

import json

import tyro

from rewards.probe import Probe, evaluate_probe, read_rows, train_probe


def train(
    data: str, model: str, out: str = "probe", dev_frac: float = 0.2, seed: int = 0, l2: float = 1e-3,
    batch_size: int = 8, device: str = "cpu", max_len: int = 2048,
) -> None:  # fmt: skip
    """Train a linear probe on a frozen LM's last-token hidden state; save it (safetensors + JSON).

    Args:
        data: labels.jsonl: {"prompt", "response", "criterion", "label"} (or {"text", "label"}) per line.
        model: HF model folder of the frozen LM, or 'smollm2' / 'tiny'.
        out: Folder to write probe.safetensors and probe.json into.
        dev_frac: Share of the questions held out to choose the layer and the threshold (rows without 'split').
        seed: Seed of the train/dev split.
        l2: L2 penalty on the probe's weights.
        batch_size: Texts per forward pass.
        device: 'cpu' or 'cuda'.
        max_len: Longest input in tokens (longer ones keep their end).
    """
    probe = train_probe(read_rows(data), model, dev_frac=dev_frac, seed=seed, l2=l2, batch_size=batch_size,
                        device=device, max_len=max_len)  # fmt: skip
    probe.save(out)
    m = probe.meta
    print(json.dumps({"out": out, "layer": m["layer"], "threshold": m["threshold"], "dev": m["dev"]}))


def eval(data: str, probe: str, batch_size: int = 8, device: str = "cpu") -> None:  # noqa: A001
    """Report a probe's accuracy, macro-F1 and pairwise accuracy on labelled rows (one JSON line).

    Args:
        data: labels.jsonl in the training format.
        probe: Folder written by `train`.
        batch_size: Texts per forward pass.
        device: 'cpu' or 'cuda'.
    """
    print(json.dumps(evaluate_probe(Probe.load(probe), read_rows(data), batch_size, device)))


if __name__ == "__main__":
    tyro.extras.subcommand_cli_from_dict({"train": train, "eval": eval})
