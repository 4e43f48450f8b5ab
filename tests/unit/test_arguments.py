"""Impossible layouts fail before any process group exists: one line naming the flag, exit code 2."""
import pytest
import torch

from chimera_schedules import Op
from chimera_schedules.ir.actions import BATCH, SEQUENCE
from megatron.chimera import job_config
from megatron.chimera.arguments import parse_args
from megatron.chimera.config.batch_ramp import step_calculator
from megatron.chimera.config.data_spec import DataSpec
from megatron.chimera.config.schedule_request import halves_note
from megatron.chimera.model import chunk, kernels
from megatron.chimera.testing.plans import plan_of

MODEL = ["--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size", "8",
         "--train-iters", "1", "--lr", "1e-3", "--mock-data", "--vocab-size", "128"]


CHIMERA2 = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "chimera"]
LAYOUT = "--pipeline-model-parallel-layout"
MTP = ["--mtp-num-layers", "1", "--position-embedding-type", "rope"]
# Megatron-LM's layout flags and MTP: each rule names its flag
LAYOUT_CASES = [
    (CHIMERA2 + [LAYOUT, "Ettt|tttL"], 2, "--pipeline-model-parallel-layout=Ettt|tttL: holds 6 transformer layers t; "
     "--num-layers is 8"),
    (CHIMERA2 + [LAYOUT, "Ett|ttt|tttL"], 2, "has 3 stages; this schedule runs 2 model stages, so the layout needs 2"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "dualpipev", LAYOUT, "Etttt|ttttL"], 2,
     "has 2 stages; this schedule runs 4 model stages"),
    (CHIMERA2 + MTP + [LAYOUT, "Ettm|ttttttL"], 2, "an MTP layer m comes before a t"),
    (CHIMERA2 + [LAYOUT, "Etttt|ttttL", "--decoder-first-pipeline-num-layers", "4"], 2,
     "cannot be combined with --decoder-first-pipeline-num-layers"),
    (["--pipeline-model-parallel-size", "4", "--pipeline-schedule", "chimera", "--decoder-first-pipeline-num-layers",
      "1"], 4, "--decoder-first-pipeline-num-layers=1: leaves 7 layers, which the 3 other stages cannot share evenly"),
    (CHIMERA2 + ["--decoder-first-pipeline-num-layers", "2", "--account-for-loss-in-pipeline-split"], 2,
     "cannot be combined with --account-for-embedding-in-pipeline-split or --account-for-loss-in-pipeline-split"),
    (CHIMERA2 + ["--account-for-loss-in-pipeline-split"], 2, "--account-for-loss-in-pipeline-split=True: "
     "--num-layers (8) plus the embedding and loss it counts (9) must divide into the 2 pipeline stages"),
    (CHIMERA2 + [LAYOUT, "Etttt|ttttmL"], 2, "the layout holds 1 MTP layers m and --mtp-num-layers is not given"),
    (["--pipeline-model-parallel-size", "4", "--pipeline-schedule", "megatron-1f1b", *MTP, LAYOUT, "Ett|ttt|tttm|L"],
     4, "puts MTP on a stage of its own, whose output (1 + --mtp-num-layers activations) megatron-core's "
        "megatron-1f1b schedule cannot send"),
    (CHIMERA2 + MTP + ["--fp16"], 2, "--fp16=True: with --mtp-num-layers is not supported yet"),
    (CHIMERA2 + ["--mtp-num-layers", "1"], 2, "Multi-Token Prediction (MTP) is not supported with learned_absolute"),
    (CHIMERA2 + ["--balance-pipeline-layout", "piz-daint-p100", LAYOUT, "Etttt|ttttL"], 2,
     "--balance-pipeline-layout=piz-daint-p100: cannot be combined with --pipeline-model-parallel-layout"),
    (CHIMERA2 + ["--balance-pipeline-layout", "no-such-machine"], 2, "--balance-pipeline-layout=no-such-machine: "
     "no such profile"),
    (CHIMERA2 + [LAYOUT, "|EttttttttL"], 2, "must start with the embedding E, once, on the first stage"),
    (CHIMERA2 + [LAYOUT, "Et*99999999|L"], 2, "a repeat count above 10000"),
    (CHIMERA2 + [LAYOUT, "Et|(tt|L"], 2, "unknown layer character '('"),
]

OVERLAP = "--overlap-moe-expert-parallel-comm"
HALVES = ["--micro-batch-size", "2"]
MOE = ["--num-experts", "4", "--disable-bias-linear", "--moe-token-dispatcher-type", "alltoall",
       "--expert-model-parallel-size", "2"]
# --overlap-moe-expert-parallel-comm: each rule names the flag, and what it needs
OVERLAP_CASES = [
    (CHIMERA2 + MOE[:-2] + [OVERLAP], 2, f"{OVERLAP}=True: hides the expert-parallel all-to-all behind another "
     "micro-batch's compute: it needs --expert-model-parallel-size > 1 (got 1)"),
    (CHIMERA2 + MOE + [OVERLAP, "--moe-token-dispatcher-type", "allgather"], 4, f"{OVERLAP}=True: splits each MoE "
     "layer at its dispatch and combine all-to-alls, which the allgather dispatcher does not have"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "megatron-1f1b", *MOE, OVERLAP], 4,
     f"{OVERLAP}=True: pairs the actions of our executor's schedules"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "gpipe", *MOE, OVERLAP], 4,
     f"{OVERLAP}=True: applies to --pipeline-schedule 1f1b or chimera or dualpipe or dualpipev or v-min or v-half or "
     "v-zb or hanayo or bitpipe only"),
    (CHIMERA2 + MOE + [OVERLAP, "--moe-layer-recompute"], 4, f"{OVERLAP}=True: runs a layer's parts one by one"),
]

MUON = ["--optimizer", "muon"]
# --optimizer muon: what megatron-core refuses, and what is not implemented here, each naming its flag
MUON_CASES = [
    (MUON + ["--fp16"], 1, "--fp16=True: cannot be combined with --optimizer muon (megatron-core's rule"),
    (MUON + ["--use-distributed-optimizer", "--overlap-param-gather"], 2, "--overlap-param-gather=True: with "
     "--optimizer muon is not implemented"),
    (MUON + ["--muon-num-ns-steps", "0"], 1, "--muon-num-ns-steps=0: must be at least 1"),
    (MUON + ["--muon-coefficient-type", "septic"], 1, "--muon-coefficient-type=septic: not one of the installed "
     "emerging-optimizers' types (simple, quintic"),
    (MUON + ["--muon-scalar-optimizer", "lion"], 1, "--muon-scalar-optimizer=lion: pretrain_gpt.py runs adam only"),
    (["--optimizer", "dist_muon"], 1, "--optimizer=dist_muon: pretrain_gpt.py runs adam, muon only"),
]


@pytest.mark.parametrize("flags,world,needle", [
    (["--pipeline-model-parallel-size", "3", "--pipeline-schedule", "chimera", "--num-layers", "6"], 3,
     "--pipeline-model-parallel-size=3: Chimera needs an even number of stages"),
    (["--pipeline-model-parallel-size", "4", "--pipeline-schedule", "chimera", "--global-batch-size", "6"], 4,
     "--global-batch-size=6: gives 6 micro-batches per pipeline replica"),
    (["--pipeline-model-parallel-size", "4", "--pipeline-schedule", "chimera", "--chimera-pipelines", "3"], 4,
     "--chimera-pipelines=3: Chimera needs an even number of pipelines"),
    (["--pipeline-model-parallel-size", "3"], 3, "--num-layers=8: must be divisible by the 3 pipeline stages"),
    (["--pipeline-model-parallel-size", "2"], 3, "--pipeline-model-parallel-size=2: TP x PP = 2 must divide"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "megatron-interleaved",
      "--num-layers-per-virtual-pipeline-stage", "2"], 2, "megatron-core's interleaved schedule needs more than 2"),
    (["--overlap-param-gather"], 1, "--overlap-param-gather=True: needs --use-distributed-optimizer"),
    (["--num-distributed-optimizer-instances", "2"], 2,
     "--num-distributed-optimizer-instances=2: needs --use-distributed-optimizer"),
    (["--num-distributed-optimizer-instances", "2", "--use-distributed-optimizer", "--num-experts", "2",
      "--expert-model-parallel-size", "2"], 2,
     "--num-distributed-optimizer-instances=2: must divide the expert data-parallel size (1)"),
    (["--use-tp-pp-dp-mapping", "--pipeline-model-parallel-size", "2", "--num-experts", "2",
      "--expert-model-parallel-size", "2"], 4,
     "--use-tp-pp-dp-mapping=True: needs --expert-tensor-parallel-size x --expert-model-parallel-size = TP x CP (1)"),
    (["--lr-warmup-iters", "1"], 1, "--lr-warmup-iters=1: must be below the decay length, 1 (--lr-decay-iters"),
    (["--seq-length", "32"], 1, "--seq-length=32: must not exceed --max-position-embeddings (16)"),
    (["--fp16", "--bf16"], 1, "--fp16=True: give one of --fp16 and --bf16"),
    (["--fp16", "--min-loss-scale", "8", "--initial-loss-scale", "4"], 1,
     "--min-loss-scale=8.0: must not exceed --initial-loss-scale (4)"),
    (["--recompute-granularity", "full"], 1, "--recompute-method=None: --recompute-granularity full needs"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "1f1b", "--chimera-concat", "halving"], 2,
     "--chimera-concat=halving: applies to --pipeline-schedule chimera only"),
    (["--chimera-pipelines", "4"], 1, "--chimera-pipelines=4: applies to --pipeline-schedule chimera only"),
    (["--pipeline-schedule", "chimera", "--chimera-order", "fastest"], 1,
     "--chimera-order=fastest: must be one of paper, best"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "chimera", "--chimera-order", "best",
      "--chimera-concat", "doubling"], 2, "--chimera-concat=doubling: --chimera-order best builds its own order"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "gpipe", "--split-backward"], 2,
     "--split-backward=True: applies to --pipeline-schedule 1f1b or chimera or hanayo or bitpipe only"),
    (["--pipeline-model-parallel-size", "4", "--pipeline-schedule", "dualpipe", "--global-batch-size", "4"], 4,
     "--global-batch-size=4: gives 4 micro-batches per pipeline replica (global batch / (micro-batch size x "
     "data-parallel size)); DualPipe needs an even number of at least 2 x --pipeline-model-parallel-size (8)"),
    (["--pipeline-model-parallel-size", "4", "--pipeline-schedule", "dualpipev", "--num-layers", "4"], 4,
     "--num-layers=4: must be divisible by the 8 pipeline stages"),
    *LAYOUT_CASES,
    *OVERLAP_CASES,
    *MUON_CASES,
])
def test_impossible_configuration(capsys, flags, world, needle):
    refused_in_one_line(capsys, MODEL + flags, world, needle)


def refused_in_one_line(capsys, argv: list[str], world: int, needle: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv, world_size=world)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and needle in err, err


def test_split_backward_and_dualpipev_build_their_schedules():
    plan = plan_of(parse_args(MODEL + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "chimera",
                                             "--split-backward"], world_size=2))
    assert plan.schedule.name == "chimera-direct-split" and plan.split_backward
    assert {a.op.value for a in plan.schedule.compute(0)} == {"F", "I", "W"}
    plan = plan_of(parse_args(MODEL + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "dualpipev"],
                                    world_size=2))
    assert (plan.model_stages, plan.schedule.placement) == (4, ((0, 1, 1, 0),))


def test_halves_run_where_the_micro_batch_splits_in_two():
    """--overlap-moe-expert-parallel-comm runs actions in halves: of the batch at an even micro-batch size,
    with seq_aux_loss or an aux_loss of coefficient 0; of each sequence at size 1. With router statistics of
    the whole micro-batch's tokens together (aux_loss, global_aux_loss, sinkhorn, a capacity factor), or at
    size 1 of the whole sequence's (seq_aux_loss), the schedule has pairs only, and at size 1 one startup
    line says why: a Megatron-LM configuration with the flag still trains, exactly."""
    overlap = MODEL + CHIMERA2 + MOE + [OVERLAP]
    size1 = ["--micro-batch-size", "1"]
    seq_aux = ["--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-2"]
    cases = {"size 1": size1, "size 2": HALVES, "size 1 seq_aux_loss": size1 + seq_aux,
             "aux_loss": [*HALVES, "--moe-aux-loss-coeff", "1e-2"],
             "global_aux_loss": [*HALVES, "--moe-router-load-balancing-type", "global_aux_loss",
                                 "--moe-aux-loss-coeff", "1e-2"],
             "capacity": [*HALVES, "--moe-expert-capacity-factor", "1.0"]}
    parsed = {name: parse_args(overlap + flags, world_size=4) for name, flags in cases.items()}
    halved = {name: any(a.op is Op.HALVED for w in plan_of(args).schedule.workers for a in w)
              for name, args in parsed.items()}
    assert halved == {"size 1": True, "size 2": True, "size 1 seq_aux_loss": False, "aux_loss": False,
                      "global_aux_loss": False, "capacity": False}, halved
    along = {name: plan_of(parsed[name]).halves for name in ("size 1", "size 2")}
    assert along == {"size 1": SEQUENCE, "size 2": BATCH}, f"where the halves cut, by case: {along}"
    notes = {name: halves_note(args) for name, args in parsed.items()}
    assert notes["size 2"] is None and "first and second half of each sequence" in notes["size 1"], notes
    assert notes["size 1 seq_aux_loss"] == ("--overlap-moe-expert-parallel-comm: no halves, pairs only "
                                            "(--moe-router-load-balancing-type seq_aux_loss: a statistic of the "
                                            "whole sequence, which neither half holds)"), notes
    args = parse_args(overlap + HALVES + seq_aux, world_size=4)
    assert args.micro_batch_size == 2 and args.moe_router_load_balancing_type == "seq_aux_loss"


def test_valid_chimera_configuration_builds_its_schedule():
    args = parse_args(MODEL + ["--pipeline-model-parallel-size", "4", "--pipeline-schedule", "chimera"], world_size=8)
    plan = plan_of(args)
    assert (args.data_parallel_size, plan.microbatches) == (2, 4)
    assert plan.schedule.name == "chimera-direct" and plan.schedule.microbatches == 4
    assert len(plan.schedule.placement) == 2 and plan.schedule.meta["order"] == "paper"  # the defaults


def test_split_backward_with_transformer_engine_layers_is_refused_on_a_gpu(monkeypatch, capsys):
    """Where the layers would be Transformer Engine's (a GPU with TE installed, Megatron-LM's default
    --transformer-impl), --split-backward is refused in one line naming --transformer-impl."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels, "transformer_engine_usable", lambda: True)
    split = MODEL + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "chimera", "--split-backward"]
    with pytest.raises(SystemExit) as exit_info:
        parse_args(split, world_size=2)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1
    assert err.startswith("pretrain_gpt.py: error: --transformer-impl=transformer_engine: Transformer Engine's fused")
    assert chunk.uses_transformer_engine(parse_args(MODEL, world_size=1).transformer_impl, "cuda")
    assert not chunk.uses_transformer_engine(
        parse_args(MODEL + ["--transformer-impl", "local"], world_size=1).transformer_impl, "cuda")


def test_layout_flags_cut_the_stages_as_megatron_lm_does():
    """Under Chimera the layout lists model stages; the schedule's placement puts stage s on workers s and
    D-1-s. First and last counts are the first and last model stages'; under the interleaved schedules a
    pipeline rank's, spread over its chunks, as in megatron-core."""
    def layout(*flags, world=4):
        return str(plan_of(parse_args(MODEL + list(flags), world_size=world)).layout)

    chimera4 = ["--pipeline-model-parallel-size", "4", "--pipeline-schedule", "chimera"]
    assert layout(*chimera4) == "Ett|tt|tt|ttL"
    assert layout(*chimera4, "--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "3") \
        == "Et|tt|tt|tttL"
    assert layout(*chimera4, "--num-layers", "6", "--account-for-embedding-in-pipeline-split",
                  "--account-for-loss-in-pipeline-split") == "Et|tt|tt|tL"
    assert layout("--pipeline-model-parallel-size", "2", "--pipeline-schedule", "interleaved",
                  "--num-layers-per-virtual-pipeline-stage", "2", "--decoder-first-pipeline-num-layers", "2",
                  world=2) == "Et|ttt|t|tttL"
    # Megatron-LM's uneven interleaving: 2 chunks per rank, the first rank's 2 layers over its 2 chunks
    assert layout("--pipeline-model-parallel-size", "4", "--num-layers", "14", "--num-virtual-stages-per-pipeline-rank",
                  "2", "--decoder-first-pipeline-num-layers", "2") == "Et|(tt|)*3t|tt|tt|ttL"
    interleaved = plan_of(parse_args(MODEL + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule",
                                                    "interleaved", LAYOUT, "Et|tt|ttt|ttL"], world_size=2))
    assert interleaved.schedule.virtual_stages == 2 and interleaved.layout.layer_counts() == (1, 2, 3, 2)
    mtp = plan_of(parse_args(MODEL + CHIMERA2 + MTP, world_size=2))
    assert str(mtp.layout) == "Etttt|ttttmL" and mtp.layout.embedding_stages(True) == (0, 1)


def test_the_balancer_option_applies_its_layout_as_megatron_lms_flag():
    """--balance-pipeline-layout stores the balancer's pick in --pipeline-model-parallel-layout, so the
    startup line, the checkpoint's arguments and a rerun all read one string."""
    args = parse_args(MODEL + ["--pipeline-model-parallel-size", "4", "--pipeline-schedule", "chimera",
                               "--balance-pipeline-layout", "h100-datasheet", "--vocab-size", "100000"], world_size=4)
    plan = plan_of(args)
    assert str(plan.layout) == args.pipeline_model_parallel_layout and plan.layout.num_layers == 8
    assert plan.layout.layer_counts() != (2, 2, 2, 2)  # a 100k vocabulary is worth moving layers for


_AT = MODEL.index("--global-batch-size")
RAMP = MODEL[:_AT] + MODEL[_AT + 2:]  # a step schedule gives the global batch
STEPS = "--step-batch-size-schedule"
# batch-size ramps: each rule names the ramp's flag, and the step that breaks it
RAMP_CASES = [
    (CHIMERA2 + [STEPS, "0:2 64:3 160:8"], 2, f"{STEPS}=0:2 64:3 160:8: the step at sample 4 (global batch size 3): "
     "--global-batch-size=3: gives 3 micro-batches"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "1f1b", STEPS, "0:2 64:3 160:8"], 4,
     "the step at sample 4 (global batch size 3): must be a multiple of micro-batch size x data-parallel size = 2"),
    (CHIMERA2 + [STEPS, "64:2 128:4"], 2, "its first threshold must be 0"),
    (CHIMERA2 + [STEPS, "0:2 10:4"], 2, "its thresholds must increase (in samples of --seq-length 16 tokens: 0, 0)"),
    (CHIMERA2 + [STEPS, "0:2 x:4"], 2, f"{STEPS}=0:2 x:4: could not convert string to float"),
    (CHIMERA2 + [STEPS, "0:8", "--global-batch-size", "8"], 2, "cannot be combined with --global-batch-size"),
    (CHIMERA2 + ["--global-batch-size", "8", "--rampup-batch-size", "2", "4", "16"], 2,
     "--rampup-batch-size=2 4 16: --global-batch-size (8) must be START plus a whole number of INCREMENTs"),
    (CHIMERA2 + ["--global-batch-size", "8", "--rampup-batch-size", "2", "3", "16"], 2,
     "--rampup-batch-size=2 3 16: the step at sample 8 (global batch size 5): --global-batch-size=5: gives 5"),
    (CHIMERA2 + [STEPS, "0:8", "--decrease-batch-size-if-needed"], 2, "cannot be combined with "
     "--decrease-batch-size-if-needed"),
    (CHIMERA2 + ["--global-batch-size", "8", "--eval-global-batch-size", "3"], 2,
     "--eval-global-batch-size=3: global batch size 3: --global-batch-size=3: gives 3 micro-batches"),
    (CHIMERA2 + ["--global-batch-size", "8", "--eval-micro-batch-size", "2"], 2, "--eval-micro-batch-size=2: must be "
     "--micro-batch-size (1)"),
]


@pytest.mark.parametrize("flags, world, needle", RAMP_CASES)
def test_impossible_batch_size_ramp(capsys, flags, world, needle):
    refused_in_one_line(capsys, RAMP + flags, world, needle)


def test_rampup_batch_size_runs_megatron_cores_linear_ramp_as_steps():
    """--rampup-batch-size START INCREMENT SAMPLES: the batch megatron-core's RampupBatchsizeNumMicroBatchesCalculator
    (removed in 0.19) gave after each count of consumed samples, here from the steps megatron-core's step
    calculator runs: START + INCREMENT x int(consumed / (SAMPLES / K)) up to SAMPLES, then the global batch."""
    start, increment, samples, final = 2, 2, 27, 8
    args = parse_args(RAMP + CHIMERA2 + ["--global-batch-size", str(final), "--rampup-batch-size", str(start),
                                         str(increment), str(samples)], world_size=2)
    calculator = step_calculator(DataSpec.from_args(args).batch_steps, micro_batch_size=1, data_parallel_size=1)
    per_increment = samples / ((final - start) // increment)
    for consumed in range(40):
        calculator.update(consumed, consistency_check=False)
        ramp = final if consumed > samples else start + increment * int(consumed / per_increment)
        assert calculator.get_current_global_batch_size() == ramp, f"after {consumed} samples"


def test_decrease_batch_size_if_needed_rounds_the_global_batch_down_to_whole_steps():
    args = parse_args(RAMP + CHIMERA2 + ["--global-batch-size", "9", "--decrease-batch-size-if-needed"], world_size=4)
    assert args.global_batch_size == 8, "megatron-core's calculator runs 8 of 9 samples at micro-batch 1 x DP 2"


def test_auto_plans_a_ramp_at_its_last_batch_and_runs_every_step_on_that_plan():
    args = parse_args(RAMP + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "auto", STEPS,
                              "0:2 64:4 128:8"], world_size=2)
    pipeline = job_config(args).pipeline
    assert [(size, p.microbatches) for size, p in pipeline.others] == [(2, 2), (4, 4)], pipeline.others
    assert {p.schedule for _, p in pipeline.others} == {pipeline.schedule}, "a step runs another schedule"


def test_the_flex_dispatcher_is_refused_off_a_gpu_naming_its_kernels(capsys):
    """megatron-core's flex dispatcher runs DeepEP's, HybridEP's or NCCL-EP's GPU kernels: here (no GPU) one line
    names the backend's kernels and what to give instead."""
    flex = CHIMERA2 + MOE + ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "hybridep",
                             "--sequence-parallel"]
    with pytest.raises(SystemExit):
        parse_args(MODEL + flex, world_size=4)
    assert capsys.readouterr().err.strip().splitlines() == [
        "pretrain_gpt.py: error: --moe-token-dispatcher-type=flex: GPU-only: megatron-core's flex dispatcher runs "
        "HybridEP's kernels (--moe-flex-dispatcher-backend hybridep) on NVIDIA GPUs; on this machine give "
        "--moe-token-dispatcher-type alltoall"]
