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
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise StageError(f"another {self.stage} process (pid {holder}) is writing to {self.output}; wait for "
                                 f"it to finish or stop it (one run per output directory)") from None
            if not self.remove or self._still_at_path(fd):
                break
            os.close(fd)  # its holder deleted this file after we opened it: lock the one now at the path
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def _still_at_path(self, fd: int) -> bool:
        try:
            return os.stat(self.path).st_ino == os.fstat(fd).st_ino
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
