"""Model FLOPs of one iteration, by the formula Megatron-LM's --log-throughput uses, so TFLOP/s per
device compare with a Megatron-LM run of the same model (recomputation is not counted, as there)."""
from __future__ import annotations


def iteration_flops(args, batch_size: int) -> float:
    """Forward and backward (3x forward) of ``batch_size`` sequences: per layer the QKV, attention
    scores and values, output projection and MLP matrix multiplies, plus the logits layer."""
    h, s, layers = args.hidden_size, args.seq_length, args.num_layers
    heads = args.num_attention_heads
    kv_channels = args.kv_channels or h // heads
    groups = args.num_query_groups or heads
    query_width = kv_channels * heads / h  # query projection width over the hidden size
    attention = (1 + groups / heads + s / h) * query_width
    mlp = args.ffn_hidden_size / h * (1.5 if args.swiglu else 1.0)
    logits = args.padded_vocab_size / (2 * layers * h)
    # 12 = 2 FLOPs per multiply-add x 3 (forward, and backward at twice its cost) x 2 (each term above
    # is in units of two h x h matrix multiplies per token)
    return 12 * batch_size * s * layers * h * h * (attention + mlp + logits)
