"""The scores of a readout's verdicts against labels (macro-F1, weighted accuracy), and the paired bootstrap
over questions that compares readouts: nanogrpo/eval/readouts.py's module docstring says what each means.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from nanogrpo.eval.stats import bootstrap_means

METRICS = ("macro_f1", "weighted_accuracy")


def decision_counts(
    pred: Sequence[int], label: Sequence[int], weight: Sequence[float] | None = None
) -> np.ndarray:
    """(n, 6) per decision: [tp, fp, fn, tn, w * correct, w]; sums of these make every metric below."""
    p = np.asarray(pred, dtype=np.float64)
    y = np.asarray(label, dtype=np.float64)
    w = np.ones_like(y) if weight is None else np.abs(np.asarray(weight, dtype=np.float64))
    if p.shape != y.shape or w.shape != y.shape:
        raise ValueError(f"predictions, labels and weights differ in length: {p.shape}, {y.shape}, {w.shape}")
    correct = (p == y).astype(np.float64)
    return np.stack([p * y, p * (1 - y), (1 - p) * y, (1 - p) * (1 - y), w * correct, w], axis=1)


def metrics_from_counts(c: np.ndarray) -> dict[str, np.ndarray]:
    """Metrics from summed (or mean) counts (..., 6) of `decision_counts`; batched over leading dims.

    macro_f1: the mean over the classes present (in labels or predictions) of F1 = 2TP / (2TP + FP + FN),
    class 0's TP being the true negatives; weighted_accuracy: sum w correct / sum w; accuracy; and
    balanced_accuracy, the mean recall of the classes present in the labels.
    """
    tp, fp, fn, tn, wc, w = np.moveaxis(np.asarray(c, dtype=np.float64), -1, 0)
    with np.errstate(invalid="ignore", divide="ignore"):  # an absent class gives 0/0: left out below
        f1 = np.stack([2 * tp / (2 * tp + fp + fn), 2 * tn / (2 * tn + fn + fp)])  # (2, ...)
        recall = np.stack([tp / (tp + fn), tn / (tn + fp)])  # (2, ...)
        return {
            "macro_f1": _nanmean(f1),
            "weighted_accuracy": wc / w,
            "accuracy": (tp + tn) / (tp + fp + fn + tn),
            "balanced_accuracy": _nanmean(recall),
        }


def _nanmean(x: np.ndarray) -> np.ndarray:
    n = (~np.isnan(x)).sum(0)
    return np.where(n > 0, np.nansum(x, 0) / np.maximum(n, 1), np.nan)


def scores(
    pred: Sequence[int], label: Sequence[int], weight: Sequence[float] | None = None
) -> dict[str, float]:
    """Macro-F1, weighted accuracy, accuracy and balanced accuracy of hard verdicts against labels."""
    m = metrics_from_counts(decision_counts(pred, label, weight).sum(0))
    return {k: float(v) for k, v in m.items()}


def paired_bootstrap(
    preds: dict[str, Sequence[int]], label: Sequence[int], weight: Sequence[float] | None, cluster: Sequence[str],
    n_resamples: int = 10_000, seed: int = 0, level: float = 0.95,
) -> dict[str, Any]:  # fmt: skip
    """Percentile intervals of each readout's metrics and of every difference 'b - a' (b after a in `preds`).

    Clusters (questions) are resampled with replacement, the same ones for every readout; a resample's
    metrics are computed from its mean per-cluster counts. A readout against itself gives [0, 0].
    """
    names = list(preds)
    cols = np.concatenate([decision_counts(preds[k], label, weight) for k in names], axis=1)  # (n, 6K)
    keys = {c: i for i, c in enumerate(dict.fromkeys(cluster))}
    sums = np.zeros((len(keys), cols.shape[1]))  # (C, 6K): each question's counts
    np.add.at(sums, [keys[c] for c in cluster], cols)
    means = bootstrap_means(sums, n_resamples, seed)  # (R, 6K)
    point = {k: metrics_from_counts(sums[:, 6 * i : 6 * i + 6].sum(0)) for i, k in enumerate(names)}
    boot = {k: metrics_from_counts(means[:, 6 * i : 6 * i + 6]) for i, k in enumerate(names)}
    q = [(1 - level) / 2, (1 + level) / 2]

    def interval(x: np.ndarray) -> list[float]:
        if np.isnan(x).all():  # e.g. only zero weights: no interval
            return [math.nan, math.nan]
        return [float(v) for v in np.nanquantile(x, q)]

    out: dict[str, Any] = {"resamples": n_resamples, "level": level, "clusters": len(keys), "readouts": {}}
    for k in names:
        out["readouts"][k] = {m: {"value": float(point[k][m]), "ci": interval(boot[k][m])} for m in METRICS}
    out["differences"] = {}
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            out["differences"][f"{b} - {a}"] = {
                m: {"diff": float(point[b][m] - point[a][m]), "ci": interval(boot[b][m] - boot[a][m])}
                for m in METRICS
            }
    return out
