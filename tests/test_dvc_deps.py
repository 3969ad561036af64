"""dvc.yaml's code deps follow the code: every project module a stage imports (directly or through other modules,
at the top or inside a function) is covered by one of the stage's deps, so changing it makes `dvc status` show the
stage as changed. Also: the library never imports a stage, and imports have no cycles."""
import ast
from pathlib import Path

import yaml

from tests.conftest import REPO

# Modules that read the whole config without it deciding what the stage writes: where MLflow runs are logged (the
# config as run params), and the schema (every key is checked before any work; a valid value of another stage's key
# changes nothing this stage writes). Deps like any other module.
LOGS_ALL_CONFIG = {"drafter_data/tracking.py", "drafter_data/schema.py"}


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
            if path.name == "__init__.py" and path.stat().st_size == 0:
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


def config_reads(path: Path) -> set[tuple[str, str | None]]:
    """(section, key) for each `cfg.section.key`, `cfg.section.get("key")` and `cfg.section` (key None: the section
    handed on whole) in a file; `cfg` being the name the stages and the library give the whole config."""
    reads = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "cfg":
            reads.add((node.attr, None))
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and \
                isinstance(node.value.value, ast.Name) and node.value.value.id == "cfg" and node.attr != "get":
            reads.add((node.value.attr, node.attr))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and \
                isinstance(node.func.value, ast.Attribute) and isinstance(node.func.value.value, ast.Name) and \
                node.func.value.value.id == "cfg" and node.args and isinstance(node.args[0], ast.Constant):
            reads.add((node.func.value.attr, node.args[0].value))
    return reads


def test_every_param_a_stage_reads_is_declared():
    """A stage declares in dvc.yaml the params it reads, so changing one of them makes DVC re-run it (the MLflow
    module, which logs the whole config as run params, and the schema, which checks it, do not count)."""
    for name, stage in stages().items():
        declared = {str(p) for p in stage.get("params", [])}
        for path in closure(REPO / "stages" / f"{name}.py"):
            if path.relative_to(REPO).as_posix() in LOGS_ALL_CONFIG:
                continue
            for section, key in config_reads(path):
                whole = section in declared
                keyed = key is None and any(d.startswith(section + ".") for d in declared)
                assert whole or keyed or f"{section}.{key}" in declared, \
                    f"stage {name} reads {section}.{key or '*'} ({path.relative_to(REPO)}), which dvc.yaml does " \
                    f"not declare in its params"


def test_dvc_lock_matches_the_code_and_params_it_names():
    """The committed dvc.lock records the code and params the data was made with: on a fresh clone `dvc status` must
    not show a stage changed by its code or params (data deps and outputs, which a clone lacks, are not compared).
    After changing code or conf/, run `dvc repro` and commit dvc.lock."""
    import json
    import subprocess
    import sys

    tracked = set(subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                                 check=True).stdout.splitlines())

    def in_git(path: str) -> bool:
        return path in tracked or any(name.startswith(path.rstrip("/") + "/") for name in tracked)

    done = subprocess.run([sys.executable, "-m", "dvc", "status", "--json"], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**__import__("os").environ, "DVC_NO_ANALYTICS": "1"})
    assert done.returncode == 0, done.stderr
    stale = []
    for stage, entries in json.loads(done.stdout or "{}").items():
        for entry in entries:
            if isinstance(entry, str):
                if entry != "always changed":
                    stale.append(f"{stage}: {entry}")
                continue
            for path, state in entry.get("changed deps", {}).items():
                if isinstance(state, dict):
                    stale += [f"{stage}: param {key} {how}" for key, how in state.items()]
                elif state != "deleted" and in_git(path):
                    stale.append(f"{stage}: {path} {state}")
    assert not stale, f"dvc.lock is older than the code and params it names ({'; '.join(stale[:8])}): run " \
                      f"`dvc repro` and commit dvc.lock"
