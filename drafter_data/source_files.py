"""The content hashes of the configured prompt files, so DVC re-runs prepare when any of them changes.

DVC only hashes the deps dvc.yaml names, and a user's prompt files can be anywhere (`prepare.sources` is config, often
an absolute path outside the repo). The `sources` stage runs on every `dvc repro` (always_changed) and writes each
file's md5 to a small JSON file that prepare depends on: the same content gives the same file, so prepare is skipped;
one byte changed anywhere gives another, so prepare and what it feeds run again.

Hashing is skipped for a file whose size, mtime and inode match the last hash (as DVC's own state does), so a
repro over many gigabytes of prompts costs a stat per file. The stat cache lives in `.dvc/tmp` and losing it only
costs a re-hash.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from drafter_data.errors import StageError

CHUNK = 1 << 20
# A file changed within this long of being hashed could change again within the same mtime tick: hash it next time too.
RACY_S = 2.0


def stat_cache_path() -> Path:
    """Under DVC (also `dvc exp run --temp`) DVC_ROOT is the repo; by hand, the cwd (the repo root)."""
    return Path(os.environ.get("DVC_ROOT") or ".") / ".dvc" / "tmp" / "source-hashes.json"


def file_md5(path: Path) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class StatCache:
    """path -> (size, mtime_ns, inode, md5) of the last hash."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.entries = json.loads(path.read_text())
        except (OSError, ValueError):
            self.entries = {}
        self.hashed_files = 0
        self.hashed_bytes = 0

    def md5(self, path: Path) -> str:
        key = str(path.resolve())
        st = path.stat()
        stamp = [st.st_size, st.st_mtime_ns, st.st_ino]
        entry = self.entries.get(key)
        if entry and entry[:3] == stamp:
            return entry[3]
        md5 = file_md5(path)
        self.hashed_files += 1
        self.hashed_bytes += st.st_size
        if time.time() - st.st_mtime_ns / 1e9 > RACY_S:
            self.entries[key] = [*stamp, md5]
        else:
            self.entries.pop(key, None)
        return md5

    def save(self) -> None:
        """Best effort: a cache that cannot be written only means hashing again next time."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.entries))
            tmp.replace(self.path)
        except OSError:
            pass


def source_hashes(sources, cache: StatCache) -> list[dict]:
    """[{name, path (as configured), size, md5}] in source order (the order decides which duplicate prepare keeps)."""
    hashes = []
    for i, src in enumerate(sources or []):
        if not src or not src.get("path"):
            raise StageError(f"prepare.sources[{i}] needs a name and a path, got {dict(src or {})}")
        path = Path(str(src["path"]))
        if not path.is_file():
            raise StageError(f"prompt file of source {src.get('name')!r} not found: {path.resolve()}")
        hashes.append({"name": src.get("name"), "path": str(src["path"]), "size": path.stat().st_size,
                       "md5": cache.md5(path)})
    return hashes


def write_hashes(hashes: list[dict], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"sources": hashes}, indent=2) + "\n")
