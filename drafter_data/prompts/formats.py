"""Turns one raw record of any supported prompt format into its conversation: (role, text, extras) turns, roles mapped
to the contract's four, extras the message's fields beyond role/content (`tool_calls`, `tool_call_id`, `name`,
`reasoning_content`) or None.

Formats: ShareGPT (`conversations` of `from`/`value`; glaive's function_call/observation turns; a top-level `system`),
OpenAI (`messages` of `role`/`content`, `tool_calls`, `tool_call_id`, the legacy `function_call`), Alpaca
(`instruction`/`input`), and prompt-only records (`prompt`, `question`, `query`, `instruction`, `text`, or a `turns`
list).
"""
from __future__ import annotations

from typing import Any

from drafter_data.prompts.malformed import Malformed
from drafter_data.prompts.tools import CallLog

__all__ = ["FORMATS", "MISSING_ANSWER", "Malformed", "Turn", "detect", "to_turns"]

FORMATS = ("auto", "jsonl", "sharegpt", "openai", "alpaca", "prompt")

# Speaker names seen in real ShareGPT-style files, mapped to the contract's four roles.
ROLE_NAMES = {
    "human": "user", "user": "user", "prompter": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "model": "assistant", "bot": "assistant", "function_call": "assistant", "tool_call": "assistant",
    "system": "system",
    "observation": "tool", "tool": "tool", "function": "tool", "ipython": "tool",
}
CALL_SPEAKERS = frozenset({"function_call", "tool_call"})  # assistant turns whose value is a tool call
PROMPT_KEYS = ("prompt", "question", "query", "instruction", "text", "input")

Turn = tuple[str, str, "dict | None"]
# Between the turns of a prompt-only `turns` list: an answer the record implies but does not have (text None)
MISSING_ANSWER: Turn = ("assistant", None, None)


def detect(record: Any) -> str:
    if not isinstance(record, dict):
        raise Malformed("wrong_type", f"a record must be a JSON object, got {type(record).__name__}")
    if "conversations" in record:
        return "sharegpt"
    if "messages" in record:
        messages = record["messages"]
        if isinstance(messages, list) and messages and isinstance(messages[0], dict) and "from" in messages[0]:
            return "sharegpt"
        return "openai"
    if "instruction" in record and ("output" in record or "input" in record):
        return "alpaca"
    if "turns" in record or any(key in record for key in PROMPT_KEYS):
        return "prompt"
    raise Malformed("missing_field", f"no known prompt field among keys {sorted(record)[:8]}")


def to_turns(record: Any, fmt: str, first_only: bool = False) -> list[Turn]:
    """The record's conversation as (role, text, extras) turns; with first_only it stops reading at the first user
    turn (all a `first` prompt needs; later turns are then not validated)."""
    if fmt in ("auto", "jsonl"):
        fmt = detect(record)
    elif not isinstance(record, dict):
        raise Malformed("wrong_type", f"a record must be a JSON object, got {type(record).__name__}")
    if fmt == "sharegpt":
        return _sharegpt(record, first_only)
    if fmt == "openai":
        return _openai(record, first_only)
    if fmt == "alpaca":
        return _alpaca(record)
    if fmt == "prompt":
        return _prompt_only(record)
    raise ValueError(f"unknown format {fmt!r}; choose one of {FORMATS}")


def _text(value: Any, where: str) -> str:
    """A message's text. Never altered silently: content parts other than text (an image, audio) and objects are
    rejected with their own reasons, not dropped or written out as JSON."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if isinstance(value, list):  # OpenAI content parts: text parts only
        kinds = sorted({str(p.get("type", "text")) if isinstance(p, dict) else type(p).__name__ for p in value}
                       - {"text"})
        if kinds:
            raise Malformed("non_text_content", f"{where} has {', '.join(kinds)} parts: the target is sent text "
                                                f"only, and a prompt is never cut down to its text")
        parts = [p.get("text", "") for p in value]
        if all(isinstance(p, str) for p in parts):
            return "".join(parts)
    if isinstance(value, dict):
        raise Malformed("object_content", f"{where} is an object, not text (keys {sorted(value)[:6]}): it is not "
                                          f"turned into JSON text silently")
    raise Malformed("wrong_type", f"{where} must be a string, got {type(value).__name__}")


def _speaker(name: Any, where: str) -> str:
    if not isinstance(name, str):
        raise Malformed("wrong_type", f"{where} must be a string, got {type(name).__name__}")
    speaker = name.strip().lower()
    if speaker not in ROLE_NAMES:
        raise Malformed("unknown_role", f"{where} {name!r} is not a known speaker")
    return speaker


def _turn_list(record: dict, key: str) -> list:
    turns = record.get(key)
    if turns is None:
        raise Malformed("missing_field", f"no '{key}' field")
    if not isinstance(turns, list):
        raise Malformed("wrong_type", f"'{key}' must be a list, got {type(turns).__name__}")
    return turns


def _system_field(record: dict) -> list[Turn]:
    system = record.get("system")
    return [("system", _text(system, "system"), None)] if system else []


def _sharegpt(record: dict, first_only: bool = False) -> list[Turn]:
    key = "conversations" if "conversations" in record else "messages"
    out = _system_field(record)  # LLaMA-Factory's ShareGPT keeps the system prompt beside the turns
    calls = None
    for i, turn in enumerate(_turn_list(record, key)):
        if not isinstance(turn, dict):
            raise Malformed("wrong_type", f"{key}[{i}] must be an object")
        speaker, value = turn.get("from"), turn.get("value")
        role = ROLE_NAMES.get(speaker) if isinstance(speaker, str) else None  # fast path: exact speaker names
        if role is None or not isinstance(value, str):
            if "from" not in turn or "value" not in turn:
                raise Malformed("missing_field", f"{key}[{i}] needs 'from' and 'value'")
            speaker = _speaker(speaker, f"{key}[{i}].from")
            role = ROLE_NAMES[speaker]
            if speaker not in CALL_SPEAKERS:
                value = _text(value, f"{key}[{i}].value")
        extras = None
        if role == "tool" or speaker in CALL_SPEAKERS:
            calls = calls or CallLog()
            if role == "tool":
                extras = calls.result_fields() or None
            else:
                extras, value = {"tool_calls": calls.glaive_calls(value, f"{key}[{i}].value")}, ""
        out.append((role, value, extras))
        if first_only and role == "user":
            break
    return out


def _openai(record: dict, first_only: bool = False) -> list[Turn]:
    out, calls = [], CallLog()
    for i, msg in enumerate(_turn_list(record, "messages")):
        if not isinstance(msg, dict):
            raise Malformed("wrong_type", f"messages[{i}] must be an object")
        if "role" not in msg:
            raise Malformed("missing_field", f"messages[{i}] has no 'role'")
        role = ROLE_NAMES[_speaker(msg["role"], f"messages[{i}].role")]
        extras = _openai_extras(msg, role, calls, f"messages[{i}]") if len(msg) > 2 else None
        out.append((role, _text(msg.get("content"), f"messages[{i}].content"), extras))
        if first_only and role == "user":
            break
    return out


def _openai_extras(msg: dict, role: str, calls: CallLog, where: str) -> dict | None:
    extras = {}
    if role == "assistant":
        if msg.get("tool_calls"):
            extras["tool_calls"] = calls.openai_calls(msg["tool_calls"], f"{where}.tool_calls")
        elif msg.get("function_call"):
            extras["tool_calls"] = calls.glaive_calls(msg["function_call"], f"{where}.function_call")
        reasoning = msg.get("reasoning_content") or msg.get("reasoning")
        if isinstance(reasoning, str) and reasoning:
            extras["reasoning_content"] = reasoning
    if role == "tool":
        extras.update(calls.result_fields(msg.get("tool_call_id"), msg.get("name")))
    elif isinstance(msg.get("name"), str) and msg["name"]:
        extras["name"] = msg["name"]
    return extras or None


def _alpaca(record: dict) -> list[Turn]:
    instruction = _text(record.get("instruction"), "instruction")
    extra = _text(record.get("input"), "input")
    prompt = f"{instruction}\n\n{extra}" if instruction.strip() and extra.strip() else (instruction + extra)
    return _system_field(record) + [("user", prompt, None)]


def _prompt_only(record: dict) -> list[Turn]:
    turns = _system_field(record)
    if "turns" in record:
        user_turns = record["turns"]
        if not isinstance(user_turns, list):
            raise Malformed("wrong_type", f"'turns' must be a list, got {type(user_turns).__name__}")
        for i, text in enumerate(user_turns):
            turns += [MISSING_ANSWER] if i else []
            turns.append(("user", _text(text, f"turns[{i}]"), None))
        return turns
    for key in PROMPT_KEYS:
        if key in record:
            return turns + [("user", _text(record[key], key), None)]
    raise Malformed("missing_field", "no prompt field")
