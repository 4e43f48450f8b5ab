"""The house's arrows point down: no import cycle anywhere in our code, and each layer of the schedule
library imports only the layers below it. Imports are read from the source (inside functions too), so a
cycle hidden behind a function-level import counts."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("chimera_schedules", os.path.join("megatron", "chimera"))
# the schedule library's layers, bottom first; runtime stands beside them on the IR alone
LAYERS = ("ir", "analysis", "passes", "generators", "registry", "tools", "__main__")
RUNTIME_MAY_IMPORT = ("ir", "runtime")


def modules() -> dict[str, str]:
    """Dotted module name -> file, for every module of our packages."""
    out = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    out[dotted.removesuffix(".__init__")] = path
    return out


def imports(name: str, path: str, known: dict[str, str]) -> set[str]:
    """The modules of ours that ``name`` imports, resolving relative imports."""
    is_package = path.endswith("__init__.py")
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            target = f"{base}.{node.module}" if node.level and node.module else base if node.level else node.module
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)  # from package import module
    return {m for m in found if m in known and m != name}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def layer(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def test_no_import_cycle_anywhere():
    assert cycles(graph()) == []


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_each_library_layer_imports_only_the_layers_below_it():
    wrong = []
    for module, targets in graph().items():
        if not module.startswith("chimera_schedules."):
            continue
        for target in targets:
            if not target.startswith("chimera_schedules."):
                wrong.append(f"{module} -> {target} (the library imports nothing from the trainer)")
            elif layer(module) == "runtime":
                if layer(target) not in RUNTIME_MAY_IMPORT:
                    wrong.append(f"{module} -> {target} (the runtime imports only the IR)")
            elif layer(target) == "runtime" or LAYERS.index(layer(target)) > LAYERS.index(layer(module)):
                wrong.append(f"{module} -> {target}")
    assert wrong == []


def test_the_library_is_in_its_layers():
    top = {m.split(".")[1] for m in modules() if m.startswith("chimera_schedules.")}
    assert top == set(LAYERS + ("runtime",))


def test_nothing_outside_the_testing_helpers_imports_them():
    """megatron.chimera.testing serves the tests and gpu_check: the trainer and the library never
    import it, so test hooks stay out of the production loop."""
    helpers = "megatron.chimera.testing"
    wrong = [f"{module} -> {target}" for module, targets in graph().items() if not module.startswith(helpers)
             for target in targets if target.startswith(helpers)]
    assert wrong == []


def _imported(path: str, module_level_only: bool = False) -> set[str]:
    """Every absolute module name a file imports (inside functions too, unless ``module_level_only``)."""
    tree = ast.parse(open(path).read())
    nodes = tree.body if module_level_only else ast.walk(tree)
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _megatron_reached(path: str, module_level_only: bool = False) -> list[str]:
    """The chains of imports from ``path`` through our own sources that reach megatron (megatron-core or ours)."""
    chains, seen, todo = [], set(), [(path, [os.path.relpath(path, ROOT)], module_level_only)]
    while todo:
        file, chain, top_only = todo.pop()
        for name in sorted(_imported(file, top_only)):
            if name.split(".")[0] == "megatron":
                chains.append(" -> ".join(chain + [name]))
                continue
            source = os.path.join(ROOT, *name.split("."))
            for candidate in (source + ".py", os.path.join(source, "__init__.py")):
                if os.path.isfile(candidate) and candidate not in seen:
                    seen.add(candidate)
                    todo.append((candidate, chain + [name], False))
    return chains


def test_the_schedule_librarys_tests_import_no_megatron():
    """tests/schedules (the schedule library's tests) and what they import of ours, transitively, and the
    shared conftest's module level, import nothing of megatron: ``pytest tests/schedules`` never pays
    megatron-core's import."""
    folder = os.path.join(ROOT, "tests", "schedules")
    files = [os.path.join(folder, f) for f in sorted(os.listdir(folder)) if f.endswith(".py")]
    assert len(files) >= 8, f"tests/schedules holds {len(files)} files"
    chains = [c for f in files for c in _megatron_reached(f)]
    chains += _megatron_reached(os.path.join(ROOT, "tests", "conftest.py"), module_level_only=True)
    assert chains == [], "imports that reach megatron: " + "; ".join(chains[:5])
