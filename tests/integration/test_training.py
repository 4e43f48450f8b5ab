"""Training on real processes: every schedule and layout equals the one-process reference.

Three launches share all cases (see megatron/chimera/testing/equivalence.py): 1 process (the references, megatron-core's
no-pipelining schedule), 2 and 4 processes (every schedule at D=2, those whose order changes with D at D=4,
4 pipelines, DP=2, TP=2, untied embeddings, RoPE), all three at once. Then the README's main command, run as written.
"""
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from megatron.chimera.distributed.ports import free_port
from megatron.chimera.observability.series import PPL_CAP
from megatron.chimera.testing.equivalence import (
    DETERMINISTIC,
    DROPPED_EXPERT,
    EVERY_PAIR,
    HALVES_CASES,
    ITERS,
    KAPPA_MAX,
    MTP_PAIRED,
    OVERLAPPED_EXPERTS,
    PER_PIPELINE,
    PLANTED_COPY,
    SEQUENCE_HALVES_CASES,
    TOLERANCE,
    cases,
)
from megatron.chimera.testing.launch import ENV, ROOT, launch

HARNESS = ["-m", "megatron.chimera.testing.equivalence"]
CASES = sorted(name for world in (2, 4) for name in cases(world) if name != DROPPED_EXPERT)


@pytest.fixture(scope="session")
def results(tmp_path_factory):
    """The three launches run at once, their cases waiting for the references they need (the harness): the ranks
    of a pipeline wait on each other, and each launch's start-up (imports) would leave the cores idle."""
    out = str(tmp_path_factory.mktemp("equivalence"))
    worlds, merged = (1, 2, 4), {}
    with ThreadPoolExecutor(len(worlds)) as pool:
        running = [(world, pool.submit(launch, world, *HARNESS, "--out", out)) for world in worlds]
        for world, launched in running:  # the one-process launch first: a failure of the others may be its
            proc = launched.result()
            assert proc.returncode == 0, f"{world}-process launch failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
            with open(os.path.join(out, f"cases_w{world}.json")) as f:
                merged.update(json.load(f))
    return merged


@pytest.mark.parametrize("case", CASES)
def test_losses_and_weights_equal_the_one_process_reference(results, case):
    r = results[case]
    bounds = TOLERANCE[r["precision"]]  # derived beside TOLERANCE in the harness
    assert r["loss_rel"] <= bounds.losses, f"{case}: losses {r['losses']} against {r['reference']}"
    for measured, bound in (("weight_rel", bounds.model_rel), ("weight_steps", bounds.model_steps),
                            ("worst_tensor_steps", bounds.tensor_steps)):  # whole model, every logical tensor once
        assert bound is None or r[measured] <= bound, f"{case}: {measured} {r[measured]:.2e} above {bound}"
    assert r["eval_rel"] <= bounds.evaluation, f"{case}: evaluation loss differs by {r['eval_rel']:.2e}"
    if r["tp"] == 1:  # before any rounding of updated weights, the reference's own arithmetic
        assert r["first_loss_rel"] <= TOLERANCE["fp32"][0], (r["losses"], r["reference"])


@pytest.mark.parametrize("case", CASES)
def test_params_norm_num_zeros_and_validation_ppl_equal_the_one_process_reference(results, case):
    """Megatron-LM's --log-params-norm, --log-num-zeros-in-grad and validation perplexity count every stage
    once, however many copies a layout holds (Chimera: two per rank). The norm and the perplexity move with
    the weights and the loss: fp32 within 1e-6; in fp16/bf16 the norm within the weights' bound, the
    perplexity e^L within L times the loss's (L <= 20, Megatron-LM's cap). The zeros are exact in fp32; in
    fp16 a gradient element can round to zero in one layout and not in another (measured: chimera fp16)."""
    r = results[case]
    bounds, fp32 = TOLERANCE[r["precision"]], r["precision"] == "fp32"
    norm_bound, ppl_bound = (1e-6, 1e-6) if fp32 else (bounds.model_rel, bounds.evaluation * PPL_CAP)
    assert r["params_norm_rel"] <= norm_bound, f"{case}: params norm differs by {r['params_norm_rel']:.2e}"
    assert r["ppl_rel"] <= ppl_bound, f"{case}: validation ppl differs by {r['ppl_rel']:.2e}"
    if fp32:
        assert r["num_zeros"] == r["num_zeros_reference"], \
            f"{case}: num zeros {r['num_zeros']}, one process {r['num_zeros_reference']}"


def test_num_zeros_counts_each_stage_once_under_chimera(results):
    """A case whose zeros are many (the untied input embedding's rows of tokens the batch lacks): Chimera at
    D=2 holds two copies of each stage per rank and still counts what one process counts."""
    r = results["chimera untied D=2"]
    assert min(r["num_zeros"]) > 0 and r["num_zeros"] == r["num_zeros_reference"], r["num_zeros"]


def test_the_per_tensor_bound_catches_a_dropped_expert_gradient(results):
    """The fp32 weight bounds are tight enough to fail a real bug: one expert that never updates lands far
    above both (about 0.75 of a step on its tensors), while its losses differ by only ~2e-6."""
    r, bounds = results[DROPPED_EXPERT], TOLERANCE["fp32"]
    assert r["worst_tensor_steps"] > 10 * bounds.tensor_steps, f"{DROPPED_EXPERT}: {r['worst_tensor_steps']:.2e} steps"
    assert r["weight_steps"] > 10 * bounds.model_steps, f"{DROPPED_EXPERT}: whole model {r['weight_steps']:.2e} steps"


def test_deterministic_mode_is_on_while_training_and_its_nan_filled_memory_changes_no_bit(results):
    """--deterministic-mode on the CPU (gloo): torch's deterministic algorithms are on while the case trains (off
    in the plain one), and with them torch fills uninitialised memory with NaN, so the same Chimera D=2 run,
    again in the same launch, equal to the last bit in losses, evaluation loss and weights' distances shows that
    no buffer is read before it is written (docs/megatron.md). What the mode sets is checked in
    tests/unit/test_determinism.py."""
    kept = ("losses", "eval_rel", "weight_rel", "worst_tensor_rel", "copies_differing")
    plain, deterministic = results["chimera direct D=2"], results[DETERMINISTIC]
    assert (plain["deterministic_algorithms"], deterministic["deterministic_algorithms"]) == (False, True), \
        f"torch's deterministic algorithms while training: plain {plain['deterministic_algorithms']}, " \
        f"with --deterministic-mode {deterministic['deterministic_algorithms']}"
    assert {k: deterministic[k] for k in kept} == {k: plain[k] for k in kept}, (deterministic, plain)


def test_moe_log_fields_equal_the_one_process_reference(results):
    """load_balancing_loss, seq_load_balancing_loss and z_loss as Megatron-LM's iteration line reports
    them, under every schedule that runs a MoE model, as one process reports them."""
    moe = {case: results[case] for case in CASES if results[case]["moe_fields"]}
    expected = {"mixtral chimera D=4", "mixtral dualpipe D=4", "deepseek-style chimera split D=2"}
    assert expected <= moe.keys(), f"cases without MoE log fields: {sorted(expected - moe.keys())}"
    fields = moe["mixtral chimera D=4"]["moe_fields"]
    assert fields == ["load_balancing_loss", "z_loss"], f"mixtral chimera D=4 logs {fields}"
    fields = moe["deepseek-style chimera split D=2"]["moe_fields"]
    assert fields == ["seq_load_balancing_loss"], f"deepseek-style chimera split D=2 logs {fields}"
    fields = moe["mixtral global aux loss chimera D=2"]["moe_fields"]
    assert fields == ["global_load_balancing_loss", "z_loss"], f"mixtral global aux loss chimera D=2 logs {fields}"
    assert all(r["moe_rel"] <= TOLERANCE["fp32"][0] for r in moe.values()), {c: r["moe_rel"] for c, r in moe.items()}


def test_global_aux_loss_under_chimera_is_one_process_restarting_its_counts_per_pipeline(results):
    """megatron-core's global_aux_loss averages each router's token counts over the micro-batches it has run in
    the iteration. Under 1F1B one copy runs them all in order: one process's (checked by the equivalence test).
    Under Chimera each copy runs its own pipeline's half: it equals one process whose counts restart at the
    second half (also checked there), and that differs from one process measurably (docs/moe.md)."""
    plain, restarted = (results[f"reference {v}"]["losses"] for v in ("mixtral-global-aux", PER_PIPELINE))
    apart = max(abs(a - b) / abs(b) for a, b in zip(plain, restarted))
    assert apart > 5 * TOLERANCE["fp32"].losses, f"restarting the counts per pipeline changed the losses by {apart}"
    assert results["mixtral global aux loss chimera D=2"]["loss_rel"] <= TOLERANCE["fp32"].losses


def test_weight_hash_check_passes_everywhere_and_names_a_planted_difference(results):
    """--check-weight-hash-across-dp-replicas-interval's check (every copy of every stage, both pipelines and
    every data-parallel replica, experts over their own groups) finds nothing after any case; after one copy of
    stage 0 is perturbed on one rank it fails in one line naming the stage and the ranks."""
    failed = {case: results[case]["weight_hashes"]["trained"] for case in CASES
              if results[case]["weight_hashes"]["trained"] is not None}
    assert failed == {}, f"the weight-hash check failed after these cases: {failed}"
    planted = results[PLANTED_COPY]["weight_hashes"]["planted"]
    expected = (f"weight hashes differ after {ITERS} iterations: stage 0 (tensor-parallel rank 0): the copies on "
                "ranks [3] differ from the copy on rank 0 (first in embedding.word_embeddings.weight; the stage's "
                "copies are on ranks [0, 1, 2, 3])")
    assert planted == expected, f"the planted difference was reported as {planted!r}"


def test_every_rank_holds_exactly_the_layers_its_layout_names(results):
    """Read from the parameters' names on every rank: a layout silently ignored would still train like
    one process. The hand layouts (stages of only E or only L, first/last counts, DualPipe's V) and MTP
    on the last stage or on a stage of its own are applied as written."""
    wrong = {case: {chunk: v for chunk, v in results[case]["layout_held"].items() if v["held"] != v["expected"]}
             for case in CASES}
    wrong = {case: (results[case]["layout"], chunks) for case, chunks in wrong.items() if chunks}
    assert wrong == {}, f"chunks holding other than their layout names, by case (layout, chunk: held/expected): {wrong}"
    layouts = {case: results[case]["layout"] for case in CASES}
    expected = {"layout E|tttt|tttt|L chimera D=4": "E|tttt|tttt|L",
                "mtp-untied first=3 chimera split D=2": "Ettt|tttttmL",
                "mtp layout Ett|ttt|tttm|L chimera D=4": "Ett|ttt|tttm|L",
                "mtp megatron-1f1b D=2": "Etttt|ttttmL"}  # Megatron-LM's place for MTP: with the loss
    got = {case: layouts[case] for case in expected}
    assert got == expected, f"layouts applied (case: layout): {got}, expected {expected}"


def test_mtp_loss_is_logged_as_one_process_logs_it(results):
    """Megatron-LM's 'mtp_1 loss' field, non-zero and equal to the one-process run's, under Chimera,
    DualPipe, split backward and megatron-core's 1F1B, with MTP on the last stage or its own, at TP=2 with
    sequence parallelism, and paired with --overlap-moe-expert-parallel-comm."""
    mtp = {case: results[case] for case in CASES if case.startswith(("mtp", "mixtral-mtp"))}
    assert len(mtp) == 8, f"expected 8 MTP cases, got {sorted(mtp)}"
    logged = {case: (r["moe_fields"], r["mtp_loss"]) for case, r in mtp.items()}
    assert all("mtp_1 loss" in fields and loss > 1 for fields, loss in logged.values()), \
        f"case: (fields logged, mtp_1 loss), each expected to hold 'mtp_1 loss' > 1: {logged}"
    assert all(r["moe_rel"] <= TOLERANCE["fp32"][0] for r in mtp.values()), {c: r["moe_rel"] for c, r in mtp.items()}


def test_the_reduced_precision_bounds_premise_holds(results):
    """The fp16/bf16 loss bound assumes the loss's condition number with respect to the weights is at
    most KAPPA_MAX; the fp32 references measure it after every step."""
    kappas = {name: r["kappa"] for name, r in results.items() if r.get("kappa") is not None}
    assert {"reference tied-learned", "reference llama"} <= kappas.keys(), f"references measured: {kappas}"
    assert all(0 < k <= KAPPA_MAX for k in kappas.values()), f"kappas, expected in (0, {KAPPA_MAX}]: {kappas}"


@pytest.mark.parametrize("case", CASES)
def test_every_copy_of_every_stage_stays_identical(results, case):
    differing = results[case]["copies_differing"]  # checked bitwise after every optimizer step
    assert differing == [], f"{case}: copies on different ranks differ: {differing}"


@pytest.mark.parametrize("case", CASES)
def test_evaluation_leaves_gradients_and_optimizer_state_untouched(results, case):
    seen = results[case]["evaluation"]
    assert seen["gradients"] > 0, f"{case}: no gradient before evaluation, so nothing to check: {seen}"
    assert seen["tensors before"] == seen["tensors after"] and seen["changed"] == [], \
        f"{case}: evaluation changed the training state: {seen}"


def test_the_hooks_see_every_iteration_and_every_action(results):
    """The hooks protocol, which the benchmark and the fault tests rely on, under every schedule."""
    wrong = {case: {what: (saw, results[case]["hooks"]["expected"][what])
                    for what, saw in results[case]["hooks"]["saw"].items()
                    if saw != results[case]["hooks"]["expected"][what]} for case in CASES}
    wrong = {case: seen for case, seen in wrong.items() if seen}
    assert wrong == {}, f"what rank 0's hooks saw, against what they should have (case: what: (saw, expected)): {wrong}"


def test_gradient_reductions_start_as_overlap_grad_reduce_says(results):
    """Megatron-LM's --overlap-grad-reduce under every schedule, ours and megatron-core's: with it every
    reduction has started before the flush: under our executor each stage copy's, each stage's experts'
    and the tied embedding's at their ALLREDUCE actions (OVERLAPPED_EXPERTS: experts over EP=2, with and
    without the distributed optimizer), under megatron-core's schedules each stage copy's through its
    no_sync/grad_sync hooks; without it, Megatron-LM's default, none has."""
    wrong = {case: results[case]["reductions_before_flush"] for case in CASES
             if results[case]["reductions_before_flush"] != ("all" if results[case]["overlap_grad_reduce"] else "none")}
    assert wrong == {}, f"reductions started before the flush ('all' expected with --overlap-grad-reduce, " \
                        f"else 'none'), by case: {wrong}"
    overlapped = {case for case in CASES if results[case]["overlap_grad_reduce"]}
    expected = {"megatron-1f1b D=2 DP=2 overlapped reduce", "chimera D=2 DP=2 overlapped reduce", *OVERLAPPED_EXPERTS}
    assert expected <= overlapped, f"cases with --overlap-grad-reduce: {sorted(overlapped)}, expected {expected}"


def test_overlap_moe_expert_parallel_comm_pairs_forwards_with_backwards(results):
    """--overlap-moe-expert-parallel-comm under every schedule that takes it (the losses and weights above
    equal one process's): F&B actions under 1F1B, DualPipe(V); the pass pairs nothing under Chimera split at
    D=2 (no forward sits next to another micro-batch's I), so a 1F1B split case with every pair fused runs
    F&I actions, and with every pair fused DualPipeV and Chimera direct at N = 2D run pairs beside halves;
    DualPipeV pairs with multi-token prediction too. With aux_loss or MTP (statistics of the whole
    micro-batch) no action runs in halves. No other case runs any."""
    paired = {case: results[case]["overlapped"] for case in CASES}
    overlap = {case for case in CASES if case.startswith("mixtral overlap ")} | {MTP_PAIRED}
    assert len(overlap) == 11 and paired[EVERY_PAIR].get("I", 0) > 0, paired
    names = ("mixtral overlap 1f1b D=2 overlapped gather EP=2", "mixtral overlap dualpipe D=2 EP=2", MTP_PAIRED,
             "mixtral overlap dualpipev D=2 halves overlapped gather EP=2",
             "mixtral overlap chimera direct D=2 N=2D pairs and halves overlapped gather EP=2")
    assert all(paired[name].get("B", 0) > 0 for name in names), paired
    halving = HALVES_CASES.keys() | SEQUENCE_HALVES_CASES.keys()
    whole = {case: results[case]["halved"] for case in overlap - halving if results[case]["halved"]}
    assert whole == {}, f"cases with aux_loss or MTP that ran actions in halves: {whole}"
    others = {case: (paired[case], results[case]["halved"]) for case in CASES if case not in overlap
              and (paired[case] or results[case]["halved"])}
    assert others == {}, f"cases without --overlap-moe-expert-parallel-comm that ran overlapped actions: {others}"


def test_overlap_moe_expert_parallel_comm_runs_actions_in_halves(results):
    """Where no other micro-batch pairs with an action, an F, B or I runs as two halves of its micro-batch
    (micro-batch size 2 or 4), equal to one process (the losses, weights and MoE log fields above): under
    Chimera at N = D every action (no pair), under Chimera split its F and I, under DualPipeV its F, B and
    I beside F&B pairs, under Chimera direct at N = 2D its F and B beside pairs (every pair fused)."""
    halved = {case: results[case]["halved"] for case in HALVES_CASES}
    expected = {"mixtral overlap chimera direct D=2 N=D halves EP=2": {"F", "B"},
                "mixtral overlap chimera split D=2 halves EP=2": {"F", "I"},
                "mixtral overlap dualpipev D=2 halves overlapped gather EP=2": {"F", "B", "I"},
                "mixtral overlap chimera direct D=2 N=2D pairs and halves overlapped gather EP=2": {"F", "B"}}
    assert {case: set(ops) for case, ops in halved.items()} == expected, halved
    assert results["mixtral overlap chimera direct D=2 N=D halves EP=2"]["overlapped"] == {}, \
        "Chimera at N = D has no two micro-batches to pair"
    fields = {case: results[case]["moe_fields"] for case in HALVES_CASES}
    assert all(f == ["seq_load_balancing_loss", "z_loss"] for f in fields.values()), fields


def test_at_micro_batch_size_1_actions_run_in_halves_of_each_sequence(results):
    """At micro-batch size 1 an F, B or I runs as the first and second half of its sequence (the second
    attending to the first's keys, rope positions after them), equal to one process (the losses and weights
    above): under Chimera at N = D every action, under Chimera split its F and I, under DualPipeV its F, B
    and I."""
    halved = {case: set(results[case]["halved"]) for case in SEQUENCE_HALVES_CASES}
    expected = {"mixtral overlap chimera direct D=2 N=D sequence halves EP=2": {"F", "B"},
                "mixtral overlap chimera split D=2 sequence halves EP=2": {"F", "I"},
                "mixtral overlap dualpipev D=2 sequence halves EP=2": {"F", "B", "I"}}
    assert halved == expected, f"the actions run in halves of a sequence, by case: {halved}"


def readme_main_command() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        first_block = re.search(r"```bash\n(.*?)\n```", f.read(), re.S).group(1)
    setup, activate, command = first_block.split("&&", 2)  # setup_env.sh and the venv are this suite's own
    assert "scripts/setup_env.sh" in setup and ".venv/bin/activate" in activate, first_block
    return command.strip()


def test_readme_main_command_trains_chimera_with_decreasing_loss(tmp_path):
    command = readme_main_command()
    assert "--pipeline-schedule chimera" in command and "--nproc_per_node 4" in command, command
    command = command.replace("torchrun", f"{sys.executable} -m torch.distributed.run --master_port {free_port()}", 1)
    command = command.replace("--save checkpoints/demo", f"--save {tmp_path / 'demo'}")  # keep the repo clean
    proc = subprocess.run(command, shell=True, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    lines = [line for line in proc.stdout.splitlines() if re.search(r"iteration\s+\d+/\s*\d+ \|", line)]
    assert len(lines) == 20, f"{len(lines)} iteration lines, expected 20:\n{proc.stdout[-3000:]}"
    assert all("elapsed time per iteration (ms):" in line for line in lines), "\n".join(lines)
    losses = [float(re.search(r"lm loss: (\d\.\d{6}E[+-]\d\d)", line).group(1)) for line in lines]
    assert losses[-1] < losses[0] - 0.3 and sum(losses[-5:]) < sum(losses[:5]), f"losses: {losses}"
    valid = [float(v) for v in re.findall(r"validation loss at iteration \d+ \| lm loss value: (\S+) \|", proc.stdout)]
    assert len(valid) == 2 and valid[1] < valid[0], f"validation losses: {valid}"
    latest = (tmp_path / "demo" / "latest_checkpointed_iteration.txt").read_text()
    assert latest == "20", f"latest checkpointed iteration: {latest!r}"
    proof = r" > schedule chimera-direct \(D=4, N=8, \w+ on every rank\): its training and forward-only lists " \
            r"complete under NCCL's rules \(nccl-single-queue\), proven in \d+\.\d\d s"
    assert len(re.findall(proof, proc.stdout)) == 1, f"no single proof line:\n{proc.stdout[:3000]}"
    # Chimera D=4, tied embedding: the world, the TP group (the cross entropy's, even at TP=1), and on the end
    # workers stages 0 and 3 with the embedding as one group (one rank set); end workers talk to one
    # neighbour on two channels, interior ones to two
    warm = (r" > communicators created before iteration 1: up to 3 collective groups \(5 without sharing\) and 4 p2p "
            r"pairs per rank, in")
    assert len(re.findall(warm, proc.stdout)) == 1, f"no single communicator line:\n{proc.stdout[:3000]}"
