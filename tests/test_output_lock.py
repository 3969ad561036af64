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
        assert lock.read_text() == f"{os.getpid()} prepare\n"
    assert not lock.exists()


def test_a_lock_file_its_holder_deleted_after_we_opened_it_is_not_the_lock(tmp_path, monkeypatch):
    """The holder deletes the file and releases it between our open and our flock: the flock succeeds, but on a file
    no other process can find. We must lock the file at the path instead, or two runs would both hold "the" lock."""
    lock, out = tmp_path / ".out.lock", tmp_path / "out"
    lock.write_text("12345 prepare\n")
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


def test_the_refusal_names_the_holders_stage(tmp_path):
    lock, out = tmp_path / ".out.lock", tmp_path / "out"
    holder = hold_in_another_process(lock, out)  # a prepare
    try:
        with pytest.raises(StageError, match=rf"^another prepare process \(pid {holder.pid}\)"), \
                OutputLock(lock, "tokenize", out, remove=True):
            pass
    finally:
        holder.kill()
        holder.wait(30)


def test_a_lock_file_this_user_cannot_write_is_locked_read_only_then_replaced(tmp_path, monkeypatch):
    """Another user's killed run left it (0644, not ours): free, it is replaced; held, the holder is named."""
    lock, out = tmp_path / ".out.lock", tmp_path / "out"
    foreign, real_open = set(), os.open

    def open_as_this_user(path, flags, *mode):  # may not write the files in `foreign` (by inode)
        if flags & os.O_RDWR and os.path.lexists(path) and os.lstat(path).st_ino in foreign:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *mode)

    monkeypatch.setattr(output_lock.os, "open", open_as_this_user)
    lock.write_text("1 prepare\n")
    foreign.add(lock.stat().st_ino)
    with OutputLock(lock, "prepare", out, remove=True):
        assert lock.read_text() == f"{os.getpid()} prepare\n"
    assert not lock.exists()
    holder = hold_in_another_process(lock, out)
    try:
        lock_text = lock.read_text()
        foreign.add(lock.stat().st_ino)
        with pytest.raises(StageError, match=rf"pid {holder.pid}\)"), OutputLock(lock, "prepare", out, remove=True):
            pass
        assert lock.read_text() == lock_text  # the holder's file, untouched
    finally:
        holder.kill()
        holder.wait(30)


def test_a_symlink_at_the_lock_path_is_not_followed(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("important contents")
    lock, out = tmp_path / ".out.lock", tmp_path / "out"
    lock.symlink_to(victim)
    with pytest.raises(OSError), OutputLock(lock, "prepare", out, remove=True):
        pass
    assert victim.read_text() == "important contents"
