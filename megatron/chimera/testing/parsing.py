"""Megatron-LM's parse_args, called a hundred times in one process: the harnesses (equivalence, cases) run
many cases per launch, and every rank parses each case's command line. Each call re-reads the source of
every config dataclass Megatron-LM builds flags from, for its fields' help text (inspect.getsource and
ast.parse: 0.07 s of a 0.09 s parse). That text cannot change while a process runs, so it is read once.
"""
from megatron.training.argument_utils import ArgumentGroupFactory


def read_field_docstrings_once() -> None:
    """From now on in this process, each dataclass's field docstrings are read on first use and then kept.
    Megatron-LM's own reader does the reading (its parent classes through this one, so they are kept too);
    its callers only read the dict it returns."""
    read, kept = ArgumentGroupFactory._get_field_docstrings, {}

    def read_once(self, src_cfg_class: type) -> dict[str, str]:
        if src_cfg_class not in kept:
            kept[src_cfg_class] = read(self, src_cfg_class)
        return kept[src_cfg_class]

    ArgumentGroupFactory._get_field_docstrings = read_once
