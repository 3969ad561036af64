"""Kimi K2.5/K2.6 tool declarations: the TypeScript-style text the chat template receives as `tools_ts_str`.

The reference tokenizer sorts the keys of the OpenAI tool list recursively, then converts it (Moonshot's
`tool_declaration_ts.encode_tools_to_typescript_style`, published with K2.5); this module reproduces that text byte
for byte. For `[{"type": "function", "function": {"name", "description", "parameters"}}]`:

    # Tools
    <blank line>
    ## functions
    namespace functions {
    // A postal address                  <- each `$defs` entry: its description, then `interface Name <type>`
    interface Address { city: string, zip?: string }   (one field a line in the real text)
    // Ship a parcel.                    <- the function description, one `// ` line per line
    type ship_parcel = (_: {             <- the parameters: required fields first, then optional `name?:`, by name
      recipient: Address,
      // Tracking note                   <- a field's description, its sorted constraints, then `// Default: ...`
      // maxLength: 80, minLength: 1
      note?: string
    }) => any;
    }                                    <- then a final newline

Types are TypeScript's (integer -> number, enum / anyOf / type lists -> ` | `, arrays -> `Array<T>`, `$ref` -> the
def's name, additionalProperties -> `[k: string]: T` last); tools of other types are skipped. A schema the reference
cannot convert makes it fall back to compact JSON in the template: `tools_ts_str` then returns None.
"""
from __future__ import annotations

import json
from typing import Any

INDENT = "  "
# Only these keys are shown, and only on these types.
_CONSTRAINT_KEYS = {"string": ("maxLength", "minLength", "pattern"), "number": ("maximum", "minimum"),
                    "integer": ("maximum", "minimum"), "array": ("minItems", "maxItems")}
_TYPE_LIST_NAMES = {"string": "string", "number": "number", "integer": "number", "boolean": "boolean",
                    "null": "null", "object": "{}", "array": "Array<any>"}


def sort_keys_deep(value):
    """A copy with every dict's keys sorted, at any depth; list order is kept (the reference's `deep_sort_dict`)."""
    if isinstance(value, dict):
        return {key: sort_keys_deep(item) for key, item in sorted(value.items(), key=lambda kv: kv[0])}
    if isinstance(value, list):
        return [sort_keys_deep(item) for item in value]
    return value


def tools_ts_str(tools: list[dict]) -> str | None:
    """The exact `tools_ts_str` K2.6 passes to its chat template for `tools`, or None when it passes none (no
    tools, or a conversion error). "" (no function tools) is passed as is; the template treats it like None."""
    tools = sort_keys_deep(tools)
    if not tools:
        return None
    try:
        return _encode_tools(tools)
    except Exception:  # the reference catches every error here and falls back to JSON
        return None


def _encode_tools(tools: list[dict]) -> str:
    blocks = []
    for tool in tools:
        if tool.get("type") != "function":
            continue
        function = tool.get("function", {})
        if function:
            blocks.append(_function_block(function))
    if not blocks:
        return ""
    return "# Tools\n\n## functions\nnamespace functions {\n" + "\n".join(blocks) + "\n}\n"


def _function_block(function: dict) -> str:
    """Interfaces for `$defs` (and the self-referencing root), the description, then the `type name = ...` line."""
    context = _Context()
    root = _Object(function.get("parameters") or {}, context)
    # Decided right after the root is parsed: a `#` ref met later, inside a $defs entry, does not change the root.
    self_ref = context.self_ref
    interfaces = [_root_interface(root)] if self_ref else []
    # Only the entries known now are written; $defs nested inside them still resolve but get no interface.
    for name, schema in list(context.defs.items()):
        node = context.parse(schema)
        description = schema.get("description", "")
        head = _comment_lines(description, "") + "\n" if description else ""
        interfaces.append(f"{head}interface {name} {node.render('')}")
    signature = "parameters" if self_ref else root.render("")
    type_line = f"type {function.get('name', 'function')} = (_: {signature}) => any;"
    description = function.get("description")
    parts = ["\n".join(interfaces), (description and _comment_lines(description, "")) or "", type_line]
    return "\n".join(part for part in parts if part)


def _root_interface(root: _Object) -> str:
    # Unlike an object type: fields in key order (no required-first sort) and no additionalProperties line.
    body = ",\n".join(field.render(INDENT) for field in root.fields)
    return f"interface parameters {{\n{body}\n}}" if body else "interface parameters {}"


def _comment_lines(text: str, indent: str) -> str:
    return "\n".join(f"{indent}// {line}" if line else "" for line in text.split("\n"))


def _default_text(value: Any) -> str:
    # Python spelling for numbers and booleans (False, 0.5); JSON for strings, lists and objects.
    if isinstance(value, (int, float, bool)):
        return repr(value)
    return json.dumps(value, ensure_ascii=False)


class _Context:
    """Per function: the `$defs` registered so far (by any object parsed, in parse order) and whether `#` was
    referenced. A `$ref` must name an entry registered before it is parsed."""

    def __init__(self):
        self.defs: dict[str, Any] = {}
        self.self_ref = False

    def register(self, defs) -> None:
        if defs:
            for name, schema in defs.items():
                self.defs[name] = schema

    def parse(self, schema) -> _Type:
        """A schema as the reference types it: string/number/boolean/null and unknown type names as written,
        integer -> number, {} / true -> any, false -> null; `enum` -> `"a" | 1 | True | None` (strings quoted,
        others as Python str); `anyOf` and type lists -> ` | `; arrays -> `Array<T>` (split over lines when the item
        has a description or constraints); objects -> `{...}` with two-space indents, `[k: string]: T` last for
        additionalProperties (any for true, never for false); `$ref: "#/$defs/X"` -> `X`; `$ref: "#"` ->
        `parameters`, and the parameters become `interface parameters {...}`. What the reference cannot convert (a
        field without a type, an unknown ref form, an enum value of the wrong type, ...) raises ValueError."""
        if isinstance(schema, bool):
            return _Scalar("any" if schema else "null")
        if not isinstance(schema, dict):
            raise ValueError(f"not a JSON schema: {schema!r}")
        if "$ref" in schema:
            return _Ref(schema, self)
        if "anyOf" in schema:
            return _AnyOf(schema, self)
        if "enum" in schema:
            return _Enum(schema)
        if "type" in schema:
            return self._parse_typed(schema)
        if not schema:
            return _Scalar("any")
        raise ValueError(f"schema without type, enum, anyOf or $ref: {schema!r}")

    def _parse_typed(self, schema: dict) -> _Type:
        kind = schema["type"]
        if isinstance(kind, list):
            return _TypeList(schema)
        if kind == "object":
            return _Object(schema, self)
        if kind == "array":
            return _Array(schema, self)
        return _Scalar(kind, schema)

    def ref_name(self, ref: str) -> str:
        if ref == "#":
            self.self_ref = True
            return "parameters"
        if not ref.startswith("#/$defs/"):
            raise ValueError(f"unsupported $ref: {ref}")
        name = ref.split("/")[-1]
        if name not in self.defs:
            raise ValueError(f"$ref to an unknown definition: {ref}")
        if not isinstance(self.defs[name], dict):
            raise ValueError(f"definition {name} is not an object schema")
        return name


class _Type:
    """A parsed schema: its description and shown constraints (the comments above it) and its rendering."""

    def __init__(self, schema: dict, constraint_keys=()):
        self.description = schema.get("description", "")
        self.constraints = {key: value for key, value in schema.items() if key in constraint_keys}

    def comments(self, indent: str) -> str:
        lines = []
        if self.description:
            lines.append(_comment_lines(self.description, indent))
        if self.constraints:
            pairs = sorted(self.constraints.items(), key=lambda kv: kv[0])
            lines.append(indent + "// " + ", ".join(f"{key}: {value}" for key, value in pairs))
        return "".join(line + "\n" for line in lines)

    def render(self, indent: str):
        raise NotImplementedError


class _Scalar(_Type):
    def __init__(self, kind, schema: dict | None = None):
        self.kind = kind
        super().__init__(schema or {}, _CONSTRAINT_KEYS.get(kind, ()) if isinstance(kind, str) else ())

    def render(self, indent: str):
        # The type value is returned as written, even if it is not a string: like the reference, it is then
        # formatted where it lands in an f-string and rejected where it is joined (anyOf, multi-line Array).
        return "number" if self.kind == "integer" else self.kind


class _Enum(_Type):
    def __init__(self, schema: dict):
        super().__init__(schema)
        self.values = schema["enum"]
        if "type" in schema:
            _check_enum_values(self.values, schema["type"])

    def render(self, indent: str) -> str:
        return " | ".join(f'"{value}"' if isinstance(value, str) else str(value) for value in self.values)


def _check_enum_values(values, kind) -> None:
    """The reference rejects enum values that contradict a declared scalar type (null is always allowed)."""
    if isinstance(kind, list):
        if len(kind) == 1:
            kind = kind[0]
        elif len(kind) == 2 and "null" in kind:
            kind = kind[0] if kind[0] != "null" else kind[1]
        else:
            raise ValueError(f"enum with type {kind} is not supported")
    accepted = {"string": str, "number": (int, float), "integer": int, "boolean": bool}.get(kind) \
        if isinstance(kind, str) else None
    for value in values:
        # bool passes as number and integer, as Python's isinstance has it.
        if value is not None and accepted is not None and not isinstance(value, accepted):
            raise ValueError(f"enum value {value!r} is not of type {kind}")


class _AnyOf(_Type):
    def __init__(self, schema: dict, context: _Context):
        super().__init__(schema)
        self.options = [context.parse(option) for option in schema["anyOf"]]

    def render(self, indent: str) -> str:
        return " | ".join(option.render(indent) for option in self.options)


class _TypeList(_Type):
    def __init__(self, schema: dict):
        super().__init__(schema)
        self.names = [_TYPE_LIST_NAMES[kind] for kind in schema["type"]]

    def render(self, indent: str) -> str:
        return " | ".join(self.names)


class _Ref(_Type):
    def __init__(self, schema: dict, context: _Context):
        super().__init__(schema)
        self.name = context.ref_name(schema["$ref"])

    def render(self, indent: str) -> str:
        return self.name


class _Array(_Type):
    def __init__(self, schema: dict, context: _Context):
        super().__init__(schema, _CONSTRAINT_KEYS["array"])
        # A missing or empty `items` (also false) means any.
        self.item = context.parse(schema["items"]) if schema.get("items") else _Scalar("any")

    def render(self, indent: str) -> str:
        inner = indent + INDENT
        comments = self.item.comments(inner)
        if comments:
            return "".join(["Array<\n", comments, inner, self.item.render(inner), "\n", indent, ">"])
        # Kept on one line, the item renders at the array's own indent (so `Array<{` ... `}>` closes in line).
        return f"Array<{self.item.render(indent)}>"


class _Field:
    def __init__(self, name: str, schema, context: _Context, optional: bool):
        self.name = name
        self.type = context.parse(schema)
        self.optional = optional
        self.default = schema.get("default") if isinstance(schema, dict) else None

    def render(self, indent: str) -> str:
        text = self.type.comments(indent)
        if self.default is not None:  # a null default is not shown
            text += f"{indent}// Default: {_default_text(self.default)}\n"
        return text + f"{indent}{self.name}{'?' if self.optional else ''}: {self.type.render(indent)}"


class _Object(_Type):
    def __init__(self, schema: dict, context: _Context):
        super().__init__(schema)
        self.fields: list[_Field] = []
        self.extra = None
        if not schema:
            return
        if "$defs" in schema:
            context.register(schema["$defs"])
        extra = schema.get("additionalProperties")
        self.extra = context.parse(extra) if isinstance(extra, dict) else extra
        if "properties" not in schema:
            return
        properties = schema["properties"]
        optional = set(properties.keys()) - set(schema.get("required", []))
        self.fields = [_Field(name, prop, context, name in optional) for name, prop in properties.items()]

    def render(self, indent: str) -> str:
        inner = indent + INDENT
        required = sorted((f for f in self.fields if not f.optional), key=lambda f: f.name)
        optional = sorted((f for f in self.fields if f.optional), key=lambda f: f.name)
        lines = [field.render(inner) for field in required + optional]
        if self.extra is not None:
            lines.append(f"{inner}[k: string]: {self._extra_type(inner)}")
        if not lines:
            return "{}"
        return "{\n" + ",\n".join(lines) + "\n" + indent + "}"

    def _extra_type(self, indent: str):
        if self.extra is True:
            return "any"
        if self.extra is False:
            return "never"
        if isinstance(self.extra, _Type):
            return self.extra.render(indent)
        raise ValueError(f"unsupported additionalProperties: {self.extra!r}")
