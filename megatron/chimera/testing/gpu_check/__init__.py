"""scripts/gpu_check.py's checks, by what they need: ``launching`` (training launches and their
comparison), ``observer`` (what a launched rank records), ``single_gpu`` and ``multi_gpu`` (the checks),
``layer_profile`` (the planner profile). The script itself only orders the checks and writes the verdict.
"""
