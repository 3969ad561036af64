"""export: tokenize's rows (and the completions they were made from) -> what trainers load, and a dataset card.

    in:  export.input (tokens shards + meta.json), export.completions (completion shards), the target's tokenizer
         (for the conversations' `exact`: target.tokenizer_dir, or the running server)
    out: export.output: pretokenized.jsonl, conversations.jsonl, README.md (the card) + its PNGs, summary.json

Refused before any work, in one line: a meta.json or shard that cannot be read, tokens tokenize refused, completions
that are not the ones the tokens were made from (meta.json's completions_request_keys_sha256), a target or template
other than the tokens'. The output is written whole (outputs.StagedOutputDir); a SIGTERM never lets it be put in
place, even one whose SystemExit something swallowed on the way (the flag is checked right before the rename). An
export that leaves no pre-tokenized row exits 1 and puts nothing in place.
"""
from __future__ import annotations

import json
import signal
import sys
from contextlib import contextmanager
from pathlib import Path


from drafter_data.config import run_stage
from drafter_data.errors import StageError
from drafter_data.export.build import CONVERSATIONS, PRETOKENIZED, export_rows, summary
from drafter_data.export.card import write_card
from drafter_data.export.figures import draw
from drafter_data.export.inputs import (CompletionIndex, check_shards, check_source, completion_shards, read_meta,
                                        token_shards)
from drafter_data.outputs import StagedOutputDir
from drafter_data.tokens.conversation import ConversationTokenizer
from drafter_data.tokens.server_root import server_root
from drafter_data.tokens.tokenizers import load_tokenizer
from drafter_data.tracking import stage_run

REPO = Path(__file__).resolve().parents[1]
MARKERS = (PRETOKENIZED, CONVERSATIONS, "summary.json")
_terminated: list[int] = []


def _on_term(signum, frame) -> None:
    _terminated.append(signum)
    raise SystemExit(128 + signum)


def stop_if_terminated() -> None:
    """Raises SystemExit again when a SIGTERM came, whatever swallowed the first one."""
    if _terminated:
        raise SystemExit(128 + _terminated[0])


def main(cfg) -> int:
    signal.signal(signal.SIGTERM, _on_term)
    ecfg = cfg.export
    tokens_dir, completions_dir, out = Path(ecfg.input), Path(ecfg.completions), Path(ecfg.output)
    meta = read_meta(tokens_dir)
    token_paths = token_shards(tokens_dir)
    check_shards(meta, token_paths, tokens_dir)
    completion_paths = completion_shards(completions_dir)
    digest = check_source(meta, completion_paths, tokens_dir, completions_dir)
    if meta["target"] != cfg.target.name:
        raise StageError(f"the tokens in {tokens_dir} were made for target {meta['target']}, this run has "
                         f"target={cfg.target.name}")
    protected = {"the tokens": tokens_dir, "the completions": completions_dir, "the repo": REPO}
    with StagedOutputDir(out, "export.output", protected, MARKERS) as staged, tokenizer(cfg, meta) as conv:
        index = CompletionIndex(completion_paths, meta.get("thinking") is not False, int(ecfg.batch_rows))
        with stage_run("export", cfg) as run:
            result = export_rows(token_paths, index, conv, staged.path, ecfg.trainer, tuple(ecfg.drop),
                                 int(ecfg.max_length), int(ecfg.batch_rows), stop_if_terminated)
            info = summary(result, index, ecfg.trainer, tuple(ecfg.drop), int(ecfg.max_length), digest)
            if not result.pretokenized:
                raise StageError(f"export left no pre-tokenized row of {result.rows_in} "
                                 f"(left out: {info['filtered'] or 'none'}); nothing put in place")
            (staged.path / "summary.json").write_text(json.dumps(info, indent=2, ensure_ascii=False))
            pngs = draw(result, staged.path, meta.get("drift", {}), meta["rows_per"] == "conversation")
            write_card(staged.path / "README.md", info, meta, {"tokens": str(ecfg.input),
                                                                "completions": str(ecfg.completions)})
            stop_if_terminated()
            out_dir = staged.commit()
            print(summary_line(info, out_dir), file=sys.stderr)
            log_run(run, info, out_dir, pngs)
    return 0


@contextmanager
def tokenizer(cfg, meta: dict):
    """The target's template and tokenizer as tokenize rendered with (meta.json's kwargs and mask-token policy),
    refused when the template or tokenizer files differ from the tokens'."""
    target = cfg.target
    mask = meta["special_ids"].get("mask_token_id")
    literal = frozenset([mask]) if meta.get("mask_token_text_policy") == "escape" and mask is not None else frozenset()
    with server_root(cfg) as root:
        tok = load_tokenizer(target, root, literal)
        chat_kwargs = {**(meta.get("template_kwargs") or {}), meta["thinking_kwarg"]: meta.get("thinking") is not False}
        conv = ConversationTokenizer(target, tok, chat_kwargs)
        if conv.template.sha256 != meta["chat_template_sha256"]:
            raise StageError(f"target.chat_template renders with another template (sha256 {conv.template.sha256[:12]})"
                             f" than the tokens were made with ({meta['chat_template_sha256'][:12]}); export with the "
                             f"tokens' target")
        made_with = (meta.get("tokenizer") or {}).get("files_sha256") or {}
        if made_with and tok.files_sha256 and made_with != tok.files_sha256:
            raise StageError(f"the target's tokenizer files ({tok.files_sha256}) are not the ones the tokens were "
                             f"made with ({made_with})")
        yield conv


def summary_line(info: dict, out_dir: Path) -> str:
    rows, ex = info["rows_out"], info["exact"]
    return (f"export: {info['rows_in']} rows -> {rows[PRETOKENIZED]} pre-tokenized ({info['trainer']}), "
            f"{rows[CONVERSATIONS]} conversations ({ex['exact']} exact, {ex['share']:.1%}); left out "
            f"{info['filtered'] or 'none'}; degenerate {info['degenerate']}; in {out_dir}")


def log_run(run, info: dict, out_dir: Path, pngs: list[Path]) -> None:
    flat = {"rows_in": info["rows_in"], "truncated": info["truncated"], "exact_share": info["exact"]["share"],
            **{f"rows_out.{k}": v for k, v in info["rows_out"].items()},
            **{f"filtered.{k}": v for k, v in info["filtered"].items()},
            **{f"degenerate.{k}": v for k, v in info["degenerate"].items()},
            **{f"would_drop.{f}.{k}": v for f, c in info["would_drop"].items() for k, v in c.items()}}
    run.metrics(flat)
    run.artifact(out_dir / "summary.json")
    run.artifact(out_dir / "README.md")
    for png in pngs:
        run.figure(out_dir / png.name)


if __name__ == "__main__":
    run_stage(main)
