"""prepare on broken and unusual files (crafted in tmp_path): every record accounted for, no record stops the run,
memory bounded whatever the file holds."""
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, read_rows

DEEP = "[" * 300 + "]" * 300
BIG = "123456789012345678901234567890"  # an integer beyond 64 bits


def run_prepare(run_stage, out: Path, sources: list[tuple[str, Path]], *extra: str):
    inner = ",".join(f"{{name:{n},path:'{p}',format:auto}}" for n, p in sources)
    run_stage("prepare", f"prepare.output={out}", f"prepare.sources=[{inner}]", *extra)
    stats = json.loads((out / "stats.json").read_text())
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    for name, s in stats.items():
        assert s["read"] == s["kept"] + sum(s["dropped"].values()), name
    return read_rows(out), stats, rejects


def texts(rows, source):
    return [r["messages"][-1]["content"] for r in rows if r["source"] == source]


def test_content_after_a_list_bom_and_array_first_jsonl_are_all_read(run_stage, tmp_path):
    """Item 14: nothing after a JSON list's `]` is ignored; a JSONL file that starts with an array or a BOM is JSONL."""
    files = {
        "then_jsonl": '[{"prompt": "a1"},\n {"prompt": "a2"}]\n{"prompt": "a3"}\n{"prompt": "a4"}\n',
        "two_lists": '[\n  {"prompt": "b1"}\n]\n[\n  {"prompt": "b2"},\n  {"prompt": "b3"}\n]\n',
        "array_first": '[{"prompt": "c0"}]\n{"prompt": "c1"}\n{"prompt": "c2"}\n',
        "bom": '\ufeff{"prompt": "d1"}\n{"prompt": "d2"}\n',
        "bom_list": '\ufeff[{"prompt": "e1"},\n {"prompt": "e2"}]',
    }
    sources = []
    for name, text in files.items():
        (tmp_path / f"{name}.json").write_text(text, encoding="utf-8")
        sources.append((name, tmp_path / f"{name}.json"))
    rows, stats, rejects = run_prepare(run_stage, tmp_path / "out", sources)
    assert texts(rows, "then_jsonl") == ["a1", "a2", "a3", "a4"]
    assert [r["line"] for r in rejects if r["source"] == "then_jsonl"] == []
    assert texts(rows, "two_lists") == ["b1", "b2", "b3"]
    # JSONL whose first line is an array: that line is one record (not an object: rejected), the rest read
    assert texts(rows, "array_first") == ["c1", "c2"]
    assert [(r["line"], r["reason"]) for r in rejects if r["source"] == "array_first"] == [(1, "wrong_type")]
    assert texts(rows, "bom") == ["d1", "d2"] and texts(rows, "bom_list") == ["e1", "e2"]
    assert stats["then_jsonl"]["read"] == 4 and stats["array_first"]["read"] == 3 and stats["bom"]["read"] == 2


def test_a_json_list_cut_anywhere_is_counted_never_a_crash(run_stage, tmp_path):
    """Item 14: a truncated list keeps every complete element and reports the cut as one `truncated` reject."""
    sources, expected = [], {}
    template = '[{"prompt": "q%02d-1"},\n {"prompt": "q%02d-2"}]'
    length = len(template % (0, 0))
    for cut in range(1, length):
        text = (template % (cut, cut))[:cut]
        path = tmp_path / f"cut{cut:02d}.json"
        path.write_text(text)
        sources.append((f"cut{cut:02d}", path))
        expected[f"cut{cut:02d}"] = [f"q{cut:02d}-{i}" for i in (1, 2) if f'"q{cut:02d}-{i}"}}' in text]
    rows, stats, rejects = run_prepare(run_stage, tmp_path / "out", sources)
    for name, kept in expected.items():
        assert texts(rows, name) == kept, name
        assert stats[name]["dropped"] == {"truncated": 1}, name
    assert all(r["reason"] == "truncated" for r in rejects)
    inside = next(r for r in rejects if r["source"] == f"cut{length - 3:02d}")
    assert inside["record"].startswith('{"prompt": "q') and inside["line"] == 2 and inside["index"] == 2


def test_no_record_can_crash_the_run(run_stage, tmp_path):
    """Item 15: deep nesting, 100k brackets, lone surrogates and integers over 64 bits, in any field and either
    container: rejected with a reason where they would reach the output, harmless elsewhere."""
    records = [
        '{"prompt": "deep unused", "x": %s}' % DEEP,
        '{"prompt": "deep tool", "tools": [{"name": "f", "parameters": {"type": "object", "x": %s}}]}' % DEEP,
        '{"messages": [{"role": "user", "content": {"parts": %s}}]}' % DEEP,
        '{"prompt": "brackets", "x": %s}' % ("[" * 100_000 + "]" * 100_000),
        '{"prompt": "lone \\ud800 surrogate"}',
        '{"prompt": "surrogate tool", "tools": [{"name": "f\\udc00"}]}',
        '{"prompt": "surrogate in tools text", "tools": "[{\\"name\\": \\"g\\\\ud800\\"}]"}',
        '{"prompt": "big unused", "id": %s}' % BIG,
        '{"prompt": "big tool", "tools": [{"name": "f", "parameters": {"type": "integer", "maximum": %s}}]}' % BIG,
        '{"prompt": "big tools text", "tools": "[{\\"name\\": \\"f\\", \\"parameters\\": {\\"maximum\\": %s}}]"}'
        % BIG,
        '{"prompt": "fine"}',
    ]
    expected = ["kept", "invalid_tools", "object_content", "invalid_json", "invalid_unicode", "invalid_unicode",
                "invalid_tools", "kept", "integer_out_of_range", "integer_out_of_range", "kept"]
    (tmp_path / "lines.jsonl").write_text("\n".join(records) + "\n")
    in_list = [r.replace('"prompt": "', '"prompt": "listed ') for r in records]  # not duplicates of the lines
    (tmp_path / "list.json").write_text("[\n" + ",\n".join(in_list) + "\n]\n")
    rows, stats, rejects = run_prepare(run_stage, tmp_path / "out",
                                       [("lines", tmp_path / "lines.jsonl"), ("list", tmp_path / "list.json")])
    for source, first_line, prefix in (("lines", 1, ""), ("list", 2, "listed ")):
        by_line = {r["line"] - first_line: r["reason"] for r in rejects if r["source"] == source}
        got = [by_line.get(i, "kept") for i in range(len(records))]
        assert got == expected, source
        assert texts(rows, source) == [prefix + t for t in ("deep unused", "big unused", "fine")]
        assert all(r["detail"] for r in rejects if r["source"] == source)


def test_glaive_tool_call_arguments_beyond_64_bits_are_rejected_not_rounded(run_stage, tmp_path):
    """Item 15: with prepare.turns=last the arguments of a kept tool call are written back: no silent rounding."""
    call = json.dumps({"name": "f", "arguments": {"n": int(BIG)}})
    record = {"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": call},
                                {"from": "observation", "value": "{}"}, {"from": "human", "value": "again"}]}
    src = tmp_path / "g.jsonl"
    src.write_text(json.dumps(record) + "\n" + json.dumps({"prompt": "fine"}) + "\n")
    rows, stats, rejects = run_prepare(run_stage, tmp_path / "out", [("g", src)], "prepare.turns=last")
    assert stats["g"]["dropped"] == {"integer_out_of_range": 1} and [r["line"] for r in rejects] == [1]


# Runs a command and prints its peak RSS. Launched as a fresh small process: a child's ru_maxrss also counts the memory
# of the process it was forked from (here pytest, which has just written big files), so the stage is forked from this.
MEASURE = """
import os, subprocess, sys
proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
err = proc.stderr.read()
_, status, usage = os.wait4(proc.pid, 0)
print(os.waitstatus_to_exitcode(status), usage.ru_maxrss)
sys.stderr.write(err)
"""


def peak_rss_mb(args: list[str], env: dict) -> tuple[int, float, str]:
    proc = subprocess.run([sys.executable, "-c", MEASURE, *args], cwd=REPO, env={**os.environ, **env},
                          capture_output=True, text=True)
    code, rss_kb = proc.stdout.split()
    return int(code), int(rss_kb) / 1024, proc.stderr


def test_memory_stays_flat_on_broken_input(run_stage, mlflow_uri, tmp_path):
    """Item 16: a 192 MB JSON list broken near its start and a 192 MB invalid line are read with memory bounded by
    prepare.max_record_bytes (1 MiB here), and the good records after them are still read. (Without the bound: the
    size of the inputs several times over.)"""
    (tmp_path / "tiny.jsonl").write_text('{"prompt": "warm-up"}\n')  # MLflow creates its tables: not measured
    run_prepare(run_stage, tmp_path / "warm-up", [("tiny", tmp_path / "tiny.jsonl")])
    size = 192 << 20
    element = '{"id": %d, "conversations": [{"from": "human", "value": "%08d%s"}]},\n'
    elements = size // len(element % (0, 0, "x" * 2000))
    with open(tmp_path / "broken.json", "w") as fh:
        fh.write('[\n{"id": -1, "conversations": [{"from": "human", "value": "first"}}]},\n')  # `}` closes a `]`
        for i in range(elements):
            fh.write(element % (i, i, "x" * 2000))
        fh.write('{"id": -2, "conversations": [{"from": "human", "value": "last"}]}\n]\n')
    with open(tmp_path / "long_line.jsonl", "w") as fh:
        fh.write('{"prompt": "before"}\n{"prompt": "' + "y" * size + '\n{"prompt": "after"}\n')
    out = tmp_path / "out"
    code, rss, err = peak_rss_mb([sys.executable, "-m", "stages.prepare", f"prepare.output={out}",
                                  f"prepare.sources=[{{name:lst,path:'{tmp_path / 'broken.json'}',format:auto}},"
                                  f"{{name:line,path:'{tmp_path / 'long_line.jsonl'}',format:auto}}]",
                                  "prepare.max_record_bytes=1048576", "prepare.sample=10"],
                                 {"MLFLOW_TRACKING_URI": mlflow_uri})
    assert code == 0, err
    stats = json.loads((out / "stats.json").read_text())
    assert stats["lst"]["read"] == elements + 2 and stats["lst"]["dropped"]["invalid_json"] == 1
    assert stats["line"]["read"] == 3 and stats["line"]["dropped"]["too_large"] == 1
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert [(r["source"], r["line"], r["index"]) for r in rejects] == [("lst", 2, 1), ("line", 2, 2)]
    assert rss < 450, f"peak RSS {rss:.0f} MB for {size >> 20} MB inputs"


def test_the_fast_path_gives_what_the_per_record_path_gives(run_stage, tmp_path):
    """Item 14.2: prepare's JSONL fast path (blocks of lines, the plainest records inline) against the per-record path,
    on the real prompt files and on a file with every case the fast path hands on or reads alone."""
    plain = lambda text: {"conversations": [{"from": "human", "value": text}, {"from": "gpt", "value": "a"}]}
    lines = [json.dumps(plain("first"))] + [json.dumps(plain(f"p{i}")) for i in range(300)] + [
        json.dumps({"conversations": [{"from": "gpt", "value": "cut mid-way"}, {"from": "human", "value": "later"}]}),
        json.dumps({"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "with system"}]}),
        json.dumps({"system": "top", "conversations": [{"from": "human", "value": "top system"}]}),
        json.dumps({"conversations": [{"from": "function_call", "value": "{}"}, {"from": "human", "value": "x"}]}),
        json.dumps({"conversations": [{"from": "HUMAN", "value": "odd case"}]}),
        json.dumps({"conversations": [{"from": "human", "value": ["not", "a string"]}]}),
        json.dumps({"conversations": [{"from": "human", "value": "   "}]}),
        json.dumps({"conversations": [{"from": "human", "value": ""}]}),
        json.dumps({"conversations": [{"from": "gpt", "value": "only answers"}]}),
        json.dumps({"conversations": []}), json.dumps({"prompt": "a plain prompt"}), json.dumps(plain("p7")),
        "", "   ", '{"conversations": [', "[1, 2]", "null", json.dumps(plain("x" * 40000)),
        json.dumps(plain("y" * 1_500_000)), json.dumps(plain("after the long line")) + "\r",
        json.dumps(plain("caf\u00e9 \u2603 \U0001f600")), json.dumps(plain("nul \u0000 inside")),
    ]
    path = tmp_path / "messy.jsonl"
    body = ("\n".join(lines) + "\n").encode() + b'{"conversations": [{"from": "human", "value": "\xff"}]}\n'
    path.write_bytes("\ufeff".encode() + body + json.dumps(plain("no final line break")).encode())
    sources = [("messy", path)] + [(p.stem, p) for p in sorted((REPO.parent / "shared/fixtures/prompts").iterdir())
                                   if p.suffix in (".json", ".jsonl")]
    results = {}
    for fast in ("true", "false"):
        rows, stats, rejects = run_prepare(run_stage, tmp_path / fast, sources, f"prepare.fast_path={fast}")
        results[fast] = (sorted(rows, key=lambda r: r["prompt_id"]), stats,
                         sorted(rejects, key=lambda r: (r["source"], r["line"])))
    fast, slow = results["true"], results["false"]
    assert fast[1] == slow[1]  # counts per source and reason
    assert fast[2] == slow[2]  # rejects: file, line, index, reason, detail, raw
    assert fast[0] == slow[0]
    assert fast[1]["messy"]["read"] == len(lines) - 2 + 2 and fast[1]["messy"]["kept"] > 300
    assert {r["reason"] for r in fast[2] if r["source"] == "messy"} >= {"wrong_type", "too_long"}
