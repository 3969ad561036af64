"""Replacing a stage's output directory without ever deleting what it must not.

prepare replaces its output directory, so the old one is deleted. That is refused, with a message, when the
directory is (or contains) one of the stage's inputs, or the repo itself, or when it exists, is not empty and holds
nothing the stage writes (a mistyped path must not wipe somebody's folder).

StagedOutputDir writes the new directory whole: into a temporary sibling (same filesystem), renamed into place only
once every file in it is written and flushed, so whatever stops the stage before that leaves the old one as it was.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import threading
from contextlib import contextmanager
from pathlib import Path

from drafter_data.contract import fsync
from drafter_data.errors import StageError
from drafter_data.output_lock import OutputLock

REPO_ROOT = Path(__file__).resolve().parents[1]


def check_apart(out_dir: Path, key: str, protected: dict[str, Path]) -> None:
    """Refuses an output directory that is, holds or lies inside one of `protected` (an input: the stage would read
    its own output, or delete its input), the working directory or the repo."""
    target = out_dir.resolve()
    always = {"the working directory": Path.cwd(), "the repo": REPO_ROOT}
    for what, path in {**protected, **always}.items():
        path = path.resolve()
        if target == path or target in path.parents:
            raise StageError(f"{key}={out_dir} {'is' if target == path else 'contains'} {what} ({path}); "
                             f"choose an output directory of its own")
        if path in target.parents and what not in always:
            raise StageError(f"{key}={out_dir} lies inside {what} ({path}); choose an output directory of its own")


def check_replaceable(out_dir: Path, key: str, protected: dict[str, Path], markers: tuple[str, ...]) -> None:
    check_apart(out_dir, key, protected)
    if out_dir.is_symlink() or (out_dir.exists() and not out_dir.is_dir()):
        raise StageError(f"{key}={out_dir} exists and is not a directory; remove it or choose another path")
    if out_dir.exists() and any(out_dir.iterdir()) and not any(any(out_dir.glob(m)) for m in markers):
        raise StageError(f"{key}={out_dir} is a directory with other files in it (none of {', '.join(markers)}): "
                         f"refusing to delete it; empty it or choose another output directory")


class StagedOutputDir:
    """with StagedOutputDir(out_dir, key, protected, markers) as staged: (write into staged.path); staged.commit()

    Entering checks out_dir may be replaced (check_replaceable: a refused output fails before any work), removes what
    killed runs for the same output left beside it (see remove_leftovers) and creates `.<name>.partial-<pid>` beside
    out_dir. commit() flushes every file in it to disk, moves the old out_dir aside (`.<name>.old-<pid>`), renames the
    new one into place and only then deletes the old one: a reader sees the old directory or the new one, never a
    half-written or half-deleted one. Leaving without commit() (an error, Ctrl-C, SIGTERM) deletes the partial
    directory and leaves out_dir untouched; after SIGKILL the next run for that output deletes it. One run per output:
    a second one while the first holds `.<name>.lock` beside out_dir fails at once, naming it (output_lock)."""

    def __init__(self, out_dir: Path, key: str, protected: dict[str, Path], markers: tuple[str, ...]):
        # `..` resolved by name: `out/x/..` is out, the directory renamed, not one inside it
        self.out_dir, self.key, self.protected, self.markers = Path(os.path.abspath(out_dir)), key, protected, markers
        self.pid = os.getpid()
        self.path = sibling(self.out_dir, "partial", self.pid)
        self.aside: Path | None = None
        self.committed = False
        self.lock = OutputLock(sibling(self.out_dir, "lock"), key.split(".")[0], self.out_dir, remove=True)

    def __enter__(self) -> "StagedOutputDir":
        check_replaceable(self.out_dir, self.key, self.protected, self.markers)
        if os.path.ismount(self.out_dir):
            raise StageError(f"{self.key}={self.out_dir} is a mount point: the stage replaces its output directory "
                             f"by renaming a new one into place, which a mount point cannot be; choose a directory "
                             f"inside it")
        try:
            self.out_dir.parent.mkdir(parents=True, exist_ok=True)
            self.lock.__enter__()  # before touching anything beside out_dir: a second run fails here
        except OSError as exc:
            raise self.no_write_access(exc) from None
        try:
            remove_leftovers(self.out_dir, self.protected)
            self.path.mkdir()
        except BaseException as exc:
            self.lock.__exit__()
            if isinstance(exc, OSError):
                raise self.no_write_access(exc) from None
            raise
        return self

    def no_write_access(self, exc: OSError) -> StageError:
        return StageError(f"{self.key}={self.out_dir}: cannot write beside it ({exc}); the stage writes its output "
                          f"next to it and renames it into place, so it needs write access to {self.out_dir.parent}")

    def __exit__(self, *exc) -> None:
        if os.getpid() != self.pid:  # never from a forked worker
            return
        try:
            if not self.committed:
                shutil.rmtree(self.path, ignore_errors=True)
            elif self.aside is not None:  # stopped after the new output was in place, before the old one was deleted
                shutil.rmtree(self.aside, ignore_errors=True)
        finally:
            self.lock.__exit__()

    def commit(self) -> Path:
        """Replaces out_dir with the partial directory (which must hold only finished files by now); returns out_dir."""
        check_replaceable(self.out_dir, self.key, self.protected, self.markers)  # again: it may have changed since
        for path in self.path.rglob("*"):
            if path.is_file() and not path.is_symlink():
                fsync(path)
        fsync(self.path)
        aside = sibling(self.out_dir, "old", self.pid)
        with signals_deferred():  # Ctrl-C or SIGTERM between the two renames would leave no output at all
            try:
                os.rename(self.out_dir, aside)
            except FileNotFoundError:  # there was none (or a concurrent run for the same output moved it aside)
                aside = None
            try:
                os.rename(self.path, self.out_dir)
            except OSError as exc:
                if aside is not None and not self.out_dir.exists():
                    os.rename(aside, self.out_dir)
                raise StageError(f"{self.key}={self.out_dir}: cannot rename the finished output ({self.path}) into "
                                 f"place: {exc}; is another run writing the same output?") from exc
            self.aside, self.committed = aside, True
        fsync(self.out_dir.parent)
        if aside is not None:
            shutil.rmtree(aside)
            self.aside = None
        return self.out_dir


def sibling(out_dir: Path, kind: str, pid: int | None = None) -> Path:
    return out_dir.parent / (f".{out_dir.name}.{kind}" + ("" if pid is None else f"-{pid}"))


def remove_leftovers(out_dir: Path, protected: dict[str, Path]) -> None:
    """Deletes the `.<name>.partial-<pid>` and `.<name>.old-<pid>` directories beside out_dir whose process is gone
    (a run killed by SIGKILL, or while deleting the old output). Those of a live process are left alone: a run for the
    same output may be writing there now (and a pid reused since only costs the disk space until it ends). This
    process's own pid is not alive in that sense: it has not created its directory yet."""
    pattern = re.compile(rf"\.{re.escape(out_dir.name)}\.(partial|old)-(\d+)")
    inputs = [p.resolve() for p in protected.values()]
    for path in sorted(out_dir.parent.iterdir()):
        match = pattern.fullmatch(path.name)
        if not match or path.is_symlink() or not path.is_dir():
            continue
        pid = int(match[2])
        if pid != os.getpid() and pid_alive(pid):
            continue
        resolved = path.resolve()
        if any(p == resolved or resolved in p.parents for p in inputs):  # somebody's input: not ours to delete
            continue
        if match[1] == "old" and not os.path.lexists(out_dir) and sibling(out_dir, "partial", pid).is_dir():
            # killed between its two renames (the second one consumes the partial directory; sorted, a run's `old`
            # comes before its `partial`): the old output, whole, goes back where it was. Without the partial one it
            # was being deleted after the commit: what is left of it is not an output
            os.rename(path, out_dir)
            continue
        shutil.rmtree(path, ignore_errors=True)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


@contextmanager
def signals_deferred():
    """SIGINT and SIGTERM received inside are delivered when it ends (from the main thread only, where Python runs
    its handlers; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: received.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        for sig in dict.fromkeys(received):
            signal.raise_signal(sig)
