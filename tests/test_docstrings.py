"""Docstrings say what a module or function is for and the one idea a reader needs; the tuning history and its
figures go to the design notes or commit messages. None is longer than MAX_LINES."""
import ast

from tests.conftest import REPO

MAX_LINES = 25
FOLDERS = ("drafter_data", "stages", "scripts", "bench")
ALLOWED = {
}


def long_docstrings(root=REPO, folders=FOLDERS, allowed=ALLOWED) -> list[str]:
    found = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel in allowed:
                continue
            tree = ast.parse(path.read_text(), filename=rel)
            for node in [tree, *ast.walk(tree)]:
                if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                doc = ast.get_docstring(node, clean=True)
                if doc and len(doc.splitlines()) > MAX_LINES:
                    where = getattr(node, "name", "module")
                    found.append(f"{rel}:{getattr(node, 'lineno', 1)} {where}: {len(doc.splitlines())} lines")
    return sorted(set(found))


def test_no_docstring_is_longer_than_25_lines():
    assert long_docstrings() == []


def test_a_long_docstring_is_found(tmp_path):
    (tmp_path / "pkg").mkdir()
    body = "\n".join(f"line {i}" for i in range(MAX_LINES + 1))
    (tmp_path / "pkg" / "m.py").write_text(f'"""{body}"""\n\n\ndef f():\n    """{body}"""\n\n\ndef g():\n    """ok"""\n')
    assert long_docstrings(tmp_path, ("pkg",), set()) == ["pkg/m.py:1 module: 26 lines", "pkg/m.py:29 f: 26 lines"]
    assert long_docstrings(tmp_path, ("pkg",), {"pkg/m.py"}) == []
