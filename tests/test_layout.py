"""The package layout: entry points at the top, packages by concern, imports pointing one way, no cycle."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ROOT / "project"
ENTRY_POINTS = {"train", "prepare", "export", "generate", "plan", "sweep", "report"}
# Each package may import the packages after it, never one before it (and the entry points import any).
LAYERS = ["planning", "training", "config", "hf", "data", "parallel", "checkpoint", "model", "runtime"]
# Beside the product: tools may use benchmarks' scaffolding, both may use the product, the product uses neither
# (but for the two entry points that run a tool: project.report and project.sweep).
BESIDE = ["tools", "benchmarks"]
RUNS_A_TOOL = {"project.report": "tools.report", "project.sweep": "tools.sweep"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """Every module of ours (the product, the tools, the benchmarks) `path` imports, at its top or inside a function
    alike."""
    ours, found = {"project", *BESIDE}, set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ours:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] in ours)
    return found & modules


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for top in ("project", *BESIDE) for p in (ROOT / top).rglob("*.py")}
    return {name: imports_of(path, set(paths)) - {name} for name, path in paths.items()}


def test_the_top_level_holds_the_entry_points_and_packages_only():
    modules = {p.stem for p in PROJECT.glob("*.py")} - {"__init__"}
    packages = {p.name for p in PROJECT.iterdir() if (p / "__init__.py").is_file()}
    assert modules == ENTRY_POINTS
    assert packages == set(LAYERS)


def test_the_product_imports_no_tool_or_benchmark_and_benchmarks_no_tool():
    wrong = []
    for module, imported in import_graph().items():
        top = module.split(".")[0]
        for other in imported:
            other_top = other.split(".")[0]
            if top == "project" and other_top in BESIDE and RUNS_A_TOOL.get(module) != other:
                wrong.append(f"{module} imports {other}")
            if top == "benchmarks" and other_top == "tools":
                wrong.append(f"{module} imports {other}")
    assert wrong == []


def test_packages_import_only_the_packages_below_them():
    wrong = []
    for module, imported in import_graph().items():
        parts = module.split(".")
        package = parts[1] if parts[0] == "project" and len(parts) > 1 and parts[1] in LAYERS else None
        if package is None:
            continue  # an entry point, the project package itself, a tool or a benchmark
        for other in imported:
            if other.split(".")[0] != "project" or other == "project":
                continue  # the product imports no tool (the test above)
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
    assert "benchmarks.runner" in graph["tools.gpu_check.check"]  # beside the product
    assert "tools.report" in graph["project.report"]
