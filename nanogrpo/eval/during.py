"""Held-out evaluation during training (--eval-every K): how the model does on rows it never trains on, at
step 0 (before any update), every K steps and after the last step.

    evaluator = HeldOutEval(cfg, policy, device, held_out)  # train.py, before the loop
    evaluator.start(logger, step0)                           # step 0: its own metrics.jsonl line
    m.update(evaluator(step + 1))                            # in the loop: {} unless an evaluation is due

Each evaluation answers --eval-prompts rows of --data.eval (or the demo task's held-out split) greedily and
scores the answers with the run's own reward (evaluate.answer_and_score): `eval/<grader>` for each grader,
`eval/em`, `eval/f1`, `eval/seqm` against the references, and `eval/reward`, the weighted reward, all means
over the rows. With --eval-samples k it also samples k completions per row at --sampling.temperature:
`eval/pass@k` is the fraction of rows with a completion whose reward is >= --eval-pass-threshold, and
`eval/avg@k` the mean reward of the samples. `t_eval` is the evaluation's seconds (not part of t_step).

Why it is built so:
- Step s's scores are the model after s updates. Step 0's are the model before any: for a full fine-tune
  (--lora.r 0) the base model, which the final base-vs-trained comparison cannot reach (its base is the
  model with the LoRA adapters off). Step 0 is a line of its own, {"step": 0, "eval/...": ...}; step s's
  scores go into step s's line, so the checkpoint of step s keeps them in the line it saves, and --resume,
  which cuts the log back to the checkpoint's step, logs every evaluation exactly once.
- It never changes training: the global RNG is saved and restored around it (torch.random.fork_rng), the
  samples come from generators of their own, seeded by (seed, step, row), the model's train/eval mode is
  put back, and the reward function is one of its own (the training one counts judge calls per step).
- --reward.aggregate normalize-then-sum z-scores a reward within a prompt's completions, which says nothing
  about one answer: the evaluation's reward is the plain weighted sum of the graders.
- Under torchrun the main rank evaluates, as the final eval does; with FSDP every rank first gathers the
  full weights (Policy.gathered), then the main rank alone generates.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from nanogrpo.config import TrainConfig
from nanogrpo.eval.evaluate import answer_and_score, pass_and_mean
from nanogrpo.infra import dist


def held_out_source(cfg: TrainConfig) -> str:
    """Where the held-out rows come from: --data.eval, or the held-out split of the demo task or of a
    reasoning_gym:TASK spec ('' = none)."""
    own = cfg.data.train in ("demo", "demo-text") or cfg.data.train.startswith("reasoning_gym:")
    return cfg.data.eval or (cfg.data.train if own else "")


def check_eval_every(cfg: TrainConfig) -> None:
    """--eval-every, --eval-samples: what the evaluation during training needs, checked before any model
    loads (a run must not train for hours to find its held-out set missing)."""
    if cfg.eval_every == 0:
        if cfg.eval_samples > 0:
            raise ValueError(
                f"--eval-samples {cfg.eval_samples} samples at each evaluation of --eval-every, which is off: "
                "add --eval-every K (e.g. 10), or drop --eval-samples"
            )
        return
    if cfg.eval_prompts <= 0:
        raise ValueError(
            f"--eval-every {cfg.eval_every} evaluates --eval-prompts held-out rows, and --eval-prompts is "
            f"{cfg.eval_prompts}: add --eval-prompts N (e.g. 100), or drop --eval-every"
        )
    if not held_out_source(cfg):  # the demo task has a held-out split of its own
        raise ValueError(
            f"--eval-every {cfg.eval_every} needs held-out rows and --data.train {cfg.data.train} has no "
            "held-out split: add --data.eval FILE (rows in the training format, never trained on), or drop "
            "--eval-every"
        )
    if cfg.eval_samples > 0 and not cfg.sampling.temperature > 0:
        raise ValueError(
            f"--eval-samples {cfg.eval_samples} samples at --sampling.temperature "
            f"{cfg.sampling.temperature}, which is greedy: k identical answers; set a temperature > 0, or "
            "drop --eval-samples (the greedy scores are logged anyway)"
        )


def eval_seed(seed: int, step: int, index: int) -> int:
    """The seed of held-out row `index`'s sampling generator at `step`: a stream apart from every training
    prompt's (rollout.prompt_seed), the same on any rank and in any batch."""
    key = f"eval,{seed},{step},{index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1  # < 2**63


def means(scores: list[dict[str, float | None]]) -> dict[str, float | None]:
    """Each metric's mean over the rows that have a score for it (None: no row has one)."""
    names = list(dict.fromkeys(k for s in scores for k in s))
    out = {}
    for name in ["reward"] * ("reward" in names) + [n for n in names if n != "reward"]:
        vals = [s[name] for s in scores if s.get(name) is not None]
        out[name] = sum(vals) / len(vals) if vals else None
    return out


class HeldOutEval:
    """--eval-every: the held-out rows, the run's reward, and when to evaluate. Every rank builds one and
    calls it at the same steps (FSDP gathers on all); only the main rank keeps rows, grades and logs."""

    def __init__(
        self,
        cfg: TrainConfig,
        policy: Any,
        device: torch.device,
        held_out: tuple[list[dict], str] | None,
        env: Any = None,
    ):
        """held_out: train.py's held-out rows and their source, read and checked before the model loaded;
        env: --env's EnvSpec (the evaluation plays episodes, greedily, as training does)."""
        self.cfg, self.policy, self.device = cfg, policy, device
        self.env = env
        self.every = cfg.eval_every
        self.rows: list[dict] = []
        self.reward_fn = None
        if not self.every or not dist.is_main():
            return
        from rewards import build_reward
        from rewards.options import with_max_tokens

        assert held_out is not None, "check_eval_every refuses --eval-every without held-out rows"
        rows, source = held_out
        self.rows = rows[: cfg.eval_prompts]
        reward_cfg = replace(with_max_tokens(cfg.reward, cfg.completion_tokens), aggregate="sum")
        self.reward_fn = build_reward(reward_cfg)
        self.reward_fn.validate(self.rows, source)  # a field a grader needs: refused before any step

    def due(self, step: int) -> bool:
        """Whether the model after `step` updates is evaluated: step 0, every K-th step and the last one."""
        return self.every > 0 and (step % self.every == 0 or step == self.cfg.steps)

    def start(self, logger: Any, step0: int) -> None:
        """Step 0's evaluation, before any update, logged as a line of its own; not when the run resumes
        past step 0, nor when the log already holds that line (a run resumed before its first checkpoint)."""
        if not self.every or step0 > 0:
            return
        if self.cfg.resume:  # the main rank's log decides for all: every rank must evaluate, or none
            if dist.gather_objects(dist.is_main() and logger.metrics.has_step(0))[0]:
                return
        m = self(0)
        if m:
            logger.log({"step": 0, **m})

    def __call__(self, step: int) -> dict[str, float | None]:
        """The eval/* metrics of the model after `step` updates (and t_eval) when an evaluation is due, else
        {}; {} on the ranks other than the main one."""
        if not self.due(step):
            return {}
        t0 = time.perf_counter()
        model, out = self.policy.model, {}
        was_training = model.training
        cuda = [self.device] if self.device.type == "cuda" else []
        try:
            # the training RNG goes on where it was; FSDP: every rank gathers, the main rank evaluates
            with torch.random.fork_rng(devices=cuda), self.policy.gathered():
                if dist.is_main():
                    out = self._scores(step)
        finally:
            model.train(was_training)
        if out:
            out["t_eval"] = time.perf_counter() - t0
            tqdm.write(eval_line(step, len(self.rows), out))
        return out

    def _scores(self, step: int) -> dict[str, float | None]:
        cfg, s = self.cfg, self.cfg.sampling
        model, tok = self.policy.core, self.policy.tokenizer
        gen = dict(
            max_new_tokens=s.max_new_tokens,
            stop=s.stop,  # the texts end as in training: right after a stop string
            system_prompt=cfg.data.system_prompt,
            autocast=self.policy.autocast,  # a full fine-tune samples in its compute dtype, as in training
            progress=False,
            env=self.env,
        )
        _, greedy = answer_and_score(model, tok, self.rows, reward_fn=self.reward_fn, seed=cfg.seed, **gen)
        out = {f"eval/{k}": v for k, v in means(greedy).items()}
        if k := cfg.eval_samples:
            seeds = [eval_seed(cfg.seed, step, i) for i in range(len(self.rows))]
            _, sampled = answer_and_score(
                model, tok, self.rows, reward_fn=self.reward_fn, num_samples=k, seeds=seeds,
                temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, **gen,
            )  # fmt: skip
            per_row = [[x.get("reward") for x in sampled[i * k : (i + 1) * k]] for i in range(len(self.rows))]
            pass_avg = pass_and_mean(per_row, cfg.eval_pass_threshold)
            out[f"eval/pass@{k}"], out[f"eval/avg@{k}"] = pass_avg or (None, None)
        return out


def eval_line(step: int, n: int, m: dict[str, Any]) -> str:
    """`eval step 10 | 27 held-out, greedy: reward 0.41 (em 0.00, rouge_l 0.41) | pass@4 0.50 avg@4 0.38 | 3.1s`"""

    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    names = [k.split("/", 1)[1] for k in m if k.startswith("eval/")]
    parts = ", ".join(f"{k} {fmt(m['eval/' + k])}" for k in names if "@" not in k and k != "reward")
    line = [f"eval step {step}", f"{n} held-out, greedy: reward {fmt(m.get('eval/reward'))} ({parts})"]
    if sampled := [k for k in names if "@" in k]:
        line.append(" ".join(f"{k} {fmt(m['eval/' + k])}" for k in sampled))
    return " | ".join(line + [f"{m['t_eval']:.1f}s"])


def final_eval(
    cfg: TrainConfig, policy: Any, out: Path, held_out: tuple[list[dict], str] | None, env: Any = None
) -> dict | None:
    """Greedy answers of the base model (LoRA off: with --lora.init-from, the SFT model) and the trained
    one on held-out prompts, scored with the training graders; prints both means and the paired bootstrap
    95% CI of the difference, and how many distinct answers each gives (a gain can be one answer to every
    question that is often right)."""
    from nanogrpo.eval.evaluate import base_vs_trained, format_answers, format_paired_table, save_eval
    from rewards.spec import parse_spec

    if held_out is None or not policy.use_lora:
        print("final eval skipped: it needs --data.eval (or the demo task) and LoRA (the base is LoRA off)")
        return None
    rows = held_out[0][: cfg.eval_prompts]  # training_data's rows: the ones checked at the start
    policy.core.eval()
    res = base_vs_trained(
        policy.core,
        policy.tokenizer,
        rows,
        graders=",".join(name for name, _ in parse_spec(cfg.reward.spec)),
        reward_cfg=cfg.reward,
        seed=cfg.seed,
        max_new_tokens=cfg.sampling.max_new_tokens,
        stop=cfg.sampling.stop,  # the texts end as in training: right after a stop string
        system_prompt=cfg.data.system_prompt,
        progress=False,
        env=env,  # --env: greedy episodes, as training plays them
    )
    save_eval(out, rows, res)
    base = "the SFT model of --lora.init-from" if cfg.lora.init_from else "LoRA off"
    print(f"\nheld-out: {len(rows)} prompts, greedy, base ({base}) vs trained; * = 95% CI excludes 0")
    print(format_paired_table(res["summary"]))
    print(format_answers(res["answers"]))
    return res["summary"]
