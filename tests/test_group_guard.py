"""drafter_data/server/group_guard.py: a server's helper processes (vLLM's EngineCore and resource tracker, forked
by the server) die with the stage that started it, even when the stage is SIGKILLed. Without the guard they were
seen running on, orphaned (the kernel's parent-death signal reaches only the server itself)."""
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from tests.conftest import REPO

GUARD = REPO / "drafter_data" / "server" / "group_guard.py"
# a "server" that forks a helper which ignores its parent's death, and writes both pids
SERVER = textwrap.dedent("""
    import os, sys, time
    helper = os.fork()
    if helper == 0:
        time.sleep(300)
        os._exit(0)
    open(sys.argv[1], "w").write(f"{os.getpid()} {helper}")
    time.sleep(300)
""")
# the "stage": starts the guarded server as local.start does (own session, dies_with_this_process), then waits
STAGE = textwrap.dedent("""
    import subprocess, sys, time
    from drafter_data.worker_processes import dies_with_this_process
    subprocess.Popen([sys.executable, sys.argv[1], sys.executable, "-c", sys.argv[2], sys.argv[3]],
                     start_new_session=True, preexec_fn=dies_with_this_process())
    time.sleep(300)
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _pids(path: Path, timeout: float = 20) -> list[int]:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text().strip()):
        assert time.monotonic() < deadline, "the guarded server did not start"
        time.sleep(0.05)
    return [int(p) for p in path.read_text().split()]


def _wait_dead(pids: list[int], timeout: float = 15) -> list[int]:
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def test_a_sigkilled_stage_takes_the_server_and_its_helpers_down(tmp_path):
    out = tmp_path / "pids"
    stage = subprocess.Popen([sys.executable, "-c", STAGE, str(GUARD), SERVER, str(out)], cwd=REPO)
    server, helper = _pids(out)
    assert _alive(server) and _alive(helper)
    stage.send_signal(signal.SIGKILL)
    stage.wait(10)
    left = _wait_dead([server, helper])
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes outlived the killed stage: {left}"


def test_stopping_the_group_as_local_stop_does_ends_everything(tmp_path):
    out = tmp_path / "pids"
    guard = subprocess.Popen([sys.executable, str(GUARD), sys.executable, "-c", SERVER, str(out)],
                             start_new_session=True)
    server, helper = _pids(out)
    os.killpg(guard.pid, signal.SIGTERM)
    guard.wait(20)
    left = _wait_dead([server, helper])
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes outlived the stopped group: {left}"
