"""One parsed record -> the candidate prompt it becomes: (digest, messages, tools JSON, message_extras JSON, turns),
or Malformed(reason, detail) for a record that is malformed or unusable (empty, no user turn, too long, ...).

The plainest ShareGPT record (prepare.turns=first, its first user turn a string after nothing but plain answers) has a
quick path that gives the same digest and prompt without the general path's work: most records of a large run take it.
"""
from __future__ import annotations

from hashlib import blake2b

import orjson

from drafter_data.prompts import formats, tools
from drafter_data.prompts.malformed import Malformed
from drafter_data.prompts.prompt import to_prompt
from drafter_data.prompts.selection import prompt_digest


def normalize_record(record, raw: bytes, unit: dict, pcfg: dict, count_tokens=None) -> tuple:
    """One parsed record -> (digest, messages, tools JSON, message_extras JSON, turns); raises Malformed(reason,
    detail) for a record that is malformed or unusable (empty, no user turn, too long, ...)."""
    fields = unit["fields"]
    if fields and isinstance(record, dict):  # e.g. {prompt: query_text}: the file's own key names
        record = {**record, **{ours: record[theirs] for ours, theirs in fields.items() if theirs in record}}
    mode = pcfg.get("turns") or "first"
    turns = formats.to_turns(record, unit["format"], first_only=mode == "first")
    if not turns:
        raise Malformed("empty_conversation", "")
    prompt = to_prompt(turns, mode)
    if prompt is None:
        raise Malformed("no_user_turn", "")
    messages, extras, n_turns = prompt
    _check_length(messages, mode, pcfg.get("max_prompt_chars"))
    declared = tools.declarations(record)
    if declared is not None or extras is not None:  # numbers are written back: none may be rounded
        tools.check_integers(raw, "the record")
    tools_json = tools.dumps_exact(declared, "invalid_tools", "'tools'") if declared else None
    extras_json = tools.dumps_exact(extras, "invalid_tool_call", "the messages' tool fields") if extras else None
    return _identified(messages, declared, tools_json, extras_json, n_turns, pcfg, count_tokens, extras)


def _identified(messages: list[dict], declared: list | None, tools_json: str | None, extras_json: str | None,
                n_turns: int, pcfg: dict, count_tokens, extras: list | None = None) -> tuple:
    """The normalized prompt with its digest, after the target's token limit."""
    digest = prompt_digest(messages, tools_json, extras_json)
    if count_tokens is not None and count_tokens(_with_extras(messages, extras), declared) > \
            pcfg["max_prompt_tokens"]:
        raise Malformed("too_many_tokens", "")
    return digest, messages, tools_json, extras_json, n_turns


SHAREGPT_FORMATS = frozenset({"auto", "jsonl", "sharegpt"})
USER_SPEAKERS = frozenset(name for name, role in formats.ROLE_NAMES.items() if role == "user")
_ANSWER_SPEAKERS = frozenset(name for name, role in formats.ROLE_NAMES.items()
                             if role == "assistant" and name not in formats.CALL_SPEAKERS)


def plain_first_turn(record) -> str | None:
    """The text of a record's first user turn when the record is the plainest ShareGPT case for prepare.turns=first:
    no system prompt, no tools, and before that turn only answers of plain text (dropped by `first`; ShareGPT
    conversations cut mid-way start with one), every turn a string with an exact speaker name. The general path gives
    the same prompt, only slower."""
    if type(record) is not dict or "system" in record or "tools" in record or "functions" in record:
        return None
    turns = record.get("conversations")
    if type(turns) is not list:
        return None
    for turn in turns:
        if type(turn) is not dict:
            return None
        speaker, text = turn.get("from"), turn.get("value")
        if type(speaker) is not str or type(text) is not str:
            return None
        if speaker in USER_SPEAKERS:
            return text
        if speaker not in _ANSWER_SPEAKERS:
            return None
    return None


def _check_length(messages: list[dict], mode: str, max_chars) -> None:
    answered = [m for m in messages if m["role"] == "user"] if mode == "all" else messages[-1:]
    if any(_blank(m["content"]) for m in answered):
        raise Malformed("empty_prompt", "")
    if max_chars and sum(len(m["content"]) for m in messages) > max_chars:
        raise Malformed("too_long", "")


def _blank(text: str) -> bool:
    return not text or text.isspace()


_PLAIN_HEAD, PLAIN_DIGEST_TAIL = b'[{"role":"user","content":', b"}]"
_PLAIN_HASHER = blake2b(_PLAIN_HEAD, digest_size=16)


def plain_digest_hasher():
    """blake2b (16 bytes) that has hashed what comes before the text in a one-user-message prompt's digest: a copy,
    updated with orjson.dumps(text) and PLAIN_DIGEST_TAIL, gives plain_prompt_digest's digest, without concatenating
    the bytes first."""
    return _PLAIN_HASHER.copy()


def plain_prompt_digest(text: str, max_chars, count_tokens, max_tokens) -> bytes:
    """What normalize_record does for a prompt that is one user message (checks, then the digest of
    [{"role": "user", "content": text}], byte for byte the same), without building the message."""
    if not text or text.isspace():
        raise Malformed("empty_prompt", "")
    if max_chars and len(text) > max_chars:
        raise Malformed("too_long", "")
    if count_tokens is not None and count_tokens([{"role": "user", "content": text}], None) > max_tokens:
        raise Malformed("too_many_tokens", "")
    digest = plain_digest_hasher()
    digest.update(orjson.dumps(text))
    digest.update(PLAIN_DIGEST_TAIL)
    return digest.digest()


def _with_extras(messages: list[dict], extras: list | None) -> list[dict]:
    if extras is None:
        return messages
    return [{**m, **e} if e else m for m, e in zip(messages, extras)]
