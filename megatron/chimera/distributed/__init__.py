"""Distributed setup: torch.distributed, megatron-core's parallel state, Chimera's replica groups."""
