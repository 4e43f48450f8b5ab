"""Observability: Megatron's startup lines, timers, FLOPs, housekeeping and fault injection."""
