"""The trainer's arrows point down: each module of megatron/chimera imports only from its own layer and the
layers below it, so a part never reaches up into what uses it (config knows nothing of the checkpoint, the
tokenizer or the model; what validation asks of them is handed in from the top, config/layer_probes.py).
Imports are read from the source with ``ast`` (inside functions too), as test_layers.py reads the schedule
library's."""
from test_layers import graph, modules

TRAINER = "megatron.chimera"
# bottom first; a layer is a folder of megatron/chimera, or a module beside them
LAYERS = (
    ("config",),  # flags, validation, the typed sections, the run plan
    ("data",),  # datasets and tokenizers
    ("model",),  # megatron-core's GPT chunks, the CPU compatibility layer
    ("distributed",),  # process groups, communicator warm-up, schedule agreement
    ("optim",),  # precision, gradient reductions, optimizers
    ("checkpoint",),  # named states, formats, the reads validation asks for
    ("observability",),  # log lines, timers, the startup banner, hooks
    # parse_args, the step, the rerun machine, the loop, offline plans, stage costs measured at startup, the package
    ("arguments", "schedule_runner", "rerun_machine", "loop", "plan", "stage_costs", "profile", ""),
    ("testing",),  # the harness and probes the tests share
)
# the schedule library's runtime runs the step (its executor, transport, faults): the top layer's to call,
# never the configuration's
RUNTIME = "chimera_schedules.runtime"
TOP = next(i for i, names in enumerate(LAYERS) if "loop" in names)


def layer_name(module: str) -> str:
    return module.removeprefix(TRAINER).removeprefix(".").split(".")[0]


def rank(module: str) -> int:
    """A module's layer, bottom 0; the rest of the schedule library lies below every trainer layer."""
    if module == RUNTIME or module.startswith(RUNTIME + "."):
        return TOP
    if module != TRAINER and not module.startswith(TRAINER + "."):
        return -1
    return next(i for i, names in enumerate(LAYERS) if layer_name(module) in names)


def upward(edges: dict[str, set[str]]) -> list[str]:
    """Every import of a trainer module that runs to a higher layer, named with both layers."""
    wrong = []
    for module, targets in sorted(edges.items()):
        if module != TRAINER and not module.startswith(TRAINER + "."):
            continue
        for target in sorted(targets):
            if rank(target) > rank(module):
                above = "the runtime" if rank(target) == TOP and target.startswith(RUNTIME) else layer_name(target)
                wrong.append(f"{module} imports {target} ({above} is above {layer_name(module) or 'the package'})")
    return wrong


def test_each_trainer_layer_imports_only_its_own_and_the_layers_below():
    wrong = upward(graph())
    assert wrong == [], "upward imports: " + "; ".join(wrong)


def test_every_trainer_module_is_in_a_layer():
    named = {name for names in LAYERS for name in names}
    found = {layer_name(m) for m in modules() if m == TRAINER or m.startswith(TRAINER + ".")}
    assert found <= named, f"modules in no layer (add them to LAYERS): {sorted(found - named)}"


def test_the_check_names_an_upward_import():
    edges = {"megatron.chimera.config.job": {"megatron.chimera.checkpoint.states", "megatron.chimera.config.run_plan"},
             "megatron.chimera.config.run_plan": {"chimera_schedules.runtime.executor", "chimera_schedules.ir"}}
    assert upward(edges) == [
        "megatron.chimera.config.job imports megatron.chimera.checkpoint.states (checkpoint is above config)",
        "megatron.chimera.config.run_plan imports chimera_schedules.runtime.executor (the runtime is above config)"]
