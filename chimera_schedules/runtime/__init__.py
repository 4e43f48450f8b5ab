"""The runtime: one executor that interprets a lowered schedule on real processes, the p2p transports
and the split autograd. It imports only the IR."""
