"""scripts/megatron_configs.py's preparation of a Megatron-LM functional-test configuration, on a made-up one
written the way Megatron-LM's ``model_config.yaml`` files are (the checkout itself is not in the suite)."""
import importlib.util
import os

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = """
MODEL_ARGS:
  --tensor-model-parallel-size: 2
  --pipeline-model-parallel-size: 4
  --num-layers-per-virtual-pipeline-stage: 1
  --expert-model-parallel-size: 4
  --num-experts: 64
  --moe-layer-freq: ([0]*1+[1]*7)
  --moe-router-topk: 8
  --num-layers: 8
  --hidden-size: 4096
  --data-path: ${DATA_PATH}/text_document
  --tokenizer-type: GPTSentencePieceTokenizer
  --transformer-impl: transformer_engine
  --fp8-format: hybrid
  --recompute-modules: "[layernorm moe_act]"
  --train-samples: 1000000
  --save: ${CHECKPOINT_SAVE_PATH}
  --log-params-norm: true
  --no-mmap-bin-files: false
"""


def _tool():
    path = os.path.join(ROOT, "scripts", "megatron_configs.py")
    spec = importlib.util.spec_from_file_location("megatron_configs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _flag(argv, flag):
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_a_configuration_is_prepared_as_a_user_moving_to_chimera_would_run_it(tmp_path):
    tool = _tool()
    argv, world = tool.prepared(yaml.safe_load(CONFIG)["MODEL_ARGS"], str(tmp_path))
    got = {flag: _flag(argv, flag) for flag in ("--pipeline-model-parallel-size", "--pipeline-schedule",
                                                "--tensor-model-parallel-size", "--transformer-impl", "--num-experts",
                                                "--moe-layer-freq", "--moe-router-topk", "--train-iters", "--save")}
    assert got == {"--pipeline-model-parallel-size": "2", "--pipeline-schedule": "chimera",
                   "--tensor-model-parallel-size": "2", "--transformer-impl": "local", "--num-experts": "8",
                   "--moe-layer-freq": "([0]*0+[1]*4)", "--moe-router-topk": "2", "--train-iters": "3",
                   "--save": os.path.join(str(tmp_path), "checkpoints")}, f"prepared flags: {got}"
    assert world == 2 * 2 * 4, f"TP 2 x PP 2 x the DP that EP 4 x expert TP 2 over TP 2 needs (4): {world}"
    dropped = {"--data-path", "--fp8-format", "--train-samples", "--num-layers-per-virtual-pipeline-stage",
               "--no-mmap-bin-files"} & set(argv)
    assert not dropped, f"data, GPU-only, sample-count, interleaving and false flags are taken out: {dropped}"
    assert argv[argv.index("--recompute-modules") + 1:][:2] == ["layernorm", "moe_act"], \
        f"a bracketed list becomes one word per value: {argv}"


def test_the_sample_covers_the_most_flags_within_the_machine():
    tool = _tool()
    results = {"a": {"passes": True, "world": 4, "argv": ["--x", "--y"]},
               "b": {"passes": True, "world": 4, "argv": ["--x", "--y", "--z"]},
               "c": {"passes": True, "world": 16, "argv": ["--w", "--v", "--u", "--t"]},
               "d": {"passes": False, "world": 2, "argv": ["--s", "--r", "--q", "--p"]},
               "e": {"passes": True, "world": 2, "argv": ["--x", "--o"]}}
    assert tool.sample(results, 2, max_world=8) == ["b", "e"], "greedy cover over passing configs that fit"
