"""nanogrpo: a minimal GRPO trainer. The core is here (config, data, rollout, grpo, policy, ...); the network
is in model/, the machinery in infra/, the other stages in stages/ (docs/ARCHITECTURE.md)."""
