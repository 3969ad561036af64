"""Benchmark of the export stage (Kimi K2.6 tokenizer): memory stays flat as rows grow, and its speed against tokenize.

Builds completions of ~2,000 tokens a row (bench/tokenize.py's, with the server's ids; row groups of 256 rows, as
generate's shards: Parquet is read a row group at a time, by tokenize too), tokenizes them, and exports them, at N
and 4N rows. Prints, per size, each stage's wall time and peak RSS (the stage process alone), then
  * memory ratio: export's peak RSS at 4N over at N (flat: close to 1);
  * speed ratio: export's rows/s over tokenize's rows/s on the same rows in the same run (export renders and
    tokenizes every row once more for `exact`, on one process; tokenize uses its 2 workers).

    .venv/bin/python bench/export.py [--rows 1000]
"""
from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

# run as a script, bench/ would be first on sys.path (bench/tokenize.py would shadow the stdlib module)
sys.path[0] = str(Path(__file__).resolve().parents[1])
from bench._common import run_measured  # noqa: E402
from bench.tokenize import KIMI, LAUNCHER, add_server_ids, build_rows, conversation_tokenizer  # noqa: E402

GROUP_ROWS = 256  # completions row groups as generate writes its shards (a reader holds a row group at a time)


def write_completions(rows: list[dict], directory: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from drafter_data.contract import COMPLETIONS

    directory.mkdir()
    for k in range(0, len(rows), 5000):
        table = pa.Table.from_pylist(rows[k:k + 5000])
        for name in ("prompt_token_ids", "completion_token_ids"):  # as generate stores them (not Python's int64)
            table = table.set_column(table.schema.get_field_index(name), name,
                                     table[name].cast(COMPLETIONS.field(name).type))
        pq.write_table(table, directory / f"completions-{k // 5000:05d}.parquet", row_group_size=GROUP_ROWS)


def stage(name: str, overrides: list[str], tmp: Path) -> dict:
    result = run_measured([sys.executable, "-c", LAUNCHER, sys.executable, "-m", f"stages.{name}", *overrides],
                          env={"MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}"})
    found = re.search(r"stage peak RSS kB: (\d+)", result["stderr"])
    result["peak_rss_mb"] = int(found[1]) / 1024 if found else float("nan")
    return result


def one_size(n: int, tmp: Path, conv) -> dict:
    base = tmp / f"n{n}"
    base.mkdir()
    rows = build_rows(n)
    add_server_ids(conv, rows)
    write_completions(rows, base / "completions")
    common = ["target=kimi-k2.6", f"target.tokenizer_dir={KIMI}", "generation.thinking=true",
              "tokenize.template_kwargs={preserve_thinking:true}"]
    tok = stage("tokenize", [*common, f"tokenize.input={base / 'completions'}", f"tokenize.output={base / 'tokens'}",
                             "tokenize.max_length=32768"], tmp)
    exp = stage("export", [*common, f"export.input={base / 'tokens'}", f"export.completions={base / 'completions'}",
                           f"export.output={base / 'export'}", "export.max_length=32768"], tmp)
    last = next(line for line in exp["stderr"].splitlines() if line.startswith("export:"))
    print(f"{n} rows: tokenize {tok['wall_s']:.1f} s, {tok['peak_rss_mb']:.0f} MB; export {exp['wall_s']:.1f} s, "
          f"{exp['peak_rss_mb']:.0f} MB ({last[:160]})", flush=True)
    return {"tokenize": tok, "export": exp}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1000)
    args = parser.parse_args()
    conv = conversation_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        small = one_size(args.rows, Path(tmp), conv)
        large = one_size(4 * args.rows, Path(tmp), conv)
    memory = large["export"]["peak_rss_mb"] / small["export"]["peak_rss_mb"]
    speed = [(n / r["export"]["wall_s"]) / (n / r["tokenize"]["wall_s"])
             for n, r in ((args.rows, small), (4 * args.rows, large))]
    print(f"memory ratio (export peak RSS at {4 * args.rows} rows / at {args.rows}): {memory:.2f}")
    print(f"speed ratio (export rows/s / tokenize rows/s, same rows, same run): {speed[0]:.2f} at {args.rows} rows, "
          f"{speed[1]:.2f} at {4 * args.rows}")


if __name__ == "__main__":
    main()
