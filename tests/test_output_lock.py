"""One run per output directory (drafter_data.output_lock): a second process is refused at once, naming the holder;
a holder killed with SIGKILL leaves the lock free; a lock file deleted by its holder as another process opened it is
not taken as the lock."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from drafter_data import output_lock
from drafter_data.errors import StageError
from drafter_data.output_lock import OutputLock
from tests.conftest import REPO

HOLD = """
import sys, time
from pathlib import Path
from drafter_data.output_lock import OutputLock
with OutputLock(Path(sys.argv[1]), "prepare", Path(sys.argv[2]), remove=True):
    print("held", flush=True)
    time.sleep(300)
"""


def hold_in_another_process(lock: Path, out: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(lock), str(out)], cwd=REPO, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_process_is_refused_naming_the_holder_and_a_killed_holder_frees_it(tmp_path):
    lock, out = tmp_path / ".out.lock", tmp_path / "out"
    holder = hold_in_another_process(lock, out)
    try:
        with pytest.raises(StageError) as refused, OutputLock(lock, "prepare", out, remove=True):
            pass
        assert str(refused.value) == (f"another prepare process (pid {holder.pid}) is writing to {out}; wait for it "
                                      f"to finish or stop it (one run per output directory)")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
    assert lock.exists()  # SIGKILL runs no clean-up; the kernel dropped the lock itself
    with OutputLock(lock, "prepare", out, remove=True):
        assert lock.read_text() == f"{os.getpid()}\n"
    assert not lock.exists()


def test_a_lock_file_its_holder_deleted_after_we_opened_it_is_not_the_lock(tmp_path, monkeypatch):
    """The holder deletes the file and releases it between our open and our flock: the flock succeeds, but on a file
    no other process can find. We must lock the file at the path instead, or two runs would both hold "the" lock."""
    lock, out = tmp_path / ".out.lock", tmp_path / "out"
    lock.write_text("12345\n")
    real_flock, calls = output_lock.fcntl.flock, []

    def flock_after_the_holder_left(fd, op):
        calls.append(fd)
        if len(calls) == 1:
            os.unlink(lock)  # what the holder's release does, just before ours
        return real_flock(fd, op)

    monkeypatch.setattr(output_lock.fcntl, "flock", flock_after_the_holder_left)
    with OutputLock(lock, "prepare", out, remove=True) as held:
        assert len(calls) == 2 and os.stat(lock).st_ino == os.fstat(held._fd).st_ino
        monkeypatch.setattr(output_lock.fcntl, "flock", real_flock)
        third = subprocess.run([sys.executable, "-c", HOLD, str(lock), str(out)], cwd=REPO, capture_output=True,
                               text=True, timeout=60)
        assert third.returncode == 1 and f"(pid {os.getpid()})" in third.stderr


def test_generates_lock_inside_its_output_stays_when_released(tmp_path):
    out = tmp_path / "completions"
    with OutputLock(out / ".lock", "generate", out):
        pass
    assert (out / ".lock").exists()  # deleting it could race a new holder; .dvcignore leaves it out
    start = time.monotonic()
    with OutputLock(out / ".lock", "generate", out):
        assert time.monotonic() - start < 5
