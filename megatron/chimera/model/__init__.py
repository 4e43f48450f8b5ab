"""Model: megatron-core GPT chunks per stage copy, architecture flags, and the CPU compatibility layer."""
