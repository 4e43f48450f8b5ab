"""What the tests and ``scripts/gpu_check.py`` share: launchers, the equivalence harness, probes and
fault injection.

Installed with the trainer (as ``torch.testing`` is with torch) so that every test, probe and script
imports it by name: nothing edits ``sys.path``. Nothing here is imported by the training loop.
"""
