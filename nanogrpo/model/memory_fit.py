"""The start-up memory check (--memory-check, `fit_to_memory`, called by train.py before the model loads).

The plan of the configured run (nanogrpo/model/memory.py) against the device's free memory (CUDA: torch.cuda.mem_get_info; CPU: MemAvailable from /proc/meminfo, capped by a cgroup's limit)
less the margin. 'fit' chooses --micro-batch and --model.activation-checkpointing so that the run fits and
prints one line saying so; 'refuse' raises, naming the flags that fit; 'off' skips it. GRPO, PPO and CPT
are planned; SFT and DPO are not (their targets' lengths are only known when a step tokenizes its rows).
Devices other than CUDA and the CPU give no figure: the run starts unchecked, with a note.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from nanogrpo.infra.dist import parallel_mode
from nanogrpo.model.memory import GiB, Plan, Step, model_config, needs_reference, plan_of

# What the check leaves free: 10% of the free memory for the allocator's fragmentation and the plan's
# approximations (the parts it does not count grow with the batch), and 1 GiB for what does not grow with it
# (cuBLAS / Triton / NCCL workspaces on a GPU; on the CPU, what the graders and tokenizer allocate later).
MARGIN_FRACTION = 0.10
MARGIN_BYTES = 1 * GiB


def usable(available: int) -> int:
    """What the plan may take of `available` bytes: less MARGIN_FRACTION of it and MARGIN_BYTES."""
    return int(available * (1 - MARGIN_FRACTION)) - MARGIN_BYTES


MEMINFO = "/proc/meminfo"
# (limit, usage) files of the process's memory cgroup: v2, then v1
CGROUP_FILES = (
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
)


def host_available() -> int | None:
    """Bytes the host can still give this process: MemAvailable (MEMINFO), capped by the memory cgroup's
    limit less its usage where one is set; where MEMINFO cannot be read, the free pages (sysconf, which
    leaves out the page cache the kernel would give back: lower); None when neither can be read."""
    avail = None
    try:
        for line in Path(MEMINFO).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024  # kB
                break
    except (OSError, ValueError, IndexError):
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, OSError, ValueError):
            return None
    for limit_file, usage_file in CGROUP_FILES:
        try:
            limit, used = Path(limit_file).read_text().strip(), Path(usage_file).read_text().strip()
        except OSError:
            continue
        if limit.isdigit() and used.isdigit() and int(limit) < 1 << 60:  # 'max' or a huge number: no limit
            avail = min(avail, max(0, int(limit) - int(used)))
        break
    return avail


def available_memory(device) -> tuple[int, str] | None:
    """(bytes free for this run on `device`, a sentence saying so with {} for the amount), or None when
    unknown."""
    if device.type == "cuda":
        import torch

        free, _total = torch.cuda.mem_get_info(device)
        return int(free), f"{device} has {{}} free"
    avail = host_available() if device.type == "cpu" else None  # other devices: no figure here
    return None if avail is None else (avail, "the host has {} available (MemAvailable)")


# ----------------------------------------------------------------------------------------------- fitting


def micro_batches(s: Step) -> list[int]:
    """Micro-batches worth trying, largest first: whole groups that split the batch evenly (k x G, k
    dividing P), then the divisors of G (part of one group; its prompt then runs once per micro-batch)."""
    whole = {k * s.group for k in range(1, s.prompts + 1) if s.prompts % k == 0}
    part = {d for d in range(1, s.group + 1) if s.group % d == 0}
    return sorted(whole | part, reverse=True)


def fit(c: dict, s: Step, budget: int, fsdp_ranks: int = 0, keep_micro: bool = False) -> Step | None:
    """The fastest setting of s that fits in `budget` bytes, or None: the largest whole-group micro-batch
    without activation checkpointing (unless s already has it), else the largest micro-batch with it; when
    none fits and the sampler folds LoRA into a copy of the weights, the same without that copy (sampling
    through the adapters: slower, and the last thing given up). keep_micro: s.micro_batch stays, only
    checkpointing (and the fold) may be turned off or on."""
    sizes = [s.micro_batch] if keep_micro else micro_batches(s)
    tries = [] if s.checkpointing else [(m, False) for m in sizes if keep_micro or m >= min(s.group, s.rows)]
    tries += [(m, True) for m in sizes]
    for fold in [True, False] if s.lora_fold else [False]:
        for m, ck in tries:
            t = replace(s, micro_batch=m, checkpointing=ck, lora_fold=fold)
            if plan_of(c, t, fsdp_ranks).peak <= budget:
                return t
    return None


def flags(s: Step, was: Step | None = None) -> str:
    """The flags of s's micro-batch and checkpointing, as a user types them, and --sampling.no-fold-lora
    when s gave up the fold that `was` had."""
    out = f"--micro-batch {s.micro_batch}" + (" --model.activation-checkpointing" if s.checkpointing else "")
    return out + (" --sampling.no-fold-lora" if was is not None and was.lora_fold and not s.lora_fold else "")


def _gib(x: float) -> str:
    return f"{x / GiB:.1f} GiB"


def _numbers(p: Plan) -> str:
    return f"{_gib(p.peak)} (sampling {_gib(p.sampling)}, training {_gib(p.training)})"


def run_step(
    cfg, device, dtype, prompt_len: int, new_tokens: int | None = None, world: int = 1
) -> Step | None:
    """The Step of a TrainConfig on `device` in `dtype`, with prompts of `prompt_len` tokens (CPT: the
    windows' context, and new_tokens their trained tokens); None for the stages the plan does not model
    (SFT, DPO). `world`: ranks the prompts are split over."""
    if cfg.algo not in ("grpo", "ppo", "cpt"):
        return None
    import torch

    import nanogrpo_kernels
    from nanogrpo.infra.cpu import packing_supported

    cuda = device.type == "cuda"
    backend = cfg.model.kernels if cfg.model.kernels != "auto" else nanogrpo_kernels.get_backend()
    triton = nanogrpo_kernels.HAS_TRITON and backend != "torch" and (cuda or backend == "triton")
    group = {"grpo": cfg.grpo.group_size, "ppo": cfg.ppo.samples_per_prompt, "cpt": 1}[cfg.algo]
    weights = dtype if cfg.lora.r > 0 else torch.float32
    packing = not cuda and packing_supported(torch.empty(0, dtype=weights))  # packing folds LoRA itself
    return Step(
        prompts=max(1, cfg.prompts_per_step // world),
        group=group,
        prompt_len=prompt_len,
        new_tokens=new_tokens if new_tokens is not None else cfg.completion_tokens,  # --env: its budget
        micro_batch=cfg.micro_batch,
        checkpointing=cfg.model.activation_checkpointing,
        lora_r=cfg.lora.r,
        lora_targets=tuple(cfg.lora.targets),
        reference=needs_reference(cfg),
        samples=cfg.algo != "cpt",
        dtype_bytes=dtype.itemsize,
        device=device.type,
        logprobs="triton" if triton else "torch",
        cpu_packing=packing,
        lora_fold=cfg.lora.r > 0 and cfg.sampling.fold_lora and not packing,
        turn_tokens=cfg.sampling.max_new_tokens if cfg.env.on else 0,
    )


def lengths(cfg, rows: list[dict]) -> tuple[int, int | None]:
    """(longest prompt, longest completion or None for --sampling.max-new-tokens) of the training rows."""
    if cfg.algo == "cpt":
        return max((len(r["_ctx"]) for r in rows), default=0), max((len(r["_ids"]) for r in rows), default=1)
    return max((len(r.get("_prompt_ids", ())) for r in rows), default=0), None


def fit_to_memory(cfg, device, dtype, rows: list[dict]):
    """--memory-check: cfg as it should run on `device` (the module docstring). Called once the training
    rows are tokenized (their longest prompt sizes the plan) and before the model loads and config.json is
    written, so the chosen flags are what the run folder records and a --resume finds.

    'fit': a run that does not fit gets the largest micro-batch of whole groups that fits without activation
    checkpointing, else the largest that fits with it, else the same sampling through the LoRA adapters
    instead of a folded copy (--sampling.no-fold-lora), and one printed line says so. A --micro-batch other
    than 0 (a flag, a preset or --config) is kept as given: only activation checkpointing may be turned on
    for it (it changes no number, only time); when that is not enough the run is refused, naming the flags
    that fit. 'refuse' refuses instead of choosing. A run that fits is left alone, silently. --resume changes
    nothing (that would not resume exactly): a note says when the plan exceeds the free memory. Under
    torchrun every rank plans with the smallest free memory among them, so all choose alike; CPU ranks
    share the host's memory. SFT and DPO are not planned: they pass unchecked."""
    from nanogrpo.infra import dist
    from nanogrpo.model.hf_model import model_impl
    from nanogrpo.model.zoo import resolve_model

    if cfg.memory_check == "off":
        return cfg
    random = cfg.model.path.startswith("random:")  # nanogrpo's own model, planned before it is built
    if cfg.model.impl == "transformers" or (
        not random and model_impl(resolve_model(cfg.model.path), cfg.model.impl) == "transformers"
    ):
        if dist.is_main():
            print(
                "note: --memory-check skipped: it plans nanogrpo's own model, and transformers' runs this one"
            )
        return cfg
    world = dist.world()
    prompt_len, new_tokens = lengths(cfg, rows)
    s = run_step(cfg, device, dtype, prompt_len, new_tokens, world)
    if s is None:
        return cfg
    found = budget(device, world)
    if found is None:
        if dist.is_main():
            print(f"note: --memory-check skipped: no figure of the free memory on {device}")
        return cfg
    room, have = found
    ranks = world if parallel_mode(cfg) == "fsdp" else 0
    c = model_config(cfg.model.path)
    now = plan_of(c, s, ranks)
    if now.peak <= room:
        return cfg
    given = f"--micro-batch {cfg.micro_batch}" + (" (all at once)" if cfg.micro_batch == 0 else "")
    given += " with" if s.checkpointing else " without"
    need = f"the memory plan (nanogrpo/model/memory.py) needs {_numbers(now)} at {given} activation checkpointing"
    if cfg.resume:
        if dist.is_main():
            print(
                f"note: {need}, but {have}; --resume keeps the run's settings (others would not resume "
                "exactly), so it may run out of memory: free some, or start a new run from its config"
            )
        return cfg
    explicit = cfg.micro_batch > 0
    fitted = fit(c, s, room, ranks, keep_micro=explicit) if cfg.memory_check == "fit" else None
    if fitted is None:
        raise ValueError(
            refusal(c, s, room, ranks, f"{need}, but {have}", explicit and cfg.memory_check == "fit")
        )
    gave_up_fold = s.lora_fold and not fitted.lora_fold
    if dist.is_main():
        print(
            f"memory: {need}, but {have}: running with {flags(fitted, s)} "
            f"({_gib(plan_of(c, fitted, ranks).peak)}; --memory-check off keeps the flags as given)"
        )
    return replace(
        cfg,
        micro_batch=fitted.micro_batch,
        model=replace(cfg.model, activation_checkpointing=fitted.checkpointing),
        sampling=replace(cfg.sampling, fold_lora=cfg.sampling.fold_lora and not gave_up_fold),
    )


def budget(device, world: int) -> tuple[int, str] | None:
    """(bytes this rank's plan may take, a sentence saying how much is free and after which margin), or
    None when `device` gives no figure. Under torchrun every rank takes the smallest free memory among them
    (-1: unknown somewhere), so all choose alike; CPU ranks of one host share its memory."""
    from nanogrpo.infra import dist

    found = available_memory(device)
    avail, where = found if found is not None else (-1, "")
    if world > 1:
        avail = -int(dist.max_floats({"m": -float(avail)})["m"])
    if avail < 0:
        return None
    procs = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if device.type == "cpu" else 1
    room = usable(avail) // max(1, procs)
    per = f" per rank ({procs} on this host)" if procs > 1 else ""
    return room, f"{where.format(_gib(avail))} ({_gib(room)}{per} after the 10% + 1 GiB margin)"


def refusal(c: dict, s: Step, room: int, ranks: int, why: str, kept_micro: bool) -> str:
    """The error of a run that does not fit in `room` bytes: the flags that fit, or, when none do, the
    largest parts of the smallest setting and what to lower. kept_micro: a given --micro-batch was kept."""
    best = fit(c, s, room, ranks)  # the flags that fit, whatever the given micro-batch
    if best is not None:
        kept = " --micro-batch is kept as given;" if kept_micro else ""
        return (
            f"{why}:{kept} {flags(best, s)} fits ({_gib(plan_of(c, best, ranks).peak)}); pass it, or "
            "--memory-check off to run as configured"
        )
    least = replace(s, micro_batch=min(micro_batches(s)), checkpointing=True, lora_fold=False)
    p = plan_of(c, least, ranks)
    top = sorted(((v, k) for k, v in p.parts.items() if v), reverse=True)[:3]
    lora = ", train LoRA adapters (--lora.r 16) rather than every weight" if s.lora_r == 0 else ""
    return (
        f"{why}: nothing fits, even {flags(least)} needs {_numbers(p)}, mostly "
        f"{', '.join(f'{k} {_gib(v)}' for v, k in top)}; lower --prompts-per-step or "
        f"--sampling.max-new-tokens{lora}, use a smaller model or free some memory, or pass --memory-check "
        "off to run anyway"
    )
