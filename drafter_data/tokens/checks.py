"""What tokenize refuses: completions of another target or thinking mode, an output directory whose replacement would
destroy something else, and (after writing meta.json) a result that is mostly drops, drift or prompt mismatches."""
from __future__ import annotations

from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq
from omegaconf import OmegaConf

from drafter_data.errors import StageError
from drafter_data.tokens.chat_template import chat_template_kwargs, kwargs_text

# what tokenize writes in its output (.conversations: the scratch partition of tokenize.rows=conversation, which a
# run stopped before the staged output existed may have left there): a directory holding none of them is not ours
OUTPUT_MARKERS = ("tokens-*.parquet", "meta.json", ".conversations")

POLICIES = {"overlength": ("drop", "truncate"), "on_length_finish": ("keep", "drop"),
            "on_mask_token_text": ("escape", "drop"), "rows": ("per_turn", "conversation")}


LIMITS = ("max_drop_share", "max_drift_rate", "max_prompt_mismatch_rate")


def check_policies(tcfg) -> None:
    """The policies and the result's limits, before any work (a params.yaml composed before a limit existed fails
    here, not after tokenizing everything)."""
    for key, allowed in POLICIES.items():
        if tcfg.get(key, allowed[0]) not in allowed:
            raise StageError(f"tokenize.{key}={tcfg[key]!r}: choose one of {', '.join(allowed)}")
    for key in LIMITS:
        value = tcfg.get(key)
        if not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise StageError(f"tokenize.{key}={value!r}: set a share from 0 to 1 (missing from an older params.yaml? "
                             f"recompose it: python scripts/compose_params.py)")


def _unique(path: Path, column: str) -> set:
    # ParquetFile, not pq.read_table: that one imports pyarrow.dataset and pandas here, before the workers are
    # forked, and every worker would carry them
    column_values = pq.ParquetFile(path).read(columns=[column], use_threads=False).column(column)
    return set(pc.unique(column_values).to_pylist()) - {None}


def render_kwargs(cfg, thinking: bool) -> dict:
    """The chat-template kwargs tokenize renders a row of mode `thinking` with: the switch, the target's kwargs and
    tokenize.template_kwargs added to them."""
    extra = OmegaConf.to_container(cfg.tokenize.template_kwargs, resolve=True) if cfg.tokenize.template_kwargs else {}
    target = OmegaConf.to_container(cfg.target.template_kwargs, resolve=True) if cfg.target.template_kwargs else {}
    return chat_template_kwargs(cfg.target.thinking_kwarg, thinking, {**target, **extra})


def check_consistency(paths: list[Path], cfg) -> None:
    """Refuse completions made for another target; unless generation.thinking_ratio mixes modes on purpose,
    completions made in another thinking mode than generation.thinking; and completions sent with other chat-template
    kwargs than tokenize would render them with (rows of older releases, which did not store them, are not
    checked)."""
    mixed = cfg.generation.get("thinking_ratio") is not None
    rendered_with = {mode: kwargs_text(render_kwargs(cfg, mode)) for mode in (True, False)}
    for path in paths:
        names = set(pq.read_schema(path).names)
        if "chat_template_kwargs" in names:
            sent = pq.ParquetFile(path).read(columns=["thinking", "chat_template_kwargs"], use_threads=False)
            for pair in sent.group_by(["thinking", "chat_template_kwargs"]).aggregate([]).to_pylist():
                want = rendered_with[bool(pair["thinking"])]
                if pair["chat_template_kwargs"] is not None and pair["chat_template_kwargs"] != want:
                    raise StageError(f"completions in {cfg.tokenize.input} were sent with chat_template_kwargs "
                                     f"{pair['chat_template_kwargs']}, but tokenize would render them with {want} "
                                     f"(target.template_kwargs + tokenize.template_kwargs): render them as they "
                                     f"were sent")
        checks = [("target", cfg.target.name, "target")]
        if not mixed:
            checks.append(("thinking", bool(cfg.generation.thinking), "generation.thinking"))
        for column, this_run, what in checks:
            seen = _unique(path, column) if column in names else set()
            if seen - {this_run}:
                raise StageError(f"completions in {cfg.tokenize.input} were generated with {column}={sorted(seen)}, "
                                 f"but this run has {what}={this_run}; tokenize them with the same setting")


def check_output_dir(out_dir: Path, protected: dict[str, Path | None]) -> None:
    """tokenize.output is replaced whole (the old directory deleted once the new one is in place): refuse, before any
    work, when it is, or contains, something that must survive. The rest (not a directory; a non-empty directory
    holding none of OUTPUT_MARKERS: a mistyped path must not wipe somebody's folder) is StagedOutputDir's check as it
    is entered, right after this one."""
    out = out_dir.resolve()
    for what, path in protected.items():
        if path is None:
            continue
        path = Path(path).resolve()
        if path == out or out in path.parents:
            raise StageError(f"tokenize.output={out_dir} would delete {what} ({path}) when it is replaced; "
                             f"choose an output directory of its own")


def result_problems(meta: dict, max_drop_share: float, max_drift_rate: float, max_prompt_mismatch_rate: float
                    ) -> list[str]:
    """One phrase per threshold crossed: a drop reason over max_drop_share of the rows read, drift over
    max_drift_rate of the rows compared, prompt mismatches over max_prompt_mismatch_rate of the prompts compared."""
    rows, problems = meta["rows"], []
    read = rows.get("read", 0)
    for reason, count in sorted(rows.items()):
        if reason.startswith("dropped.") and read and count / read > max_drop_share:
            problems.append(f"{count} of {read} rows were dropped as {reason.removeprefix('dropped.')} "
                            f"(over tokenize.max_drop_share={max_drop_share})")
    drift = meta["drift"]
    if drift["rate"] > max_drift_rate:
        problems.append(f"{drift['rows_differ']} of {drift['rows_compared']} rows with the server's sampled ids "
                        f"retokenize differently (drift rate {drift['rate']:.4f} > tokenize.max_drift_rate="
                        f"{max_drift_rate}): the template or tokenizer does not match the server's, or (over few "
                        f"rows, {drift['rows_compared']} here) the target sampled more non-canonical splits of its "
                        f"own text than usual; the rows keep the sampled ids")
    prompt = meta["prompt_ids"]
    if prompt["rate"] > max_prompt_mismatch_rate:
        problems.append(f"{prompt['rows_differ']} of {prompt['rows_compared']} prompts render to other ids than "
                        f"the server's prompt_token_ids (rate {prompt['rate']:.4f} > tokenize.max_prompt_mismatch_rate="
                        f"{max_prompt_mismatch_rate}): the template or tokenizer does not match the server's")
    return problems
