"""Shared by the tests of stages that write their output whole (outputs.StagedOutputDir: prepare, tokenize): a stage
run with a fault injected at a named point, the ways to stop it there, and what to compare before and after."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import REPO

# Runs a stage with a fault at one point (FAULT_AT, a key of the driver's points): "raise" raises there, "block" waits
# there (its pid in FAULT_DIR/blocked-<pid>) until FAULT_DIR/go exists, so a test can stop it at a moment it can see.
# A point wraps module.function, before or after the real call; the wrapper keeps its name (it is pickled to workers).
DRIVER = r"""
import faulthandler, importlib, os, runpy, signal, sys, time
from pathlib import Path

faulthandler.register(signal.SIGUSR1, all_threads=True)  # a stage that hangs shows every thread's stack (finished())
# Ctrl-C as a terminal delivers it: a test suite started in the background (`cmd &`, a CI runner) starts its children
# with SIGINT ignored, and Python keeps it ignored, so a stage stopped "by Ctrl-C" would never see it
signal.signal(signal.SIGINT, signal.default_int_handler)

fault, at, marks = os.environ["FAULT"], os.environ["FAULT_AT"], Path(os.environ["FAULT_DIR"])
stage, error = sys.argv.pop(1), sys.argv.pop(1)
points = dict(p.split("=") for p in sys.argv.pop(1).split(","))

def fault_here():
    if fault == "raise":
        from drafter_data.errors import StageError
        raise {"StageError": StageError, "RuntimeError": RuntimeError}[error]("injected fault")
    (marks / f"blocked-{os.getpid()}").touch()
    deadline = time.monotonic() + 300
    while not (marks / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)

module_name, name, when = points[at].split(":")
module = importlib.import_module(module_name)
real = getattr(module, name)

def injected(*args):
    if when == "before":
        fault_here()
    result = real(*args)
    if when == "after":
        fault_here()
    return result

injected.__module__, injected.__qualname__ = real.__module__, real.__qualname__
setattr(module, name, injected)
runpy.run_module(stage, run_name="__main__", alter_sys=True)
"""


class FaultyRun:
    """Starts `stage` (a module) with stage args and a fault at one of `points`
    ({name: "module:function:before|after"}); keeps the runs it started, to kill what a failed test left running."""

    def __init__(self, stage: str, points: dict[str, str], marks: Path, mlflow_uri: str, error: str = "RuntimeError"):
        self.stage, self.error, self.marks, self.mlflow_uri = stage, error, marks, mlflow_uri
        self.points = ",".join(f"{k}={v}" for k, v in points.items())
        self.marks.mkdir(parents=True, exist_ok=True)
        self.started: list[subprocess.Popen] = []

    def start(self, fault: str, at: str, args: list[str]) -> subprocess.Popen:
        env = {**os.environ, "MLFLOW_TRACKING_URI": self.mlflow_uri, "FAULT": fault, "FAULT_AT": at,
               "FAULT_DIR": str(self.marks)}
        proc = subprocess.Popen([sys.executable, "-c", DRIVER, self.stage, self.error, self.points, *args], cwd=REPO,
                                env=env, text=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                start_new_session=True)
        self.started.append(proc)
        return proc

    def blocked(self, proc: subprocess.Popen, n: int = 1, timeout: float = 120) -> list[int]:
        """The pids blocked at the fault, once there are n."""
        deadline = time.monotonic() + timeout
        while len(pids := [int(p.name.split("-")[1]) for p in self.marks.glob("blocked-*")]) < n:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(f"{self.stage} never reached the fault (exit {proc.wait()}): {proc.stderr.read()}")
            time.sleep(0.05)
        return pids

    def stop_all(self) -> None:
        for proc in self.started:
            if proc.poll() is None:  # a test that failed before it stopped or released its run
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)


def finished(proc: subprocess.Popen, timeout: float = 120) -> str:
    """The stderr of a stage run started by FaultyRun, once it ends. One that does not end within `timeout` fails
    the test with what it was doing: the processes of its group and every thread's stack (the driver dumps them on
    SIGUSR1)."""
    try:
        return proc.communicate(timeout=timeout)[1]
    except subprocess.TimeoutExpired:
        group = process_group(proc.pid)
        os.killpg(proc.pid, signal.SIGUSR1)
        time.sleep(2)
        os.killpg(proc.pid, signal.SIGKILL)
        stderr = proc.communicate(timeout=30)[1]
        raise AssertionError(f"the stage did not end within {timeout} s; its process group:\n{group}\n"
                             f"stderr (stacks at the end):\n{stderr[-12000:]}") from None


def process_group(pgid: int) -> str:
    """`pid state command` of each live process in the group (from /proc)."""
    lines = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmd = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
        except OSError:
            continue
        if int(fields[2]) == pgid:  # after the command: state, ppid, pgrp
            lines.append(f"{stat.parent.name} {fields[0]} {cmd}")
    return "\n".join(lines) or "(none left)"


def check_a_second_run_is_refused(run_stage, stage: str, args: list[str], out: Path, pid: int, before: dict) -> None:
    """While run `pid` writes `out` (blocked at a fault), the same stage for the same output fails at once with one
    line naming it, and touches neither the output nor what the first run is writing."""
    partial = out.parent / f".{out.name}.partial-{pid}"
    being_written = snapshot(partial)
    second = run_stage(stage, *args, check=False)
    assert second.returncode == 1
    assert second.stderr.strip().splitlines()[-1] == (
        f"error: another {stage} process (pid {pid}) is writing to {out}; wait for it to finish or stop it "
        f"(one run per output directory)")
    assert snapshot(out) == before and snapshot(partial) == being_written


def snapshot(directory: Path) -> dict:
    return {p.relative_to(directory).as_posix(): p.read_bytes() if p.is_file() else None
            for p in sorted(directory.rglob("*"))}


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def stop_with_sigterm(proc, pids):
    proc.send_signal(signal.SIGTERM)  # the stage alone


def stop_group_with_sigterm(proc, pids):
    os.killpg(proc.pid, signal.SIGTERM)  # the stage and its workers, as `kill -- -pgid` or a CI runner does


def stop_group_with_sigint(proc, pids):
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C


def kill_a_worker(proc, pids):
    assert proc.pid not in pids  # blocked in a worker process
    os.kill(pids[0], signal.SIGKILL)
