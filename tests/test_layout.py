"""The package layout: entry points at the top, packages by concern, imports pointing one way, no cycle."""

import ast
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1] / "project"
ENTRY_POINTS = {"train", "prepare", "export", "generate", "plan", "sweep", "report", "gpu_check"}
# Each package may import the packages after it, never one before it (and the entry points import any).
LAYERS = ["tooling", "planning", "training", "config", "hf", "data", "parallel", "checkpoint", "model", "runtime"]


def module_name(path: Path) -> str:
    parts = path.relative_to(PROJECT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """Every project module `path` imports, at its top or inside a function alike."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "project":
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "project")
    return found & modules


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in PROJECT.rglob("*.py")}
    return {name: imports_of(path, set(paths)) - {name} for name, path in paths.items()}


def test_the_top_level_holds_the_entry_points_and_packages_only():
    modules = {p.stem for p in PROJECT.glob("*.py")} - {"__init__"}
    packages = {p.name for p in PROJECT.iterdir() if (p / "__init__.py").is_file()}
    assert modules == ENTRY_POINTS
    assert packages == set(LAYERS)


def test_packages_import_only_the_packages_below_them():
    wrong = []
    for module, imported in import_graph().items():
        package = module.split(".")[1] if module.count(".") >= 1 and module.split(".")[1] in LAYERS else None
        if package is None:
            continue  # an entry point, or the project package itself
        for other in imported:
            below = other.split(".")[1]
            if below != package and LAYERS.index(below) < LAYERS.index(package):
                wrong.append(f"{module} imports {other}")
    assert wrong == []


def test_no_module_imports_itself_through_others():
    graph, state, cycles = import_graph(), {}, []

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for other in sorted(graph[module]):
            if state.get(other) == "open":
                cycles.append(path[path.index(other) :] + [other])
            elif other not in state:
                visit(other, path + [other])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_the_graph_sees_imports_inside_functions():
    # The checks above would pass vacuously if the graph missed imports: one known edge of each kind.
    graph = import_graph()
    assert "project.model.config" in graph["project.model.llama"]  # at the top
    assert "project.hf.folder" in graph["project.config.checkpoints"]  # inside a function
