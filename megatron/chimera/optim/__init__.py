"""Optimizer and precision: main weights, loss scaling, replica gradient sums, distributed optimizer."""
