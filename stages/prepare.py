"""prepare: real prompt files in; clean, deduplicated, sampled prompts out.

Two streaming passes keep memory flat: pass 1 normalizes every record into temporary shards and keeps only a
16-byte digest and a source index per candidate; dedupe (first occurrence in source order wins) and sampling
(bottom-k of a seeded hash) run on those arrays; pass 2 copies the chosen rows into the output shards.

    in:  prepare.sources: [{name, path, format, quota?, fields?}, ...]
    out: prepare.output: prompts-*.parquet, stats.json (read == kept + sum(dropped) per source), rejects.jsonl

The output directory is written whole: into `.<name>.partial-<pid>` beside it, renamed into place once complete
(outputs.StagedOutputDir), so a prepare that fails or is stopped leaves the previous output as it was.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import orjson

from drafter_data.config import run_stage
from drafter_data.errors import StageError
from drafter_data.prompts import formats
from drafter_data.prompts.accounts import Accounts
from drafter_data.prompts.normalize import normalize_sources, pass1_pool, pass1_units
from drafter_data.outputs import StagedOutputDir
from drafter_data.prompts.prompt import MODES
from drafter_data.prompts.selection import choose, write_chosen
from drafter_data.tracking import stage_run

OUTPUT_MARKERS = ("stats.json", "rejects.jsonl", "prompts-*.parquet", ".pass1")


def main(cfg) -> int:
    pcfg = cfg.prepare
    sources = check_sources(pcfg.sources)
    if (pcfg.get("turns") or "first") not in MODES:
        raise StageError(f"prepare.turns must be one of {', '.join(MODES)}, got {pcfg.get('turns')!r}")
    inputs = {f"the prompt file of source {s['name']!r}": s["path"] for s in sources}
    # the output's checks first (a refused output fails before any work); everything is written into staged.path,
    # which commit() renames to prepare.output once complete (leaving the block without it deletes staged.path)
    with StagedOutputDir(Path(pcfg.output), "prepare.output", inputs, OUTPUT_MARKERS) as staged:
        units = pass1_units(sources, pcfg)
        # workers first (forked before any thread starts); then the MLflow run opens, on a thread of its own (imports
        # and store: ~2.5 s of CPU while the prompts are read), so an interrupted or failed prepare shows as KILLED or
        # FAILED; closing it waits for that thread
        with pass1_pool(sources, units, pcfg) as pool, stage_run("prepare", cfg) as run:
            stats = select_prompts(sources, units, pool, cfg, staged.path)
            out_dir = staged.commit()
            print_summary(stats, out_dir)
            log_run(run, stats, out_dir)  # stats.json from its final place
    return 0


def select_prompts(sources: list[dict], units: list[dict], pool, cfg, out_dir: Path) -> dict:
    """Pass 1 over `units` (in `pool`, or here when None), dedupe and sampling, pass 2; writes stats.json and
    returns it."""
    pcfg = cfg.prepare
    tmp_dir = out_dir / ".pass1"
    tmp_dir.mkdir()
    acc = Accounts([s["name"] for s in sources], out_dir / "rejects.jsonl")
    try:
        digests, source_of = normalize_sources(units, pool, cfg, tmp_dir, acc)
        keep = choose(digests, source_of, sources, pcfg.get("sample"), int(pcfg.get("seed") or 0), acc)
        write_chosen(tmp_dir, keep, out_dir, int(pcfg.get("shard_rows") or 100000))
    finally:
        acc.close()
        shutil.rmtree(tmp_dir, ignore_errors=True)
    stats = acc.stats()
    (out_dir / "stats.json").write_bytes(orjson.dumps(stats, option=orjson.OPT_INDENT_2))
    return stats


def check_sources(sources) -> list[dict]:
    """Each source has a unique name, a known format and a file that exists; stops at the first that does not."""
    if not sources:
        raise StageError("no prompt sources configured: set prepare.sources (a list of {name, path, format})")
    checked, names = [], set()
    for i, src in enumerate(sources):
        if not src or not src.get("name") or not src.get("path"):
            raise StageError(f"prepare.sources[{i}] needs a name and a path, got {dict(src or {})}")
        if src["name"] in names:
            raise StageError(f"prepare.sources: the name {src['name']!r} is used twice")
        fmt = src.get("format") or "auto"
        if fmt not in formats.FORMATS:
            raise StageError(f"prepare.sources[{i}].format {fmt!r} is not one of {', '.join(formats.FORMATS)}")
        path = Path(src["path"])
        if not path.is_file():
            raise StageError(f"prompt file of source {src['name']!r} not found: {path.resolve()}")
        names.add(src["name"])
        fields = dict(src.get("fields") or {})
        checked.append({"name": src["name"], "path": path, "format": fmt, "quota": src.get("quota"), "fields": fields})
    return checked


def print_summary(stats: dict, out_dir: Path) -> None:
    print(f"{'source':<28}{'read':>10}{'kept':>10}  dropped", file=sys.stderr)
    for name, s in stats.items():
        dropped = ", ".join(f"{r}={n}" for r, n in s["dropped"].items() if n) or "-"
        print(f"{name:<28}{s['read']:>10}{s['kept']:>10}  {dropped}", file=sys.stderr)
    total_kept = sum(s["kept"] for s in stats.values())
    print(f"kept {total_kept} prompts in {out_dir}; rejected records listed in {out_dir / 'rejects.jsonl'}",
          file=sys.stderr)
    unexpected = sum(s["dropped"].get("unexpected_error", 0) for s in stats.values())
    if unexpected:
        print(f"warning: {unexpected} records hit an unexpected error (a bug in prepare: please report it with "
              f"their rejects.jsonl entries)", file=sys.stderr)


def log_run(run, stats: dict, out_dir: Path) -> None:
    metrics = {"kept": sum(s["kept"] for s in stats.values()), "read": sum(s["read"] for s in stats.values())}
    for name, s in stats.items():
        metrics[f"{name}.read"] = s["read"]
        metrics[f"{name}.kept"] = s["kept"]
        metrics.update({f"{name}.dropped.{r}": n for r, n in s["dropped"].items()})
    run.metrics(metrics)
    run.artifact(out_dir / "stats.json")


if __name__ == "__main__":
    run_stage(main)
