"""Pretrain a GPT with megatron-core and a pipeline schedule of your choice, Chimera included.

    torchrun --nproc_per_node 4 pretrain_gpt.py --pipeline-model-parallel-size 4 \\
        --pipeline-schedule chimera --mock-data ...

As in Megatron-LM, this program pairs the model-specific parts (the forward step and the loss, in
megatron/chimera/model/gpt_step.py so that tests and benchmarks import the same functions) with the
training loop (megatron/chimera/). To train another model, pass your own forward step to ``pretrain``.
"""
from megatron.chimera import parse_args, pretrain
from megatron.chimera.model.gpt_step import forward_step, loss_func

__all__ = ["forward_step", "loss_func"]

if __name__ == "__main__":
    pretrain(parse_args(), forward_step)
