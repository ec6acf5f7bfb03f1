"""The TRL side of bench/step.py: TRL's GRPOTrainer on the same model, LoRA, prompts, lengths and loss as
nanogrpo's side, timed per step in its own process (see bench/step.py for what is compared)."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from memwatch import MemoryMonitor

from nanogrpo.model.lora import DEFAULT_TARGETS as TARGETS


def trl_install_line() -> str:
    import torch

    base = torch.__version__.split("+")[0]
    # pinning torch to the installed version keeps pip from swapping it (e.g. a CPU build for a CUDA one)
    return f"{sys.executable} -m pip install trl 'torch=={base}'"


def run_trl(a: argparse.Namespace, data: Path, out_dir: Path) -> dict:
    import torch
    import trl
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from nanogrpo.config import ModelConfig
    from nanogrpo.data import load_rows
    from nanogrpo.infra.device import resolve_device_dtype
    from nanogrpo.model.zoo import resolve_model
    from rewards import Sample, build_reward
    from rewards.options import RewardConfig

    torch.manual_seed(0)
    mem = MemoryMonitor()
    device, dtype = resolve_device_dtype(ModelConfig(path=a.model, dtype=a.dtype, device=a.device))
    model_dir = resolve_model(a.model)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    rows = load_rows(data)
    dataset = Dataset.from_list([{"prompt": r["prompt"], "reference": r["reference"]} for r in rows])
    grader = build_reward(RewardConfig(spec="rouge_l:1"))

    def rouge_l(prompts, completions, reference, **_) -> list[float | None]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        batch = [
            Sample(prompt=str(p), completion=t, group=i // a.group, row={"reference": ref})
            for i, (p, t, ref) in enumerate(zip(prompts, texts, reference))
        ]
        return grader(batch)[0]

    args = trl.GRPOConfig(
        output_dir=str(out_dir),
        max_steps=a.warmup + a.steps,
        per_device_train_batch_size=a.prompts * a.group,
        gradient_accumulation_steps=1,
        num_generations=a.group,
        max_completion_length=a.new_tokens,
        generation_kwargs={"min_new_tokens": a.new_tokens},  # no early EOS: fixed length, as in nanogrpo
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        epsilon=0.2,
        loss_type="dapo",  # token-mean over the batch: nanogrpo's default aggregation
        scale_rewards="group",
        learning_rate=1e-4,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        gradient_checkpointing=a.checkpointing,  # TRL's default is on; nanogrpo's is off
        use_vllm=False,
        use_cpu=device.type == "cpu",
        shuffle_dataset=False,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    peft_cfg = LoraConfig(
        r=a.lora_r,
        lora_alpha=2 * a.lora_r,
        lora_dropout=0.0,
        target_modules=list(TARGETS),
        task_type="CAUSAL_LM",
    )
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=rouge_l,
        args=args,
        train_dataset=dataset,
        processing_class=tok,
        peft_config=peft_cfg,
    )

    t_step: list[float] = []
    t_sample: list[float] = []
    cpu_step: list[float] = []
    cpu_sample: list[float] = []
    prompt_lens: list[float] = []
    logged: list[dict] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            mem.start()
            self.t0, self.c0 = time.perf_counter(), time.process_time()
            t_sample.append(0.0)
            cpu_sample.append(0.0)

        def on_step_end(self, args, state, control, **kw):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t_step.append(time.perf_counter() - self.t0)
            cpu_step.append(time.process_time() - self.c0)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                logged.append(dict(logs))

    gen = trainer._generate_single_turn

    def timed_generate(prompt_ids, *args, **kw):
        t0, c0 = time.perf_counter(), time.process_time()
        out = gen(prompt_ids, *args, **kw)
        t_sample[-1] += time.perf_counter() - t0
        cpu_sample[-1] += time.process_time() - c0
        prompt_lens.append(sum(map(len, prompt_ids)) / len(prompt_ids))
        return out

    trainer._generate_single_turn = timed_generate
    trainer.add_callback(Timer())
    trainer.train()
    w = a.warmup
    return {
        "version": f"TRL {trl.__version__}",
        "t_step": t_step[w:],
        "t_sample": t_sample[w:],
        "cpu_step": cpu_step[w:],
        "cpu_sample": cpu_sample[w:],
        "len_mean": statistics.mean(x["completions/mean_length"] for x in logged[w:]),
        "prompt_len": statistics.mean(prompt_lens[w:]),
        "reward": statistics.mean(x["reward"] for x in logged[w:]),
        "checkpointing": bool(trainer.args.gradient_checkpointing),
        **mem.result(),
    }


# ----------------------------------------------------------------------------------------------------------
# the driver: one subprocess per side and run, then a table
