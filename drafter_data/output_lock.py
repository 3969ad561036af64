"""One run per output directory: a lock file held (flock) by the stage process while it writes the output, released
on any exit, even a kill -9. A second process for the same output fails at once, naming the holder's pid.

generate keeps its lock inside the output it appends to (`<output>/.lock`). prepare and tokenize replace their output
whole (outputs.StagedOutputDir), so theirs lies beside it (`.<name>.lock`) and is deleted when released."""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

from drafter_data.errors import StageError


class OutputLock:
    """with OutputLock(lock_path, stage, output): ... ; remove=True deletes lock_path on release."""

    def __init__(self, lock_path: Path, stage: str, output: Path, remove: bool = False):
        self.path, self.stage, self.output, self.remove = Path(lock_path), stage, Path(output), remove
        self._fd: int | None = None

    def __enter__(self) -> OutputLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666)
            except PermissionError:  # left by another user's killed run: locked read-only, then replaced
                fd = self._lock_or_refuse(os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW))
                os.unlink(self.path)
                os.close(fd)
                continue
            self._lock_or_refuse(fd)
            if self._still_at_path(fd):
                break
            os.close(fd)  # its holder deleted this file after we opened it: lock the one now at the path
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {self.stage}\n".encode(), 0)
        self._fd = fd
        return self

    def _lock_or_refuse(self, fd: int) -> int:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 128, 0).decode(errors="replace").split()  # "<pid> <stage>"
            pid, stage = (holder[0] if holder else "unknown"), (holder[1] if len(holder) > 1 else self.stage)
            os.close(fd)
            raise StageError(f"another {stage} process (pid {pid}) is writing to {self.output}; wait for it to "
                             f"finish or stop it (one run per output directory)") from None
        return fd

    def _still_at_path(self, fd: int) -> bool:
        try:
            return os.lstat(self.path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            return False

    def __exit__(self, *exc) -> None:
        if self._fd is None:
            return
        if self.remove:
            # deleted while still held: a process waiting on this file finds it gone and takes the new one
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        os.close(self._fd)  # closing releases the lock; without `remove` the file stays (removing it would race)
        self._fd = None
