"""Linear probes on a frozen LM's last-token hidden state: small, cheap rubric judges (Small-LM Judges).

A probe reads one (question, response, criterion) triple, rendered exactly as the rubric judge's
Yes/No prompt (rewards.rubric.criterion_messages, through the LM's chat template), takes the hidden
state of the last non-padding token at one layer, and applies a logistic classifier to it:
P(criterion met) = sigmoid(w . (h - mean) / std + b). The LM stays frozen; only w and b are trained.

    python -m rewards.probe train --data labels.jsonl --model /models/lm --out probes/science
    python -m rewards.probe eval --data test.jsonl --probe probes/science
    python -m nanogrpo.eval.probe train --data labels.jsonl --model smollm2 --out probes/science   # a name

labels.jsonl rows: {"prompt", "response", "criterion", "label": 0|1} (or {"text", "label"} for any
text), optional "split" ("train" / "dev"; otherwise a seeded split by question) and "group" (rows
compared by pairwise accuracy; default: same prompt and criterion).

As in Small-LM Judges, the layer and the decision threshold are chosen on the dev split (layer: lowest dev
log-loss; threshold: highest dev macro-F1); `fit_probe` does this on hidden states already extracted.
`pool='mean'` averages the hidden states over the text instead of taking the last token (the paper's
weaker variant; `python -m nanogrpo.eval.probe compare` sets such variants side by side). Departures:
features are standardised with the training mean and std, and the fit is a full-batch L-BFGS with a
small L2 penalty (float64) rather than SGD.
Hidden states come from transformers (`output_hidden_states`) on the same model folder the local
judge loads, since a judge's model returns only the last layer. A model name ('tiny', 'smollm2') is
resolved by the backend registered in rewards.local_client: nanogrpo registers one in train.py, eval.py
and `python -m nanogrpo.eval.probe` (the same command line as `python -m rewards.probe`, rewards/probe_cli.py);
without one a model is a folder.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nanogrpo_base.files import save_tensors
from rewards import agreement
from rewards.text import well_formed

if TYPE_CHECKING:  # torch is imported where it is used: `import rewards` stays light
    import torch

TEXT_FORMAT = "rubric-criterion-v1"  # bump when criterion_messages changes: old probes then refuse to load
POOLS = ("last", "mean")


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """labels.jsonl -> rows, with ValueError naming the line and field for a bad row."""
    rows = []
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"{path}: cannot read the labels file ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{n}: a row must be a JSON object")
        if "text" not in row and not all(
            isinstance(row.get(k), str) for k in ("prompt", "response", "criterion")
        ):
            raise ValueError(f"{path}:{n}: give 'text', or 'prompt', 'response' and 'criterion' (strings)")
        if row.get("label") not in (0, 1, True, False):
            raise ValueError(
                f"{path}:{n}: field 'label' must be 0 or 1 (criterion not met / met), got {row.get('label')!r}"
            )
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def _finite(x: Any) -> Any:
    """x with every non-finite float as None: json.dumps would write NaN, which is not JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def group_key(row: dict[str, Any]) -> str:
    if "group" in row:
        return str(row["group"])
    return json.dumps([row.get("prompt", row.get("text")), row.get("criterion")])


PROGRESS_ROWS = 200
"""A pass over this many rows or more shows a progress bar (on stderr)."""


def pooled(h: torch.Tensor, mask: torch.Tensor, pool: str) -> torch.Tensor:
    """(B, T, H) hidden states, (B, T) right-padded mask -> (B, H) float32: the last real token, or the
    mean over the real tokens (padding left out)."""
    if pool == "last":
        import torch

        last = mask.sum(1) - 1  # (B,) right padding: the last real token
        return h[torch.arange(h.shape[0], device=h.device), last].float()
    m = mask[:, :, None].float()  # (B, T, 1)
    return (h.float() * m).sum(1) / m.sum(1)


class FrozenLM:
    """Hidden states of every layer at the last non-padding token (or their mean over the text), from a
    frozen HF model folder."""

    def __init__(
        self, model: str, device: str = "cpu", dtype: str = "float32", max_len: int = 2048, upto: int = 0
    ):
        """`upto` > 0: only the layers a probe of that layer reads run (the model cut after layer `upto`, its
        final norm dropped, so hidden state `upto` is the full model's, unnormed); 0: all of them."""
        import torch
        from transformers import AutoModel, AutoTokenizer

        from rewards.local_client import resolve_model

        path = resolve_model(model)  # 'tiny', 'smollm2' through the registered backend; else a folder
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.tokenizer.padding_side = "right"
        self.tokenizer.truncation_side = "left"  # the verdict position is at the end: keep it
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
        self.model = AutoModel.from_pretrained(str(path), dtype=torch_dtype).to(device).eval()
        cut = getattr(self.model, "layers", None) is not None and hasattr(self.model, "norm")
        if cut and 0 < upto < self.model.config.num_hidden_layers:  # the later layers' output is never read
            self.model.layers = self.model.layers[:upto]
            self.model.config.num_hidden_layers = upto
            self.model.norm = torch.nn.Identity()  # hidden state `upto` is a layer's output, not the last one
        self.device, self.max_len = device, max_len

    def text(self, row: dict[str, Any]) -> str:
        if "text" in row:
            return str(row["text"])
        from rewards.local_client import render_chat
        from rewards.rubric import criterion_messages

        return render_chat(
            self.tokenizer, criterion_messages(row["prompt"], row["response"], row["criterion"])
        )

    def features(
        self,
        rows: Sequence[dict[str, Any]],
        layer: int | None = None,
        batch_size: int = 8,
        pool: str = "last",
    ) -> torch.Tensor:
        """(L+1, N, H) float32: embeddings and every layer's output; (N, H) for one `layer`.

        pool 'last' takes the last non-padding token (Small-LM Judges's probe); 'mean' averages the hidden
        states over the non-padding tokens (the paper's weaker variant, kept for comparing)."""
        import torch

        if pool not in POOLS:
            raise ValueError(f"pool must be one of {', '.join(POOLS)}, got {pool!r}")
        from tqdm import tqdm

        out = []
        starts = range(0, len(rows), batch_size)
        bar = tqdm(starts, desc="hidden states", unit="batch", disable=len(rows) < PROGRESS_ROWS, leave=False)
        for i in bar:  # a bar on a long pass (training a probe); none for a step's scoring
            texts = [well_formed(self.text(r)) for r in rows[i : i + batch_size]]  # lone surrogates: U+FFFD
            enc = self.tokenizer(
                texts, return_tensors="pt", padding=True, truncation=True, max_length=self.max_len
            )
            ids, mask = enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device)  # (B, T)
            with torch.no_grad():
                hs = self.model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
            if layer is None:
                out.append(torch.stack([pooled(h, mask, pool) for h in hs]).cpu())  # (L+1, B, H)
            else:
                out.append(pooled(hs[layer], mask, pool).cpu())  # (B, H)
        return torch.cat(out, dim=-2)


def fit_logistic(
    x: torch.Tensor, y: torch.Tensor, l2: float = 1e-3, iters: int = 200
) -> tuple[torch.Tensor, float]:
    """Weights w (H,) and bias b minimising mean BCE(x @ w + b, y) + l2/2 |w|^2 (x standardised)."""
    import torch

    x, y = x.double(), y.double()  # (N, H), (N,)
    w = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros((), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], lr=1.0, max_iter=iters, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(x @ w + b, y) + 0.5 * l2 * (w @ w)
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    return w.detach(), float(b.detach())


def log_loss(p: Sequence[float], y: Sequence[int]) -> float:
    eps = 1e-12
    return -sum(t * math.log(max(q, eps)) + (1 - t) * math.log(max(1 - q, eps)) for q, t in zip(p, y)) / len(
        y
    )


def macro_f1(pred: Sequence[int], y: Sequence[int]) -> float:
    """Mean F1 of the two classes (a class absent from both labels and predictions is left out)."""
    f1s = []
    for c in (0, 1):
        tp = sum(p == c and t == c for p, t in zip(pred, y))
        fp = sum(p == c and t != c for p, t in zip(pred, y))
        fn = sum(p != c and t == c for p, t in zip(pred, y))
        if tp + fp + fn:
            f1s.append(2 * tp / (2 * tp + fp + fn))
    return sum(f1s) / len(f1s) if f1s else 0.0


def pairwise_accuracy(p: Sequence[float], y: Sequence[int], groups: Sequence[str]) -> float | None:
    """Within each group, the share of (met, not met) pairs the probe orders correctly (ties count 1/2)."""
    acc, pairs = agreement.pairwise_accuracy(p, y, groups)
    return acc if pairs else None


def best_threshold(p: Sequence[float], y: Sequence[int]) -> float:
    """The threshold with the highest macro-F1 on (p, y); ties go to the one nearest 0.5."""
    qs = sorted(set(p))
    cands = [0.5] + [(a + b) / 2 for a, b in zip(qs, qs[1:])]
    return max(cands, key=lambda t: (macro_f1([int(q >= t) for q in p], y), -abs(t - 0.5)))


def split_rows(rows: list[dict], dev_frac: float, seed: int) -> tuple[list[dict], list[dict]]:
    """Rows with a 'split' field go where it says; the others are split by question (no leakage)."""
    train, dev = [], []
    for r in rows:
        s = r.get("split")
        if s is None:
            h = hashlib.sha256(f"{seed}:{r.get('prompt', r.get('text'))}".encode()).digest()
            s = "dev" if random.Random(h).random() < dev_frac else "train"
        (dev if s == "dev" else train if s == "train" else []).append(r)
    return train, dev


class Probe:
    """A trained probe: weights, standardisation, layer, threshold and the frozen LM it reads."""

    def __init__(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]):
        self.w, self.b = tensors["weight"].double(), float(tensors["bias"])
        self.mean, self.std = tensors["mean"].double(), tensors["std"].double()
        self.meta = meta
        self.layer, self.threshold = int(meta["layer"]), float(meta["threshold"])
        self._lm: FrozenLM | None = None

    def lm(self, device: str = "cpu") -> FrozenLM:
        if self._lm is None:
            self._lm = FrozenLM(
                self.meta["model"],
                device=device,
                max_len=int(self.meta.get("max_len", 2048)),
                upto=self.layer,
            )
        return self._lm

    def proba_features(self, h: torch.Tensor) -> list[float]:
        import torch

        z = ((h.double() - self.mean) / self.std) @ self.w + self.b  # (N,)
        return torch.sigmoid(z).tolist()

    def predict_proba(
        self, rows: Sequence[dict[str, Any]], batch_size: int = 8, device: str = "cpu"
    ) -> list[float]:
        """P(criterion met) per row ({prompt, response, criterion} or {text})."""
        if not rows:
            return []
        pool = self.meta.get("pool", "last")  # probes saved before pooling was an option read the last token
        return self.proba_features(self.lm(device).features(rows, self.layer, batch_size, pool))

    def save(self, out: str | Path) -> None:
        """probe.safetensors and probe.json in `out`, each written whole (a new name, renamed), with the
        umask's mode (safetensors alone writes 0600). probe.json is strict JSON: a non-finite number in the
        metadata is written as null; non-finite weights are refused (train_probe refuses them first)."""
        import torch

        out = Path(out)
        t = {"weight": self.w, "bias": torch.tensor([self.b]), "mean": self.mean, "std": self.std}
        t = {k: v.float().contiguous() for k, v in t.items()}
        if not all(bool(torch.isfinite(v).all()) for v in t.values()):
            raise ValueError(f"the probe's weights are not finite; nothing written to {out}")
        out.mkdir(parents=True, exist_ok=True)
        weights, tmp = out / "probe.safetensors", out / f".probe.safetensors.tmp-{os.getpid()}"
        save_tensors(t, tmp)  # the umask's mode, as every weights file
        os.replace(tmp, weights)
        meta = out / f".probe.json.tmp-{os.getpid()}"
        meta.write_text(json.dumps(_finite(self.meta), indent=2, allow_nan=False) + "\n")
        os.replace(meta, out / "probe.json")  # last: a folder with probe.json holds a whole probe

    @classmethod
    def load(cls, path: str | Path) -> Probe:
        path = Path(path)
        if not (path / "probe.json").is_file():
            raise ValueError(
                f"{path} holds no probe (probe.json); train one with `python -m rewards.probe train`"
            )
        retrain = "retrain it with `python -m rewards.probe train`"
        try:
            meta = json.loads((path / "probe.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:  # a torn write, bytes that are not UTF-8
            raise ValueError(
                f"{path / 'probe.json'} is damaged ({getattr(e, 'strerror', None) or e}); {retrain}"
            ) from None
        if not isinstance(meta, dict):
            raise ValueError(
                f"{path / 'probe.json'} is damaged (a JSON {type(meta).__name__}, not an object); {retrain}"
            )
        if meta.get("text_format") != TEXT_FORMAT:
            raise ValueError(f"{path}: probe trained on text format {meta.get('text_format')!r}, this nanogrpo reads "
                             f"{TEXT_FORMAT!r}; retrain it")  # fmt: skip
        from safetensors.torch import load_file

        try:
            return cls(load_file(str(path / "probe.safetensors")), meta)
        except Exception as e:  # noqa: BLE001 a missing or torn file, a tensor or field missing: name the file
            raise ValueError(f"{path} is not a whole probe ({type(e).__name__}: {e}); {retrain}") from None


def fit_probe(
    xs_tr: torch.Tensor, y_tr: Sequence[int], xs_dev: torch.Tensor, y_dev: Sequence[int], *, l2: float = 1e-3,
    layers: Sequence[int] | None = None, tune_threshold: bool = True,
) -> tuple[Probe, list[float], list[float]]:  # fmt: skip
    """Fit one probe per layer of xs_tr (L+1, N, H) on the train rows; keep the layer with the lowest dev
    log-loss (only those in `layers`, when given) and, with `tune_threshold`, the threshold with the best
    dev macro-F1 (else 0.5). Returns the probe, the dev log-loss per layer tried, and its dev P(met)."""
    import torch

    y = torch.tensor([int(t) for t in y_tr])
    y_dev = [int(t) for t in y_dev]
    best = None
    per_layer = []
    for layer in range(xs_tr.shape[0]) if layers is None else layers:
        x = xs_tr[layer].double()  # (N, H)
        mean, std = x.mean(0), x.std(0).clamp_min(1e-6)
        w, b = fit_logistic((x - mean) / std, y, l2)
        probe = Probe(
            {"weight": w, "bias": torch.tensor(b), "mean": mean, "std": std},
            {"layer": layer, "threshold": 0.5},
        )
        p_dev = probe.proba_features(xs_dev[layer])
        per_layer.append(log_loss(p_dev, y_dev))
        if best is None or per_layer[-1] < best[0]:
            best = (per_layer[-1], probe, p_dev)
    assert best is not None, "no layer to fit"
    _, probe, p_dev = best
    if tune_threshold:
        probe.threshold = best_threshold(p_dev, y_dev)
    return probe, per_layer, p_dev


def train_probe(
    rows: list[dict], model: str, *, dev_frac: float = 0.2, seed: int = 0, l2: float = 1e-3,
    batch_size: int = 8, device: str = "cpu", max_len: int = 2048, lm: FrozenLM | None = None,
    pool: str = "last",
) -> Probe:  # fmt: skip
    """Fit one probe per layer on the train split; keep the layer and threshold best on the dev split."""
    train, dev = split_rows(rows, dev_frac, seed)
    unsplit = sum(r.get("split") is None for r in rows)
    for name, part in (("train", train), ("dev", dev)):
        if len({int(r["label"]) for r in part}) < 2:
            had = f"{len(part)} rows" + (
                f", labels {sorted({int(r['label']) for r in part})}" if part else ""
            )
            to_dev = sum(r.get("split") is None for r in dev)
            why = (f"; --dev-frac {dev_frac:g} sent {to_dev} of the {unsplit} rows without a 'split' field to dev"
                   if unsplit else "")  # fmt: skip
            raise ValueError(
                f"the {name} split needs both labels (0 and 1), and it has {had}{why}: give more rows of "
                f"each label, a 'split' field, or another --dev-frac"
            )
    lm = lm or FrozenLM(model, device=device, max_len=max_len)
    xs_tr, xs_dev = (
        lm.features(train, batch_size=batch_size, pool=pool),
        lm.features(dev, batch_size=batch_size, pool=pool),
    )  # (L+1, N, H)
    y_dev = [int(r["label"]) for r in dev]
    probe, per_layer, p_dev = fit_probe(xs_tr, [int(r["label"]) for r in train], xs_dev, y_dev, l2=l2)
    if not all(math.isfinite(float(v)) for v in (*probe.w.tolist(), probe.b, probe.threshold)):
        raise ValueError(f"the probe's fit gave non-finite weights (--l2 {l2:g}); nothing was saved")
    pred = [int(q >= probe.threshold) for q in p_dev]
    probe.meta = {
        "model": model, "layer": probe.layer, "threshold": probe.threshold, "text_format": TEXT_FORMAT,
        "max_len": max_len, "hidden_size": int(xs_tr.shape[-1]), "l2": l2, "pool": pool, "train_rows": len(train),
        "dev_rows": len(dev), "dev_log_loss_per_layer": per_layer,
        "dev": {"accuracy": sum(a == t for a, t in zip(pred, y_dev)) / len(y_dev), "macro_f1": macro_f1(pred, y_dev)},
    }  # fmt: skip
    probe._lm = lm
    return probe


def evaluate_probe(
    probe: Probe, rows: list[dict], batch_size: int = 8, device: str = "cpu"
) -> dict[str, Any]:
    """Accuracy, macro-F1 and pairwise accuracy of a probe on labelled rows."""
    p = probe.predict_proba(rows, batch_size, device)
    y = [int(r["label"]) for r in rows]
    pred = [int(q >= probe.threshold) for q in p]
    return {
        "rows": len(rows),
        "accuracy": sum(a == t for a, t in zip(pred, y)) / len(y),
        "macro_f1": macro_f1(pred, y),
        "pairwise_accuracy": pairwise_accuracy(p, y, [group_key(r) for r in rows]),
        "layer": probe.layer,
        "threshold": probe.threshold,
    }


if __name__ == "__main__":  # python -m rewards.probe train|eval ... (rewards/probe_cli.py)
    from rewards.probe_cli import main

    main()
