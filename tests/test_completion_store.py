"""The completion store repairs itself after a kill at any point of a write or a compaction."""
import shutil

from drafter_data.generation.keys import KeySet, hex_column
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
    assert key_set.keys.tobytes() == np.unique(keys).tobytes()
    assert (key_set.contains(queries) == np.isin(queries, keys)).all()
    assert sorted(first_of_each(keys).tolist()) == sorted(np.unique(keys, return_index=True)[1].tolist())
