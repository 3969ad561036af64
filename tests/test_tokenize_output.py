"""tokenize replaces its output directory whole, as prepare does (drafter_data.outputs.StagedOutputDir): whatever
stops a tokenize part-way (an error in a worker, SIGTERM or Ctrl-C to its process group, a worker killed) leaves the
previous output byte for byte as it was and nothing beside it; a result over a threshold is put in place and the
message names its meta.json; a directory of somebody else's files is refused before any work and left as it was."""
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import REPO, read_rows
from tests.stage_faults import (FaultyRun, check_a_second_run_is_refused, dead_pid, finished, kill_a_worker,
                                snapshot, stop_group_with_sigint, stop_group_with_sigterm, stop_with_sigterm)
from tests.test_tokenize import completion_row, kimi_overrides

ROWS = 20  # in row groups of 4: 5 tasks at tokenize.shard_rows=4, for 2 worker processes


def write_input(directory: Path, tag: str, reason: str = "stop") -> Path:
    rows = [completion_row(f"{tag}-{i}", [{"role": "user", "content": f"{tag} question {i}"},
                                          {"role": "assistant", "content": f"{tag} answer {i}",
                                           "reasoning_content": f"{tag} thought {i}"}],
                           finish_reason=reason if i % 2 else "stop")
            for i in range(ROWS)]
    directory.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), directory / "completions-00000.parquet", row_group_size=4)
    return directory


def stage_args(inp: Path, out: Path, *extra: str) -> list[str]:
    return [*kimi_overrides(inp, out), "tokenize.workers=2", "tokenize.shard_rows=4", *extra]


def prompts_of(out: Path) -> set[str]:
    return {r["prompt_id"].split("-")[0] for r in read_rows(out)}


@pytest.fixture(scope="module")
def old_output(tmp_path_factory, mlflow_uri) -> Path:
    """A tokenize output as a real run writes it, from the rows "old" (made once, copied into each test)."""
    base = tmp_path_factory.mktemp("old")
    out = base / "tokens"
    proc = subprocess.run([sys.executable, "-m", "stages.tokenize", *stage_args(write_input(base / "in", "old"), out)],
                          cwd=REPO, env={**os.environ, "MLFLOW_TRACKING_URI": mlflow_uri}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert prompts_of(out) == {"old"} and (out / "meta.json").exists()
    return out


# tokenize with a fault in a task (in a worker process, before its rows are read; with tokenize.rows=conversation the
# scratch partition is written by then) or at the metadata (every shard written, meta.json not yet)
FAULT_POINTS = {"task": "drafter_data.tokens.rows:tokenize_task:before",
                "finish": "drafter_data.tokens.report:metadata:before"}


class Setup:
    """tmp/data/tokens holds the old output; tmp/in holds the rows "new"."""

    def __init__(self, old_output: Path, tmp_path: Path, mlflow_uri: str):
        self.data, self.marks, self.mlflow_uri = tmp_path / "data", tmp_path / "marks", mlflow_uri
        self.out = self.data / "tokens"
        self.data.mkdir()
        shutil.copytree(old_output, self.out)
        self.before = snapshot(self.out)
        self.inp = write_input(tmp_path / "in", "new")
        self.runs = FaultyRun("stages.tokenize", FAULT_POINTS, self.marks, mlflow_uri, error="StageError")

    def start(self, fault: str, at: str, *extra: str) -> subprocess.Popen:
        return self.runs.start(fault, at, stage_args(self.inp, self.out, *extra))

    def blocked(self, proc: subprocess.Popen, n: int = 1) -> list[int]:
        return self.runs.blocked(proc, n)

    def siblings(self) -> list[str]:
        return sorted(p.name for p in self.data.iterdir())


@pytest.fixture
def setup(old_output, tmp_path, mlflow_uri):
    setup = Setup(old_output, tmp_path, mlflow_uri)
    yield setup
    setup.runs.stop_all()


@pytest.mark.parametrize("fault, at, stop, codes", [
    ("raise", "task", None, {1}),
    ("block", "task", stop_group_with_sigterm, {1, 128 + signal.SIGTERM}),  # a worker's death may be seen first
    ("block", "task", kill_a_worker, {1}),
    ("block", "finish", stop_with_sigterm, {128 + signal.SIGTERM}),
    ("block", "finish", stop_group_with_sigint, {130}),
], ids=["StageError in a worker", "SIGTERM to the group while workers run", "a worker killed",
        "SIGTERM with every shard written", "SIGINT to the group with every shard written"])
def test_a_tokenize_stopped_part_way_leaves_the_previous_output_as_it_was(setup, fault, at, stop, codes):
    proc = setup.start(fault, at)
    if stop is not None:
        stop(proc, setup.blocked(proc, n=2 if at == "task" else 1))  # both workers at work
    stderr = finished(proc)
    assert proc.returncode in codes, stderr[-3000:]
    if fault == "raise":
        assert stderr.strip().splitlines()[-1] == "error: injected fault"
    assert snapshot(setup.out) == setup.before
    assert setup.siblings() == ["tokens"]  # the partial directory was deleted


@pytest.mark.parametrize("rows, at", [("per_turn", "finish"), ("conversation", "task")])
def test_a_tokenize_replaces_the_output_only_once_complete_and_leaves_nothing_beside_it(setup, tmp_path, rows, at):
    killed = setup.data / f".tokens.partial-{dead_pid()}"  # what a SIGKILLed tokenize left
    killed.mkdir()
    (killed / "tokens-00000-0000.parquet").write_bytes(b"half written")
    (setup.out / "tokens-00099-0000.parquet").write_bytes(b"a stale shard of another run")
    before = snapshot(setup.out)
    proc = setup.start("block", at, f"tokenize.rows={rows}")
    pid = setup.blocked(proc, n=2 if at == "task" else 1)[0]
    # the new output is written beside the old one, which is still in place
    partial = setup.data / f".tokens.partial-{proc.pid}"
    assert snapshot(setup.out) == before
    assert setup.siblings() == [".tokens.lock", partial.name, "tokens"]
    if at == "finish":  # every shard written, meta.json not yet
        assert pid == proc.pid and prompts_of(partial) == {"new"} and not (partial / "meta.json").exists()
    else:  # the scratch partition is in the staged directory, not in the output
        assert pid != proc.pid and any((partial / ".conversations").glob("part-*.parquet"))
    (setup.marks / "go").touch()
    stderr = finished(proc)
    assert proc.returncode == 0, stderr[-3000:]
    assert setup.siblings() == ["tokens"]
    assert f"rows in {setup.out} (" in stderr
    names = sorted(p.name for p in setup.out.iterdir())
    assert names[0] == "meta.json" and all(n.startswith("tokens-") and n.endswith(".parquet") for n in names[1:])
    assert "tokens-00099-0000.parquet" not in names
    assert prompts_of(setup.out) == {"new"} and len(read_rows(setup.out)) == ROWS
    meta = json.loads((setup.out / "meta.json").read_text())
    assert meta["rows"] == {"read": ROWS, "kept": ROWS} and meta["rows_per"] == rows and "refused" not in meta
    # MLflow has this run's meta.json (uploaded from the output, not from the deleted partial directory)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(setup.mlflow_uri)
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])
            if r.data.params.get("tokenize.output") == str(setup.out)]
    latest = max(runs, key=lambda r: r.info.start_time)
    assert latest.info.status == "FINISHED"
    logged = client.download_artifacts(latest.info.run_id, "meta.json", str(tmp_path / "artifacts"))
    assert Path(logged).read_bytes() == (setup.out / "meta.json").read_bytes()


def test_a_refused_result_is_in_place_with_its_meta_json_where_the_message_says(setup, run_stage):
    inp = write_input(setup.inp.parent / "aborted", "new", reason="abort")  # half the rows: unknown_finish_reason
    proc = run_stage("tokenize", *stage_args(inp, setup.out, "tokenize.max_drop_share=0.4"), check=False)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1, proc.stderr[-3000:]
    problem = f"10 of {ROWS} rows were dropped as unknown_finish_reason (over tokenize.max_drop_share=0.4)"
    assert last == f"error: {problem} (details in {setup.out / 'meta.json'})"
    meta = json.loads((setup.out / "meta.json").read_text())
    assert meta["rows"] == {"read": ROWS, "kept": 10, "dropped.unknown_finish_reason": 10}
    assert meta["refused"] == [problem]  # a reader of the output can tell it was refused
    assert prompts_of(setup.out) == {"new"} and len(read_rows(setup.out)) == 10
    assert setup.siblings() == ["tokens"]


def test_a_directory_of_other_files_is_refused_before_any_work_and_left_as_it_was(setup, run_stage):
    theirs = setup.data / "theirs"
    (theirs / "sub").mkdir(parents=True)
    (theirs / "notes.txt").write_text("mine")
    (theirs / "sub" / "data.parquet").write_bytes(b"not tokenize's")
    before = snapshot(theirs)
    proc = run_stage("tokenize", *stage_args(setup.inp, theirs), check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"error: tokenize.output={theirs} is a directory with other files in it (none of "
                               f"tokens-*.parquet, meta.json")
    assert snapshot(theirs) == before
    assert setup.siblings() == ["theirs", "tokens"]
    # an empty directory, or one tokenize wrote (the old output), is replaced
    (setup.data / "empty").mkdir()
    run_stage("tokenize", *stage_args(setup.inp, setup.data / "empty"))
    assert prompts_of(setup.data / "empty") == {"new"}
    assert setup.siblings() == ["empty", "theirs", "tokens"]


def test_a_second_tokenize_for_the_same_output_is_refused_at_once_and_touches_nothing(setup, run_stage):
    proc = setup.start("block", "finish")
    (pid,) = setup.blocked(proc)
    check_a_second_run_is_refused(run_stage, "tokenize", stage_args(setup.inp, setup.out), setup.out, pid,
                                  setup.before)
    (setup.marks / "go").touch()
    stderr = finished(proc)
    assert proc.returncode == 0, stderr[-3000:]
    assert setup.siblings() == ["tokens"] and prompts_of(setup.out) == {"new"}
