"""What a tokenize run says about itself: meta.json, the summary lines on stderr, the MLflow metrics and plot."""
from __future__ import annotations

import tempfile
from collections import Counter
from pathlib import Path

from drafter_data.tokens.conversation import ConversationTokenizer
from drafter_data.tokens.lengths import LengthHistograms

# Counter keys that are not row outcomes (rows.* in meta.json): totals and the comparisons' own blocks
_NOT_ROWS = ("tokens", "loss_tokens", "rows_out")
_BLOCKS = ("drift.", "prompt.", "thinking.", "time.")


def _rate(differ: int, compared: int) -> float:
    return differ / compared if compared else 0.0


def thinking_mode(on: int, off: int, configured: bool) -> bool | str:
    """True/False when every row has one mode (the configured one when there are no rows), else "mix"."""
    if on and off:
        return "mix"
    return bool(on) if on or off else configured


def named_rows(examples: list) -> list[dict]:
    return [{"prompt_id": prompt_id, "turn": turn} for prompt_id, turn in examples]


def metadata(cfg, settings: dict, conv: ConversationTokenizer, counts: Counter, examples: dict | None = None
             ) -> dict:
    """examples: the first rows (by prompt_id, turn) of each comparison that differed, by name (drift,
    prompt_ids)."""
    examples = examples or {}
    tokenizer = conv.tokenizer
    compared, differ = counts["drift.rows_compared"], counts["drift.rows_differ"]
    return {
        "target": cfg.target.name,
        "tokenizer": {"kind": tokenizer.kind, "name": tokenizer.name, "files_sha256": tokenizer.files_sha256},
        "vocab_size": tokenizer.vocab_size,
        "special_ids": {"bos": tokenizer.bos_id, "eos": tokenizer.eos_id, "pad": tokenizer.pad_id,
                        "mask_token_id": settings["mask_token_id"]},
        # escape only where the tokenizer can encode the spelling as text; elsewhere such rows are dropped
        "mask_token_text_policy": "escape" if tokenizer.literal_specials else "drop",
        "chat_template_sha256": conv.template.sha256,
        "thinking": thinking_mode(counts["thinking.on"], counts["thinking.off"], settings["thinking"]),
        "thinking_rows": {"on": counts["thinking.on"], "off": counts["thinking.off"]},
        "template_kwargs": {k: v for k, v in conv.kwargs.items() if k != conv.thinking_kwarg},
        "thinking_kwarg": conv.thinking_kwarg,
        "tool_declarations": conv.tool_declarations,
        "loss_boundary": "end of the prompt rendered with add_generation_prompt=True",
        "rows_per": settings["rows"],
        "max_length": settings["max_length"],
        "rows": {k: v for k, v in sorted(counts.items()) if k not in _NOT_ROWS and not k.startswith(_BLOCKS)},
        "output_rows": counts["rows_out"],
        "tokens": counts["tokens"],
        "loss_tokens": counts["loss_tokens"],
        "drift": {"rows_compared": compared, "rows_differ": differ, "tokens_differ": counts["drift.tokens_differ"],
                  "rate": _rate(differ, compared), "rows_text_cut_short": counts["drift.rows_text_cut_short"],
                  "tokens_text_cut_short": counts["drift.tokens_text_cut_short"],
                  "first_rows_differ": named_rows(examples.get("drift", []))},
        "prompt_ids": {"rows_compared": counts["prompt.rows_compared"], "rows_differ": counts["prompt.rows_differ"],
                       "rate": _rate(counts["prompt.rows_differ"], counts["prompt.rows_compared"]),
                       "first_rows_differ": named_rows(examples.get("prompt_ids", []))},
    }


def throughput(counts: Counter) -> dict:
    """Tokens per second while tokenizing (first task start to last task end: past start-up) and per busy worker
    second; not in meta.json, which stays the same for the same data."""
    window, busy = counts["time.window_ms"] / 1000, counts["time.busy_ms"] / 1000
    return {"tokenize_window_s": window, "tokens_per_s": counts["tokens"] / window if window else 0.0,
            "tokens_per_worker_s": counts["tokens"] / busy if busy else 0.0}


def _first(named: list[dict]) -> str:
    """'; first: p1 turn 0, p7 turn 2' (at most 3), or nothing."""
    if not named:
        return ""
    return "; first: " + ", ".join(f"{r['prompt_id']} turn {r['turn']}" for r in named[:3]) + \
        (" (more in meta.json)" if len(named) > 3 else "")


def summary_lines(meta: dict, speed: dict, out_dir: Path, max_drift_rate: float,
                  max_prompt_mismatch_rate: float) -> list[str]:
    rows, drift, prompt = meta["rows"], meta["drift"], meta["prompt_ids"]
    outcome = ", ".join(f"{k}={v}" for k, v in rows.items())
    lines = [f"tokenized {rows.get('kept', 0)} of {rows.get('read', 0)} rows into {meta['output_rows']} "
             f"{meta['rows_per']} rows in {out_dir} ({meta['tokens']} tokens, {meta['loss_tokens']} in the loss; "
             f"{outcome})",
             f"thinking: on in {meta['thinking_rows']['on']} rows, off in {meta['thinking_rows']['off']}"]
    if drift["rows_compared"]:
        lines.append(f"drift: {drift['rows_differ']} of {drift['rows_compared']} rows with the server's sampled ids "
                     f"retokenize differently ({drift['tokens_differ']} tokens; rate {drift['rate']:.4f}, limit "
                     f"{max_drift_rate}); the rows keep the sampled ids{_first(drift['first_rows_differ'])}")
        if drift["rows_text_cut_short"]:
            lines.append(f"drift: {drift['rows_text_cut_short']} length rows' text stops {drift['tokens_text_cut_short']}"
                         f" tokens before their ids (the server kept back the text of its last tokens at the cut; "
                         f"not counted as drift)")
    else:
        lines.append("drift: no rows carry the server's sampled ids (retokenized from text)")
    if prompt["rows_compared"]:
        lines.append(f"prompt ids: {prompt['rows_differ']} of {prompt['rows_compared']} prompts render to other ids "
                     f"than the server's (rate {prompt['rate']:.4f}, limit {max_prompt_mismatch_rate})"
                     f"{_first(prompt['first_rows_differ'])}")
    lines.append(f"throughput: {speed['tokens_per_s'] / 1e6:.2f} M tokens/s over {speed['tokenize_window_s']:.2f} s "
                 f"of tokenizing, {speed['tokens_per_worker_s'] / 1e6:.2f} M per busy worker-second")
    return lines


def log_run(run, meta: dict, speed: dict, out_dir: Path, lengths: LengthHistograms, estimated_reasoning: bool) -> None:
    """Into the stage's MLflow run (drafter_data.tracking.stage_run): counts, drift, thinking split, throughput,
    meta.json and the length plot."""
    run.metrics({**{f"rows.{k}": v for k, v in meta["rows"].items()}, "tokens": meta["tokens"],
                 "loss_tokens": meta["loss_tokens"], "output_rows": meta["output_rows"],
                 "tokens_per_row_mean": meta["tokens"] / meta["output_rows"] if meta["output_rows"] else 0.0,
                 **{f"drift.{k}": v for k, v in meta["drift"].items() if k != "first_rows_differ"},
                 **{f"prompt_ids.{k}": v for k, v in meta["prompt_ids"].items() if k != "first_rows_differ"},
                 **{f"thinking_rows.{k}": v for k, v in meta["thinking_rows"].items()}, **speed})
    run.artifact(out_dir / "meta.json")
    if meta["output_rows"]:
        with tempfile.TemporaryDirectory() as tmp:
            png = Path(tmp) / "token_lengths.png"
            lengths.plot(png, estimated_reasoning)
            run.figure(png)
