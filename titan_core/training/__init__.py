"""The pretraining loop over megatron-core: DDP, optimizer, schedules, metrics."""
