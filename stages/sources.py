"""sources: the configured prompt files in; their content hashes out, as the dependency that re-runs prepare.

Runs on every `dvc repro` (always_changed in dvc.yaml) and is cheap: a file whose size, mtime and inode did not
change since its last hash is not read again. Its output changes only when a configured file's content (or the list
of sources) does, so an unchanged setup skips prepare and a one-byte edit anywhere, in the repo or outside it,
re-runs prepare and everything downstream of what changed.

    in:  prepare.sources: [{name, path, ...}, ...] (the files themselves)
    out: data/sources.json: {"sources": [{name, path, size, md5}, ...]}
"""
from __future__ import annotations

import sys
from pathlib import Path

from drafter_data.config import run_stage
from drafter_data.source_files import StatCache, source_hashes, stat_cache_path, write_hashes

OUTPUT = Path("data/sources.json")


def main(cfg) -> int:
    cache = StatCache(stat_cache_path())
    hashes = source_hashes(cfg.prepare.sources, cache)
    cache.save()
    write_hashes(hashes, OUTPUT)
    print(f"sources: {len(hashes)} prompt files, {cache.hashed_files} hashed ({cache.hashed_bytes:,} bytes), "
          f"{len(hashes) - cache.hashed_files} unchanged since their last hash -> {OUTPUT}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    run_stage(main)
