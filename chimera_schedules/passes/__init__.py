"""Passes: schedule in, schedule out (gradient reductions, the split backward's W placement, and
lowering, which adds the communication). They import the IR and the analyses (lowering orders
its posts by a replay)."""
