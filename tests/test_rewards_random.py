"""The random-reward control: uniform, seeded, blind to the batch layout, and carrying no signal."""

import statistics

from scipy import stats

from rewards import RewardConfig, Sample, build_reward
from rewards.random_reward import random_score


def _batch(groups: list[list[str]], prompt="q", first_group=0) -> list[Sample]:
    return [Sample(f"{prompt}{g}", text, first_group + g) for g, texts in enumerate(groups) for text in texts]


def test_uniform_and_seeded():
    fn = build_reward(RewardConfig(spec="random:1"))
    scores = fn(_batch([[f"answer {i}" for i in range(8)] for _ in range(250)]))[0]  # 2000 completions
    assert all(0.0 <= s < 1.0 for s in scores)
    assert stats.kstest(scores, "uniform").pvalue > 1e-3  # indistinguishable from U(0, 1)
    batch = _batch([[f"answer {i}" for i in range(8)] for _ in range(250)])
    assert build_reward(RewardConfig(spec="random:1"))(batch)[0] == scores  # the same seed, the same scores
    other = build_reward(RewardConfig(spec="random:1", random_seed=1))(batch)[0]
    assert sum(a != b for a, b in zip(other, scores)) == len(scores)  # another seed: other scores


def test_equal_completions_of_a_group_differ_and_layout_does_not_matter():
    fn = build_reward(RewardConfig(spec="random:1"))
    same = fn(_batch([["Paris"] * 4]))[0]
    assert len(set(same)) == 4  # equal texts, different places: a group keeps its spread
    alone = fn(_batch([["a", "b"]], prompt="x"))[0]
    # the same group later in a bigger batch (another group index, another rank's batch) scores the same
    mixed = fn(_batch([["c", "d"]], prompt="y") + _batch([["a", "b"]], prompt="x", first_group=5))[0]
    assert mixed[2:] == alone


def test_no_signal_in_the_text():
    """Scores do not follow any property of the text: length, say (correlation near 0 over 4000)."""
    texts = ["w " * (i % 40) for i in range(4000)]
    scores = [random_score(0, "p", t, i // 40) for i, t in enumerate(texts)]
    r = stats.pearsonr([len(t) for t in texts], scores).statistic
    assert abs(r) < 0.06 and abs(statistics.mean(scores) - 0.5) < 0.02
