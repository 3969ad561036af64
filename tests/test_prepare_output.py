"""Item 17: prepare replaces its output directory, and refuses (exit 1, one line, nothing deleted) when that directory
is or contains an input, the repo, or somebody else's files."""
import json
from pathlib import Path

import pytest

from drafter_data.errors import StageError
from tests.conftest import REPO, read_rows


def sources(*paths: Path) -> str:
    return "prepare.sources=[" + ",".join(f"{{name:s{i},path:'{p}',format:auto}}" for i, p in enumerate(paths)) + "]"


def refused(run_stage, out: Path, *paths: Path) -> str:
    proc = run_stage("prepare", f"prepare.output={out}", sources(*paths), check=False)
    assert proc.returncode == 1, proc.stderr[-2000:]
    return proc.stderr.strip().splitlines()[-1]


def test_an_output_that_holds_the_prompt_files_is_refused_and_nothing_is_deleted(run_stage, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    src = data / "prompts.jsonl"
    src.write_text('{"prompt": "keep me"}\n')
    message = refused(run_stage, data, src)
    assert "prepare.output" in message and "prompts.jsonl" in message and "is the" not in message
    message = refused(run_stage, tmp_path, src)  # a folder further up
    assert "contains the prompt file of source 's0'" in message
    assert src.read_text() == '{"prompt": "keep me"}\n'


def test_an_output_with_other_files_or_that_is_a_file_is_refused(run_stage, tmp_path):
    src = tmp_path / "p.jsonl"
    src.write_text('{"prompt": "q"}\n')
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    assert "other files" in refused(run_stage, theirs, src)
    assert (theirs / "notes.txt").read_text() == "mine"
    a_file = tmp_path / "file.out"
    a_file.write_text("x")
    assert "not a directory" in refused(run_stage, a_file, src)
    assert a_file.read_text() == "x"


def test_a_previous_output_is_replaced(run_stage, tmp_path):
    src = tmp_path / "p.jsonl"
    src.write_text('{"prompt": "one"}\n')
    out = tmp_path / "out"
    run_stage("prepare", f"prepare.output={out}", sources(src))
    (out / "prompts-00007.parquet").write_bytes(b"stale shard from another run")
    src.write_text('{"prompt": "two"}\n')
    run_stage("prepare", f"prepare.output={out}", sources(src))
    assert [r["messages"][0]["content"] for r in read_rows(out)] == ["two"]
    assert json.loads((out / "stats.json").read_text())["s0"]["read"] == 1


@pytest.mark.parametrize("where", ["repo", "repo parent", "filesystem root"])
def test_the_repo_and_the_folders_above_it_are_never_an_output(where):
    from drafter_data.outputs import check_replaceable  # checked without running the stage: nothing at risk

    out = {"repo": REPO, "repo parent": REPO.parent, "filesystem root": Path("/")}[where]
    with pytest.raises(StageError, match="the repo|the working directory"):
        check_replaceable(out, "prepare.output", {}, ("stats.json",))
