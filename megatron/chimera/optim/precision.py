"""Megatron-LM's --fp16 and --bf16: half-precision parameters and activations, fp32 main weights that
the optimizer steps, and under --fp16 a loss scale that keeps fp16 gradients from underflowing (bf16
has fp32's range and needs none).

Every backward adds its half-precision gradient into the fp32 main parameter's gradient at once (a hook), so
gradients accumulate over micro-batches and reduce over stage copies in fp32: Megatron-LM's
--accumulate-allreduce-grads-in-fp32. That keeps layouts apart only by fp32 rounding; fp16 sums in
each layout's own order would differ by far more. In fp32 the main parameters are the model's own (or,
under gradient-accumulation fusion, share their storage).

With Megatron-LM's gradient-accumulation fusion (on a GPU) the fused weight-gradient kernels add into
``param.main_grad`` themselves: here the main parameter's fp32 gradient (``MainParams._point_main_grads``),
and hand autograd a placeholder the hook skips. In fp32 too the model's weights then get a main parameter
and the hook: one sharing their storage (``MainParams.aliases``), so that nothing is copied. Without the
placeholder autograd would get no weight gradient, and run those weights' hooks, which start reductions
under --overlap-grad-reduce, on the CPU's ready queue while the rest run on the GPU's thread: NCCL from
two threads. megatron-core's DDP keeps the same contract for the same reason.
"""
from __future__ import annotations

import torch

from ..config.train_spec import PrecisionSpec
from .gradients import clip_, global_norm, global_zeros
from .muon import loaded_state


class MainParams:
    """The parameters the optimizer steps and the gradient code reads, per held chunk (optim/main.py's
    MainWeights). ``rt``: the process groups the norms sum over; ``tied``: whether the word embedding has
    copies on several stages (each counted once)."""

    def __init__(self, chunks: dict, rt, tied: bool):
        self.chunks, self.rt, self.tied = chunks, rt, tied
        self.pairs: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] = []  # (model, fp32 copy)
        self.aliases: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] = []  # (model, its storage)
        self.fused = {key: chunk for key, chunk in chunks.items() if chunk.config.gradient_accumulation_fusion}
        self.by_chunk = {key: [self._main(p, key in self.fused) for p in chunk.parameters()]
                         for key, chunk in chunks.items()}

    def _main(self, param: torch.nn.Parameter, fused: bool) -> torch.nn.Parameter:
        """The model's own fp32 parameter; an fp32 copy of a half-precision one; under gradient-accumulation
        fusion, a new parameter over an fp32 one's storage, so that the model's ``.grad`` stays free for
        the kernels' placeholder."""
        copy = param.dtype != torch.float32
        if not copy and not fused:
            return param
        main = torch.nn.Parameter(param.detach().float() if copy else param.detach())
        main.__dict__.update(param.__dict__)  # global_name, tensor-parallel and sequence-parallel marks
        param.main_param = main
        param.grad_added_to_main_grad = False
        param.register_post_accumulate_grad_hook(_accumulate_into_main)
        (self.pairs if copy else self.aliases).append((param, main))
        return main

    def _point_main_grads(self) -> None:
        """Under gradient-accumulation fusion, each parameter's ``main_grad`` is its main parameter's fp32
        gradient, a view of the replica sync's persistent buffer, which exists only once the replica sync
        is built, after this; the tied embedding, which it keeps no buffer for, gets its persistent
        gradient here."""
        for key, chunk in self.fused.items():
            for param, main in zip(chunk.parameters(), self.by_chunk[key]):
                if main.grad is None:
                    main.grad = torch.zeros_like(main)
                param.main_grad = main.grad

    def all(self) -> list[torch.nn.Parameter]:
        return [p for params in self.by_chunk.values() for p in params]

    def stepped(self) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter]]:
        """What this rank's optimizer steps, each beside its model parameter: every main parameter
        (layer_wise.py: the owned ones)."""
        return self._model_and_main()

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """After a step: the model runs on the updated main weights, rounded."""
        for model, main in self.pairs:
            model.copy_(main)

    @torch.no_grad()
    def copy_from_model(self) -> None:
        """After loading weights without their fp32 main copies."""
        for model, main in self.pairs:
            main.copy_(model)

    @torch.no_grad()
    def unscale(self, scale: float) -> None:
        for p in self.all():
            if p.grad is not None:
                p.grad.mul_(1.0 / scale)

    @property
    def half(self) -> bool:
        return bool(self.pairs)

    def flush(self) -> None:
        """Nothing is ever pending: the optimizer steps the weights in place or copies them at once."""

    def zero_grad(self, optimizer) -> None:
        """In place: the gradients are views into the replica sync's persistent buffers. Each iteration
        starts here, so the fused kernels' targets are pointed here too."""
        optimizer.zero_grad(set_to_none=False)
        self._point_main_grads()

    def grad_norm(self) -> float:
        return global_norm(self.by_chunk, self.rt, self.tied)

    def params_norm(self) -> float:
        """Megatron-LM's calc_params_l2_norm: the main weights (fp32 ones, or bf16's fp32 copies), or under
        --fp16 the fp16 weights themselves normed in fp32; each logical parameter once."""
        if any(model.dtype == torch.float16 for model, _ in self.pairs):
            return half_weights_norm(self.chunks, self.rt, self.tied)
        return global_norm(self.by_chunk, self.rt, self.tied, of=lambda p: p)

    def zeros(self) -> int:
        return global_zeros(self.by_chunk, self.rt, self.tied)

    def clip(self, max_norm: float, norm: float) -> None:
        clip_(self.all(), max_norm, norm)

    def full_state(self, optimizer, names: tuple[str, ...]) -> dict[int, dict[str, torch.Tensor]]:
        """Each named state of every model parameter, whole (for checkpoints): id(model param) -> state."""
        out = {}
        for model, main in self._model_and_main():
            kept = {**optimizer.state.get(main, {}), "fp32_param": main.detach()}
            out[id(model)] = {name: kept[name] for name in names if name in kept}
        return out

    @torch.no_grad()
    def load_full_state(self, optimizer, states: dict[int, dict[str, torch.Tensor]], step: int) -> None:
        copies = {id(main) for _, main in self.pairs}
        for model, main in self._model_and_main():
            saved = states[id(model)]
            optimizer.state[main] = loaded_state(optimizer, main, step, saved)
            if "fp32_param" in saved and id(main) in copies:
                main.copy_(saved["fp32_param"])

    def _model_and_main(self) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter]]:
        model_of = {id(main): model for model, main in self.pairs + self.aliases}
        return [(model_of.get(id(main), main), main) for main in self.all()]

    def state_bytes(self) -> tuple[int, int]:
        """(main parameters, gradients) in bytes: fp32 copies of half-precision weights, and the fp32
        gradient every main parameter holds during an iteration."""
        return sum(m.numel() * 4 for _, m in self.pairs), sum(p.numel() * 4 for p in self.all())


def half_weights_norm(chunks: dict, rt, tied: bool) -> float:
    """The L2 norm of the model chunks' own weights, in fp32, each logical parameter once (--fp16's params norm)."""
    return global_norm({key: list(chunk.parameters()) for key, chunk in chunks.items()}, rt, tied,
                       of=lambda p: p.float())


def unfused_gradient(param: torch.nn.Parameter) -> torch.Tensor | None:
    """What a post-accumulate-grad hook must still add of ``param.grad`` into the fp32 main gradient, by
    megatron-core's DDP rule. Nothing where a fused weight-gradient kernel (apex's under megatron-core's
    linears, Transformer Engine's) added into ``param.main_grad`` itself and handed autograd a placeholder
    (``grad_added_to_main_grad``), unless megatron-core zeroed the placeholder (``zero_out_wgrad``: a tied
    weight, whose other use's gradient autograd sums into it). Nothing where autograd got no gradient at
    all (a fused kernel without the flag, or a weight gradient delayed to W): the hook fires all the same."""
    if param.grad is None or (param.grad_added_to_main_grad and not getattr(param, "zero_out_wgrad", False)):
        return None
    return param.grad


def _accumulate_into_main(param: torch.nn.Parameter) -> None:
    grad, main = unfused_gradient(param), param.main_param
    if grad is not None and main.grad is None:
        main.grad = grad.float()
    elif grad is not None:
        main.grad.add_(grad)
    param.grad, param.grad_added_to_main_grad = None, False


class LossScaler:
    """Megatron-LM's loss scale: constant with --loss-scale; otherwise dynamic, halved (down to
    --min-loss-scale) once --hysteresis iterations have overflowed, doubled after --loss-scale-window
    clean ones. Same rules and state keys as megatron-core's DynamicGradScaler, whose tensors live on
    CUDA."""

    def __init__(self, precision: PrecisionSpec):
        self.constant = precision.loss_scale is not None
        self.scale = precision.loss_scale if self.constant else precision.initial_loss_scale
        self.min_scale, self.window = precision.min_loss_scale, precision.loss_scale_window
        self.hysteresis = precision.hysteresis
        self.growth_tracker, self.hysteresis_tracker = 0, precision.hysteresis

    def update(self, found_inf: bool) -> None:
        if self.constant:
            return
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale / 2.0, self.min_scale)
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.window:
            self.growth_tracker, self.hysteresis_tracker = 0, self.hysteresis
            self.scale *= 2.0

    def state_dict(self) -> dict:
        return {"scale": torch.tensor([self.scale]), "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, state: dict) -> None:
        if not self.constant:
            self.scale = float(state["scale"].reshape(-1)[0])
        self.growth_tracker, self.hysteresis_tracker = state["growth_tracker"], state["hysteresis_tracker"]


def scaled_loss(forward_step_func, scaler: LossScaler):
    """The loss each micro-batch's backward starts from, times the current loss scale; the logged
    report stays unscaled. Works the same under our executor and megatron-core's schedules, and for a
    schedule plan in the output's place (``return_schedule_plan``, passed on)."""

    def forward_step(data_iterator, model, **kwargs):
        output, loss_func = forward_step_func(data_iterator, model, **kwargs)

        def loss_times_scale(output_tensor):
            loss, *rest = loss_func(output_tensor)
            return (loss * scaler.scale, *rest)

        return output, loss_times_scale

    return forward_step
