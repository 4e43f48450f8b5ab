"""Data: tokenizers and megatron-core's datasets, fed to the stages that read them."""
