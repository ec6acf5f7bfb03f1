"""The grader registry and the composite reward.

`@register("name")` on a factory `f(cfg: RewardConfig) -> Grader` makes a grader available to
`--reward.spec`; `build_reward(cfg)` turns the spec ('judge:0.6,concepts:0.3,consistency:0.1', read by
rewards/spec.py) into a `RewardFunction`.

The composite reward is the weighted sum of the components that apply to a row. A component that is
None for a row (the grader does not apply) drops out and the remaining weights are scaled up so they
keep their total: with weights that sum to 1 the reward stays a weighted mean in [0, 1], and Shaping Explanations'
unweighted sum 'a:1,b:1' stays a sum in [0, 2]. A weight of 0 computes and logs a grader without
letting it into the reward. All components None -> the reward is None (the trainer skips the row).
`mix(...)` builds a named composite grader (e.g. 'judge+numbers') with the same rule, as a weighted mean.

Two options change what goes into that sum (rewards/blend.py, docs/STABILITY.md). `--reward.gate 'rouge_l<format'` scores
rouge_l 0 on the rows where format is below its threshold (a gate). `--reward.aggregate
normalize-then-sum` z-scores each grader's scores within their group before the sum (GDPO, Liu et al.
2026), which then goes through the trainer's usual group advantage where GDPO normalises the summed
advantages over the batch. Both leave the components returned for logging raw.

Mixed tasks (rewards/tasks.py): with `--reward.tasks 'math=exact:1;open=rouge_l:1'` a row's `task` picks
its mix, and a row's own `reward` spec wins over that; rows without either use --reward.spec. Each row is
validated against, and scored by, its own mix only, with the rules above (gates and normalize-then-sum
apply within each mix). The components cover every mix's graders (None on the rows of other mixes), plus
'task/<name>': the reward of that task's rows, None elsewhere, which the trainer logs as reward/task/<name>.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rewards.base import Grader, Sample, combine
from rewards.blend import AGGREGATES, Gate, apply_gates, normalize_in_groups, parse_gates
from rewards.options import RewardConfig
from rewards.spec import parse_spec, spec_entries
from rewards.tasks import parse_tasks, route, task_flag
from rewards.user import make_user_grader, split_ref

Factory = Callable[[RewardConfig], Grader]
_REGISTRY: dict[str, Factory] = {}


def register(name: str) -> Callable[[Factory], Factory]:
    """Decorator: `@register("rouge_l")` on `def make(cfg: RewardConfig) -> Grader`."""
    assert name and "," not in name and ":" not in name, f"grader name {name!r} may not contain ',' or ':'"

    def deco(factory: Factory) -> Factory:
        old = _REGISTRY.get(name)
        assert old is None or old.__qualname__ == factory.__qualname__, f"grader '{name}' registered twice"
        _REGISTRY[name] = factory
        return factory

    return deco


def known() -> list[str]:
    """Names of every registered grader, sorted."""
    return sorted(_REGISTRY)


def make(name: str, cfg: RewardConfig, flag: str = "--reward.spec") -> Grader:
    """Build one grader by name, or a user grader from its 'file.py:function' (rewards/user.py, behind
    --reward.allow-user-code); unknown names get a ValueError listing the known ones (`flag`: where
    the name was written)."""
    ref = split_ref(name)
    if ref is not None:
        if ref[1] in _REGISTRY:
            raise ValueError(
                f"{flag} '{name}': function '{ref[1]}' has the name of a built-in grader (the name is logged "
                "as reward/<name>); rename the function"
            )
        return make_user_grader(name, cfg, flag)
    if name not in _REGISTRY:
        raise ValueError(f"unknown grader '{name}' in {flag}; {_known_hint()}")
    grader = _REGISTRY[name](cfg)
    grader.name = grader.name or name
    return grader


def _known_hint() -> str:
    return f"known graders: {', '.join(known())}; or your own function, 'file.py:function:weight'"


def _line(row: Any, i: int) -> Any:
    """Row i's line in its file: the loader's `_line`, else its position + 1."""
    return row.get("_line", i + 1) if isinstance(row, dict) else i + 1


def _row_errors(rows: Sequence[dict], path: str, mixes: Sequence[tuple[Mapping[str, Grader], str]]) -> None:
    """Refuse the first row a grader of its own mix cannot read: a ValueError naming file, line, field and
    grader. mixes[i]: row i's graders, and the flag (or field) that chose them, for the fix."""
    for i, (row, (graders, chosen_by)) in enumerate(zip(rows, mixes)):
        for name, g in graders.items():
            bad = g.check_row(row)
            if bad is not None:
                field, problem = bad
                raise ValueError(
                    f"{path}:{_line(row, i)}: field '{field}' {problem}, and grader '{name}' needs it; "
                    f"fix the data or choose another grader with {chosen_by} (known: {', '.join(known())})"
                )


def _chosen_by(row: dict, task: str | None) -> str:
    """What chose a row's mix, as the error messages name it."""
    if row.get("reward") is not None:
        return "the row's 'reward' spec"
    return task_flag(task) if task is not None else "--reward.spec"


TASK_PREFIX = "task/"  # the components holding each task's reward: 'task/math'


class NoRewardError(ValueError):
    """Steps in a row without one valid reward (EmptySteps). A ValueError: train.py prints it as one
    line and exits 2, as for bad flags."""


class EmptySteps:
    """Stops a run whose graders have stopped scoring: `limit` steps in a row in which every reward is
    None (a judge server gone mid-run gives None, never a made-up 0; every episode of a step failed by its
    environment) raise NoRewardError; limit 0 never does. Under torchrun, give `update` the count summed over
    ranks, so every rank stops at the same step."""

    def __init__(self, limit: int):
        if limit < 0:
            raise ValueError(f"--reward.max-empty-steps must be >= 0 (0 = never stop), got {limit}")
        self.limit, self.empty = limit, 0
        self.causes: Counter[str] = Counter()  # over the empty steps in a row: why completions had no reward

    def update(self, n_valid: float, causes: dict[str, int] | None = None) -> None:
        """Count one step that had `n_valid` valid (not None) rewards; `causes`: why its completions had none
        (each cause a line that says its fix, with its count), named when the run stops."""
        self.empty = 0 if n_valid > 0 else self.empty + 1
        self.causes = Counter() if n_valid > 0 else self.causes + Counter(causes or {})
        if not (self.limit and self.empty >= self.limit):
            return
        if self.causes:
            (cause, k), total = self.causes.most_common(1)[0], sum(self.causes.values())
            raise NoRewardError(
                f"no valid reward in {self.empty} steps in a row: the environment failed every episode, most "
                f"often {cause} ({k} of {total}); fix it and rerun with --resume, or pass "
                "--reward.max-empty-steps 0 to go on regardless"
            )
        raise NoRewardError(
            f"no valid reward in {self.empty} steps in a row: the graders scored no completion (a judge "
            "server that stopped answering? see the warnings above and judge/failed in metrics.jsonl); "
            "fix it and rerun with --resume, or pass --reward.max-empty-steps 0 to go on regardless"
        )


def mean_metrics(summed: dict[str, float]) -> dict[str, float | None]:
    """Graders' metrics after the sum over ranks, each 'x_sum' + 'x_n' pair turned into the mean 'x'
    (None when n is 0: no mean, rather than a made-up 0). Other keys pass through."""
    out: dict[str, float | None] = {}
    for k, v in summed.items():
        if k.endswith("_sum") and (n := k[: -len("_sum")] + "_n") in summed:
            out[k[: -len("_sum")]] = v / summed[n] if summed[n] else None
        elif not (k.endswith("_n") and k[: -len("_n")] + "_sum" in summed):
            out[k] = v
    return out


def own_mix(row: dict) -> bool:
    """Whether a row names its own task or reward spec (rewards.tasks.route reads them)."""
    return row.get("task") is not None or row.get("reward") is not None


class RewardFunction:
    """The reward of a training run: several graders, weighted (see the module docstring).

    With --reward.tasks, or rows that carry their own 'reward' spec, each row is weighted by its own mix:
    `graders` then holds every mix's graders, each built once (`factory(name, flag)` builds those the
    default mix lacks), and `weights` stays the default mix's."""

    def __init__(
        self,
        graders: dict[str, Grader],
        weights: dict[str, float],
        max_empty_steps: int = 0,
        aggregate: str = "sum",
        gates: Sequence[Gate] = (),
        tasks: Mapping[str, str] | None = None,
        factory: Callable[[str, str], Grader] | None = None,
        sources: Mapping[str, str] | None = None,
    ):
        assert graders.keys() == weights.keys(), "one weight per grader"
        assert aggregate in AGGREGATES, f"aggregate must be one of {AGGREGATES}, got {aggregate!r}"
        self.graders = dict(graders)
        self.weights = weights
        self.aggregate, self.gates = aggregate, list(gates)
        self._gate_counts = [(0, 0)] * len(self.gates)  # the last call's (closed, scored) per gate
        self.empty_steps = EmptySteps(max_empty_steps)
        """The trainer calls `empty_steps.update(n_valid)` once a step (--reward.max-empty-steps)."""
        self._last_n = -1
        self._last_idx: dict[str, list[int]] = {}  # the samples each grader scored in the last call
        self.tasks = dict(tasks or {})
        """Each task's spec as written in --reward.tasks; a row names its task in 'task'."""
        self._factory = factory
        self._sources: dict[str, str] = dict(sources or {})
        """What built each grader where it is not its name: a user grader's 'file.py:function'."""
        self._mixes: dict[str | None, dict[str, float]] = {None: dict(weights)}
        """Each mix's weights, keyed by its spec as written; None is the default mix."""
        for task, spec in self.tasks.items():
            self._mix(spec, task_flag(task))

    def _mix(self, spec: str | None, flag: str) -> dict[str, float]:
        """The weights of the mix `spec` (None: the default), parsed and its missing graders built the
        first time it is seen. A gate's grader B joins, with weight 0, each mix that holds its A."""
        if spec in self._mixes:
            return self._mixes[spec]
        entries = spec_entries(spec, flag)
        weights = {name: w for name, _, w in entries}
        sources = {name: source for name, source, _ in entries}
        targets = set(weights)
        for g in self.gates:
            if g.target in targets:
                weights.setdefault(g.gate, 0.0)
        for name in weights:
            source = sources.get(name, name)
            known_as = self._sources.get(name, name)
            if name in self.graders and source != name and known_as != source:
                raise ValueError(
                    f"{flag}: '{source}' is named '{name}', as '{known_as}' is in another mix; rename one"
                )
            if name in self.graders:
                continue  # a grader several mixes use is built once
            if self._factory is None:
                raise ValueError(
                    f"{flag}: grader '{name}' is not one of this reward's ({', '.join(self.graders)}); "
                    "build the reward with build_reward to use any registered grader"
                )
            self.graders[name] = self._factory(source, flag)
            self._sources[name] = source
        self._mixes[spec] = weights
        return weights

    def _route(self, row: dict) -> tuple[str | None, str | None]:
        """(the row's task, the key of its mix), the mix built if it is new (a row's own 'reward' spec)."""
        task, spec = route(row, self.tasks)
        self._mix(spec, "field 'reward'")
        return task, spec

    @property
    def requires(self) -> tuple[str, ...]:
        """Row fields some grader needs."""
        return tuple(sorted({f for g in self.graders.values() for f in g.requires}))

    def validate(self, rows: Sequence[dict[str, Any]], path: str = "data") -> None:
        """Refuse data a grader cannot read, each row against the graders of its own mix (ValueError naming
        file, line, field and grader; a task not in --reward.tasks, or a row's 'reward' spec that does not
        parse, is refused with file and line too), check the services the graders call (`check`), then let
        each grader see once the rows it will grade (`Grader.prepare`). A row's line is its `_line` key,
        else its position + 1. Every mix the rows use is built here, so the components' names are fixed
        from now on (the same on every rank)."""
        routes = []
        for i, row in enumerate(rows):
            try:
                routes.append(self._route(row))
            except ValueError as e:
                raise ValueError(f"{path}:{_line(row, i)}: {e}") from None
        graders = {key: {n: self.graders[n] for n in w} for key, w in self._mixes.items()}
        _row_errors(
            rows, path, [(graders[key], _chosen_by(row, task)) for row, (task, key) in zip(rows, routes)]
        )
        self.check()
        for name, g in self.graders.items():
            g.prepare([row for row, (_, key) in zip(rows, routes) if name in self._mixes[key]])

    def check(self) -> None:
        """ValueError with the fix when a grader's service does not answer: one cheap request to each
        judge server, at start-up, before any model loads (rewards.llm_client.check_endpoint)."""
        for g in self.graders.values():
            g.check()

    def __call__(self, batch: list[Sample]) -> tuple[list[float | None], dict[str, list[float | None]]]:
        """(each sample's reward, or None where no grader scored it; each grader's scores, the components)."""
        self._last_n = len(batch)
        if self.tasks or self.gates or self.aggregate != "sum" or any(own_mix(s.row) for s in batch):
            return self._routed(batch)  # each sample graded by its task's or its row's mix, gates, ...
        every = list(range(len(batch)))  # one mix: the weighted sum of every grader's scores
        components = {name: self._score(name, g, batch, every) for name, g in self.graders.items()}
        w = [self.weights[n] for n in self.graders]
        return [combine([components[n][k] for n in self.graders], w) for k in every], components

    def _routed(self, batch: list[Sample]) -> tuple[list[float | None], dict[str, list[float | None]]]:
        """__call__ where samples differ in their mix (--reward.tasks, a row's 'reward'), or with gates or
        --reward.aggregate normalize-then-sum."""
        routes = [self._route(s.row) for s in batch]  # (task, mix) per sample
        by_mix: dict[str | None, list[int]] = {}
        for i, (_, key) in enumerate(routes):
            by_mix.setdefault(key, []).append(i)
        # each grader scores only the samples whose mix holds it: a group is one row, so it stays whole
        components = {}
        for name, g in self.graders.items():
            idx = [i for i, (_, key) in enumerate(routes) if name in self._mixes[key]]
            components[name] = self._score(name, g, batch, idx)
        rewards: list[float | None] = [None] * len(batch)
        self._gate_counts = [(0, 0)] * len(self.gates)
        for key, idx in by_mix.items():
            for i, r in zip(idx, self._blend(self._mixes[key], components, batch, idx)):
                rewards[i] = r
        for task in self.tasks:  # each task's reward, for the trainer's per-task means
            components[TASK_PREFIX + task] = [r if t == task else None for r, (t, _) in zip(rewards, routes)]
        return rewards, components

    def _score(self, name: str, g: Grader, batch: list[Sample], idx: list[int]) -> list[float | None]:
        """Grader g's scores of the samples idx, None on the others (g is not called when idx is empty)."""
        self._last_idx[name] = idx
        if len(idx) == len(batch):
            return g(batch)
        out: list[float | None] = [None] * len(batch)
        if idx:
            for i, s in zip(idx, g([batch[i] for i in idx])):
                out[i] = s
        return out

    def _blend(
        self, weights: dict[str, float], components: dict[str, list], batch: list[Sample], idx: list[int]
    ) -> list[float | None]:
        """The rewards of the samples idx, all of one mix: its gates, normalize-then-sum, weighted sum."""
        names = [n for n in self.graders if n in weights]  # the graders' order: the default sums as before
        comps = {n: [components[n][i] for i in idx] for n in names}
        scores = comps  # what goes into the sum; the components stay raw for logging
        gates = [(j, g) for j, g in enumerate(self.gates) if g.target in weights]
        if gates:
            scores, counts = apply_gates(comps, [g for _, g in gates])
            for (j, _), (closed, scored) in zip(gates, counts):
                c0, s0 = self._gate_counts[j]
                self._gate_counts[j] = (c0 + closed, s0 + scored)
        if self.aggregate == "normalize-then-sum":
            groups = [batch[i].group for i in idx]
            scores = {n: normalize_in_groups(v, groups) if weights[n] > 0 else v for n, v in scores.items()}
        w = [weights[n] for n in names]
        return [combine([scores[n][k] for n in names], w) for k in range(len(idx))]

    def metrics(self) -> dict[str, float]:
        """Every grader's extra numbers, keyed 'grader/metric': counts and sums, the same keys at every
        step, to sum over ranks; `mean_metrics` of the sum gives the means. Each gate adds
        'gate/A<B/closed': the fraction of A's scored rows it set to 0."""
        out = {f"{name}/{k}": v for name, g in self.graders.items() for k, v in g.metrics().items()}
        for g, (closed, scored) in zip(self.gates, self._gate_counts):
            out[f"gate/{g.key}/closed_sum"], out[f"gate/{g.key}/closed_n"] = float(closed), float(scored)
        return out

    def details(self) -> dict[str, list]:
        """Per-completion details of the last call, from graders that keep `last_details` (the judge's
        marks and reason, a rubric's verdicts): {'judge': [...], 'rubric': [...]}, one entry per sample
        (None on the samples a grader did not score: rows of another mix)."""
        out: dict[str, list] = {}
        for name, g in self.graders.items():
            d, idx = getattr(g, "last_details", None), self._last_idx.get(name)
            if isinstance(d, list) and idx and len(d) == len(idx):
                full: list = [None] * self._last_n
                for i, x in zip(idx, d):
                    full[i] = x
                out.setdefault("judge" if name.startswith("judge") else name, full)
        return out

    def __repr__(self) -> str:
        tasks = "".join(f"; {t}={spec}" for t, spec in self.tasks.items())
        return "RewardFunction(" + ", ".join(f"{n}:{w:g}" for n, w in self.weights.items()) + tasks + ")"


def build_reward(cfg: RewardConfig) -> RewardFunction:
    """The reward named by `cfg.spec`, each grader built from `cfg`, with `cfg.gate`, `cfg.aggregate` and
    `cfg.tasks`' mixes; a gate's B that is not in a mix holding its A is added to it with weight 0 (computed
    and logged, not rewarded)."""
    if not cfg.spec.strip():
        raise ValueError(
            f"--reward.spec is empty; name graders with weights, e.g. 'rouge_l:1' (known: {', '.join(known())})"
        )
    entries = spec_entries(cfg.spec)
    spec = [(n, w) for n, _, w in entries]
    sources = {n: src for n, src, _ in entries if src != n}  # user graders: name -> 'file.py:function'
    unknown = [n for n, src, _ in entries if n not in _REGISTRY and src == n]
    if unknown:
        raise ValueError(f"unknown grader '{unknown[0]}' in --reward.spec; {_known_hint()}")
    if cfg.aggregate not in AGGREGATES:
        raise ValueError(f"--reward.aggregate {cfg.aggregate!r}: use 'sum' or 'normalize-then-sum'")
    tasks = parse_tasks(cfg.tasks)
    in_tasks = {n for t, s in tasks.items() for n, _ in parse_spec(s, task_flag(t))}
    weights, gates = dict(spec), parse_gates(cfg.gate)
    for g in gates:
        if g.target not in dict(spec) and g.target not in in_tasks:
            where = f"--reward.spec {cfg.spec!r}" + (" nor in any mix of --reward.tasks" if tasks else "")
            raise ValueError(
                f"--reward.gate '{g.key}': '{g.target}' is not in {where}; add it or drop the gate"
            )
        if g.gate not in _REGISTRY and g.gate not in sources:
            raise ValueError(f"unknown grader '{g.gate}' in --reward.gate '{g.key}'; {_known_hint()}")
        if g.target in dict(spec):
            weights.setdefault(g.gate, 0.0)
    graders = {n: make(sources.get(n, n), cfg) for n in weights}
    return RewardFunction(
        graders, weights, cfg.max_empty_steps, cfg.aggregate, gates, tasks,
        lambda n, flag: make(n, cfg, flag), sources,
    )  # fmt: skip


class Mix(Grader):
    """A named composite grader: the weighted mean of its parts in [0, 1].

    on_none='renormalise' drops a part that is None for a row and rescales the others (judge+numbers
    is the judge alone where numbers does not apply); on_none='none' makes the mix None instead.
    """

    def __init__(self, name: str, parts: Sequence[tuple[Grader, float]], on_none: str = "renormalise"):
        assert on_none in ("renormalise", "none"), f"on_none must be 'renormalise' or 'none', got {on_none!r}"
        assert parts and all(w >= 0 for _, w in parts) and sum(w for _, w in parts) > 0, (
            "weights >= 0, sum > 0"
        )
        self.name, self.parts, self.on_none = name, list(parts), on_none
        self.requires = tuple(sorted({f for g, _ in parts for f in g.requires}))
        self.last_components: dict[str, list[float | None]] = {}

    def score(self, batch: list[Sample]) -> list[float | None]:
        cols = [g(batch) for g, _ in self.parts]
        self.last_components = {g.name: c for (g, _), c in zip(self.parts, cols)}
        weights = [w for _, w in self.parts]
        out: list[float | None] = []
        for i in range(len(batch)):
            row = [c[i] for c in cols]
            if self.on_none == "none" and any(s is None for s in row):
                out.append(None)
            else:
                out.append(combine(row, weights, total=1.0))
        return out

    def check_row(self, row: dict[str, Any]) -> tuple[str, str] | None:
        for g, _ in self.parts:
            bad = g.check_row(row)
            if bad is not None:
                return bad
        return None

    def prepare(self, rows: list[dict[str, Any]]) -> None:
        for g, _ in self.parts:
            g.prepare(rows)

    def check(self) -> None:
        for g, _ in self.parts:
            g.check()

    def metrics(self) -> dict[str, float]:
        return {f"{g.name}/{k}": v for g, _ in self.parts for k, v in g.metrics().items()}


def mix(
    name: str, cfg: RewardConfig, parts: Sequence[tuple[str, float]], on_none: str = "renormalise"
) -> Mix:
    """Build a named composite from registered graders: `mix('judge+numbers', cfg, [('judge', .5), ('numbers', .5)])`."""
    return Mix(name, [(make(n, cfg), w) for n, w in parts], on_none)
