"""What generate has to do: each input prompt's turn-0 request key and thinking mode (computed once, kept as compact
arrays in input order), and the conversations that are not finished yet."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from drafter_data.contract import PROMPTS, iter_batches
from drafter_data.generation.conversation import Conversation, prompt_messages
from drafter_data.generation.keys import KEY_DTYPE, first_of_each, request_keys, thinking_share, turn_key
from drafter_data.generation.store import ResumePlan
from drafter_data.server.request import RequestSpec

READ_COLUMNS = [f.name for f in PROMPTS]


@dataclass
class ThinkingModes:
    """Which prompts think: every one in `default`, or (ratio set) the share below `ratio` of a seeded hash."""

    default: bool
    ratio: float | None
    seed: int

    @classmethod
    def from_config(cls, generation) -> ThinkingModes:
        ratio = generation.get("thinking_ratio")
        return cls(bool(generation.thinking), None if ratio is None else float(ratio), int(generation.get("seed") or 0))

    def of(self, prompt_id: str) -> bool:
        return self.default if self.ratio is None else thinking_share(prompt_id, self.seed) < self.ratio

    def used(self) -> tuple[bool, ...]:
        """The modes prompts are generated in (thinking first)."""
        if self.ratio is None:
            return (self.default,)
        return tuple(mode for mode, share in ((True, self.ratio), (False, 1 - self.ratio)) if share > 0)

    def label(self) -> str:
        if self.ratio is None:
            return "on" if self.default else "off"
        return "mix"


@dataclass
class InputKeys:
    keys: np.ndarray  # S16, turn-0 request key per input prompt, in input order
    thinking: np.ndarray  # bool, the mode of each prompt
    first: np.ndarray | None = None  # bool: the first copy of its key (a prompt found twice is generated once)

    def __post_init__(self):
        if self.first is None:
            self.first = np.zeros(len(self.keys), dtype=bool)
            self.first[first_of_each(self.keys)] = True

    @property
    def repeated(self) -> int:
        """Input prompts that are copies of an earlier one (same prompt, same settings)."""
        return int(len(self.keys) - self.first.sum())


def input_keys(paths: list[Path], spec: RequestSpec, target: str, modes: ThinkingModes) -> InputKeys:
    """Reads the prompt_id column only (fast over millions); builds no Python object per prompt that outlives its
    batch."""
    identity = {True: spec.identity(target, thinking=True), False: spec.identity(target, thinking=False)}
    keys, thinking = [], []
    for batch in iter_batches(paths, columns=["prompt_id"], batch_size=65536):
        pids = batch.column(0).to_pylist()
        if modes.ratio is None:
            mode = np.full(len(pids), modes.default)
            keys.append(request_keys(pids, identity[modes.default]))
        else:
            mode = np.fromiter((modes.of(pid) for pid in pids), dtype=bool, count=len(pids))
            mixed = np.empty((len(pids), 16), dtype=np.uint8)
            for m in (True, False):
                rows = np.flatnonzero(mode == m)
                digests = request_keys([pids[i] for i in rows], identity[m])
                mixed[rows] = np.frombuffer(digests, dtype=np.uint8).reshape(-1, 16)
            keys.append(mixed.tobytes())
        thinking.append(mode)
    return InputKeys(np.frombuffer(b"".join(keys), dtype=KEY_DTYPE),
                     np.concatenate(thinking) if thinking else np.zeros(0, dtype=bool))


def not_started(inputs: InputKeys, plan: ResumePlan) -> np.ndarray:
    """Per input prompt: no turn of it is done yet (and it is the first copy of its key)."""
    return ~plan.done0.contains(inputs.keys) & inputs.first


def iter_todo(paths: list[Path], inputs: InputKeys, fresh: np.ndarray, plan: ResumePlan, keep_reasoning: bool):
    """The conversations with turns left, in input order: new ones (`fresh`: not_started) from turn 0, started ones
    from their next turn. Python rows are built only for those."""
    continuing = {row["prompt_id"]: row for row in plan.continue_rows}
    todo_mask = fresh.copy()
    if continuing:
        todo_mask |= np.isin(_prompt_ids(paths), list(continuing)) & inputs.first
    offset = 0
    for batch in iter_batches(paths, columns=_columns(paths[0]) if paths else None, batch_size=4096):
        rows = np.flatnonzero(todo_mask[offset: offset + batch.num_rows])
        for i, prompt in zip(rows, batch.take(rows).to_pylist() if len(rows) else []):
            key, thinking = inputs.keys[offset + i: offset + i + 1].tobytes(), bool(inputs.thinking[offset + i])
            conv = Conversation(prompt, thinking, key)
            if prompt["prompt_id"] in continuing:
                resume_from(conv, continuing[prompt["prompt_id"]], keep_reasoning)
            yield conv
        offset += batch.num_rows


def resume_from(conv: Conversation, last: dict, keep_reasoning: bool) -> None:
    """Continue after the last finished turn `last` (a completions row) of this conversation."""
    conv.turn = int(last["turn"])
    conv.key = bytes.fromhex(last["request_key"])
    conv.sent = prompt_messages(last)
    answer = {"reasoning": last["reasoning"], "content": last["content"], "tool_calls": last["tool_calls"]}
    conv.advance(conv.sent, answer, keep_reasoning, turn_key(conv.key, conv.turn + 1, answer, keep_reasoning))


def _columns(path: Path) -> list[str]:
    names = set(pq.read_schema(path).names)
    return [c for c in READ_COLUMNS if c in names]


def _prompt_ids(paths: list[Path]) -> np.ndarray:
    return np.concatenate([b.column(0).to_numpy(zero_copy_only=False)
                           for b in iter_batches(paths, columns=["prompt_id"], batch_size=65536)])

