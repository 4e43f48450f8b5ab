"""The runtime: one executor that interprets a lowered schedule on real processes, dispatching each action
to a stage object per held chunk and to the iteration's messages; the p2p transports, the split autograd
and the fault classification. It imports only the IR."""
