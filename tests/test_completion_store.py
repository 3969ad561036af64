"""The completion store repairs itself after a kill at any point of a write or a compaction."""
import shutil

from drafter_data.generation.keys import KeySet, hex_column, turn_key
from drafter_data.generation.store import CompletionStore
from tests.conftest import read_rows


def key(name: str) -> str:
    return name.encode().hex().ljust(32, "0")


def rows(names):
    return [{"prompt_id": k, "source": "s", "messages": [{"role": "user", "content": k}], "tools": None,
             "reasoning": None, "content": f"answer {k}", "finish_reason": "stop", "prompt_tokens": 1,
             "completion_tokens": 1, "request_key": key(k)} for k in names]


def wanted(*names) -> KeySet:
    return KeySet(hex_column([key(n) for n in names]))


def resume(directory, *names):
    store = CompletionStore(directory)
    plan = store.plan(wanted(*names))
    store.apply(plan)
    return plan


def test_kill_during_compaction_leaves_duplicates_that_scan_removes(tmp_path):
    store = CompletionStore(tmp_path / "out", compact_rows=4)
    for chunk in (["a", "b"], ["c", "d"], ["e"]):
        store.write(rows(chunk))
    small = store.shards()
    backup = tmp_path / "backup"
    backup.mkdir()
    for p in small:
        shutil.copy(p, backup / p.name)
    store.compact()
    for p in backup.iterdir():  # as if killed after the merged shard was written, before the old ones were removed
        shutil.copy(p, tmp_path / "out" / p.name)
    (tmp_path / "out" / ".completions-x.parquet.tmp-123").write_bytes(b"half a file")
    plan = resume(tmp_path / "out", "a", "b", "c", "d", "e")
    assert len(plan.valid) == 5 and plan.duplicate_rows == 4  # a-d merged; "e" stayed alone
    assert sorted(r["request_key"] for r in read_rows(tmp_path / "out")) == sorted(key(k) for k in "abcde")
    assert not list((tmp_path / "out").glob(".*tmp*"))


def test_rows_no_longer_wanted_are_moved_aside_not_deleted(tmp_path):
    store = CompletionStore(tmp_path / "out")
    store.write(rows(["a", "b", "old"]))
    plan = resume(tmp_path / "out", "a", "b", "new")
    assert len(plan.valid) == 2 and plan.stale_rows == 1
    assert sorted(r["request_key"] for r in read_rows(tmp_path / "out")) == [key("a"), key("b")]
    stale = [r for p in (tmp_path / "out.stale").iterdir() for r in read_rows(p)]
    assert key("old") in {r["request_key"] for r in stale}


def test_key_sets_are_exact_where_keys_share_their_first_half():
    """KeySet searches the keys' two 8-byte halves: keys equal in the first half must still be told apart."""
    import numpy as np

    from drafter_data.generation.keys import KEY_DTYPE, KeySet, first_of_each

    rng = np.random.default_rng(0)
    raw = bytearray(rng.bytes(16 * 2000))
    for i in range(0, 400, 2):  # pairs sharing their first 8 bytes
        raw[16 * (i + 1): 16 * (i + 1) + 8] = raw[16 * i: 16 * i + 8]
    keys = np.frombuffer(bytes(raw), dtype=KEY_DTYPE)
    keys = np.concatenate([keys, keys[:300], keys[::7]])  # and repeats
    queries = bytearray(np.concatenate([keys[::3], np.frombuffer(rng.bytes(16 * 500), dtype=KEY_DTYPE)]).tobytes())
    for i in range(200):  # a member's first half with another second half
        queries[16 * i: 16 * i + 8] = raw[32 * i: 32 * i + 8]
    queries = np.frombuffer(bytes(queries), dtype=KEY_DTYPE)
    key_set = KeySet(keys)
    assert len(key_set) == len(np.unique(keys))
    assert (key_set.contains(queries) == np.isin(queries, keys)).all()
    first = first_of_each(keys)
    assert keys[first].tobytes() == np.unique(keys).tobytes()  # in key order
    assert first.tolist() == np.unique(keys, return_index=True)[1].tolist()  # the first copy of each
    some = first[::3]
    assert (KeySet.of_distinct(keys, some).contains(queries) == np.isin(queries, keys[some])).all()


def turn_row(name: str, turn: int, parent: dict | None, turns: int = 3, finish: str = "stop",
             keep_reasoning: bool = False) -> dict:
    """A turn's row; a later turn's key is derived from its parent's key and answer, as generate derives it."""
    row = {**rows([name])[0], "turn": turn, "turns": turns, "parent_key": None, "finish_reason": finish}
    if parent is not None:
        answer = {"reasoning": parent["reasoning"], "content": parent["content"], "tool_calls": None}
        row["parent_key"] = parent["request_key"]
        row["request_key"] = turn_key(bytes.fromhex(parent["request_key"]), turn, answer, keep_reasoning).hex()
    return row


def test_a_later_turn_counts_only_on_a_valid_turn_before_it(tmp_path):
    """Validity follows each conversation turn by turn, whatever shard a turn is in: a turn built on an answer that
    is no longer valid goes aside with it, and a conversation goes on from its last valid turn."""
    store = CompletionStore(tmp_path / "out")
    a0, b0, x0 = turn_row("a0", 0, None), turn_row("b0", 0, None), turn_row("x0", 0, None)
    a1, x1 = turn_row("a1", 1, a0), turn_row("x1", 1, x0)
    orphan1 = turn_row("orphan1", 1, turn_row("nobody", 0, None))
    a2, x2, b1 = turn_row("a2", 2, a1), turn_row("x2", 2, x1), turn_row("b1", 1, b0, finish="length")
    store.write([a0, b0, x0])
    store.write([a1, x1, orphan1])
    store.write([a2, x2, b1])
    plan = resume(tmp_path / "out", "a0", "b0")  # x0 is no longer an input prompt
    assert len(plan.valid) == 5 and len(plan.done0) == 2  # a0 a1 a2 b0 b1
    assert plan.stale_rows == 4  # x0 x1 x2 orphan1
    assert plan.continue_rows == []  # a has no turn left; b was cut at length
    kept = sorted(r["request_key"] for r in read_rows(tmp_path / "out"))
    assert kept == sorted(r["request_key"] for r in (a0, a1, a2, b0, b1))

    store = CompletionStore(tmp_path / "more")
    c0, d0 = turn_row("c0", 0, None), turn_row("d0", 0, None)
    c1 = turn_row("c1", 1, c0)
    store.write([c0, c1, d0])
    plan = resume(tmp_path / "more", "c0", "d0")
    assert sorted(r["request_key"] for r in plan.continue_rows) == sorted([c1["request_key"], key("d0")])


def test_a_later_turn_sent_with_another_history_setting_is_not_reused(tmp_path):
    """A turn's key is derived again from its parent under the current generation.history_reasoning: turns sent
    with their history's reasoning (keep) are not valid under drop, and the conversation goes on from turn 0."""
    store = CompletionStore(tmp_path / "out")
    e0 = {**turn_row("e0", 0, None), "reasoning": "thought"}
    e1 = turn_row("e1", 1, e0, keep_reasoning=True)
    store.write([e0, e1])
    kept = store.plan(wanted("e0"), keep_reasoning=True)
    assert len(kept.valid) == 2 and kept.stale_rows == 0
    plan = store.plan(wanted("e0"), keep_reasoning=False)
    assert len(plan.valid) == 1 and plan.stale_rows == 1
    assert [r["request_key"] for r in plan.continue_rows] == [key("e0")]
