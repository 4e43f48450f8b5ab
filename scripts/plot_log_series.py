"""Megatron-LM's log series of two runs, side by side, from their TensorBoard event files.

    python scripts/plot_log_series.py --run "one process" DIR1 --run "Chimera D=2" DIR2 --out PNG

docs/log_series.md gives the runs that made docs/images/log_series_chimera_vs_one_process.png.
"""
from __future__ import annotations

import argparse

from matplotlib.figure import Figure  # no pyplot: a file, no display

from megatron.chimera.testing.run_files import tensorboard_scalars

PANELS = ("lm loss", "params-norm", "num-zeros", "grad-norm", "lm loss validation ppl", "world-size",
          "iteration-time", "forward-backward-time")


def plot(runs: list[tuple[str, str]], out: str) -> None:
    series = [(name, tensorboard_scalars(folder)) for name, folder in runs]
    fig = Figure(figsize=(16, 7), layout="constrained")
    axes = fig.subplots(2, 4)
    for ax, tag in zip(axes.flat, PANELS):
        for (name, scalars), style in zip(series, ({"lw": 3, "alpha": 0.5}, {"lw": 1, "ls": "--", "marker": "."})):
            if tag in scalars:
                steps, values = zip(*scalars[tag])
                ax.plot(steps, values, label=name, **style)
        ax.set_title(tag)
        ax.set_xlabel("iteration")
    axes.flat[0].legend()
    fig.suptitle("TensorBoard series (Megatron-LM's tags): each stage counted once, however many copies a rank holds")
    fig.savefig(out, dpi=80)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", nargs=2, action="append", metavar=("NAME", "TENSORBOARD_DIR"), required=True)
    parser.add_argument("--out", required=True)
    options = parser.parse_args()
    plot([tuple(r) for r in options.run], options.out)


if __name__ == "__main__":
    main()
