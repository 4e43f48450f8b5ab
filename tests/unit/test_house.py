"""The house's bars, read from the source: functions short enough to read top to bottom, and Megatron-LM's
namespace read only where it belongs (config/, the testing helpers, the schedule CLI's own parser),
everywhere else handed on only to Megatron-LM's functions (issue 41)."""
import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOURCES = ("chimera_schedules", os.path.join("megatron", "chimera"), "benchmarks", "scripts", "pretrain_gpt.py")
LONGEST_FUNCTION = 60
# Where reading the namespace field by field is the job: validation and the typed sections, the helpers
# the tests share, and the schedule CLI, whose namespace is its own parser's
NAMESPACE_READERS = (os.path.join("megatron", "chimera", "config") + os.sep,
                     os.path.join("megatron", "chimera", "testing") + os.sep,
                     os.path.join("chimera_schedules", "tools", "cli.py"))
# Reads left elsewhere, each the argument of a Megatron-LM function or a flag Megatron-LM's own code reads
NAMESPACE_READS_ALLOWED = 40
READ = re.compile(r"\bargs\.[a-z_]+")


def python_files(*tops: str) -> list[str]:
    """Every Python file under ``tops`` (a file names itself), relative to the repository root."""
    out = []
    for top in tops:
        path = os.path.join(ROOT, top)
        if path.endswith(".py"):
            out.append(top)
            continue
        out += [os.path.relpath(os.path.join(folder, name), ROOT)
                for folder, _, names in os.walk(path) for name in names if name.endswith(".py")]
    return sorted(out)


def source(relative: str) -> str:
    with open(os.path.join(ROOT, relative)) as f:
        return f.read()


def test_no_function_is_longer_than_a_screen():
    long = [f"{path}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path in python_files(*SOURCES) for node in ast.walk(ast.parse(source(path)))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > LONGEST_FUNCTION]
    assert long == [], f"functions over {LONGEST_FUNCTION} lines: {long}"


def test_the_namespace_is_read_only_where_it_belongs():
    reads = {path: len(READ.findall(source(path))) for path in python_files(*SOURCES[:2], SOURCES[-1])
             if not path.startswith(NAMESPACE_READERS)}
    total = sum(reads.values())
    busiest = sorted(((n, p) for p, n in reads.items() if n), reverse=True)
    assert total < NAMESPACE_READS_ALLOWED, f"{total} reads of args.<field> outside config/ and testing/: {busiest}"


def test_the_run_plan_is_made_from_the_typed_sections_alone():
    """make_run_plan takes the job's pipeline and parallel sections (config/job.py): run_plan.py never reads
    Megatron-LM's namespace, whose rules end with validation."""
    text = source(os.path.join("megatron", "chimera", "config", "run_plan.py"))
    reads = READ.findall(text) + re.findall(r"\bmegatron_args\b", text)
    assert reads == [], f"run_plan.py reads the namespace: {reads}"
