"""Helpers shared by the benchmarks: child processes timed with their own peak RSS and CPU time."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


def run_measured(args: list[str], env: dict | None = None, cwd: Path = REPO) -> dict:
    """Runs a command; returns wall seconds, CPU seconds and peak RSS (MB) of that process alone."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(args, cwd=cwd, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    out, err = proc.stdout.read(), proc.stderr.read()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        sys.exit(f"benchmark step failed ({proc.returncode}): {' '.join(args)}\n{err[-3000:]}")
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime, "peak_rss_mb": usage.ru_maxrss / 1024,
            "stdout": out, "stderr": err}
