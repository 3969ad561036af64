"""Turns one raw record of any supported prompt format into the contract's messages: [{role, content}, ...].

Formats: ShareGPT (`conversations` of `from`/`value`), OpenAI (`messages` of `role`/`content`), Alpaca
(`instruction`/`input`), and prompt-only records (`prompt`, `question`, `query`, `instruction`, `text`, or a `turns` list).
"""
from __future__ import annotations

from typing import Any

import orjson

FORMATS = ("auto", "jsonl", "sharegpt", "openai", "alpaca", "prompt")

# Speaker names seen in real ShareGPT-style files, mapped to the contract's four roles.
ROLE_NAMES = {
    "human": "user", "user": "user", "prompter": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "model": "assistant", "bot": "assistant", "function_call": "assistant", "tool_call": "assistant",
    "system": "system",
    "observation": "tool", "tool": "tool", "function": "tool", "ipython": "tool",
}
PROMPT_KEYS = ("prompt", "question", "query", "instruction", "text", "input")


class Malformed(Exception):
    """The record does not have the shape its format needs; args[0] is the reason, args[1] the detail."""


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


def to_turns(record: Any, fmt: str, first_only: bool = False) -> list[tuple[str, str]]:
    """The record's conversation as (role, text) pairs, roles already mapped; with first_only it stops reading at
    the first user turn (all a `first` prompt needs; later turns are then not validated)."""
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
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if isinstance(value, list):  # OpenAI content parts: keep the text parts
        parts = [p.get("text", "") for p in value if isinstance(p, dict) and p.get("type", "text") == "text"]
        if all(isinstance(p, str) for p in parts):
            return "".join(parts)
    if isinstance(value, dict):  # e.g. a function_call given as an object
        return orjson.dumps(value).decode()
    raise Malformed("wrong_type", f"{where} must be a string, got {type(value).__name__}")


def _role(name: Any, where: str) -> str:
    if not isinstance(name, str):
        raise Malformed("wrong_type", f"{where} must be a string, got {type(name).__name__}")
    role = ROLE_NAMES.get(name.strip().lower())
    if role is None:
        raise Malformed("unknown_role", f"{where} {name!r} is not a known speaker")
    return role


def _turn_list(record: dict, key: str) -> list:
    turns = record.get(key)
    if turns is None:
        raise Malformed("missing_field", f"no '{key}' field")
    if not isinstance(turns, list):
        raise Malformed("wrong_type", f"'{key}' must be a list, got {type(turns).__name__}")
    return turns


def _sharegpt(record: dict, first_only: bool = False) -> list[tuple[str, str]]:
    key = "conversations" if "conversations" in record else "messages"
    out = []
    for i, turn in enumerate(_turn_list(record, key)):
        if not isinstance(turn, dict):
            raise Malformed("wrong_type", f"{key}[{i}] must be an object")
        speaker, value = turn.get("from"), turn.get("value")
        role = ROLE_NAMES.get(speaker) if isinstance(speaker, str) else None  # fast path: exact speaker names
        if role is None or not isinstance(value, str):
            if "from" not in turn or "value" not in turn:
                raise Malformed("missing_field", f"{key}[{i}] needs 'from' and 'value'")
            role, value = _role(speaker, f"{key}[{i}].from"), _text(value, f"{key}[{i}].value")
        out.append((role, value))
        if first_only and role == "user":
            break
    return out


def _openai(record: dict, first_only: bool = False) -> list[tuple[str, str]]:
    out = []
    for i, msg in enumerate(_turn_list(record, "messages")):
        if not isinstance(msg, dict):
            raise Malformed("wrong_type", f"messages[{i}] must be an object")
        if "role" not in msg:
            raise Malformed("missing_field", f"messages[{i}] has no 'role'")
        content = msg.get("content")
        if content is None and msg.get("tool_calls"):
            content = orjson.dumps(msg["tool_calls"]).decode()
        out.append((_role(msg["role"], f"messages[{i}].role"), _text(content, f"messages[{i}].content")))
        if first_only and out[-1][0] == "user":
            break
    return out


def _alpaca(record: dict) -> list[tuple[str, str]]:
    instruction = _text(record.get("instruction"), "instruction")
    extra = _text(record.get("input"), "input")
    prompt = f"{instruction}\n\n{extra}" if instruction.strip() and extra.strip() else (instruction + extra)
    turns = [("system", _text(record["system"], "system"))] if record.get("system") else []
    turns.append(("user", prompt))
    return turns


def _prompt_only(record: dict) -> list[tuple[str, str]]:
    turns = [("system", _text(record["system"], "system"))] if record.get("system") else []
    if "turns" in record:
        user_turns = record["turns"]
        if not isinstance(user_turns, list):
            raise Malformed("wrong_type", f"'turns' must be a list, got {type(user_turns).__name__}")
        return turns + [("user", _text(t, f"turns[{i}]")) for i, t in enumerate(user_turns)]
    for key in PROMPT_KEYS:
        if key in record:
            return turns + [("user", _text(record[key], key))]
    raise Malformed("missing_field", "no prompt field")


def tools_of(record: Any) -> str | None:
    """A record's tool declaration as a JSON string (ShareGPT/LLaMA-Factory keep it as a string), or None."""
    if not isinstance(record, dict):
        return None
    tools = record.get("tools")
    if isinstance(tools, str):
        try:
            tools = orjson.loads(tools)
        except orjson.JSONDecodeError:
            raise Malformed("invalid_tools", "'tools' is a string but not JSON") from None
    if not tools:
        return None
    if not isinstance(tools, list):
        raise Malformed("wrong_type", f"'tools' must be a list, got {type(tools).__name__}")
    return orjson.dumps(tools).decode()


def to_prompt(turns: list[tuple[str, str]], mode: str = "first") -> list[dict[str, str]]:
    """The conversation the target should answer: leading non-user turns other than system are dropped,
    consecutive turns of one role merged; `first` ends at the first user turn, `last` at the last one.
    Returns [] when there is no user turn."""
    merged: list[list[str]] = []
    seen_user = False
    for role, text in turns:
        if not seen_user and role in ("assistant", "tool"):
            continue  # a conversation that starts with the assistant (a split chunk): drop those turns
        if seen_user and mode == "first":
            break  # the first user turn ends the prompt; a following user turn is a separate follow-up
        seen_user = seen_user or role == "user"
        if merged and merged[-1][0] == role:
            merged[-1][1] = f"{merged[-1][1]}\n\n{text}" if merged[-1][1] and text else merged[-1][1] + text
        else:
            merged.append([role, text])
    users = [i for i, (role, _) in enumerate(merged) if role == "user"]
    if not users:
        return []
    end = users[0] if mode == "first" else users[-1]
    return [{"role": role, "content": text} for role, text in merged[: end + 1]]
