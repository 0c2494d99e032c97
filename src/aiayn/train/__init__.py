"""Training (§5): the `Trainer` and its set-up, one optimizer update, validation, stopping, the
run log and run directory, checkpoints, fine-tuning and DDP."""
