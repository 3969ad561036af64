"""Kimi K2.6 tool declarations (`tools_ts_str`): the reference goldens exactly, rendered and tokenized end to end,
and hand-made schemas that pin single rules (expected text written from the rules, not from the encoder)."""
import copy
import json

import pytest

from drafter_data.tokens.chat_template import ChatTemplate
from drafter_data.tokens.kimi_tools import sort_keys_deep, tools_ts_str
from drafter_data.tokens.tokenizers import KimiTokenizer
from tests.conftest import KIMI_DIR, REPO, require_shared

HEAD = "# Tools\n\n## functions\nnamespace functions {\n"
TAIL = "\n}\n"


def _golden_cases() -> list[dict]:
    require_shared(REPO.parent / "shared")
    path = require_shared(KIMI_DIR / "tools_golden.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def cases() -> list[dict]:
    found = _golden_cases()
    assert len(found) == 10, f"expected the 10 tool cases, found {len(found)}"
    return found


@pytest.fixture(scope="module")
def kimi():
    require_shared(KIMI_DIR)
    tokenizer = KimiTokenizer(KIMI_DIR)
    source = require_shared(KIMI_DIR / "chat_template.jinja").read_text()
    return tokenizer, ChatTemplate(source, tokenizer.special_tokens_map)


def _function(name: str, parameters=None, description=None) -> dict:
    function = {"name": name}
    if description is not None:
        function["description"] = description
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def test_every_golden_tools_ts_str_exactly(cases):
    for case in cases:
        assert case["tools_ts_str"] is not None, case["id"]
        assert tools_ts_str(case["tools"]) == case["tools_ts_str"], case["id"]


def test_every_golden_rendered_and_tokenized(cases, kimi):
    tokenizer, template = kimi
    for case in cases:
        kwargs = {k: v for k, v in case["template_kwargs"].items() if k != "add_generation_prompt"}
        rendered = template.render(case["messages"], add_generation_prompt=False, tools=sort_keys_deep(case["tools"]),
                                   tools_ts_str=tools_ts_str(case["tools"]), **kwargs)
        assert rendered == case["rendered"], case["id"]
        assert tokenizer.encode_chat(rendered) == case["ids"], case["id"]


def test_sort_keys_deep_sorts_every_dict_keeps_lists_and_input():
    value = {"b": [{"z": 1, "a": {"y": 2, "c": 3}}, 3, "x"], "a": None}
    before = copy.deepcopy(value)
    result = sort_keys_deep(value)
    assert json.dumps(result) == '{"a": null, "b": [{"a": {"c": 3, "y": 2}, "z": 1}, 3, "x"]}'
    assert value == before and json.dumps(value) == json.dumps(before)  # the input is not reordered in place


def test_required_first_nested_indents_number_enums_constraints():
    parameters = {
        "type": "object",
        "properties": {
            "zeta": {"type": "number", "enum": [1, 2.5]},
            "mode": {"enum": [1, True, None, "x"]},
            "alpha": {
                "type": "object", "description": "Nested\n\nblock", "additionalProperties": False,
                "properties": {
                    "inner": {"type": "array", "items": {"type": "array", "items": {"type": "number", "minimum": 0}}},
                    "flag": {"type": "boolean", "default": True},
                },
                "required": ["inner"],
            },
            "limit": {"type": "integer", "minimum": 1, "maximum": 10, "default": None},
        },
        "required": ["zeta", "mode"],
    }
    expected = HEAD + "\n".join([
        "// Configure it.",
        "type configure = (_: {",
        '  mode: 1 | True | None | "x",',
        "  zeta: 1 | 2.5,",
        "  // Nested",
        "",
        "  // block",
        "  alpha?: {",
        "    inner: Array<Array<",
        "      // minimum: 0",
        "      number",
        "    >>,",
        "    // Default: True",
        "    flag?: boolean,",
        "    [k: string]: never",
        "  },",
        "  // maximum: 10, minimum: 1",
        "  limit?: number",
        "}) => any;",
    ]) + TAIL
    assert tools_ts_str([_function("configure", parameters, "Configure it.")]) == expected


def test_anyof_in_array_defaults_of_each_json_type_nullable_list():
    parameters = {"type": "object", "properties": {
        "items": {"type": "array", "items": {"anyOf": [
            {"type": "string"}, {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}]}},
        "s": {"type": "string", "default": 'a"b\n'},
        "n": {"type": "number", "default": 1.0},
        "o": {"type": "object", "default": {"b": 1, "a": [True, None]}},
        "nl": {"type": ["string", "null"], "default": None},
        "extra": {"type": "object", "additionalProperties": True},
    }}
    expected = HEAD + "\n".join([
        "type f = (_: {",
        "  extra?: {",
        "    [k: string]: any",
        "  },",
        "  items?: Array<string | {",
        "    id: number",
        "  }>,",
        "  // Default: 1.0",
        "  n?: number,",
        "  nl?: string | null,",
        '  // Default: {"a": [true, null], "b": 1}',
        "  o?: {},",
        '  // Default: "a\\"b\\n"',
        "  s?: string",
        "}) => any;",
    ]) + TAIL
    assert tools_ts_str([_function("f", parameters)]) == expected


def test_several_defs_ref_in_nested_property():
    parameters = {
        "type": "object",
        "$defs": {
            "Point": {"type": "object", "description": "A point", "properties": {
                "x": {"type": "number"}, "y": {"type": "number"}}, "required": ["x", "y"]},
            "Color": {"type": "string", "enum": ["red", "green"], "description": "Colour\nname"},
        },
        "properties": {"shape": {"type": "object", "required": ["center"], "properties": {
            "center": {"$ref": "#/$defs/Point", "description": "Centre"}, "fill": {"$ref": "#/$defs/Color"}}}},
        "required": ["shape"],
    }
    expected = HEAD + "\n".join([
        "// Colour",
        "// name",
        'interface Color "red" | "green"',
        "// A point",
        "interface Point {",
        "  x: number,",
        "  y: number",
        "}",
        "type draw = (_: {",
        "  shape: {",
        "    // Centre",
        "    center: Point,",
        "    fill?: Color",
        "  }",
        "}) => any;",
    ]) + TAIL
    assert tools_ts_str([_function("draw", parameters)]) == expected


def test_self_reference_makes_an_interface_in_key_order():
    # With `$ref: "#"` the reference writes the parameters as `interface parameters`, fields in key order (not
    # required-first) and drops the additionalProperties line.
    parameters = {"type": "object", "additionalProperties": False, "required": ["name"], "properties": {
        "name": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#"}}}}
    expected = HEAD + "\n".join([
        "interface parameters {",
        "  children?: Array<parameters>,",
        "  name: string",
        "}",
        "// A tree.",
        "type tree = (_: parameters) => any;",
    ]) + TAIL
    assert tools_ts_str([_function("tree", parameters, "A tree.")]) == expected


def test_missing_description_or_parameters_and_other_tool_types():
    tools = [_function("ping"), {"type": "web_search"}, _function("echo", {"type": "object", "properties": {}})]
    assert tools_ts_str(tools) == HEAD + "type ping = (_: {}) => any;\ntype echo = (_: {}) => any;" + TAIL
    assert tools_ts_str([{"type": "web_search"}]) == ""  # passed as is; the template then writes JSON
    assert tools_ts_str([]) is None


@pytest.mark.parametrize("bad", [
    {"note": {"description": "no type"}},
    {"ref": {"$ref": "#/definitions/X"}},
    {"ref": {"$ref": "#/$defs/Missing"}},
    {"level": {"type": "string", "enum": ["a", 1]}},
    {"kind": {"type": ["string", "weird"]}},
    {"obj": {"type": "object", "additionalProperties": "yes"}},
])
def test_unconvertible_schema_returns_none(bad):
    tools = [_function("ok", {"type": "object", "properties": {"a": {"type": "string"}}}),
             _function("broken", {"type": "object", "properties": bad})]
    assert tools_ts_str(tools) is None


def test_failed_conversion_renders_compact_json(kimi):
    _, template = kimi
    tools = [_function("broken", {"type": "object", "properties": {"note": {"description": "no type"}}})]
    messages = [{"role": "user", "content": "hi"}]
    rendered = template.render(messages, add_generation_prompt=False, tools=sort_keys_deep(tools),
                               tools_ts_str=tools_ts_str(tools))
    declared = json.dumps(sort_keys_deep(tools), separators=(",", ":"), ensure_ascii=False)
    user_turn = "<|im_user|>user<|im_middle|>hi<|im_end|>"
    assert rendered == f"<|im_system|>tool_declare<|im_middle|>{declared}<|im_end|>{user_turn}"
