"""The training stages other than GRPO, each a step function beside train.py's grpo_step.

    m = stage.step(run, step, rows, first)   # one optimizer step on this rank's rows; returns its metrics

`run` (Run, below) is what every step works with; `rows` are this rank's share of the step's rows (prompts,
preference pairs, or CPT windows), and `first` the index of rows[0] in the step's global batch. A stage
builds its own batch and the loss of one micro-batch, which optim.update runs (passes, micro-batches,
backward, optimizer step); the model, LoRA, optimizer, logging, checkpoints, resume and torchrun are
train.py's, the same for every stage.

    sft.py  supervised fine-tuning on each row's reference (or --data.template)
    cpt.py  continued pre-training: the causal-LM loss over windows of raw text
    dpo.py  direct preference optimisation on chosen/rejected pairs
    ppo.py  PPO with a value head and GAE: the baseline GRPO's group replaces
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from nanogrpo.config import TrainConfig
from nanogrpo.data import PromptOrder
from nanogrpo.infra.metrics import Logger
from nanogrpo.policy import Policy


@dataclass
class Run:
    """What every step of a run works with."""

    cfg: TrainConfig
    policy: Policy
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    reward_fn: object | None  # rewards.RewardFunction for GRPO and PPO; None for the other stages
    logger: Logger
    device: torch.device
    order: PromptOrder  # the data order: --grpo.dynamic-sampling draws its extra rounds from it
    data: list[dict]  # the training rows
    env: object | None = None  # --env: the EnvSpec (nanogrpo/envs/spec.py); None: single completions
    held_out: tuple[list[dict], str] | None = None  # the held-out rows and their source (the evaluations')
    step0: int = 0  # the step the run starts from (--resume: its checkpoint's)
    evaluator: object | None = None  # --eval-every's held-out scores (eval/during.py HeldOutEval)
    notes: object | None = None  # what is said when a step learns nothing (summary.StepNotes)


def step_function(algo: str):
    """The step function of a stage other than GRPO (whose step is train.py's grpo_step)."""
    return importlib.import_module(f"nanogrpo.stages.{algo}").step
