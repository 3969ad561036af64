"""The dataset card, data/export/README.md, in the Hugging Face dataset-card form: a YAML header (configs and their
data_files, so `datasets.load_dataset(<the folder>)` finds the two files; the pre-tokenized rows' features), then
what a user wants to see in a minute (the pictures, per source) and the provenance: target, tokenizer and template
hashes, the engine and model each answer named, sampling params, mask token, git commit, dvc.lock hashes of the
inputs."""
from __future__ import annotations

from pathlib import Path

import yaml

from drafter_data.export.build import CONVERSATIONS, PRETOKENIZED
from drafter_data.export.figures import FILES
from drafter_data.tracking import git_commit

GENERATION_KEYS = ("thinking", "thinking_ratio", "history_reasoning", "max_tokens", "temperature", "top_p", "seed",
                   "token_ids")


def size_category(n: int) -> str:
    for limit, name in ((1_000, "n<1K"), (10_000, "1K<n<10K"), (100_000, "10K<n<100K"),
                        (1_000_000, "100K<n<1M"), (10_000_000, "1M<n<10M")):
        if n < limit:
            return name
    return "10M<n<100M"


def header(summary: dict, meta: dict, sizes: dict[str, int]) -> dict:
    """sizes: bytes of each data file (`datasets` reads a split's num_bytes with its num_examples)."""
    rows = summary["rows_out"]
    return {
        "pretty_name": f"{meta['target']} drafter training data (drafter-data)",
        "tags": ["speculative-decoding", "eagle3", "dflash", "synthetic", "self-distillation"],
        "size_categories": [size_category(rows[PRETOKENIZED])],
        "configs": [
            {"config_name": "pretokenized", "default": True,
             "data_files": [{"split": "train", "path": PRETOKENIZED}]},
            {"config_name": "conversations", "data_files": [{"split": "train", "path": CONVERSATIONS}]},
        ],
        "dataset_info": [
            {"config_name": "pretokenized",
             "features": [{"name": "id", "dtype": "string"}, {"name": "input_ids", "sequence": "int64"},
                          {"name": "loss_mask", "sequence": "int64"}],
             "splits": [{"name": "train", "num_bytes": sizes[PRETOKENIZED], "num_examples": rows[PRETOKENIZED]}]},
            {"config_name": "conversations",
             "splits": [{"name": "train", "num_bytes": sizes[CONVERSATIONS], "num_examples": rows[CONVERSATIONS]}]},
        ],
    }


def lock_record(lock_path: Path = Path("dvc.lock")) -> dict:
    """What dvc.lock says the inputs were made with: generate's generation params and the md5 of each stage's out."""
    try:
        lock = yaml.safe_load(lock_path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return {}
    stages = lock.get("stages", {}) or {}
    params = ((stages.get("generate") or {}).get("params") or {}).get("params.yaml") or {}
    generation = params.get("generation") or {k.split(".", 1)[1]: v for k, v in params.items()
                                               if k.startswith("generation.")}
    outs = {out["path"]: out.get("md5") for entry in stages.values() for out in (entry.get("outs") or [])
            if isinstance(out, dict) and "path" in out}
    return {"generation": {k: generation[k] for k in GENERATION_KEYS if k in generation}, "outs": outs}


def dvc_dir_md5(directory: Path) -> str | None:
    """The md5 DVC records for a directory output (dvc-data's Tree.digest: md5 of the sorted JSON list of each file's
    md5 and relative path, plus ".dir"), generate's `.lock` left out as .dvcignore leaves it out; None when unreadable."""
    import hashlib
    import json

    try:
        entries = []
        for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != ".lock"):
            h = hashlib.md5()
            with open(path, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
            entries.append({"md5": h.hexdigest(), "relpath": path.relative_to(directory).as_posix()})
    except OSError:
        return None
    entries.sort(key=lambda e: e["relpath"])
    return hashlib.md5(json.dumps(entries, sort_keys=True).encode()).hexdigest() + ".dir"


def _table(head: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def write_card(path: Path, summary: dict, meta: dict, inputs: dict[str, str]) -> None:
    """inputs: {"tokens": dir, "completions": dir} as configured (their dvc.lock md5s are looked up)."""
    lock = lock_record()
    rows_out, filtered = summary["rows_out"], summary["filtered"]
    tok = meta["tokenizer"]
    drift = meta.get("drift", {})
    ex = summary["exact"]
    sizes = {name: (path.parent / name).stat().st_size for name in (PRETOKENIZED, CONVERSATIONS)}
    lines = ["---", yaml.safe_dump(header(summary, meta, sizes), sort_keys=False).rstrip(), "---", "",
             f"# {meta['target']}: drafter training data made by the target itself", "",
             f"{summary['rows_in']} training rows of the target's own answers (thinking "
             f"{meta.get('thinking')}), with the exact tokens it saw and produced and the loss over what it produced. "
             f"Made by drafter-data (`dvc repro`, stage `export`).", "",
             "## Files", ""]
    lines += _table(["file", "rows", "for"], [
        [f"`{PRETOKENIZED}`", rows_out[PRETOKENIZED],
         f"trainers that load `input_ids` + `loss_mask` as they are: SGLang SpecForge (`data.prompts_path`), vLLM "
         f"speculators (`prepare-data`); rows the {summary['trainer']} family drops are left out"],
        [f"`{CONVERSATIONS}`", rows_out[CONVERSATIONS],
         f"trainers that render and tokenize again (Model Optimizer, NeMo AutoModel, DeepSpec): messages as sent, "
         f"system written out, the answer with `reasoning_content` and `tool_calls`; `exact` on "
         f"{_pct(ex['exact'], ex['rows'])} of them"],
        ["`summary.json`", "", "every count on this card"]])
    lines += ["", "```python", "from datasets import load_dataset",
              "rows = load_dataset(\"<this folder>\", \"pretokenized\", split=\"train\")", "```", "",
              "## What is in it", ""]
    by_source = summary["by_source"]
    lines += _table(["source", "rows", "thinking on/off", "loss tokens / row", "reasoning share", "cut by max_tokens",
                     "degenerate", "exact", "left out"],
                    [[s, c.get("rows", 0), f"{c.get('thinking_on', 0)}/{c.get('thinking_off', 0)}",
                      f"{c.get('loss_tokens', 0) / max(c.get('rows', 0), 1):.0f}",
                      _pct(c.get("reasoning_tokens", 0), c.get("loss_tokens", 0)),
                      _pct(c.get("length_cut", 0), c.get("rows", 0)), _pct(c.get("degenerate", 0), c.get("rows", 0)),
                      _pct(c.get("exact", 0), c.get("rows", 0)), c.get("left_out", 0)]
                     for s, c in by_source.items()])
    lines += ["", "A source whose answers are often cut by max_tokens, degenerate or not exact on re-render is one "
              "this target answers badly: its share of the mix is worth a second look.", ""]
    lines += [f"![{name}]({name})" for name in FILES]
    lines += ["", "## Rows left out and counted", ""]
    lines += _table(["reason", "rows"], [[k, v] for k, v in filtered.items()] or [["(none)", 0]])
    lines += ["", f"`rows_in` {summary['rows_in']} = `{PRETOKENIZED}` {rows_out[PRETOKENIZED]} + left out "
              f"{sum(filtered.values())}. Rows are cut to {summary['max_length']} tokens first ({summary['truncated']} "
              f"were longer), as the trainer's `max_length` cuts them. Each family would drop, of the rows that reach "
              f"its rules: " + "; ".join(f"{fam}: {sum(c.values())} ({', '.join(f'{k} {v}' for k, v in c.items()) or 'none'})"
                                         for fam, c in summary["would_drop"].items()) + ".", ""]
    deg = summary["degenerate"]
    lines += [f"Degenerate answers (kept unless `export.drop` names them): loop {deg['loop']}, empty reasoning with "
              f"thinking on {deg['empty_reasoning']}, empty answer {deg['empty_answer']}.", "",
              "Finish reasons: " + ", ".join(f"{k} {v}" for k, v in summary["finish_reasons"].items()) + ".", "",
              f"Drift: {drift.get('rows_differ', 0)} of {drift.get('rows_compared', 0)} rows with the server's sampled "
              f"ids retokenize differently (rate {drift.get('rate', 0.0):.4f}); the rows keep the sampled ids.", "",
              "## Provenance", ""]
    outs = lock.get("outs") or {}
    actual = {p: dvc_dir_md5(Path(p)) for p in inputs.values()}
    recorded = {p: outs.get(p) is not None and outs.get(p) == actual[p] for p in inputs.values()}
    # generate's params in dvc.lock describe these completions only when dvc.lock records these very completions
    gen = (lock.get("generation") or {}) if recorded.get(inputs.get("completions")) else {}
    lines += _table(["what", "value"], [
        ["target", meta["target"]],
        ["tokenizer", f"{tok.get('kind')} {tok.get('name')}; " + ", ".join(
            f"{k} sha256 {v}" for k, v in (tok.get("files_sha256") or {}).items())],
        ["chat template sha256", meta["chat_template_sha256"]],
        ["template kwargs", f"{meta.get('template_kwargs')} + {meta.get('thinking_kwarg')} per row"],
        ["mask token id", meta["special_ids"].get("mask_token_id")],
        ["loss boundary", meta.get("loss_boundary", "")],
        ["rows per", meta["rows_per"]],
        ["answers named (model, token ids via)", "; ".join(f"{m['model']} / {m['token_ids_via']}: {m['rows']}"
                                                            for m in summary["models"])],
        ["sampling (dvc.lock, generate)", ", ".join(f"{k}={v}" for k, v in gen.items())
         or "not recorded for these completions (generate ran outside `dvc repro`)"],
        ["git commit", git_commit() or "unknown"],
        *[[f"{p}: md5", f"{actual[p]} ({'as dvc.lock records it' if recorded[p] else 'not in dvc.lock'})"]
          for p in inputs.values()],
        ["completions digest", summary["completions_request_keys_sha256"]],
    ])
    lines.append("")
    path.write_text("\n".join(lines), encoding="utf-8")
