"""The import rule of docs/architecture.md, read from the source (every `import` statement,
function-level ones too, parsed with ast; nothing is imported): `cli -> analysis -> evals ->
engine`, never back up, and no circle of imports among the modules of evals/ or among its parts
(its subpackages and top-level modules)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Lower layers never import higher ones.
LAYERS = {"engine": 0, "evals": 1, "analysis": 2, "cli": 3}


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for the packages of LAYERS and the top-level cli.py."""
    found = {}
    for top in LAYERS:
        for path in sorted(root.glob(f"{top}/**/*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    if (root / "cli.py").is_file():
        found["cli"] = root / "cli.py"
    return found


def import_graph(root: Path) -> dict[str, dict[str, int]]:
    """module -> {imported module of the tree: line of its first import}. `from pkg import name`
    counts as importing `pkg.name` when that is a module, else `pkg`; an import of a name inside a
    module (`from evals.results import X`) counts as importing that module."""
    mods = modules(root)

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        found: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module
                names = [f"{source}.{a.name}" if f"{source}.{a.name}" in mods else source
                         for a in node.names]
            else:
                continue
            for name in names:
                target = resolve(name)
                if target is not None and target != mod:
                    found.setdefault(target, node.lineno)
        graph[mod] = found
    return graph


def upward_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    """`a:line -> b` for every import of a higher layer than the importer's."""
    layer = lambda m: LAYERS[m.split(".")[0]]  # noqa: E731
    return [f"{a}:{line} -> {b}" for a, targets in graph.items() for b, line in targets.items()
            if layer(b) > layer(a)]


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One circle of imports (`[a, b, ..., a]`), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt, path)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [])):
            return cycle
    return None


def restricted(graph: dict[str, dict[str, int]], prefix: str, depth: int | None = None
               ) -> dict[str, dict[str, int]]:
    """The graph among the modules under `prefix`; with `depth`, each module is merged into its
    ancestor of that many dotted parts (depth 2 under evals: `evals.run`, `evals.results`, ...)."""
    part = (lambda m: ".".join(m.split(".")[:depth])) if depth else (lambda m: m)  # noqa: E731
    out: dict[str, dict[str, int]] = {}
    for a, targets in graph.items():
        if not a.startswith(prefix + "."):
            continue
        edges = out.setdefault(part(a), {})
        for b, line in targets.items():
            if b.startswith(prefix + ".") and part(b) != part(a):
                edges.setdefault(part(b), line)
    return out


GRAPH = import_graph(ROOT)


def test_the_graph_reads_every_layer_and_function_level_imports():
    assert {m.split(".")[0] for m in GRAPH} == set(LAYERS)
    assert len(GRAPH) > 100
    # cli.py imports the benchmarks inside its `bench` command only
    assert "evals.benchmarks" in GRAPH["cli"]


def test_the_checks_catch_an_upward_import_and_a_circle(tmp_path):
    for name, text in {
        "engine/__init__.py": "",
        "engine/core.py": "def f():\n    from evals import run\n",
        "evals/__init__.py": "",
        "evals/run/__init__.py": "",
        "evals/run/plan.py": "from ..budget import x\n",
        "evals/budget.py": "def g():\n    from .run.plan import y\n",
        "evals/tables.py": "import evals.budget\n",
    }.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path)
    assert upward_imports(graph) == ["engine.core:2 -> evals.run"]
    assert find_cycle(restricted(graph, "evals")) == ["evals.budget", "evals.run.plan", "evals.budget"]
    assert find_cycle(restricted(graph, "evals", depth=2)) == ["evals.budget", "evals.run", "evals.budget"]
    assert graph["evals.tables"] == {"evals.budget": 1}


def test_imports_go_one_way_cli_analysis_evals_engine():
    assert upward_imports(GRAPH) == []


def test_the_kernels_sit_below_the_models():
    # the CPU kernels' build cache comes from engine/paths.py, not from the model loader
    assert [f"{a}:{line} -> {b}" for a, targets in GRAPH.items() if a.startswith("engine.kernels")
            for b, line in targets.items() if b.startswith("engine.models")] == []


def test_no_circle_of_imports_among_the_modules_of_evals():
    cycle = find_cycle(restricted(GRAPH, "evals"))
    assert cycle is None, " -> ".join(cycle)


def test_no_circle_of_imports_among_the_parts_of_evals():
    cycle = find_cycle(restricted(GRAPH, "evals", depth=2))
    assert cycle is None, " -> ".join(cycle)
