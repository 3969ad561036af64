"""Degenerate answers: counted and shown in the card, left out only when export.drop names their kind.

- loop: the answer (reasoning and content) is mostly a repeated span: over LOOP_SHARE of its word 8-grams
  occurred earlier in it (an answer that repeats one sentence until max_tokens);
- empty_reasoning: the row thinks, and its reasoning is empty;
- empty_answer: a finished answer (not cut by max_tokens) with no content and no tool call.
"""
from __future__ import annotations

from drafter_data.schema import DEGENERATE_KINDS

KINDS = DEGENERATE_KINDS
NGRAM = 8
LOOP_SHARE = 0.5
LOOP_MIN_WORDS = 32


def repeated_share(text: str, n: int = NGRAM) -> float:
    """The share of the text's word n-grams that occurred earlier in it."""
    words = text.split()
    if len(words) < max(LOOP_MIN_WORDS, n + 1):
        return 0.0
    seen, repeated = set(), 0
    for i in range(len(words) - n + 1):
        gram = tuple(words[i:i + n])
        if gram in seen:
            repeated += 1
        else:
            seen.add(gram)
    return repeated / (len(words) - n + 1)


def kinds(turn) -> list[str]:
    """The degenerate kinds of one answer (a tokens Turn), in KINDS order."""
    found = []
    text = f"{turn.reasoning or ''}\n{turn.content or ''}"
    if repeated_share(text) > LOOP_SHARE:
        found.append("loop")
    if turn.thinking and not (turn.reasoning or "").strip():
        found.append("empty_reasoning")
    if turn.finish_reason != "length" and not (turn.content or "").strip() and not turn.tool_calls:
        found.append("empty_answer")
    return found
