"""Degenerate answers: counted and shown in the card, left out only when export.drop names their kind.

- loop: the answer (its loss tokens: reasoning, content, tool calls) is mostly a repeated span: over LOOP_SHARE of
  its token 8-grams occurred earlier in it (an answer that repeats one sentence, or one tag, until max_tokens);
- empty_reasoning: the row thinks, and its reasoning is empty;
- empty_answer: a finished answer (not cut by max_tokens) with no content and no tool call.
"""
from __future__ import annotations

import numpy as np

from drafter_data.schema import DEGENERATE_KINDS

KINDS = DEGENERATE_KINDS
NGRAM = 8
LOOP_SHARE = 0.5
LOOP_MIN_TOKENS = 32


def repeated_share(ids: np.ndarray, n: int = NGRAM) -> float:
    """The share of the ids' n-grams that occurred earlier in them."""
    if len(ids) < max(LOOP_MIN_TOKENS, n + 1):
        return 0.0
    grams = np.lib.stride_tricks.sliding_window_view(np.ascontiguousarray(ids, dtype=np.int64), n)
    distinct = len(np.unique(grams, axis=0))
    return 1 - distinct / len(grams)


def kinds(turn, answer_ids: np.ndarray) -> list[str]:
    """The degenerate kinds of one answer (a tokens Turn, and its loss tokens), in KINDS order."""
    found = []
    if repeated_share(answer_ids) > LOOP_SHARE:
        found.append("loop")
    if turn.thinking and not (turn.reasoning or "").strip():
        found.append("empty_reasoning")
    if turn.finish_reason != "length" and not (turn.content or "").strip() and not turn.tool_calls:
        found.append("empty_answer")
    return found
