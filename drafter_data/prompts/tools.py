"""Tool declarations and tool calls, in the OpenAI form the server takes and the target's template renders.

- Declarations: `[{"type": "function", "function": {name, description, parameters}}]`; bare function schemas
  (glaive / LLaMA-Factory: `[{"name", "description", "parameters"}]`) are wrapped, wrapped ones kept.
- Calls: `{"id", "type": "function", "function": {"name", "arguments": <JSON text>}}`; a call without an id (glaive's
  function_call turn) gets `functions.<name>:<n>`, n counting the conversation's calls from 0, as Kimi K2 numbers them.

Numbers are re-serialized here, so JSON with an integer beyond 64 bits (which orjson would round to a float) or
nested too deeply to write back is rejected instead of changed.
"""
from __future__ import annotations

import json
import re
from typing import Any

import orjson

from drafter_data.prompts.malformed import Malformed

_LONG_DIGITS = re.compile(rb"\d{19}")  # cheap pre-check: no integer beyond 64 bits has fewer digits
_INT_RANGE = (-(2**63), 2**64 - 1)


def check_integers(text: bytes | str, where: str) -> None:
    """Raises Malformed if JSON text holds an integer that does not fit 64 bits (it would be silently rounded)."""
    data = text.encode() if isinstance(text, str) else text
    if not _LONG_DIGITS.search(data):
        return
    try:
        json.loads(data, parse_int=_int_in_range)
    except _OutOfRange as exc:
        raise Malformed("integer_out_of_range", f"{where}: the integer {exc.args[0][:40]} does not fit 64 bits") \
            from None
    except (ValueError, RecursionError):
        pass  # orjson read this text, so it is JSON; only its depth can trouble the json module


class _OutOfRange(Exception):
    pass


def _int_in_range(digits: str) -> int:
    value = int(digits)
    if not _INT_RANGE[0] <= value <= _INT_RANGE[1]:
        raise _OutOfRange(digits)
    return value


def loads_exact(text: str, reason: str, where: str) -> Any:
    """JSON text inside a record (e.g. glaive's `tools` string): parsed, or Malformed(reason)."""
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise Malformed(reason, f"{where} is not valid JSON: {exc}") from None
    check_integers(text, where)
    return value


def dumps_exact(value: Any, reason: str, where: str) -> str:
    try:
        return orjson.dumps(value).decode()
    except orjson.JSONEncodeError as exc:
        raise Malformed(reason, f"{where} cannot be written back as JSON: {exc}") from None


# -- declarations -----------------------------------------------------------------------------------------------------
def declarations(record: dict) -> list[dict] | None:
    """The record's tool declarations in OpenAI form, or None when it declares none (absent, null or empty)."""
    tools = record.get("tools")
    if tools is None:
        tools = record.get("functions")  # OpenAI's legacy field: bare function schemas
    if isinstance(tools, str):
        tools = loads_exact(tools, "invalid_tools", "'tools'") if tools.strip() else None
    if not tools:
        return None
    if not isinstance(tools, list):
        raise Malformed("invalid_tools", f"'tools' must be a list, got {type(tools).__name__}")
    return [_declaration(tool, i) for i, tool in enumerate(tools)]


def _declaration(tool: Any, i: int) -> dict:
    if not isinstance(tool, dict):
        raise Malformed("invalid_tools", f"tools[{i}] must be an object, got {type(tool).__name__}")
    if "function" in tool:
        if tool.get("type", "function") != "function":
            raise Malformed("invalid_tools", f"tools[{i}].type is {tool.get('type')!r}, not 'function'")
        _check_function(tool["function"], f"tools[{i}].function")
        return tool if "type" in tool else {"type": "function", **tool}
    _check_function(tool, f"tools[{i}]")
    return {"type": "function", "function": tool}


def _check_function(fn: Any, where: str) -> None:
    if not isinstance(fn, dict):
        raise Malformed("invalid_tools", f"{where} must be an object, got {type(fn).__name__}")
    name = fn.get("name")
    if not isinstance(name, str) or not name.strip():
        raise Malformed("invalid_tools", f"{where} needs a 'name' string")
    if not isinstance(fn.get("description", ""), str):
        raise Malformed("invalid_tools", f"{where}.description must be a string")
    if not isinstance(fn.get("parameters", {}), dict):
        raise Malformed("invalid_tools", f"{where}.parameters must be a JSON schema object")


# -- calls ------------------------------------------------------------------------------------------------------------
class CallLog:
    """A conversation's tool calls in order: numbers calls without an id, matches results to the calls they answer."""

    def __init__(self):
        self.count = 0
        self.pending: list[dict] = []  # calls not answered yet, oldest first

    def openai_calls(self, calls: Any, where: str) -> list[dict]:
        """An assistant message's `tool_calls` (OpenAI form), checked; calls without an id get one."""
        if not isinstance(calls, list) or not calls:
            raise Malformed("invalid_tool_call", f"{where} must be a non-empty list")
        out = []
        for i, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict):
                raise Malformed("invalid_tool_call", f"{where}[{i}] needs a 'function' object")
            out.append(self._call(fn, call.get("id"), f"{where}[{i}].function"))
        return out

    def glaive_calls(self, value: Any, where: str) -> list[dict]:
        """A function_call turn's value (`{"name", "arguments"}` as JSON text, or a list of them) as OpenAI calls."""
        parsed = loads_exact(value, "invalid_tool_call", where) if isinstance(value, str) else value
        calls = parsed if isinstance(parsed, list) else [parsed]
        if not calls or not all(isinstance(c, dict) for c in calls):
            raise Malformed("invalid_tool_call", f"{where} must be a JSON object {{name, arguments}}")
        return [self._call(c, c.get("id"), where) for c in calls]

    def _call(self, fn: dict, call_id: Any, where: str) -> dict:
        name, args = fn.get("name"), fn.get("arguments", {})
        if not isinstance(name, str) or not name.strip():
            raise Malformed("invalid_tool_call", f"{where} needs a 'name' string")
        if not isinstance(args, str):
            args = _arguments_text(args, where)
        if not isinstance(call_id, str) or not call_id:
            call_id = f"functions.{name}:{self.count}"
        self.count += 1
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
        self.pending.append(call)
        return call

    def result_fields(self, call_id: Any = None, name: Any = None) -> dict:
        """tool_call_id and name of a tool result: given ones kept, else those of the oldest unanswered call."""
        match = next((c for c in self.pending if c["id"] == call_id), None) if isinstance(call_id, str) else None
        if match is None and not isinstance(call_id, str) and self.pending:
            match = self.pending[0]
        if match is not None:
            self.pending.remove(match)
        fields = {}
        if isinstance(call_id, str) or match is not None:
            fields["tool_call_id"] = call_id if isinstance(call_id, str) else match["id"]
        if isinstance(name, str) and name:
            fields["name"] = name
        elif match is not None:
            fields["name"] = match["function"]["name"]
        return fields


def _arguments_text(args: Any, where: str) -> str:
    """Arguments given as a JSON value, written as JSON text the way Python's json writes it (as glaive's own text)."""
    try:
        return json.dumps(args, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise Malformed("invalid_tool_call", f"{where}.arguments cannot be written as JSON: {exc}") from None
