"""The CPU stages' worker processes: a stage stopped while a worker is half-way through sending its result ends at
once instead of hanging, and workers never outlive a stage killed outright."""
import subprocess
import sys
import time

from tests.conftest import REPO

# A worker writes the start of a result message (the length of 1,000 bytes, then 10 of them) and stops there; the
# stage is then stopped (an error in its main thread, as SIGTERM raises), which kills the workers and shuts down.
HALF_WRITTEN_RESULT = r"""
import gc, os, struct, time
from multiprocessing.queues import SimpleQueue
from drafter_data.worker_processes import worker_processes

def half_a_result():
    (results,) = [q for q in gc.get_objects() if isinstance(q, SimpleQueue)]
    os.write(results._writer.fileno(), struct.pack("!i", 1000) + b"x" * 10)
    time.sleep(120)

try:
    with worker_processes(2) as pool:
        pool.submit(half_a_result)
        time.sleep(1.0)
        raise RuntimeError("stopped")
except RuntimeError:
    print("ended", flush=True)
"""

# The stage is SIGKILLed while its workers wait for work: they must not live on.
STAGE_KILLED = r"""
import os, signal, sys
from drafter_data.worker_processes import worker_processes

with worker_processes(2) as pool:
    print(" ".join(str(p) for p in pool._processes), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_stage_stopped_while_a_worker_sends_half_a_result_ends_at_once():
    proc = subprocess.run([sys.executable, "-c", HALF_WRITTEN_RESULT], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "ended", proc.stderr[-3000:]


def test_workers_die_with_a_stage_that_is_killed():
    proc = subprocess.run([sys.executable, "-c", STAGE_KILLED], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == -9, proc.stderr[-3000:]
    workers = [int(p) for p in proc.stdout.split()]
    assert len(workers) == 2
    deadline = time.monotonic() + 10
    while (alive := [p for p in workers if is_alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive, f"workers {alive} outlived the stage"


def is_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
