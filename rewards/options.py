"""Grader options: the flags under `--reward.*` (tyro reads the field docstrings for --help).

Each grader family reads its own fields from one RewardConfig; judges and rubric judges keep their
options in nested dataclasses.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
    concurrency: int = 8
    """Requests in flight at once (openai backend)."""
    timeout_s: float = 120.0
    """Seconds to wait for one response before retrying it."""
    max_retries: int = 4
    """Retries of a request after a timeout, a connection error, a 429 or a 5xx."""
    backoff_s: float = 1.0
    """First retry delay; it doubles on each retry (a Retry-After header from the server wins)."""
    max_backoff_s: float = 60.0
    """Longest wait between two tries, Retry-After included."""
    temperature: float = 0.0
    """Judge sampling temperature (0 = greedy: the most repeatable marks)."""
    max_tokens: int = 1024
    """Most tokens in one judge reply (a group of G answers needs about 60 x G)."""
    json_mode: bool = True
    """Ask the server for a JSON object (response_format json_object); turn off for servers that refuse it."""
    top_logprobs: int = 20
    """Alternatives per generated token requested by judge_entropy and the logprob rubric readout."""
    max_answer_chars: int = 6000
    """Each answer (and the reference) is cut to this many characters in the judge prompt."""
    seed: int = 0
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
    batch_size: int = 8
    """Texts per forward pass of the probe's frozen LM."""


@dataclass(frozen=True)
class RewardConfig:
    """Which graders make the reward, with weights, and their options."""

    spec: str = "rouge_l:1"
    """Graders and weights, e.g. 'judge:0.6,concepts:0.3,consistency:0.1'; 'a:1,b:1' is an unweighted sum."""
    answer_tag: str = "answer"
    """Tag whose content is the extracted answer ('answer' reads <answer>...</answer>); '' uses the whole completion."""
    format_tags: tuple[str, ...] = ("think", "answer")
    """Tags the format grader expects, well formed and in this order."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """The group LLM judge."""
    rubric: RubricConfig = field(default_factory=RubricConfig)
    """Rubric judges."""
