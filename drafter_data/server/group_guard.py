"""Runs a command and takes its whole process group down with it when the process that started us dies, however it
dies (SIGKILL included). A server such as vLLM forks helpers (its EngineCore, multiprocessing's resource tracker)
that the kernel's parent-death signal on the server alone does not reach: killed with its stage, they ran on,
holding gigabytes. Stdlib only: run by any Python (vLLM's own environment included), by path:

    python group_guard.py COMMAND [ARGS...]

The starter gives us our own session (start_new_session=True), so the group is ours and the command's. When the
starter dies, the kernel sends us SIGTERM (PR_SET_PDEATHSIG); on SIGTERM or SIGINT we pass SIGTERM to the group,
give it GRACE_S to stop, then SIGKILL the group, ourselves included. We exit with the command's code when it ends
on its own.
"""
import ctypes
import os
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1
GRACE_S = 10.0


def main(argv: list[str]) -> int:
    starter = os.getppid()
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != starter:  # pragma: no cover - the starter died before the line above
        return 1
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(time.monotonic()))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(time.monotonic()))
    child = subprocess.Popen(argv)
    while child.poll() is None:
        if stopping:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            os.killpg(0, signal.SIGTERM)
            deadline = stopping[0] + GRACE_S
            while child.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            os.killpg(0, signal.SIGKILL)
        time.sleep(0.2)
    # the command ended on its own: its helpers must not outlive it either
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.killpg(0, signal.SIGTERM)
    return child.returncode


if __name__ == "__main__":
    if len(sys.argv) < 2:
        print("usage: python group_guard.py COMMAND [ARGS...]", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1:]))
