"""Worker processes for the CPU stages (prepare's pass 1, tokenize).

Forked where the platform allows, and all at once when the pool opens (before the stage starts a thread of its own,
such as MLflow's): they begin with the stage's modules and tokenizer already loaded. A worker that dies (killed, out
of memory) fails the stage with one line instead of hanging it, and a stage stopped by a signal kills its workers
instead of waiting for their queued work.
"""
from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager

from drafter_data.errors import StageError

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
FORKED = "fork" in multiprocessing.get_all_start_methods()  # workers start as copies of the stage and what it loaded


@contextmanager
def worker_processes(n: int, initializer=None, initargs: tuple = ()):
    """A ProcessPoolExecutor of n workers, each started by `initializer(*initargs)`."""
    method = "fork" if FORKED else "spawn"
    pool = ProcessPoolExecutor(n, mp_context=multiprocessing.get_context(method), initializer=_start_worker,
                               initargs=(initializer, initargs, os.getpid()))
    try:
        pool.submit(int).result()  # starts every worker now (a forking pool starts them all with its first task)
        if method == "fork":
            # Only the workers write results; the write end this process holds would keep a reader waiting forever
            # on the rest of a message whose writer was killed half-way (a stage stopped by Ctrl-C or SIGTERM to its
            # process group then hung in shutdown). Without it, the reader sees the end of the pipe instead.
            pool._result_queue._writer.close()
        yield pool
    except BrokenProcessPool as exc:
        raise StageError(f"a worker process died before finishing its work ({exc}); was it killed or out of "
                         f"memory? Nothing was written as complete: re-run the stage") from exc
    except BaseException:  # Ctrl-C, SIGTERM, an error: queued work is dropped, not waited for
        for child in multiprocessing.active_children():
            child.kill()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _start_worker(initializer, initargs: tuple, stage_pid: int) -> None:
    # a forked worker would inherit the stage's SIGTERM handler (config.run_stage), whose SystemExit unwinds through
    # the worker's shutdown and can hang there on a queue's lock
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _die_with_parent(stage_pid)
    if initializer is not None:
        initializer(*initargs)


def _die_with_parent(parent: int) -> None:
    """Linux: the kernel kills this worker when the stage's process ends, however it ends (SIGKILL, OOM), instead
    of leaving it blocked on a pipe nobody reads."""
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the stage died before the line above
        os._exit(1)


def dies_with_this_process():
    """A subprocess.Popen preexec_fn (None off Linux): the child (a server a stage or a test starts) is killed by the
    kernel when this process ends, however it ends (SIGKILL included), instead of running on, orphaned. Call it from
    the thread that lives as long as the child should (the main one): the signal comes when that thread ends."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: between fork and exec the child only calls it
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:
            os._exit(1)

    return preexec
