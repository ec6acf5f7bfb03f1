"""Mixed tasks in one run (--reward.tasks, a row's 'task' and own 'reward' spec): the flag's parse errors,
validation per task, scoring that routes each row to its mix, gates and normalize-then-sum within a mix,
and train.py end to end on the tiny preset with math and open-ended rows."""

from __future__ import annotations

import json

import pytest
from helpers import write_rows

import train
from nanogrpo import startup
from rewards import Grader, RewardConfig, RewardFunction, Sample, build_reward
from rewards.tasks import parse_tasks

TASKS = "math=exact:0.7,contains:0.3;open=rouge_l:0.5,consistency:0.5"
MATH = {"task": "math", "answer": "4"}
OPEN = {"task": "open", "reference": "the cat sat on the mat"}
PLAIN = {"reference": "a dog ran in the park"}  # no task: the default mix


def reward(tasks: str = TASKS, spec: str = "rouge_l:1", **kw) -> RewardFunction:
    return build_reward(RewardConfig(spec=spec, tasks=tasks, consistency_n=1, **kw))


def samples(*rows_and_texts: tuple[dict, list[str]]) -> list[Sample]:
    """Groups of completions: one (row, texts) pair per group, in order."""
    return [Sample("q", text, g, row) for g, (row, texts) in enumerate(rows_and_texts) for text in texts]


MATH_TEXTS = ["<answer>4</answer>", "it is 4", "5", "four or 4?"]
OPEN_TEXTS = ["the cat sat on the mat", "a cat on a mat", "dogs bark", "the the the"]
PLAIN_TEXTS = ["a dog ran", "in the park a dog ran", "cats", ""]


# ---------------------------------------------------------------------------------------------------- the flag


def test_parse_tasks():
    assert parse_tasks("") == {}
    assert parse_tasks(" math = exact:1 ; open=keywords:0.5,style:0.5 ;") == {
        "math": "exact:1",
        "open": "keywords:0.5,style:0.5",
    }


@pytest.mark.parametrize(
    "text, needle",
    [
        ("math", "cannot read 'math'; write 'task=grader:weight,...' separated by ';'"),
        ("=exact:1", "cannot read '=exact:1'; write"),
        ("math=exact:1,open=rouge_l:1", "separate tasks with ';'"),
        ("math=exact:1;math=contains:1", "task 'math' appears twice; give each task one mix"),
        ("math=", "task 'math' names no grader; write e.g. 'math=rouge_l:1'"),
        ("my task=exact:1", "may hold only letters, digits"),
        ("a/b=exact:1", "rename the task"),
    ],
)
def test_parse_tasks_errors_say_the_fix(text, needle):
    with pytest.raises(ValueError, match="--reward.tasks") as e:
        parse_tasks(text)
    assert needle in str(e.value)


@pytest.mark.parametrize(
    "tasks, needle",
    [
        ("math=nope:1", "unknown grader 'nope' in --reward.tasks 'math'; known graders: "),
        (
            "math=exact:x",
            "--reward.tasks 'math': weight 'x' of 'exact' is not a number; write e.g. 'exact:0.5'",
        ),
        ("math=exact:0", "--reward.tasks 'math' 'exact:0': the weights sum to 0"),
        ("math=exact:1,exact:2", "grader 'exact' appears twice"),
    ],
)
def test_bad_task_mixes_are_refused_when_the_reward_is_built(tasks, needle):
    with pytest.raises(ValueError) as e:
        reward(tasks)
    assert needle in str(e.value)


def test_a_gate_must_name_a_grader_of_some_mix():
    reward("math=exact:1;open=rouge_l:1", spec="consistency:1", gate="rouge_l<format")  # in a task: fine
    with pytest.raises(ValueError, match="'exact' is not in --reward.spec 'rouge_l:1' nor in any mix"):
        reward("open=rouge_l:1", gate="exact<format")


# ---------------------------------------------------------------------------------------------- validation


def test_unknown_task_is_refused_with_file_line_and_the_fix():
    fn = reward()
    with pytest.raises(ValueError) as e:
        fn.validate([MATH, {**OPEN, "task": "geo", "_line": 7}], "train.jsonl")
    msg = str(e.value)
    assert msg.startswith("train.jsonl:7: task 'geo' is not in --reward.tasks (its tasks: math, open)")
    assert "add 'geo=grader:weight' to --reward.tasks" in msg
    with pytest.raises(
        ValueError, match="train.jsonl:1: task 'math' is not in --reward.tasks .the flag is empty"
    ):
        reward("").validate([MATH], "train.jsonl")  # a named task never falls back to --reward.spec
    with pytest.raises(ValueError, match="train.jsonl:2: field 'task' must be a task name"):
        fn.validate([MATH, {**MATH, "task": 3}], "train.jsonl")


def test_each_row_is_validated_against_its_own_mix():
    fn = reward()
    fn.validate([MATH, OPEN, PLAIN], "train.jsonl")  # open and plain rows have no answer: fine
    with pytest.raises(ValueError) as e:
        fn.validate([OPEN, {"task": "math", "_line": 12}], "train.jsonl")
    msg = str(e.value)
    assert msg.startswith("train.jsonl:12: field 'answer' is missing, and grader 'exact' needs it")
    assert "choose another grader with --reward.tasks 'math'" in msg
    with pytest.raises(ValueError, match="train.jsonl:2: field 'reference' is missing, and grader 'rouge_l'"):
        fn.validate([MATH, {"task": "open"}], "train.jsonl")
    with pytest.raises(ValueError, match="train.jsonl:1: field 'reference' .* with --reward.spec"):
        fn.validate([{"answer": "4"}], "train.jsonl")  # no task: --reward.spec's rouge_l


def test_a_rows_own_spec_is_validated_and_wins():
    fn = reward()
    own = {"task": "math", "reference": "two plus two is four", "reward": "rouge_l:1"}  # no answer: fine
    fn.validate([own, MATH], "train.jsonl")
    with pytest.raises(ValueError, match="train.jsonl:1: field 'answer' .* with the row's 'reward' spec"):
        fn.validate([{**OPEN, "reward": "exact:1"}], "train.jsonl")
    with pytest.raises(ValueError, match="train.jsonl:2: unknown grader 'nope' in field 'reward'; known"):
        fn.validate([MATH, {**MATH, "reward": "nope:1"}], "train.jsonl")
    with pytest.raises(
        ValueError, match="train.jsonl:1: field 'reward': weight 'x' of 'exact' is not a number"
    ):
        fn.validate([{**MATH, "reward": "exact:x"}], "train.jsonl")
    with pytest.raises(ValueError, match="train.jsonl:1: field 'reward' must be a spec string"):
        fn.validate([{**MATH, "reward": 1}], "train.jsonl")


# ------------------------------------------------------------------------------------------------- scoring


def alone(spec: str, batch: list[Sample], **kw) -> tuple[list, dict]:
    """`batch` scored by the single mix `spec`, its rows' task fields dropped."""
    fn = build_reward(RewardConfig(spec=spec, consistency_n=1, **kw))
    untasked = [
        Sample(s.prompt, s.completion, s.group, {k: v for k, v in s.row.items() if k != "task"})
        for s in batch
    ]
    return fn(untasked)


def test_each_row_is_scored_by_its_own_mix():
    fn = reward()
    groups = [(MATH, MATH_TEXTS), (OPEN, OPEN_TEXTS), (PLAIN, PLAIN_TEXTS)]
    batch = samples(*groups)
    fn.validate([s.row for s in batch], "train.jsonl")
    got, comps = fn(batch)
    # each group scored alone by its mix: math's, open's, and the default (--reward.spec) for the plain row
    (m_r, m_c), (o_r, o_c), (p_r, p_c) = (
        alone(spec, samples(g))
        for spec, g in zip(["exact:0.7,contains:0.3", "rouge_l:0.5,consistency:0.5", "rouge_l:1"], groups)
    )
    assert got == m_r + o_r + p_r
    assert len(set(got[:4])) > 1 and len(set(got[4:8])) > 1  # spread within the groups
    none4 = [None] * 4
    assert set(comps) == {"rouge_l", "exact", "contains", "consistency", "task/math", "task/open"}
    assert comps["exact"] == m_c["exact"] + none4 + none4
    assert comps["contains"] == m_c["contains"] + none4 + none4
    assert comps["consistency"] == none4 + o_c["consistency"] + none4
    assert comps["rouge_l"] == none4 + o_c["rouge_l"] + p_c["rouge_l"]  # two mixes, one grader
    # the per-task rewards: the total reward of that task's rows, None elsewhere (the default's rows too)
    assert comps["task/math"] == got[:4] + none4 + none4
    assert comps["task/open"] == none4 + got[4:8] + none4


def test_a_rows_own_spec_wins_over_its_task():
    fn = reward()
    own = {**MATH, "reward": "contains:1"}
    batch = samples((own, MATH_TEXTS), (MATH, MATH_TEXTS))
    got, comps = fn(batch)
    assert got[:4] == alone("contains:1", samples((own, MATH_TEXTS)))[0]
    assert got[4:] == alone("exact:0.7,contains:0.3", samples((MATH, MATH_TEXTS)))[0]
    assert comps["exact"][:4] == [None] * 4  # not in the row's own mix
    assert comps["task/math"] == got  # still a math row


def test_gates_and_normalize_then_sum_work_within_each_mix():
    kw = dict(gate="rouge_l<format", aggregate="normalize-then-sum")
    fn = reward("math=exact:1,consistency:1;open=rouge_l:1,consistency:1", spec="consistency:1", **kw)
    batch = samples((MATH, MATH_TEXTS), (OPEN, OPEN_TEXTS))
    got, comps = fn(batch)
    math_alone = alone("exact:1,consistency:1", samples((MATH, MATH_TEXTS)), aggregate="normalize-then-sum")[
        0
    ]
    open_alone = alone("rouge_l:1,consistency:1", samples((OPEN, OPEN_TEXTS)), **kw)[0]
    assert got == math_alone + open_alone
    assert comps["format"] == [None] * 4 + [0.0] * 4  # the gate's grader joins only the mix holding rouge_l
    assert (
        fn.metrics()["gate/rouge_l<format/closed_sum"] == 4.0 == fn.metrics()["gate/rouge_l<format/closed_n"]
    )


class Column(Grader):
    """A stand-in grader: the score is the row's field `key`; keeps a detail per sample."""

    def __init__(self, key: str):
        self.name, self.key = key, key

    def score(self, batch):
        self.last_details = [{"saw": s.row[self.key]} for s in batch]
        return [s.row[self.key] for s in batch]


def test_graders_are_built_once_and_details_line_up():
    built = []

    def factory(name, flag):
        built.append(name)
        return Column(name)

    fn = RewardFunction({"a": Column("a")}, {"a": 1.0}, tasks={"x": "a:1,b:1", "y": "b:1"}, factory=factory)
    assert built == ["b"]  # 'a' is the default's, 'b' is shared by both tasks
    rows = [{"task": "y", "b": 0.5}, {"a": 0.2}, {"task": "x", "a": 1.0, "b": 0.0}]
    got, comps = fn([Sample("q", "c", i, r) for i, r in enumerate(rows)])
    assert got == [0.5, 0.2, 1.0]  # x: a:1,b:1 is a sum
    assert comps == {
        "a": [None, 0.2, 1.0],
        "b": [0.5, None, 0.0],
        "task/x": [None, None, 1.0],
        "task/y": [0.5, None, None],
    }
    assert fn.details() == {"a": [None, {"saw": 0.2}, {"saw": 1.0}], "b": [{"saw": 0.5}, None, {"saw": 0.0}]}


# ------------------------------------------------------------------------------------------- train.py


MIXED = [
    {"prompt": "What is 2 + 2?", "answer": "4", "task": "math"},
    {"prompt": "Describe a cat.", "reference": "a small cat sat on the warm mat", "task": "open"},
]


def test_train_logs_each_tasks_reward(tmp_path):
    data = str(write_rows(tmp_path / "mixed.jsonl", MIXED))
    out = tmp_path / "run"
    cfg = train.cli(["tiny", "--out-dir", str(out), "--steps", "2", "--no-plots", "--data.train", data,
                     "--reward.spec", "rouge_l:1", "--reward.tasks", "math=exact:1;open=rouge_l:1"])  # fmt: skip
    train.main(cfg)
    ms = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in ms] == [1, 2]
    for m in ms:  # two prompts a step, two rows: every step holds both tasks
        assert m["reward/task/math"] is not None and m["reward/task/open"] is not None
        assert m["reward/task/math"] == pytest.approx(m["reward/exact"])  # the math mix is exact alone
        assert m["reward/task/open"] == pytest.approx(m["reward/rouge_l"])  # only open rows use rouge_l
        assert m["reward"] == pytest.approx((m["reward/task/math"] + m["reward/task/open"]) / 2)
    groups = json.loads((out / "samples.jsonl").read_text().splitlines()[0])["groups"]
    by_task = {
        tuple(sorted(k for k, v in g["completions"][0]["scores"].items() if v is not None)) for g in groups
    }
    assert by_task == {("exact", "task/math"), ("rouge_l", "task/open")}


def test_the_held_out_eval_grades_each_row_with_its_tasks_graders():
    """train.py's final eval (evaluate.grade) names the --reward.spec graders; with tasks every row is graded
    by its own mix, so a math row gets its 'exact' score and each task its total."""
    from nanogrpo.eval.evaluate import grade
    from rewards.options import RewardConfig

    rows = [dict(r, _line=i + 1) for i, r in enumerate(MIXED)]
    cfg = RewardConfig(spec="rouge_l:1", tasks="math=exact:1;open=rouge_l:1")
    scores = grade(rows, ["4", "a small cat sat"], "rouge_l", cfg)
    assert scores["exact"] == [1.0, None] and scores["task/math"] == [1.0, None]
    assert scores["rouge_l"][0] is None and scores["rouge_l"][1] == pytest.approx(scores["task/open"][1])
    assert 0 < scores["rouge_l"][1] < 1


def test_train_refuses_a_bad_row_before_the_model_loads(tmp_path, monkeypatch):
    def no_model(*a, **k):
        raise AssertionError("the model loaded before the data was checked")

    monkeypatch.setattr(startup, "load_policy", no_model)
    flags = ["--reward.spec", "rouge_l:1", "--reward.tasks", "math=exact:1;open=rouge_l:1"]
    bad = str(write_rows(tmp_path / "bad.jsonl", [MIXED[1], {"prompt": "What is 3 + 3?", "task": "math"}]))
    with pytest.raises(ValueError, match=f"{bad}:2: field 'answer' is missing, and grader 'exact' needs it"):
        train.main(train.cli(["tiny", "--out-dir", str(tmp_path / "a"), "--data.train", bad, *flags]))
    geo = str(write_rows(tmp_path / "geo.jsonl", [*MIXED, {"prompt": "Area?", "answer": "1", "task": "geo"}]))
    with pytest.raises(ValueError, match=f"{geo}:3: task 'geo' is not in --reward.tasks"):
        train.main(train.cli(["tiny", "--out-dir", str(tmp_path / "b"), "--data.train", geo, *flags]))
