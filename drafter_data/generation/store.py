"""The generate stage's output directory as a crash-safe store of completions, keyed by request identity.

Shards are written whole or not at all (write, fsync, rename). A resume first *plans* (reads only the key columns,
changes nothing) and, once preflight has passed, *applies* the plan:
- rows the current config would not produce (other generation params, prompts no longer in the input, a turn built
  on another answer or sent with another history: each later turn's key is derived again, under the current config,
  from its parent's) are moved to `<output>.stale/<run>/`: kept, because they cost GPU time, never reused silently;
- rows in `.stale/` that the current config wants again are moved back (reverting a config change costs nothing);
- a request that appears twice (a kill during compaction, or two writers) is kept once;
- a shard that cannot be read is moved to `<output>.quarantine/<run>/` and its prompts are generated again.
"""
from __future__ import annotations

import shutil
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from drafter_data.contract import COMPLETIONS, shard_paths, write_table_atomic
from drafter_data.generation.keys import KEY_DTYPE, KeySet, first_of_each, hex_keys, turn_key

SHARD_PREFIX = "completions-"
PLAN_COLUMNS = ["request_key", "parent_key", "turn", "turns", "finish_reason", "tool_calls", "token_ids_via"]


@dataclass
class Shard:
    path: Path
    stale_source: bool  # a shard of .stale/ (a candidate for restoring)
    rows: int


@dataclass
class KeyColumns:
    """The plan's view of rows (one shard's, or every shard's joined): their keys and what each row is."""

    keys: np.ndarray
    later: np.ndarray  # the rows of turns after the first (intp)
    parents: np.ndarray  # their parents' keys (a turn-0 row has none: single-turn data holds no parent keys)
    turns_done: np.ndarray  # the row's turn
    may_go_on: np.ndarray  # the conversation has turns left and this answer stopped by itself
    has_ids: np.ndarray  # the server's token ids were stored with the row
    next_keys: np.ndarray  # the key the next turn has under the current config (rows that may go on; else zeros)

    @classmethod
    def join(cls, parts: list[KeyColumns]) -> KeyColumns:
        """One array per column; each shard's own arrays are let go as soon as they are joined (peak: one copy plus
        one column)."""
        dtypes = {"keys": KEY_DTYPE, "later": np.intp, "parents": KEY_DTYPE, "turns_done": np.int32,
                  "may_go_on": bool, "has_ids": bool, "next_keys": KEY_DTYPE}
        offset = 0
        for p in parts:  # row numbers of the joined arrays
            p.later = p.later + offset
            offset += len(p.keys)
        joined = {}
        for name, dtype in dtypes.items():
            joined[name] = np.concatenate([getattr(p, name) for p in parts]) if parts else np.zeros(0, dtype)
            for p in parts:
                setattr(p, name, None)
        return cls(**joined)


@dataclass
class ResumePlan:
    valid: KeySet  # every request key already done for the current config (all turns)
    done0: KeySet  # turn-0 keys done: their conversations need nothing, unless listed in `continue_rows`
    continue_rows: list[dict]  # the last finished turn of each conversation that has turns left
    keep: dict[Path, tuple[np.ndarray, bool]] = field(default_factory=dict)  # main shard: (rows that stay, any stale)
    restore: dict[Path, np.ndarray] = field(default_factory=dict)  # per .stale shard: rows to move back
    broken: list[tuple[Path, str]] = field(default_factory=list)
    stale_rows: int = 0
    duplicate_rows: int = 0
    restored_rows: int = 0


class CompletionStore:
    def __init__(self, out_dir: Path, compact_rows: int = 20000):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        # unique per store: a new shard never takes the name of an existing one (which a plan may be moving)
        self.run_tag = time.strftime("%Y%m%dT%H%M%S") + f"-{uuid.uuid4().hex[:8]}"
        self.compact_rows = compact_rows
        self.lost: list[tuple[str, str]] = []  # (shard, reason): found unreadable after the plan counted its rows
        self._seq = 0
        self._seq_lock = threading.Lock()  # flushes and compaction run in threads

    @property
    def stale_root(self) -> Path:
        return self.dir.with_name(self.dir.name + ".stale")

    @property
    def stale_dir(self) -> Path:
        return self.stale_root / self.run_tag

    @property
    def quarantine_dir(self) -> Path:
        return self.dir.with_name(self.dir.name + ".quarantine") / self.run_tag

    def _next_path(self, kind: str = "") -> Path:
        with self._seq_lock:
            self._seq += 1
            return self.dir / f"{SHARD_PREFIX}{self.run_tag}{kind}-{self._seq:06d}.parquet"

    def shards(self) -> list[Path]:
        return shard_paths(self.dir, SHARD_PREFIX)

    def plan(self, wanted0: KeySet, require_ids: bool = False, keep_reasoning: bool = False) -> ResumePlan:
        """What is done for the current config (wanted0: the turn-0 keys of the input prompts; require_ids: with
        generation.token_ids=on, rows without the server's ids do not count; keep_reasoning: how earlier answers are
        sent back, generation.history_reasoning), and what a resume must move; reads key columns (and, of the rows
        a conversation may go on from, their answers) and changes nothing but leftover temp files."""
        for leftover in self.dir.glob(".*.tmp-*"):
            leftover.unlink()
        shards, parts, broken = [], [], []
        stale_paths = sorted(self.stale_root.rglob(f"{SHARD_PREFIX}*.parquet")) if self.stale_root.exists() else []
        for path, from_stale in [(p, False) for p in self.shards()] + [(p, True) for p in stale_paths]:
            try:
                parts.append(_read_keys(path, keep_reasoning))
            except Exception as exc:  # noqa: BLE001 - any unreadable shard: quarantined, never a crash
                if not from_stale:
                    broken.append((path, f"{type(exc).__name__}: {exc}"))
                continue
            shards.append(Shard(path, from_stale, len(parts[-1].keys)))
        return _plan(shards, KeyColumns.join(parts), wanted0, broken, require_ids)

    def apply(self, plan: ResumePlan) -> None:
        """Carries out a plan: quarantine, rewrite/move aside, restore. Each step writes before it removes, so a
        kill at any point leaves at worst duplicates, which the next plan drops. A shard whose key columns read but
        whose other columns do not is quarantined too and listed in `lost` (the plan counted its rows: plan again)."""
        for path, _ in plan.broken:
            self._quarantine(path)
        for path, (keep, has_stale) in plan.keep.items():
            table = self._read_whole(path)
            if table is None:
                continue
            if keep.any():
                write_table_atomic(table.filter(pa.array(keep)), self._next_path())
            if has_stale:
                self.stale_dir.mkdir(parents=True, exist_ok=True)
                shutil.move(str(path), self.stale_dir / path.name)
            else:  # only duplicates of rows kept elsewhere
                path.unlink()
        for path, back in plan.restore.items():
            try:
                table = pq.read_table(path)
            except Exception:  # noqa: BLE001 - a broken .stale shard: nothing to restore from it
                continue
            write_table_atomic(_conform(table.filter(pa.array(back))), self._next_path("r"))
            rest = table.filter(pa.array(~back))
            if rest.num_rows:
                write_table_atomic(rest, path)
            else:
                path.unlink()

    def _quarantine(self, path: Path) -> None:
        self.quarantine_dir.mkdir(parents=True, exist_ok=True)
        shutil.move(str(path), self.quarantine_dir / path.name)

    def _lose(self, path: Path, exc: Exception) -> None:
        """A shard the plan counted turned out unreadable: quarantined and listed in `lost`."""
        self._quarantine(path)
        self.lost.append((path.name, f"{type(exc).__name__}: {exc}".splitlines()[0][:300]))

    def _read_whole(self, path: Path) -> pa.Table | None:
        """A shard, every column; None when it cannot be read whole (then lost)."""
        try:
            return _conform(pq.read_table(path))
        except Exception as exc:  # noqa: BLE001 - any unreadable shard: quarantined, never a crash
            self._lose(path, exc)
            return None

    def write(self, rows: list[dict]) -> Path | None:
        if not rows:
            return None
        path = self._next_path()
        write_table_atomic(pa.Table.from_pylist(rows, schema=COMPLETIONS), path)
        return path

    def compact(self) -> None:
        """Merges small shards into shards of about compact_rows: few files for DVC to hash and a fast resume. New
        shards are written before the old ones are removed; a kill in between leaves duplicates that plan drops. A
        shard that cannot be read whole is quarantined and listed in `lost`."""
        small = []
        for path in self.shards():
            try:
                rows = pq.ParquetFile(path).metadata.num_rows
            except Exception as exc:  # noqa: BLE001 - its footer broke since the plan read it
                self._lose(path, exc)
                continue
            if rows < self.compact_rows:
                small.append(path)
        if len(small) < 2:
            return
        batch, rows, merged_from = [], 0, []
        for i, path in enumerate(small):
            table = self._read_whole(path)
            if table is not None:
                batch.append(table)
                merged_from.append(path)
                rows += table.num_rows
            if batch and (rows >= self.compact_rows or i == len(small) - 1):
                if len(merged_from) > 1:
                    write_table_atomic(pa.concat_tables(batch), self._next_path("c"))
                    for p in merged_from:
                        p.unlink()
                batch, rows, merged_from = [], 0, []


def _conform(table: pa.Table) -> pa.Table:
    """A shard written by an older release, as today's schema (missing columns null)."""
    if table.schema.equals(COMPLETIONS):
        return table
    columns = [table.column(f.name).cast(f.type) if f.name in table.column_names else pa.nulls(table.num_rows, f.type)
               for f in COMPLETIONS]
    return pa.table(columns, schema=COMPLETIONS)


def _read_keys(path: Path, keep_reasoning: bool) -> KeyColumns:
    names = set(pq.read_schema(path).names)
    table = pq.read_table(path, columns=[c for c in PLAN_COLUMNS if c in names])
    n = table.num_rows

    def ints(name: str, default: int) -> np.ndarray:
        if name not in names:
            return np.full(n, default, dtype=np.int32)
        return table.column(name).fill_null(default).to_numpy().astype(np.int32)

    turn = ints("turn", 0)
    later = np.flatnonzero(turn > 0)
    parents = hex_keys(table.column("parent_key").take(later)) if "parent_key" in names and len(later) \
        else np.zeros(len(later), KEY_DTYPE)
    # a conversation goes on only after an answer that stopped by itself without a tool call (as Runner.converse:
    # some servers end a tool call with finish_reason "stop")
    stopped = pc.equal(table.column("finish_reason"), "stop").fill_null(False).to_numpy(zero_copy_only=False)
    if "tool_calls" in names:
        stopped &= ~table.column("tool_calls").is_valid().to_numpy(zero_copy_only=False)
    may_go_on = stopped & (turn < np.maximum(ints("turns", 1), 1) - 1)
    has_ids = table.column("token_ids_via").is_valid().to_numpy(zero_copy_only=False) if "token_ids_via" in names \
        else np.zeros(n, dtype=bool)
    keys = hex_keys(table.column("request_key"))
    return KeyColumns(keys, later, parents, turn, may_go_on, has_ids,
                      _next_keys(path, keys, turn, may_go_on, keep_reasoning))


def _next_keys(path: Path, keys: np.ndarray, turn: np.ndarray, may_go_on: np.ndarray, keep_reasoning: bool
               ) -> np.ndarray:
    """The next turn's key after each row that may go on, as the current config would send it (as Runner.converse
    derives it); single-turn data reads no text."""
    out = np.zeros(len(keys), KEY_DTYPE)
    rows = np.flatnonzero(may_go_on)
    if len(rows):
        answers = pq.read_table(path, columns=["reasoning", "content", "tool_calls"]).take(rows).to_pylist()
        out[rows] = [turn_key(keys[i: i + 1].tobytes(), int(turn[i]) + 1, answer, keep_reasoning)
                     for i, answer in zip(rows, answers)]
    return out


def _plan(shards: list[Shard], rows: KeyColumns, wanted0: KeySet, broken: list, require_ids: bool) -> ResumePlan:
    """Validity by turn: a turn-0 row is valid when its key is wanted; a turn-k row when its parent is a valid
    turn-(k-1) row and its key is the one the current config derives from that parent (rows.next_keys: made with
    another history_reasoning, it is not). The first copy of a key wins (main shards before .stale)."""
    keys, turn, later, parents = rows.keys, rows.turns_done, rows.later, rows.parents
    usable = rows.has_ids if require_ids else np.ones(len(keys), dtype=bool)
    winners = np.flatnonzero(usable)  # the first usable copy of each key wins; in key order
    winners = winners[first_of_each(keys[winners])] if len(winners) < len(keys) else first_of_each(keys)
    first = np.zeros(len(keys), dtype=bool)
    first[winners] = True
    valid = first & (turn == 0)
    valid[valid] = wanted0.contains(keys[valid])
    for t in range(1, int(turn.max()) + 1 if len(turn) else 1):
        level = turn[later] == t
        rows_t = later[level]
        before = valid & (turn == t - 1)
        valid[rows_t] = first[rows_t] & KeySet(keys[before]).contains(parents[level]) & \
            KeySet(rows.next_keys[before & rows.may_go_on]).contains(keys[rows_t])
    has_child = KeySet(parents[valid[later]]).contains(keys)
    goes_on = valid & ~has_child & rows.may_go_on
    duplicate = usable & ~first  # a second copy of a row kept elsewhere; anything else invalid is kept aside
    valid_keys = KeySet.of_distinct(keys, winners[valid[winners]])
    started = valid & (turn > 0)
    done0 = KeySet.of_distinct(keys, winners[(valid & ~started)[winners]]) if started.any() else valid_keys
    plan = ResumePlan(valid=valid_keys, done0=done0, continue_rows=[], broken=broken)
    offset = 0
    for s in shards:
        at = slice(offset, offset + s.rows)
        offset += s.rows
        _shard_actions(plan, s, valid[at], duplicate[at], goes_on[at])
    return plan


def _shard_actions(plan: ResumePlan, s: Shard, valid: np.ndarray, duplicate: np.ndarray, goes_on: np.ndarray):
    if goes_on.any():
        table = pq.read_table(s.path).filter(pa.array(goes_on))
        plan.continue_rows += _conform(table).to_pylist()
    if s.stale_source:
        if valid.any():
            plan.restore[s.path] = valid
            plan.restored_rows += int(valid.sum())
        return
    if not valid.all():
        stale = int((~duplicate & ~valid).sum())
        plan.keep[s.path] = (valid, stale > 0)
        plan.duplicate_rows += int(duplicate.sum())
        plan.stale_rows += stale
