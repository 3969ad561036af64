"""One regenerated assistant turn -> the ids of its context and of what the target produced.

The loss boundary is where generation started: the end of the prompt rendered with `add_generation_prompt=True`
(the text the server was sent). The answer's text in the target's format is the full render (prompt + answer) after
that prompt, which must therefore be a prefix of it. A finished answer ends with the template's end-of-turn; a
`length` answer ends exactly where sampling stopped (nothing the template would close it with).

With the server's ids the context is its `prompt_token_ids` and the answer its sampled ids (plus the template's
end-of-turn when the engine did not return it); the text is retokenized anyway, to measure drift.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from drafter_data.tokens.conversation import SENTINEL, ConversationTokenizer, final_assistant_message


class Dropped(Exception):
    """A row that cannot become training data; `reason` names the meta.json count (`dropped.<reason>`)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass
class Turn:
    """One completions row: the messages exactly as sent, the answer, and the server's ids when it returned them."""

    prompt_id: str
    turn: int
    messages: list[dict]
    tools: list | None
    thinking: bool
    reasoning: str | None
    content: str
    tool_calls: list | None
    finish_reason: str
    length_stop_in: str | None = None
    prompt_token_ids: np.ndarray | None = None
    completion_token_ids: np.ndarray | None = None

    @property
    def cut(self) -> bool:
        return self.finish_reason == "length"


def answer_message(turn: Turn) -> dict:
    """The answer as the template renders it; for a cut answer, SENTINEL marks the end of the last thing sampled
    (the last tool call's arguments, else the content, else the reasoning)."""
    msg = final_assistant_message(turn.content, turn.reasoning, turn.tool_calls, turn.thinking)
    if not turn.cut:
        return msg
    if msg.get("tool_calls"):
        calls = [dict(c, function=dict(c.get("function") or {})) for c in msg["tool_calls"]]
        calls[-1]["function"]["arguments"] = str(calls[-1]["function"].get("arguments") or "") + SENTINEL
        msg["tool_calls"] = calls
    elif turn.length_stop_in == "reasoning" or (turn.length_stop_in is None and not turn.content
                                                 and turn.reasoning is not None):
        msg["reasoning_content"] = (turn.reasoning or "") + SENTINEL
    else:
        msg["content"] = turn.content + SENTINEL
    return msg


def turn_texts(conv: ConversationTokenizer, turn: Turn) -> tuple[str, str]:
    """(the prompt as sent, the answer as the target produced it), both in the template's own text."""
    prompt, full = conv.prompt_and_full(turn.messages, answer_message(turn), turn.tools, turn.thinking)
    if not full.startswith(prompt):
        raise Dropped("prefix_mismatch")
    answer = full[len(prompt):]
    if turn.cut:
        end = answer.find(SENTINEL)
        if end < 0:  # the template did not render the part that was cut (e.g. reasoning it drops)
            raise Dropped("length_cut_not_rendered")
        answer = answer[:end]
    return prompt, answer


def with_end_of_turn(sampled: np.ndarray, end_of_turn: np.ndarray) -> np.ndarray:
    """A finished answer's sampled ids, closed by exactly the template's end-of-turn ids: nothing when the engine
    returned them, the rest when it returned their start (its stop token), all of them otherwise."""
    n = len(end_of_turn)
    for k in range(n, 0, -1):
        if len(sampled) >= k and np.array_equal(sampled[len(sampled) - k:], end_of_turn[:k]):
            return sampled if k == n else np.concatenate([sampled, end_of_turn[k:]])
    return np.concatenate([sampled, end_of_turn]).astype(np.int32, copy=False)


def tokens_differ(a: np.ndarray, b: np.ndarray) -> int:
    """How many tokens differ: the longer side of what is left between the common prefix and common suffix."""
    if len(a) == len(b) and np.array_equal(a, b):
        return 0
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    prefix = int(diff[0]) if len(diff) else m
    tail = np.flatnonzero(a[::-1][: m - prefix] != b[::-1][: m - prefix])
    suffix = int(tail[0]) if len(tail) else m - prefix
    return max(len(a), len(b)) - prefix - suffix


def compare_prompt(turn: Turn, ours: np.ndarray, counts: Counter) -> None:
    """Our render of the prompt, tokenized, against the server's prompt ids: a mismatch is a template or tokenizer
    bug to report (counted), not to hide."""
    if turn.prompt_token_ids is not None:
        counts["prompt.rows_compared"] += 1
        counts["prompt.rows_differ"] += not np.array_equal(ours, turn.prompt_token_ids)


def context_ids(turn: Turn, ours: np.ndarray, counts: Counter) -> np.ndarray:
    """The server's prompt ids when it returned them (compared with ours), else our render tokenized."""
    compare_prompt(turn, ours, counts)
    return ours if turn.prompt_token_ids is None else turn.prompt_token_ids


def answer_ids(conv: ConversationTokenizer, turn: Turn, retokenized: np.ndarray, counts: Counter) -> np.ndarray:
    """The sampled ids (a finished answer closed by the end-of-turn) when the server returned them, else the answer
    text retokenized; with ids, the retokenization is compared (drift)."""
    if turn.completion_token_ids is None:
        return retokenized
    sampled = turn.completion_token_ids
    if not turn.cut:
        sampled = with_end_of_turn(sampled, conv.end_of_turn(turn.thinking)[1])
    differ = tokens_differ(sampled, retokenized)
    counts["drift.rows_compared"] += 1
    if differ and turn.cut and len(retokenized) < len(sampled) and np.array_equal(sampled[:len(retokenized)],
                                                                                   retokenized):
        # the text stops before the ids: at the cut the server kept back the text of its last tokens (e.g. a `<`
        # that might have begun `</think>`); nothing differs, the row keeps every sampled id
        counts["drift.rows_text_cut_short"] += 1
        counts["drift.tokens_text_cut_short"] += differ
    else:
        counts["drift.rows_differ"] += differ > 0
        counts["drift.tokens_differ"] += differ
    return sampled


def reasoning_tokens(conv: ConversationTokenizer, turn: Turn, answer_text: str, answer: np.ndarray) -> int:
    """The reasoning part of an answer's ids: up to the think-end token where the tokenizer has one, else estimated
    by the characters' share."""
    if not turn.reasoning:
        return 0
    end_id = getattr(conv.tokenizer, "think_end_id", None)
    if end_id is not None:
        hits = np.flatnonzero(answer == end_id)
        return int(hits[0]) if len(hits) else len(answer)
    end = answer_text.find(turn.reasoning)
    share = (end + len(turn.reasoning)) / len(answer_text) if end >= 0 and answer_text else 0.0
    return round(share * len(answer))
