"""The prompt a conversation becomes, by `prepare.turns`:

- `first`: the system prompt(s) and the first user turn;
- `last`: everything up to the last user turn, the dataset's own answers, tool calls and tool results kept as context;
- `all`: the system prompt(s) and every user turn in order, the original answers and tool results dropped; generate
  answers each user turn in turn with the target (`turns` = the number of user turns).

Leading assistant/tool turns (a conversation split mid-way) are always dropped. Turns of one role that are adjacent
in the source are merged (texts joined by a blank line), except tool results, which each answer their own call.
"""
from __future__ import annotations

from drafter_data.prompts.formats import Turn

MODES = ("first", "last", "all")

# (messages [{role, content}], extras aligned with messages or None when there are none, turns generate makes)
Prompt = tuple[list[dict], "list | None", int]


def to_prompt(turns: list[Turn], mode: str) -> Prompt | None:
    """None when the conversation has no user turn."""
    if mode == "first":
        kept = _first(turns)
    elif mode == "last":
        kept = _last(turns)
    elif mode == "all":
        kept = _all(turns)
    else:
        raise ValueError(f"prepare.turns must be one of {', '.join(MODES)}, got {mode!r}")
    if not kept:
        return None
    messages = [{"role": role, "content": text} for role, text, _ in kept]
    extras = [e for _, _, e in kept]
    n_turns = sum(role == "user" for role, _, _ in kept) if mode == "all" else 1
    return messages, (extras if any(extras) else None), n_turns


def _join(a: str, b: str) -> str:
    return f"{a}\n\n{b}" if a and b else a + b


def _first(turns: list[Turn]) -> list[list]:
    kept = []
    for role, text, extras in turns:
        if role == "system":
            _append(kept, role, text, extras)
        elif role == "user":
            kept.append([role, text, extras])
            return kept
    return []


def _last(turns: list[Turn]) -> list[list]:
    kept, last_user = [], -1
    for role, text, extras in turns:
        if text is None or (last_user < 0 and role in ("assistant", "tool")):
            continue  # an answer the data does not have, or a conversation that starts with the assistant
        _append(kept, role, text, extras)
        if role == "user":
            last_user = len(kept) - 1
    return kept[: last_user + 1]


def _all(turns: list[Turn]) -> list[list]:
    kept, previous, seen_user = [], None, False
    for role, text, extras in turns:
        if role == "user":
            if previous == "user":
                _append(kept, role, text, extras)  # adjacent in the source: one turn
            else:
                kept.append([role, text, extras])  # after a dropped answer: a turn of its own
            seen_user = True
        elif role == "system" and not seen_user:
            _append(kept, role, text, extras)
        previous = role
    return kept if seen_user else []


def _append(kept: list[list], role: str, text: str, extras: dict | None) -> None:
    """Appends a turn, merged into the previous one when that has the same role and the two can be one message."""
    if kept and kept[-1][0] == role and _merge(kept[-1], text, extras):
        return
    kept.append([role, text, extras])


def _merge(prev: list, text: str, extras: dict | None) -> bool:
    role, prev_extras = prev[0], prev[2]
    if role == "tool":
        return False
    if prev_extras and "tool_calls" in prev_extras:  # an assistant tool call: only further calls join it
        if extras and set(extras) == {"tool_calls"} and not text:
            prev[2] = {**prev_extras, "tool_calls": prev_extras["tool_calls"] + extras["tool_calls"]}
            return True
        return False
    if prev_extras != extras and not (role == "assistant" and prev_extras is None):
        return False  # e.g. two users with different names
    prev[1], prev[2] = _join(prev[1], text), prev_extras or extras
    return True
