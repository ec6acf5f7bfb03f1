"""The network: one decoder-only Transformer, its caches, LoRA, the sampler and the log-prob forward."""
