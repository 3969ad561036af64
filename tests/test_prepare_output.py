"""Item 17: prepare replaces its output directory, and refuses (exit 1, one line, nothing deleted) when that directory
is or contains an input, the repo, or somebody else's files. The new directory is written whole: whatever stops a
prepare (an error, SIGTERM, Ctrl-C, a worker killed, SIGKILL) leaves the previous output byte for byte as it was."""
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from drafter_data.errors import StageError
from tests.conftest import REPO, read_rows
from tests.stage_faults import (FaultyRun, check_a_second_run_is_refused, dead_pid, finished, kill_a_worker,
                                snapshot, stop_group_with_sigint, stop_group_with_sigterm, stop_with_sigterm)


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


# prepare with a fault at pass 1 (in a worker, before a unit is read) or after pass 2 (every shard written, stats.json
# not yet)
FAULT_POINTS = {"pass1": "drafter_data.prompts.normalize:normalize_unit:before",
                "pass2": "drafter_data.prompts.selection:write_chosen:after"}


def write_source(path: Path, tag: str) -> Path:
    """400 lines (some broken: rejects.jsonl is not empty), in several ranges at prepare.split_mb=0.001."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ['{"prompt": "broken' if i % 37 == 5 else json.dumps({"prompt": f"{tag} question {i}"}) for i in range(400)]
    path.write_text("\n".join(lines) + "\n")
    return path


class Setup:
    """tmp/in/p.jsonl -> tmp/data/prompts, which a first prepare has written from the prompts "old"; the source then
    holds the prompts "new"."""

    def __init__(self, run_stage, tmp_path: Path, mlflow_uri: str):
        self.src = write_source(tmp_path / "in" / "p.jsonl", "old")
        self.data, self.marks, self.mlflow_uri = tmp_path / "data", tmp_path / "marks", mlflow_uri
        self.out = self.data / "prompts"
        self.runs = FaultyRun("stages.prepare", FAULT_POINTS, self.marks, mlflow_uri)
        self.args = [f"prepare.output={self.out}", sources(self.src), "prepare.workers=2", "prepare.split_mb=0.001"]
        run_stage("prepare", *self.args)
        self.before = snapshot(self.out)
        assert any(name.startswith("prompts-") for name in self.before) and self.before["rejects.jsonl"]
        write_source(self.src, "new")

    def start(self, fault: str, at: str) -> subprocess.Popen:
        return self.runs.start(fault, at, self.args)

    def blocked(self, proc: subprocess.Popen) -> list[int]:
        return self.runs.blocked(proc)

    def siblings(self) -> list[str]:
        return sorted(p.name for p in self.data.iterdir())


@pytest.fixture
def setup(run_stage, tmp_path, mlflow_uri):
    setup = Setup(run_stage, tmp_path, mlflow_uri)
    yield setup
    setup.runs.stop_all()


@pytest.mark.parametrize("fault, at, stop, codes", [
    ("raise", "pass2", None, {1}),
    ("block", "pass2", stop_with_sigterm, {128 + signal.SIGTERM}),
    ("block", "pass1", stop_group_with_sigterm, {1, 128 + signal.SIGTERM}),  # a worker's death may be seen first
    ("block", "pass2", stop_group_with_sigint, {130}),
    ("block", "pass1", kill_a_worker, {1}),
], ids=["exception after pass 2", "SIGTERM after pass 2", "SIGTERM to the group in pass 1",
        "SIGINT to the group after pass 2", "a worker killed in pass 1"])
def test_a_prepare_stopped_part_way_leaves_the_previous_output_as_it_was(setup, fault, at, stop, codes):
    proc = setup.start(fault, at)
    if stop is not None:
        stop(proc, setup.blocked(proc))
    stderr = finished(proc)
    assert proc.returncode in codes, stderr[-3000:]
    assert snapshot(setup.out) == setup.before
    assert setup.siblings() == ["prompts"]  # the partial directory was deleted


def test_a_sigkilled_prepares_leftovers_are_deleted_by_the_next_run_and_a_live_ones_are_not(setup, run_stage):
    proc = setup.start("block", "pass2")
    setup.blocked(proc)
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(60) == -signal.SIGKILL
    assert snapshot(setup.out) == setup.before
    # nothing could delete them; the lock file is released (the kernel drops a dead process's lock)
    assert setup.siblings() == [".prompts.lock", f".prompts.partial-{proc.pid}", "prompts"]
    live = setup.data / f".prompts.partial-{os.getpid()}"  # a prepare for the same output, still running
    live.mkdir()
    (live / "prompts-00000.parquet").write_bytes(b"being written")
    run_stage("prepare", *setup.args)
    assert setup.siblings() == [live.name, "prompts"]
    assert (live / "prompts-00000.parquet").read_bytes() == b"being written"
    rows = read_rows(setup.out)
    assert rows and all(r["messages"][0]["content"].startswith("new ") for r in rows)
    assert sorted(p.name for p in setup.out.iterdir()) == [
        "prompts-00000.parquet", "rejects.jsonl", "stats.json"]


def test_a_prepare_replaces_the_output_only_once_complete_and_leaves_no_temp_dir(setup, tmp_path, mlflow_uri):
    proc = setup.start("block", "pass2")
    (pid,) = setup.blocked(proc)
    # every shard is written, stats.json not yet: the new rows are beside the output, which is still the old one
    partial = setup.data / f".prompts.partial-{pid}"
    assert snapshot(setup.out) == setup.before
    assert setup.siblings() == [".prompts.lock", partial.name, "prompts"]
    assert [r["messages"][0]["content"] for r in read_rows(partial)][:1] == ["new question 0"]
    (setup.marks / "go").touch()
    stderr = finished(proc)
    assert proc.returncode == 0, stderr[-3000:]
    assert setup.siblings() == ["prompts"]
    assert f"kept 389 prompts in {setup.out}" in stderr
    rows = read_rows(setup.out)
    assert len(rows) == 389 and all(r["messages"][0]["content"].startswith("new ") for r in rows)
    stats = json.loads((setup.out / "stats.json").read_text())
    assert stats["s0"] == {"read": 400, "kept": 389, "dropped": {"invalid_json": 11}}
    assert len((setup.out / "rejects.jsonl").read_text().splitlines()) == 11
    assert not (setup.out / ".pass1").exists()
    # MLflow has the stats.json of this run (uploaded from the output, not from the deleted partial directory)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_uri)
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])
            if r.data.params.get("prepare.output") == str(setup.out)]
    latest = max(runs, key=lambda r: r.info.start_time)
    assert latest.info.status == "FINISHED"
    logged = client.download_artifacts(latest.info.run_id, "stats.json", str(tmp_path / "artifacts"))
    assert Path(logged).read_bytes() == (setup.out / "stats.json").read_bytes()


def test_a_second_prepare_for_the_same_output_is_refused_at_once_and_touches_nothing(setup, run_stage):
    proc = setup.start("block", "pass2")
    (pid,) = setup.blocked(proc)
    check_a_second_run_is_refused(run_stage, "prepare", setup.args, setup.out, pid, setup.before)
    (setup.marks / "go").touch()
    stderr = finished(proc)
    assert proc.returncode == 0, stderr[-3000:]
    assert setup.siblings() == ["prompts"]  # the lock file went with the run
    assert all(r["messages"][0]["content"].startswith("new ") for r in read_rows(setup.out))
    run_stage("prepare", *setup.args)  # and the next run for that output may start
    assert setup.siblings() == ["prompts"]


def test_a_prepare_killed_between_its_two_renames_gets_its_old_output_back(setup):
    """SIGKILL (or power loss) after the old output was moved aside and before the new one was renamed in: no output
    at all. The next prepare puts the old one back first, so even when that one fails too nothing is lost."""
    pid = dead_pid()
    setup.out.rename(setup.data / f".prompts.old-{pid}")
    (setup.data / f".prompts.partial-{pid}").mkdir()
    proc = setup.start("raise", "pass2")
    stderr = finished(proc)
    assert proc.returncode == 1, stderr[-3000:]
    assert snapshot(setup.out) == setup.before
    assert setup.siblings() == ["prompts"]


def test_an_old_output_killed_while_being_deleted_is_not_put_back(setup):
    """SIGKILL while the old output was being deleted, after the commit (no partial directory left), and then the
    output removed (as `dvc repro` does): what is left of the old one is not an output, and the next prepare, failing
    too, must not put it in place."""
    pid = dead_pid()
    aside = setup.data / f".prompts.old-{pid}"
    setup.out.rename(aside)
    (aside / "stats.json").unlink()  # half deleted
    proc = setup.start("raise", "pass2")
    stderr = finished(proc)
    assert proc.returncode == 1, stderr[-3000:]
    assert setup.siblings() == []


def test_no_write_access_beside_the_output_is_one_line(tmp_path, monkeypatch):
    from drafter_data import outputs

    def refuse(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(outputs.Path, "mkdir", refuse)
    with pytest.raises(StageError, match=r"prepare.output=.*cannot write beside it .*Permission denied.* needs write "
                                         r"access to"):
        with outputs.StagedOutputDir(tmp_path / "out", "prepare.output", {}, ("stats.json",)):
            pass


def test_a_signal_during_the_commit_leaves_the_new_output_and_deletes_the_old(tmp_path, monkeypatch):
    """SIGTERM while the new output is renamed in: delivered once both renames are done (the stage exits 143), and the
    old output moved aside is deleted on the way out, not left beside the new one."""
    from drafter_data import outputs

    out = tmp_path / "prompts"
    out.mkdir()
    (out / "stats.json").write_text("old")
    renames = []

    def rename(a, b):
        renames.append(b)
        if len(renames) == 1:
            signal.raise_signal(signal.SIGTERM)  # deferred: the handler below runs after the second rename
        os.replace(a, b)

    def sigterm(signum, frame):
        raise SystemExit(143)

    previous = signal.signal(signal.SIGTERM, sigterm)
    monkeypatch.setattr(outputs.os, "rename", rename)
    try:
        with pytest.raises(SystemExit), outputs.StagedOutputDir(out, "prepare.output", {}, ("stats.json",)) as staged:
            (staged.path / "stats.json").write_text("new")
            staged.commit()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert len(renames) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts"]
    assert (out / "stats.json").read_text() == "new"


def test_an_output_named_through_dotdot_is_the_directory_it_names(tmp_path):
    """`prompts/x/..` is prompts (renamed as a whole), not a directory to create inside it."""
    from drafter_data import outputs

    out = tmp_path / "prompts"
    out.mkdir()
    (out / "stats.json").write_text("old")
    with outputs.StagedOutputDir(out / "x" / "..", "prepare.output", {}, ("stats.json",)) as staged:
        (staged.path / "stats.json").write_text("new")
        assert staged.commit() == out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts"] and (out / "stats.json").read_text() == "new"
