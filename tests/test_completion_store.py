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
