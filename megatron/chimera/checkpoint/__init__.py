"""Checkpoints: megatron-core's torch_dist format (one copy of each Chimera stage), legacy reads."""
