"""Generators: pure functions from a request to a compute schedule (1F1B, GPipe, interleaved, Chimera's
orders, DualPipe, the list scheduler and the CP-SAT search). They import the IR, the analyses and the
passes."""
