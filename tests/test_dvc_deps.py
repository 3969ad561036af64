"""dvc.yaml's code deps follow the code: every project module a stage imports (directly or through other modules,
at the top or inside a function) is covered by one of the stage's deps, so changing it makes `dvc status` show the
stage as changed. Also: the library never imports a stage, and imports have no cycles."""
import ast
from pathlib import Path

import yaml

from tests.conftest import REPO

# Modules that cannot change what a stage writes (where MLflow runs are logged); dvc.yaml says so too.
NOT_DEPS = {"drafter_data/tracking.py"}


def module_file(name: str) -> Path | None:
    base = REPO / Path(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imported_modules(path: Path) -> set[str]:
    """Every drafter_data/stages module imported anywhere in the file (from-imports of submodules included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return {n for n in found if n.split(".")[0] in ("drafter_data", "stages") and module_file(n)}


def closure(entry: Path) -> dict[Path, set[Path]]:
    """file -> files it imports, for every project file reachable from entry."""
    graph, todo = {}, [entry]
    while todo:
        path = todo.pop()
        if path in graph:
            continue
        graph[path] = {module_file(m) for m in imported_modules(path)}
        # a module inside a package also runs the package's __init__
        graph[path] |= {p / "__init__.py" for p in path.parents if (p / "__init__.py").is_file() and REPO in p.parents}
        todo.extend(graph[path])
    return graph


def stages():
    return yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]


def test_every_imported_module_is_a_declared_dep():
    for name, stage in stages().items():
        deps = [REPO / (d if isinstance(d, str) else next(iter(d))) for d in stage["deps"]]
        entry = REPO / "stages" / f"{name}.py"
        assert entry in deps, f"stage {name} must depend on its own module"
        for path in closure(entry):
            rel = path.relative_to(REPO).as_posix()
            if rel in NOT_DEPS or (path.name == "__init__.py" and path.stat().st_size == 0):
                continue
            assert any(path == d or d in path.parents for d in deps), \
                f"stage {name} imports {rel}, but dvc.yaml does not list it (or a folder holding it) in its deps"


def test_the_library_never_imports_a_stage_and_has_no_cycles():
    files = sorted((REPO / "drafter_data").rglob("*.py"))
    graph = {}
    for path in files:
        imports = imported_modules(path)
        assert not any(m.startswith("stages") for m in imports), f"{path} imports a stage"
        graph[path] = {module_file(m) for m in imports} - {path}
    state = {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in graph.get(node, ()):
            if nxt.name == "__init__.py":
                continue
            assert state.get(nxt) != "open", "import cycle: " + " -> ".join(p.name for p in stack + [nxt])
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for path in files:
        if path not in state:
            visit(path, [path])
