"""One prompt's conversation as generate regenerates it: turn k sends the prompt's messages up to its k-th user turn
with the target's own answers to the earlier turns in between, exactly as a deployed chat client would send them.

A prompt with `turns` = n answers its last n user turns (n = 1: the prompt as prepared, whatever it holds, is one
request; prepare.turns=all gives every user turn).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import orjson

ROW_FIELDS = ("role", "content")  # what the messages column keeps; the rest travels in message_extras


@dataclass
class Conversation:
    prompt: dict  # the prompts row: prompt_id, source, messages, tools, message_extras, turns
    thinking: bool
    key: bytes  # the request key of the next turn
    turn: int = 0  # the next turn to generate
    sent: list[dict] = field(default_factory=list)  # the messages of the last request (full dicts)
    parent_key: bytes | None = None
    failed: bool = False  # the current turn failed for good

    def __post_init__(self):
        self.messages = prompt_messages(self.prompt)
        self.bounds = turn_bounds(self.messages, max(1, int(self.prompt.get("turns") or 1)))

    @property
    def turns(self) -> int:
        return len(self.bounds)

    def tools(self) -> list | None:
        return orjson.loads(self.prompt["tools"]) if self.prompt.get("tools") else None

    def messages_for_turn(self) -> list[dict]:
        """The full messages (extras merged) of the next turn's request."""
        if self.turn == 0:
            return self.messages[: self.bounds[0] + 1]
        return self.sent + self.messages[self.bounds[self.turn - 1] + 1: self.bounds[self.turn] + 1]

    def advance(self, sent: list[dict], answer: dict, keep_reasoning: bool, next_key: bytes) -> None:
        """After turn `turn` was answered with `answer`: the history the next turn is sent with."""
        reply = {"role": "assistant", "content": answer.get("content") or ""}
        if keep_reasoning and answer.get("reasoning"):
            reply["reasoning_content"] = answer["reasoning"]
        self.sent = sent + [reply]
        self.parent_key, self.key = self.key, next_key
        self.turn += 1


def prompt_messages(prompt: dict) -> list[dict]:
    """The prompt's messages with their per-message extras (tool_calls, tool_call_id, name, ...) merged in."""
    messages = [dict(m) for m in prompt["messages"]]
    if prompt.get("message_extras"):
        for message, extra in zip(messages, orjson.loads(prompt["message_extras"])):
            message.update(extra or {})
    return messages


def turn_bounds(messages: list[dict], turns: int) -> list[int]:
    """Indexes of the user messages that end each turn: the last `turns` user messages."""
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    return users[-turns:] if turns > 1 else users[-1:]


def split_for_row(messages: list[dict]) -> tuple[list[dict], str | None]:
    """Sent messages -> (the messages column: role and content, message_extras JSON or None)."""
    rows = [{"role": m["role"], "content": m.get("content") if isinstance(m.get("content"), str) else ""}
            for m in messages]
    extras = [{k: v for k, v in m.items() if k not in ROW_FIELDS} or None for m in messages]
    return rows, orjson.dumps(extras).decode() if any(extras) else None
