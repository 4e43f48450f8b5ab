"""The balancer: Megatron-LM's layout strings read and written, the hand options it compares with, and
layouts it picks for the models people train now, no slower than the even split or Megatron-LM's best
hand option under the simulator, and within the memory cap."""
import dataclasses

import pytest

from chimera_schedules import ConfigError, build_spec, check, variant
from chimera_schedules.ir import layout
from chimera_schedules.tools.balancer import Sizes, balance, best_megatron, megatron_options, score
from chimera_schedules.tools.cli import main
from chimera_schedules.tools.planner import GPT2_1_3B, LLAMA3_8B, MODELS, Precision, Profile, even_layout

H100 = Profile.load("profiles/h100-datasheet.json")


def test_layout_strings_read_and_write_as_megatron_core_spells_them():
    deepseek = layout.parse("Et|(tt|)*30mL")  # NVIDIA's DeepSeek-V3 guide, at 32 stages
    assert len(deepseek.stages) == 32 and deepseek.num_layers == 61 and deepseek.mtp_layers == 1
    assert str(deepseek) == "Et|(tt|)*30mL" and layout.parse(str(deepseek)) == deepseek
    assert str(layout.even(8, 4, mtp=1)) == "Ett|tt|tt|ttmL"
    assert layout.parse("E|t*3,t|tttt|L").layer_counts() == (0, 4, 4, 0)
    assert layout.parse("Ett|ttt|tttm|L").output_rows() == (1, 1, 2, 1)  # MTP's depths ride with the sequence


def test_megatron_options_are_the_splits_its_flags_allow():
    options = dict((str(held), flags) for held, flags in megatron_options(dataclasses.replace(GPT2_1_3B, layers=8), 4))
    assert options["Ett|tt|tt|ttL"] == ""
    assert options["Et|tt|tt|tttL"] == "--decoder-first-pipeline-num-layers 1 --decoder-last-pipeline-num-layers 3"
    assert not any("account-for" in flags for flags in options.values()), options  # 8 + 1 or 8 + 2 does not divide by 4
    assert all(sum(layout.parse(s).layer_counts()) == 8 for s in options), list(options)


@pytest.mark.parametrize("model,name", [("gpt2-1.3b", "chimera direct"), ("llama3-8b", "1f1b"),
                                        ("llama3-8b", "chimera direct"), ("llama3-8b", "dualpipev"),
                                        ("deepseek-v3", "chimera direct")])
def test_the_balanced_layout_is_no_slower_than_the_even_split_or_megatrons_best(model, name):
    shape, profile = MODELS[model], dataclasses.replace(H100, memory=1e15)
    schedule = build_spec(check(variant(name, 8, 16)))
    even = score(shape, profile, schedule, even_layout(shape, schedule.stages_per_pipeline))
    hand = best_megatron(shape, profile, schedule)
    balanced = balance(shape, profile, schedule)
    assert balanced.seconds <= min(even.seconds, hand.seconds) + 1e-12
    assert balanced.layout.num_layers == shape.layers and balanced.layout.mtp_layers == shape.mtp


def test_chimera_moves_layers_off_both_edge_workers():
    """Worker 0 and worker D-1 each hold the embedding's stage and the output layer's: under Chimera both
    shed layers, where 1F1B takes them off the last stage only."""
    schedule = build_spec(check(variant("chimera direct", 8, 8)))
    counts = balance(LLAMA3_8B, H100, schedule, Sizes(1, 1, 1, Precision(half=True))).layout.layer_counts()  # bf16
    assert counts[-1] < 4 and sum(counts) == 32


def test_a_layout_that_does_not_fit_is_not_picked():
    schedule = build_spec(check(variant("1f1b", 8, 8)))
    tight = dataclasses.replace(H100, memory=1.0)
    assert score(LLAMA3_8B, tight, schedule, even_layout(LLAMA3_8B, 8)).seconds == float("inf")


def test_plan_prints_the_balanced_layout_and_its_gain(capsys):
    code = main(["plan", "--workers", "8", "--global-batch", "16", "--model", "llama3-8b", "--profile",
                 "profiles/h100-datasheet.json", "--bf16", "--use-distributed-optimizer", "--depths", "8",
                 "--memory-gb", "1000", "--top", "1"])
    out = capsys.readouterr().out
    assert code == 0 and "faster than the even split" in out and "--pipeline-model-parallel-layout '" in out
    assert "Megatron-LM's best hand option: --decoder-" in out


def test_a_layout_string_with_a_foreign_character_is_one_error():
    with pytest.raises(ConfigError, match="unknown layer character"):
        layout.parse("Etx|L")
