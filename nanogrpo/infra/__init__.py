"""The machinery under a run: devices and the CPU, torchrun and FSDP, checkpoints, the run folder, logs, memory."""
