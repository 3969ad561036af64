"""One writer per output directory: `<output>/.lock`, held (flock) by the generate process while it runs and
released on any exit, even a kill -9. A second process fails at once, naming the holder."""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

from drafter_data.errors import StageError


class OutputLock:
    def __init__(self, out_dir: Path):
        self.path = Path(out_dir) / ".lock"
        self._fd: int | None = None

    def __enter__(self) -> OutputLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise StageError(f"another generate process (pid {holder}) is writing to {self.path.parent}; wait for it "
                             f"to finish or stop it (one writer per output directory)") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing releases the lock; the file stays (removing it would race a new holder)
            self._fd = None
