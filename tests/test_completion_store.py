"""The completion store repairs itself after a kill at any point of a write or a compaction."""
import shutil

from drafter_data.generation.store import CompletionStore
from tests.conftest import read_rows


def rows(keys):
    return [{"prompt_id": k, "source": "s", "messages": [{"role": "user", "content": k}], "tools": None,
             "reasoning": None, "content": f"answer {k}", "finish_reason": "stop", "prompt_tokens": 1,
             "completion_tokens": 1, "request_key": k} for k in keys]


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
    again = CompletionStore(tmp_path / "out")
    done = again.scan({"a", "b", "c", "d", "e"})
    assert done == {"a", "b", "c", "d", "e"} and again.duplicate_rows == 4  # a-d merged; "e" stayed alone
    assert sorted(r["request_key"] for r in read_rows(tmp_path / "out")) == ["a", "b", "c", "d", "e"]
    assert not list((tmp_path / "out").glob(".*tmp*"))


def test_rows_no_longer_wanted_are_moved_aside_not_deleted(tmp_path):
    store = CompletionStore(tmp_path / "out")
    store.write(rows(["a", "b", "old"]))
    done = CompletionStore(tmp_path / "out").scan({"a", "b", "new"})
    assert done == {"a", "b"}
    assert sorted(r["request_key"] for r in read_rows(tmp_path / "out")) == ["a", "b"]
    stale = [r for p in (tmp_path / "out.stale").iterdir() for r in read_rows(p)]
    assert "old" in {r["request_key"] for r in stale}
