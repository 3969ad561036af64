"""MkDocs hook: tables the docs take from the code, so docs and code cannot drift.

`<!-- config: SECTION -->` becomes the table of that params.yaml section (key, type, default, allowed values), read
from the typed schema (drafter_data/schema.py) and the default composition of conf/. `<!-- errors -->` becomes the
table of every one-line error a stage can stop with: each `StageError(...)` and `self.fail(...)` message in
stages/ and drafter_data/, read with `ast` (the `{...}` parts are filled in at run time).
"""
from __future__ import annotations

import ast
import re
import sys
import typing
from dataclasses import fields
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from drafter_data import schema  # noqa: E402 - after the path (mkdocs loads hooks from a path, not a package)
from drafter_data.config import compose  # noqa: E402


def type_name(annotation) -> str:
    if annotation is typing.Any:
        return "any"
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Union:
        inner = [type_name(a) for a in args if a is not type(None)]
        return " or ".join(inner) + " or null"
    if origin in (list, typing.List):
        return f"list of {type_name(args[0])}" if args else "list"
    if origin in (dict, typing.Dict):
        return "mapping"
    return getattr(annotation, "__name__", str(annotation))


def allowed(meta) -> str:
    if not meta:
        return ""
    if meta.get("choices"):
        return " \\| ".join(f"`{c}`" for c in meta["choices"])
    if (meta.get("low"), meta.get("high")) == (0.0, 1.0):
        return "0 to 1"
    parts = [f">= {meta['low']}" if meta.get("low") is not None else "",
             f"> {meta['above']}" if meta.get("above") is not None else "",
             f"<= {meta['high']}" if meta.get("high") is not None else ""]
    return ", ".join(p for p in parts if p)


def default_text(value) -> str:
    from omegaconf import OmegaConf

    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    text = str(value)
    return f"`{text}`" if len(text) <= 60 else f"`{text[:57]}...`"


def field_comments() -> dict[tuple[str, str], str]:
    """(dataclass name, field) -> the `# comment` on its line in drafter_data/schema.py: what the key is for."""
    found, current, above = {}, None, ""
    for line in (REPO / "drafter_data/schema.py").read_text().splitlines():
        if match := re.match(r"class (\w+)", line):
            current = match.group(1)
        elif match := re.match(r"    # (.+)$", line):
            above = match.group(1).strip()
            continue
        elif current and (match := re.match(r"    (\w+): [^#]*(?:#\s*(.+))?$", line)):
            if match.group(2) or above:
                found[(current, match.group(1))] = (match.group(2) or above).strip()
        above = ""
    return found


def config_rows(section: str) -> list[tuple[str, str, str, str, str]]:
    """(key, type, default, allowed) for every key of a params.yaml section, in the schema's order."""
    defaults = compose([], root=REPO)
    field_of = {f.name: f for f in fields(schema.Config)}
    kind = schema._dataclass_of(field_of[section].type)
    notes = field_comments()
    rows = []
    for f in fields(kind):
        value = defaults[section].get(f.name) if defaults.get(section) is not None else None
        nested = schema._dataclass_of(f.type)
        if nested is not None and typing.get_origin(f.type) is not list:
            for g in fields(nested):
                inner = value.get(g.name) if value is not None else None
                rows.append((f"{section}.{f.name}.{g.name}", type_name(g.type), default_text(inner),
                             allowed(g.metadata), notes.get((nested.__name__, g.name), "")))
            continue
        rows.append((f"{section}.{f.name}", type_name(f.type), default_text(value), allowed(f.metadata),
                     notes.get((kind.__name__, f.name), "")))
    return rows


def config_table(section: str) -> str:
    lines = ["| key | type | default | allowed | what it does |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| `{k}` | {t} | {d} | {a} | {n.replace('|', '&#124;')} |" for k, t, d, a, n in config_rows(section)]
    return "\n".join(lines)


def _text(node) -> str | None:
    """A message expression as text, `{...}` for what is filled in at run time; None when it is not a string."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{...}" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _text(node.left), _text(node.right)
        return None if left is None and right is None else (left or "{...}") + (right or "{...}")
    return None


def error_messages() -> list[tuple[str, str]]:
    """(module, message) of every StageError(...) / self.fail(...) with a message written in the code."""
    found = []
    for path in sorted([*REPO.glob("stages/*.py"), *REPO.glob("drafter_data/**/*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            if name not in ("StageError", "fail"):
                continue
            text = _text(node.args[0])
            if text and text.strip("{.}"):
                found.append((str(path.relative_to(REPO)), " ".join(text.split())))
    return found


def errors_table() -> str:
    lines = ["| the line starts or reads | where |", "| --- | --- |"]
    for module, message in error_messages():
        lines.append(f"| {message.replace('|', '&#124;')} | `{module}` |")
    return "\n".join(lines)


def on_page_markdown(markdown: str, **_) -> str:
    markdown = re.sub(r"<!-- config: ([a-z_]+) -->", lambda m: config_table(m.group(1)), markdown)
    return markdown.replace("<!-- errors -->", errors_table())
