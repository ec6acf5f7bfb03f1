"""Grader options: the flags under `--reward.*` (tyro reads the field docstrings for --help).

Each grader family reads its own fields from one RewardConfig; judges and rubric judges keep their
options in nested dataclasses.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class JudgeConfig:
    """The group LLM judge (rewards/judge.py)."""

    backend: str = "openai"
    """Where the judge runs: 'openai' (any OpenAI-compatible chat-completions server) or 'local' (a model folder)."""
    base_url: str = "http://127.0.0.1:8000/v1"
    """Base URL of the chat-completions server (vLLM, SGLang, llama.cpp server, a hosted API)."""
    model: str = ""
    """Model name sent to the server, or the model folder for the 'local' backend."""
    api_key_env: str = "OPENAI_API_KEY"
    """Name of the environment variable holding the API key (the key itself is never logged or saved)."""


@dataclass(frozen=True)
class RubricConfig:
    """Rubric judges (rewards/rubric.py)."""

    readout: str = "generative"
    """How each criterion is judged: 'generative' (Yes/No), 'logprob' (Yes-vs-No margin) or 'probe'."""


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
