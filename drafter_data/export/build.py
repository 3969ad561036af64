"""The export itself: token rows in order, each joined with its completion, out as a pre-tokenized line (unless the
trainer family's rules or export.drop leave it out) and a conversations line, with the counts and the fixed-size
figures the card draws. Streams: one batch of token rows and a few completion row groups in memory at a time.

Every row read is accounted for once: `rows_in == rows_out[pretokenized.jsonl] + sum(filtered)`, where `filtered`
names one reason per row left out (a degenerate kind export.drop names, checked first, else the trainer's rule);
`would_drop` counts, for both families, the rows that reach the trainer rules and the rule each would fail.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import orjson

from drafter_data.export import degenerate
from drafter_data.export.conversations import SystemDefault, exact, record
from drafter_data.export.inputs import CompletionIndex, token_batches
from drafter_data.export.rules import FAMILIES, dropped_by
from drafter_data.tokens.columns import id_arrays

PRETOKENIZED = "pretokenized.jsonl"
CONVERSATIONS = "conversations.jsonl"
LOG2_BINS = 24  # token counts by power of two: 0, 1, 2-3, 4-7, ... (fixed memory)


def log2_bin(n: int) -> int:
    return min(int(n).bit_length(), LOG2_BINS - 1)


@dataclass
class Figures:
    """What the card and MLflow show, in fixed-size counters (no per-row lists)."""

    by_source: dict = field(default_factory=lambda: defaultdict(Counter))
    turn_rows: Counter = field(default_factory=Counter)  # rows per turn index: conversations with > k turns
    reasoning: np.ndarray = field(default_factory=lambda: np.zeros(LOG2_BINS, np.int64))
    answer: np.ndarray = field(default_factory=lambda: np.zeros(LOG2_BINS, np.int64))
    loss: np.ndarray = field(default_factory=lambda: np.zeros(LOG2_BINS, np.int64))
    finish: Counter = field(default_factory=Counter)
    models: Counter = field(default_factory=Counter)
    reasoning_estimated: bool = False

    def add(self, completion, loss_tokens: int, reasoning_tokens: int, kinds: list[str], line_exact: bool,
            dropped: str | None) -> None:
        turn, extra = completion.turn, completion.extra
        src = self.by_source[extra.get("source") or "(none)"]
        src["rows"] += 1
        src["thinking_on" if turn.thinking else "thinking_off"] += 1
        src["loss_tokens"] += loss_tokens
        src["reasoning_tokens"] += reasoning_tokens
        src["exact"] += line_exact
        src["length_cut"] += turn.finish_reason == "length"
        src["degenerate"] += bool(kinds)
        src["left_out"] += dropped is not None
        self.turn_rows[turn.turn] += 1
        self.reasoning[log2_bin(reasoning_tokens)] += 1
        self.answer[log2_bin(loss_tokens - reasoning_tokens)] += 1
        self.loss[log2_bin(loss_tokens)] += 1
        if turn.finish_reason == "length":
            where = extra.get("length_stop_in") or ("reasoning" if not turn.content and turn.reasoning else "content")
            self.finish[f"length ({where})"] += 1
        else:
            self.finish[turn.finish_reason or "(none)"] += 1
        self.models[(extra.get("model") or "(not named)", extra.get("token_ids_via") or "(retokenized)")] += 1


@dataclass
class Result:
    rows_in: int = 0
    pretokenized: int = 0
    conversations: int = 0
    exact: int = 0
    truncated: int = 0
    filtered: Counter = field(default_factory=Counter)
    would_drop: dict = field(default_factory=lambda: {f: Counter() for f in FAMILIES})
    degenerate: Counter = field(default_factory=Counter)
    figures: Figures = field(default_factory=Figures)


def reasoning_share(conv, completion, mask: np.ndarray, ids: np.ndarray) -> tuple[int, bool]:
    """Loss tokens of the reasoning: up to the think-end id where the tokenizer has one, else by the characters'
    share (estimated: True)."""
    turn = completion.turn
    loss_ids = ids[mask != 0]
    if not turn.reasoning:
        return 0, False
    end_id = getattr(conv.tokenizer, "think_end_id", None)
    if end_id is not None:
        hits = np.flatnonzero(loss_ids == end_id)
        return (int(hits[0]) if len(hits) else len(loss_ids)), False
    chars = len(turn.reasoning) + len(turn.content or "")
    return round(len(loss_ids) * len(turn.reasoning) / chars) if chars else 0, True


def export_rows(token_paths: list[Path], index: CompletionIndex, conv, out_dir: Path, trainer: str,
                drop: tuple[str, ...], max_length: int, batch_rows: int, stop_check=None) -> Result:
    result = Result()
    system = SystemDefault(conv)
    with open(out_dir / PRETOKENIZED, "wb") as pre, open(out_dir / CONVERSATIONS, "wb") as convs:
        for batch in token_batches(token_paths, batch_rows):
            if stop_check is not None:
                stop_check()
            prompt_ids = batch.column("prompt_id").to_pylist()
            turns = batch.column("turn").to_pylist()
            all_ids = id_arrays(batch.column("input_ids"))
            all_masks = id_arrays(batch.column("loss_mask"))
            for pid, turn_no, ids, mask in zip(prompt_ids, turns, all_ids, all_masks):
                result.rows_in += 1
                completion = index.get(pid, turn_no or 0)
                kinds = degenerate.kinds(completion.turn, ids[mask != 0])
                result.degenerate.update(kinds)
                left_out = next((f"degenerate.{k}" for k in kinds if k in drop), None)
                line_exact = False
                if left_out is None:
                    line = record(completion, system)
                    line["exact"] = line_exact = exact(conv, line, ids)
                    convs.write(orjson.dumps(line) + b"\n")
                    result.conversations += 1
                    result.exact += line_exact
                    cut_ids, cut_mask = ids[:max_length], mask[:max_length]
                    result.truncated += len(ids) > max_length
                    for family in FAMILIES:
                        reason = dropped_by(family, cut_mask)
                        if reason:
                            result.would_drop[family][reason] += 1
                    reason = dropped_by(trainer, cut_mask)
                    if reason:
                        left_out = f"{trainer}.{reason}"
                    else:
                        pre.write(orjson.dumps({"id": f"{pid}#turn{turn_no or 0}", "input_ids": cut_ids,
                                                "loss_mask": cut_mask}, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
                        result.pretokenized += 1
                if left_out:
                    result.filtered[left_out] += 1
                reasoning, estimated = reasoning_share(conv, completion, mask, ids)
                result.figures.reasoning_estimated |= estimated
                result.figures.add(completion, int(np.count_nonzero(mask)), reasoning, kinds, line_exact, left_out)
    return result


def summary(result: Result, index: CompletionIndex, trainer: str, drop, max_length: int, digest: str) -> dict:
    figures = result.figures
    return {
        "rows_in": result.rows_in,
        "rows_out": {PRETOKENIZED: result.pretokenized, CONVERSATIONS: result.conversations},
        "trainer": trainer,
        "drop": list(drop),
        "max_length": max_length,
        "filtered": dict(sorted(result.filtered.items())),
        "would_drop": {family: dict(sorted(c.items())) for family, c in result.would_drop.items()},
        "truncated": result.truncated,
        "exact": {"rows": result.conversations, "exact": result.exact,
                  "share": result.exact / result.conversations if result.conversations else 0.0},
        "degenerate": {kind: result.degenerate.get(kind, 0) for kind in degenerate.KINDS},
        "completions": {"rows": index.rows, "duplicates_read_once": index.duplicates,
                        "without_a_row_of_their_own": index.rows - index.used},
        "by_source": {src: dict(c) for src, c in sorted(figures.by_source.items())},
        "finish_reasons": dict(sorted(figures.finish.items())),
        "turn_rows": {str(k): v for k, v in sorted(figures.turn_rows.items())},
        "models": [{"model": m, "token_ids_via": via, "rows": n} for (m, via), n in sorted(figures.models.items())],
        "completions_request_keys_sha256": digest,
    }
