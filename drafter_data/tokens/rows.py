"""Completion rows -> token rows, in worker processes: each worker loads the tokenizer once (`init_worker`), reads
its own input (one row group of a completions shard, or one partition of whole conversations), writes its own
shards, and sends back only counts, fixed-size histograms and a few named rows.

Every row read is counted once: `kept`, or `dropped.<reason>`. Flags beside them (`finish_length`,
`mask_text_escaped`, `over_max_length`, `truncated`) say what was done to kept rows. The rows whose sampled ids
retokenize differently (drift) or whose prompt renders to other ids than the server's are named too, the first
MAX_EXAMPLES of each by (prompt_id, turn): a rate that rises is then read off real rows.
"""
from __future__ import annotations

import sys
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import groupby
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from omegaconf import OmegaConf

from drafter_data.arrow_columns import numpy_array, string_array
from drafter_data.contract import TOKENS, write_table_atomic
from drafter_data.errors import StageError
from drafter_data.tokens.columns import COLUMNS, turns_from_batch
from drafter_data.tokens.conversation import ConversationTokenizer
from drafter_data.tokens.lengths import LengthHistograms
from drafter_data.tokens.turns import Dropped, Turn, answer_ids, compare_prompt, context_ids, reasoning_tokens, \
    turn_texts

FINISH_REASONS = ("stop", "length", "tool_calls")
# token ids are near-unique per row: dictionary encoding and statistics cost 5x the write and gain nothing; levels
# and values go to the writer in batches of 64k instead of 1k (about 15% less CPU time for the write, measured
# interleaved; pages stay about 1 MB)
TOKENS_WRITE_OPTIONS = {"use_dictionary": False, "write_statistics": False, "write_batch_size": 65536}
MAX_EXAMPLES = 10  # named rows per comparison (drift, prompt ids), in meta.json
EXAMPLE_COUNTS = {"drift": "drift.rows_differ", "prompt_ids": "prompt.rows_differ"}
MAX_WARNINGS = 3  # per worker: one bad row is worth a line, two thousand are worth a count
_worker: dict = {}


def init_worker(settings: dict) -> None:
    """settings: target (plain dict), chat_kwargs, thinking (the default mode), rows, mask_token_id,
    escape_mask_text, max_length, overlength, on_length_finish, shard_rows, out_dir, server_root."""
    from drafter_data.tokens.tokenizers import load_tokenizer

    target = OmegaConf.create(settings["target"])
    mask_id = settings["mask_token_id"]
    literal = frozenset([mask_id]) if settings["escape_mask_text"] and mask_id is not None else frozenset()
    tokenizer = load_tokenizer(target, settings.get("server_root"), literal)
    _worker.update(conv=ConversationTokenizer(target, tokenizer, settings["chat_kwargs"]), settings=settings,
                   warnings=0)


def worker_conversation() -> ConversationTokenizer:
    return _worker["conv"]


def worker_settings_loaded() -> dict:
    return _worker["settings"]


@dataclass
class TokenRow:
    prompt_id: str
    turn: int
    thinking: bool
    ids: np.ndarray
    spans: list[tuple[int, int]]  # [start, end) of each regenerated answer: loss_mask 1
    texts: list[str]  # what was rendered (checked for the mask token's spelling)
    turn_lengths: list[tuple[int, int]] = field(default_factory=list)  # (reasoning, answer) tokens per turn


@contextmanager
def naming(turn: Turn, counts: Counter, examples: dict[str, list] | None):
    """Names the turn in examples[name] when the block raised that comparison's count (EXAMPLE_COUNTS)."""
    before = {name: counts[key] for name, key in EXAMPLE_COUNTS.items()}
    try:
        yield
    finally:
        if examples is not None:
            for name, key in EXAMPLE_COUNTS.items():
                if counts[key] > before[name]:
                    examples[name].append((turn.prompt_id, turn.turn))


def per_turn_row(conv: ConversationTokenizer, turn: Turn, counts: Counter,
                 examples: dict[str, list] | None = None) -> TokenRow:
    """The context exactly as sent for this turn + this turn's answer; loss over the answer only."""
    prompt, answer = turn_texts(conv, turn)
    ours, retokenized = conv.tokenizer.encode_chat_split(prompt + answer, len(prompt))
    with naming(turn, counts, examples):
        context = context_ids(turn, ours, counts)
        sampled = answer_ids(conv, turn, retokenized, counts)
    reasoning = reasoning_tokens(conv, turn, answer, sampled)
    return TokenRow(turn.prompt_id, turn.turn, turn.thinking, np.concatenate([context, sampled]),
                    [(len(context), len(context) + len(sampled))], [prompt, answer],
                    [(reasoning, len(sampled) - reasoning)])


def conversation_row(conv: ConversationTokenizer, turns: list[Turn], counts: Counter,
                     examples: dict[str, list] | None = None) -> TokenRow:
    """One row with every regenerated turn in the loss: the last turn's messages + its answer, with each turn's
    answer where that turn's prompt ended. Refused (StageError) when the whole conversation does not render each turn
    as it was sent and answered (a template that rewrites history, e.g. drops earlier reasoning)."""
    if [t.turn for t in turns] != list(range(len(turns))):
        raise Dropped("incomplete_conversation")
    texts = [turn_texts(conv, t) for t in turns]
    full = "".join(texts[-1])
    pieces, spans, turn_lengths, done = [], [], [], 0
    for k, (turn, (prompt, answer)) in enumerate(zip(turns, texts)):
        if len(prompt) < done or not full.startswith(prompt) or not full.startswith(answer, len(prompt)):
            raise StageError(f"tokenize.rows=conversation: the chat template renders turn {k} of {turn.prompt_id} "
                             f"differently inside the whole conversation than it was sent and answered (a template "
                             f"that rewrites history, e.g. generation.history_reasoning=drop); use "
                             f"tokenize.rows=per_turn")
        with naming(turn, counts, examples):
            if k == 0:
                ours, retokenized = conv.tokenizer.encode_chat_split(prompt + answer, len(prompt))
                context = context_ids(turn, ours, counts)
            else:
                context, retokenized = conv.tokenizer.encode_chat_split(full[done:len(prompt) + len(answer)],
                                                                        len(prompt) - done)
                if turn.prompt_token_ids is not None:
                    compare_prompt(turn, conv.tokenizer.encode_chat_np(prompt), counts)
            sampled = answer_ids(conv, turn, retokenized, counts)
        start = sum(map(len, pieces)) + len(context)
        pieces += [context, sampled]
        spans.append((start, start + len(sampled)))
        reasoning = reasoning_tokens(conv, turn, answer, sampled)
        turn_lengths.append((reasoning, len(sampled) - reasoning))
        done = len(prompt) + len(answer)
    last = turns[-1]
    return TokenRow(last.prompt_id, last.turn, last.thinking, np.concatenate(pieces), spans, [full], turn_lengths)


def check_finish(turn: Turn, settings: dict, counts: Counter) -> None:
    if turn.finish_reason not in FINISH_REASONS:
        raise Dropped("unknown_finish_reason")
    if turn.cut:
        counts["finish_length"] += 1
        if settings["on_length_finish"] == "drop":
            raise Dropped("finish_length")


def apply_policies(row: TokenRow, conv: ConversationTokenizer, settings: dict, counts: Counter) -> TokenRow:
    """The mask token (escaped spelling counted; the id itself in a row drops it) and max_length."""
    specials = conv.tokenizer.literal_specials
    if specials and any(sp in text for text in row.texts for sp in specials):
        counts["mask_text_escaped"] += 1
    mask_id, max_len = settings["mask_token_id"], settings["max_length"]
    if mask_id is not None and (row.ids == mask_id).any():
        raise Dropped("mask_token_in_text")
    if len(row.ids) > max_len:
        counts["over_max_length"] += 1
        if settings["overlength"] == "drop" or row.spans[0][0] >= max_len:
            raise Dropped("over_max_length")
        counts["truncated"] += 1
        row.ids = row.ids[:max_len]
        row.spans = [(a, min(b, max_len)) for a, b in row.spans if a < max_len]
    return row


def build_row(group: list[Turn], counts: Counter, examples: dict[str, list] | None = None) -> TokenRow | None:
    """One training row from one turn (per_turn) or one conversation's turns; None when dropped (counted). A turn
    whose ids were compared and differ is named in examples (see naming)."""
    conv, settings = _worker["conv"], _worker["settings"]
    counts["read"] += len(group)
    try:
        for turn in group:
            check_finish(turn, settings, counts)
        row = (conversation_row(conv, group, counts, examples) if settings["rows"] == "conversation"
               else per_turn_row(conv, group[0], counts, examples))
        row = apply_policies(row, conv, settings, counts)
    except Dropped as drop:
        counts[f"dropped.{drop.reason}"] += len(group)
        return None
    except StageError:
        raise
    except Exception as exc:  # noqa: BLE001 - a template error on one row must not stop the run
        counts["dropped.render_error"] += len(group)
        warn(f"{group[-1].prompt_id}: cannot render: {type(exc).__name__}: {exc}")
        return None
    counts["kept"] += len(group)
    return row


def warn(message: str) -> None:
    _worker["warnings"] += 1
    if _worker["warnings"] <= MAX_WARNINGS:
        print(f"warning: {message}", file=sys.stderr)
    elif _worker["warnings"] == MAX_WARNINGS + 1:
        print("warning: more rows cannot be rendered; meta.json counts them (dropped.render_error)", file=sys.stderr)


def tokens_table(rows: list[TokenRow]) -> pa.Table:
    """Flat numpy buffers, not Python lists of lists: the conversion would cost as much as the tokenizing (and
    not pa.array: see arrow_columns)."""
    lengths = np.fromiter((len(r.ids) for r in rows), dtype=np.int32, count=len(rows))
    offsets = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    ids = np.concatenate([r.ids for r in rows]).astype(np.int32, copy=False)
    mask = np.zeros(len(ids), dtype=np.int8)
    for begin, row in zip(offsets[:-1], rows):
        for a, b in row.spans:
            mask[begin + a: begin + b] = 1
    loss = np.fromiter((sum(b - a for a, b in r.spans) for r in rows), dtype=np.int32, count=len(rows))
    turns = np.fromiter((r.turn for r in rows), dtype=np.int32, count=len(rows))
    pa_offsets = numpy_array(offsets, pa.int32())
    return pa.table([string_array([r.prompt_id for r in rows]), numpy_array(turns, pa.int32()),
                     pa.ListArray.from_arrays(pa_offsets, numpy_array(ids, pa.int32())),
                     pa.ListArray.from_arrays(pa_offsets, numpy_array(mask, pa.int8())),
                     numpy_array(lengths, pa.int32()), numpy_array(loss, pa.int32())], schema=TOKENS)


class ShardWriter:
    """Kept rows -> tokens shards of about shard_rows rows, plus their counts and length histograms."""

    def __init__(self, out_dir: Path, name: str, settings: dict):
        self.out_dir, self.name, self.settings = out_dir, name, settings
        self.rows: list[TokenRow] = []
        self.shards = 0
        self.counts = Counter()
        self.lengths = LengthHistograms(settings["max_length"])
        self.examples: dict[str, list] = {name: [] for name in EXAMPLE_COUNTS}

    def add(self, row: TokenRow | None) -> None:
        if row is not None:
            self.rows.append(row)
            if len(self.rows) >= self.settings["shard_rows"]:
                self.flush()

    def flush(self) -> None:
        if not self.rows:
            return
        rows, self.rows = self.rows, []
        write_table_atomic(tokens_table(rows), self.out_dir / f"tokens-{self.name}-{self.shards:04d}.parquet",
                           **TOKENS_WRITE_OPTIONS)
        self.shards += 1
        self.counts["rows_out"] += len(rows)
        self.counts["tokens"] += sum(len(r.ids) for r in rows)
        self.counts["loss_tokens"] += sum(b - a for r in rows for a, b in r.spans)
        self.counts["thinking.on"] += sum(r.thinking for r in rows)
        self.counts["thinking.off"] += sum(not r.thinking for r in rows)
        self.lengths.add("row", [len(r.ids) for r in rows])
        self.lengths.add("reasoning", [t[0] for r in rows for t in r.turn_lengths])
        self.lengths.add("answer", [t[1] for r in rows for t in r.turn_lengths])


def input_turns(pieces: list[tuple[str, int | None, np.ndarray | None]], settings: dict):
    """The turns of one task, in batches: row groups of completions shards (per_turn), less the rows listed as later
    copies of others, or a partition file sorted by conversation (conversation). Read on this thread: the workers
    already take the cores."""
    for path, row_group, skip in pieces:
        file = pq.ParquetFile(path)
        columns = [c for c in COLUMNS if c in file.schema_arrow.names]
        if row_group is None:
            table = file.read(columns=columns, use_threads=False).sort_by([("prompt_id", "ascending"),
                                                                           ("turn", "ascending")])
            batches = table.to_batches(max_chunksize=settings["shard_rows"])
        elif skip is not None:
            table = file.read_row_group(row_group, columns=columns, use_threads=False)
            keep = np.ones(table.num_rows, dtype=bool)
            keep[skip] = False
            batches = table.filter(pa.array(keep)).to_batches(max_chunksize=settings["shard_rows"])
        else:
            batches = file.iter_batches(batch_size=settings["shard_rows"], row_groups=[row_group], columns=columns,
                                        use_threads=False)
        for batch in batches:
            yield from turns_from_batch(batch, settings["thinking"])


def first_examples(lists) -> list[tuple[str | None, int]]:
    """The first MAX_EXAMPLES (prompt_id, turn) of several lists: the same whatever the order tasks ran in (a null
    prompt_id first)."""
    found = {example for examples in lists for example in examples}
    return sorted(found, key=lambda e: (e[0] is not None, e[0] or "", e[1]))[:MAX_EXAMPLES]


def tokenize_task(task: tuple[str, list[tuple[str, int | None]]]
                  ) -> tuple[Counter, LengthHistograms, tuple, dict[str, list]]:
    """One task -> its shards, written by the worker itself (results never travel back as lists); also when it
    started and ended (wall clock, for the throughput past start-up) and its first named rows."""
    start = time.time()
    name, pieces = task
    settings = _worker["settings"]
    writer = ShardWriter(Path(settings["out_dir"]), name, settings)
    turns = input_turns(pieces, settings)
    if settings["rows"] == "conversation":
        groups = (list(group) for _, group in groupby(turns, key=lambda t: t.prompt_id))
    else:
        groups = ([turn] for turn in turns)
    for group in groups:
        writer.add(build_row(group, writer.counts, writer.examples))
    writer.flush()
    examples = {name: first_examples([found]) for name, found in writer.examples.items()}
    return writer.counts, writer.lengths, (start, time.time()), examples
