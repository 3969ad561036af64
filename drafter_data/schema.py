"""The configuration's typed schema: every key of params.yaml, its type and its allowed values.

Hydra composes conf/ on top of `Config` (registered in Hydra's ConfigStore as `schema`, the first entry of
conf/config.yaml's defaults), so a wrong type or an unknown key fails at compose time, also under `dvc exp run` (which
finds the registration through hydra_plugins/). A stage reading params.yaml merges it onto the same schema, then
`check` tests each value's range: a stage refuses a bad config before any work, in one line naming the key.
"""
from dataclasses import dataclass, field, fields, is_dataclass
import typing
from typing import Any, Dict, List, Optional

from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from drafter_data.errors import StageError


def ranged(default=MISSING, low=None, high=None, above=None, choices=None, factory=None):
    """A field with its allowed values: low <= v <= high, v > above, or v in choices (None passes: Optional)."""
    meta = {"low": low, "high": high, "above": above, "choices": choices}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


SHARE = {"low": 0.0, "high": 1.0}
POSITIVE = {"low": 1}


@dataclass
class Source:
    name: str = MISSING  # a short name: the rows' `source` column and the stats' key
    path: str = MISSING  # the prompt file (JSON list or JSONL), absolute or from the repo root
    # auto detects the container per file and the schema per record
    format: str = ranged("auto", choices=("auto", "jsonl", "sharegpt", "openai", "alpaca", "prompt"))
    # at most this many prompts from this source, taken before prepare.sample
    quota: Optional[int] = ranged(None, low=0)
    fields: Optional[Dict[str, str]] = None  # our key names to the file's own, e.g. {prompt: query_text}


@dataclass
class LocalServer:
    # llama-server (the embedded default) or vllm (experiment=vllm-local, installed by ./setup.sh --with-vllm)
    engine: str = ranged("llama-server", choices=("llama-server", "vllm"))
    binary: Optional[str] = None  # llama-server to start; null: the one ./setup.sh built
    # the GGUF (llama-server) or the checkpoint directory (vllm); null: the embedded Gemma 3 270M
    model_path: Optional[str] = None
    chat_template: Optional[str] = None  # the template the server renders with (it keys the completions)
    slots: int = ranged(16, **POSITIVE)  # parallel sequences the server holds (vllm: --max-num-seqs)
    context: int = ranged(32768, **POSITIVE)  # the whole context (llama-server: shared by its slots; vllm: per sequence)
    threads: int = ranged(2, **POSITIVE)  # CPU threads the server uses
    startup_timeout_s: float = ranged(60.0, above=0)  # how long the stage waits for it to answer
    python: Optional[str] = None  # vllm: its environment's Python; null: the one ./setup.sh --with-vllm installs
    kv_cache_gb: int = ranged(2, **POSITIVE)  # vllm: VLLM_CPU_KVCACHE_SPACE, the KV cache in GiB
    dtype: str = "bfloat16"  # vllm: --dtype
    reasoning_parser: Optional[str] = None  # vllm: --reasoning-parser (e.g. qwen3)
    extra_args: List[str] = field(default_factory=list)  # vllm: further arguments, e.g. a --tool-call-parser


@dataclass
class Server:
    # local: the stage starts and stops llama-server; remote: a server already running
    kind: str = ranged("remote", choices=("local", "remote"))
    base_url: Any = MISSING  # one URL or a list of URLs
    model: str = MISSING  # the model name the server serves; answers naming another are refused
    api_key_env: Optional[str] = None  # the environment variable holding the API key (never the key itself)
    # one request's limit (a 16k-token answer at 20 tok/s takes 800 s)
    request_timeout_s: float = ranged(1800.0, above=0)
    local: Optional[LocalServer] = None  # the embedded server's settings (server=local)


@dataclass
class Target:
    name: str = MISSING  # the target's name, stored in every row and checked by tokenize
    tokenizer_dir: Optional[str] = None  # the checkpoint directory with the tokenizer files and chat_template.jinja
    # how the target tokenizes: kimi_tiktoken, hf_tokenizers, or the running server
    tokenizer: str = ranged(MISSING, choices=("kimi_tiktoken", "hf_tokenizers", "server"))
    chat_template: Optional[str] = None  # a template file; null: tokenizer_dir/chat_template.jinja
    # the template kwarg that switches thinking (thinking for Kimi, enable_thinking for Qwen)
    thinking_kwarg: str = MISSING
    # kwargs every render and request gets, e.g. {preserve_thinking: true}
    template_kwargs: Dict[str, Any] = field(default_factory=dict)
    assistant_header: str = MISSING  # the text that opens an assistant turn in the template
    # the id recorded as the mask token for DFlash (K2.6 has none: an unused reserved id)
    mask_token_id: Optional[int] = ranged(None, low=0)
    # how the template wants tools declared (K2.6: TypeScript-style)
    tool_declarations: Optional[str] = ranged(None, choices=("kimi_typescript",))
    # the share of rows whose sampled ids may differ from their retokenized text
    max_drift_rate: float = ranged(0.02, **SHARE)


@dataclass
class Generation:
    thinking: bool = True  # thinking mode on for every request
    # instead: this share of prompts thinks (seeded by prompt_id), the rest does not
    thinking_ratio: Optional[float] = ranged(None, **SHARE)
    # later turns send earlier answers without (drop) or with (keep) their reasoning
    history_reasoning: str = ranged("drop", choices=("drop", "keep"))
    # keep the server's own token ids: auto when offered, on (required), off
    token_ids: str = ranged("auto", choices=("auto", "on", "off"))
    max_tokens: int = ranged(MISSING, **POSITIVE)  # the answer's limit in tokens, reasoning included
    temperature: float = ranged(MISSING, low=0.0, high=2.0)  # sampling temperature
    top_p: float = ranged(1.0, above=0.0, high=1.0)  # nucleus sampling
    concurrency: Any = 16  # requests in flight (>= 1) or "auto": checked in `check`
    concurrency_min: int = ranged(1, **POSITIVE)  # auto's lowest level
    concurrency_max: int = ranged(256, **POSITIVE)  # auto's highest level (keep it near what the engine holds)
    seed: Optional[int] = None  # sampling seed sent with each request (null: none)
    logit_bias: Any = None  # {token id: bias}; Any, since OmegaConf cannot merge int-keyed dicts: checked in `check`


@dataclass
class Prepare:
    # the prompt files: a list of {name, path, format, quota, fields}
    sources: List[Source] = field(default_factory=list)
    output: str = MISSING  # where the prompt shards go
    sample: Optional[int] = ranged(None, low=0)  # how many prompts to draw (null: all), after per-source quotas
    seed: int = 0  # the sampling seed (the same sample on every machine)
    # which turns of a conversation are asked: first, last (with the dataset's answers), all
    turns: str = ranged("first", choices=("first", "last", "all"))
    max_prompt_chars: int = ranged(32768, **POSITIVE)  # longer prompts are dropped (too_long)
    max_record_bytes: int = ranged(16777216, **POSITIVE)  # larger records are rejected without being held whole
    # drop prompts longer than this for the target's tokenizer (null: no limit)
    max_prompt_tokens: Optional[int] = ranged(None, **POSITIVE)
    shard_rows: int = ranged(100000, **POSITIVE)  # rows per Parquet shard
    workers: int = ranged(2, **POSITIVE)  # processes for reading large files
    split_mb: float = ranged(64.0, above=0)  # how much of a large JSONL file each worker reads at a time
    fast_path: bool = True  # plain ShareGPT records skip the general path (same rows either way)


@dataclass
class Generate:
    input: str = MISSING  # prepare's prompt shards
    output: str = MISSING  # where completions go (resumed, never overwritten)
    shard_rows: int = ranged(256, **POSITIVE)  # rows per small shard (merged every 10 minutes and at the end)
    server_down_timeout_s: float = ranged(600.0, low=0)  # how long a server that cannot be reached is waited for
    max_attempts: int = ranged(8, **POSITIVE)  # tries of one request through passing faults
    # broken connections one request may cause (a prompt that crashes the engine)
    max_connection_failures: int = ranged(6, **POSITIVE)
    max_backoff_s: float = ranged(60.0, low=0)  # the longest wait between retries
    # run-wide faults in a row (bad key, unknown model) before the run stops
    max_run_wide_failures: int = ranged(5, **POSITIVE)
    # requests failing for good in a row, none answered, before the run stops
    max_failed_in_a_row: int = ranged(10, **POSITIVE)
    grace_period_s: float = ranged(300.0, low=0)  # after Ctrl-C or SIGTERM, how long in-flight requests may finish
    stream: bool = True  # stream answers (TTFT figures); false costs the client less CPU per token
    assessment: Optional[str] = None  # assess's metrics.json: the ETA, the throughput check and auto's start


@dataclass
class Tokenize:
    input: str = MISSING  # generate's completions
    output: str = MISSING  # where the token shards and meta.json go (replaced whole)
    template_kwargs: Any = None  # a mapping added to target.template_kwargs; Any, so `={k: v}` may add new keys
    max_length: int = ranged(16384, **POSITIVE)  # longer rows are truncated or dropped (overlength)
    overlength: str = ranged("truncate", choices=("drop", "truncate"))  # what happens to rows over max_length
    on_length_finish: str = ranged("keep", choices=("keep", "drop"))  # keep or drop answers cut by max_tokens
    # content spelling the mask token: encode it as text, or drop the row
    on_mask_token_text: str = ranged("escape", choices=("escape", "drop"))
    rows: str = ranged("per_turn", choices=("per_turn", "conversation"))  # one row per turn, or one per conversation
    max_drift_rate: float = ranged(0.02, **SHARE)  # above it the stage exits 1 (default: the target's)
    # share of prompts whose render differs from the server's prompt ids
    max_prompt_mismatch_rate: float = ranged(0.02, **SHARE)
    max_drop_share: float = ranged(0.5, **SHARE)  # share of rows dropped above which the stage exits 1
    shard_rows: int = ranged(2000, **POSITIVE)  # rows per token shard
    workers: int = ranged(2, **POSITIVE)  # tokenizing processes


@dataclass
class Assess:
    input: str = MISSING  # prompts to measure with (prepare's; built-in ones when they run out)
    output: str = MISSING  # metrics.json, report.md and plots
    concurrency: List[int] = field(default_factory=lambda: [1, 4, 16])  # the levels measured
    requests_per_level: int = ranged(24, **POSITIVE)  # requests measured at each level
    max_tokens: int = ranged(MISSING, **POSITIVE)  # each measured answer's limit
    num_completions: int = ranged(900000, **POSITIVE)  # the whole job projected: this many completions...
    completion_tokens: int = ranged(2000, **POSITIVE)  # ...of this many tokens each


DEGENERATE_KINDS = ("loop", "empty_reasoning", "empty_answer")


@dataclass
class Export:
    input: str = MISSING  # tokenize's rows (tokens-*.parquet, meta.json)
    completions: str = MISSING  # the completions those rows were made from (checked by meta.json's digest)
    output: str = MISSING  # pretokenized.jsonl, conversations.jsonl, README.md (the card), summary.json
    trainer: str = ranged("eagle3", choices=("eagle3", "dflash"))  # whose row rules pretokenized.jsonl follows
    drop: List[str] = field(default_factory=list)  # degenerate kinds left out: loop, empty_reasoning, empty_answer
    max_length: int = ranged(16384, **POSITIVE)  # rows cut to this many tokens, as the trainer's max_length cuts
    batch_rows: int = ranged(1024, **POSITIVE)  # rows read at a time


@dataclass
class Mlflow:
    tracking_uri: Optional[str] = None  # null: mlflow.db at the repo root (or MLFLOW_TRACKING_URI)
    experiment: str = "drafter-data"  # the MLflow experiment's name


@dataclass
class Config:
    target: Target = field(default_factory=Target)
    server: Server = field(default_factory=Server)
    generation: Generation = field(default_factory=Generation)
    prepare: Prepare = field(default_factory=Prepare)
    generate: Generate = field(default_factory=Generate)
    tokenize: Tokenize = field(default_factory=Tokenize)
    assess: Assess = field(default_factory=Assess)
    export: Export = field(default_factory=Export)
    mlflow: Mlflow = field(default_factory=Mlflow)


# The prompt files had two names (data.sources, read through prepare.sources); prepare.sources is now the only one.
RENAMED = "data.sources and data.sample are now prepare.sources and prepare.sample"


def renamed_override(overrides: list[str]) -> Optional[str]:
    """The one-line hint for an override of the old data.* keys (or the removed data= group), else None."""
    old = next((o for o in overrides if o.lstrip("+~").split("=")[0].split(".")[0] == "data"), None)
    return f"{old}: {RENAMED}" if old else None


def register() -> None:
    """Puts the schema in Hydra's ConfigStore as `schema` (conf/config.yaml's first default)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="schema", node=Config)


def typed(plain) -> Any:
    """A loaded params.yaml (a DictConfig) merged onto the schema: wrong types, unknown and missing keys refused."""
    if "data" in plain:
        raise StageError(f"{RENAMED} (an older params.yaml? recompose it: python scripts/compose_params.py)")
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(Config), plain)
        missing = sorted(OmegaConf.missing_keys(cfg)) + _absent(plain, Config, "")
    except OmegaConfBaseException as exc:
        raise StageError(one_line(exc)) from None
    if missing:
        raise StageError(f"{missing[0]} is missing from the config (an older params.yaml? recompose it: python "
                         f"scripts/compose_params.py)")
    return cfg


def _absent(plain, schema, prefix: str) -> list[str]:
    """Keys of the schema's sections that params.yaml lacks: a default that DVC never saw must not decide a run."""
    out = []
    for f in fields(schema):
        if f.name not in plain:
            out.append(f"{prefix}{f.name}")
        elif prefix == "" and is_dataclass(_dataclass_of(f.type)) and OmegaConf.is_dict(plain[f.name]):
            out += _absent(plain[f.name], _dataclass_of(f.type), f"{f.name}.")
    return out


def one_line(exc: BaseException) -> str:
    """OmegaConf's and Hydra's errors (several lines, the key on one of them) as one line naming the key."""
    while exc.__cause__ is not None and not isinstance(exc, OmegaConfBaseException):
        exc = exc.__cause__
    key = getattr(exc, "full_key", None)
    text = " ".join((str(getattr(exc, "msg", None) or exc).split("\n    full_key:")[0]).split())
    line = f"{key}: {text}" if key and not text.startswith(str(key)) else text
    allowed = _allowed(str(key)) if key else None
    return f"{line}; give {key}=<{allowed}>" if allowed else line


def _allowed(key: str) -> Optional[str]:
    """What a key takes, in words, from its field's metadata (None for a key the schema does not range)."""
    schema, meta = Config, None
    for part in key.split("."):
        match = next((f for f in fields(schema) if f.name == part), None) if schema is not None else None
        if match is None:
            return None
        schema, meta = _dataclass_of(match.type), match.metadata
    if not meta:
        return None
    if meta["choices"]:
        return " | ".join(meta["choices"])
    if meta["low"] == 0.0 and meta["high"] == 1.0:
        return "a share from 0 to 1"
    bounds = [f">= {meta['low']}" if meta["low"] is not None else "", f"> {meta['above']}" if meta["above"] is not None
              else "", f"<= {meta['high']}" if meta["high"] is not None else ""]
    return "a number " + " and ".join(b for b in bounds if b)


def check(cfg) -> None:
    """Every value in its range (the fields' metadata), and the few rules that tie two keys: one line naming each key
    that is wrong (all of them, so a user fixes a config in one go)."""
    problems = _out_of_range(cfg, Config, "")
    gen = cfg.generation
    level = gen.concurrency
    if not (level == "auto" or (isinstance(level, int) and not isinstance(level, bool) and level >= 1)):
        problems.append(f"generation.concurrency={level!r}: give a number of requests in flight (>= 1) or auto")
    if gen.concurrency_min > gen.concurrency_max:
        problems.append(f"generation.concurrency_min={gen.concurrency_min} is above generation.concurrency_max="
                        f"{gen.concurrency_max}")
    if not cfg.assess.concurrency or any(c < 1 for c in cfg.assess.concurrency):
        problems.append(f"assess.concurrency={list(cfg.assess.concurrency)}: give levels of 1 or more")
    bias = gen.logit_bias
    if bias is not None and not (OmegaConf.is_dict(bias) and all(
            str(k).lstrip("-").isdigit() and isinstance(v, (int, float)) and not isinstance(v, bool)
            and -100 <= v <= 100 for k, v in bias.items())):
        problems.append(f"generation.logit_bias={bias!r}: give a mapping of token id to a bias from -100 to 100, "
                        f"e.g. {{106: 16}}, or null")
    extra = cfg.tokenize.template_kwargs
    if extra is not None and not OmegaConf.is_dict(extra):
        problems.append(f"tokenize.template_kwargs={extra!r}: give a mapping of kwargs, e.g. {{preserve_thinking: "
                        f"true}}, or null")
    unknown = [kind for kind in cfg.export.drop if kind not in DEGENERATE_KINDS]
    if unknown:
        problems.append(f"export.drop={list(cfg.export.drop)}: {unknown[0]!r} is not a kind of degenerate answer; "
                        f"choose from {', '.join(DEGENERATE_KINDS)}")
    urls = cfg.server.base_url if OmegaConf.is_list(cfg.server.base_url) else [cfg.server.base_url]
    if not urls or not all(isinstance(u, str) and u.lower().startswith(("http://", "https://")) for u in urls):
        problems.append(f"server.base_url={_plain(cfg.server.base_url)!r}: give the server's http(s) URL (e.g. "
                        f"http://host:8000/v1) or a list of them")
    if cfg.server.kind == "local" and cfg.server.local is None:
        problems.append("server.local: server.kind=local needs its settings (server=local)")
    if problems:
        raise StageError("invalid config: " + "; ".join(problems))


def _out_of_range(node, schema, prefix: str) -> list[str]:
    known = {f.name for f in fields(schema)}
    problems = [f"{prefix}{key}: unknown key (a typo? the keys are in drafter_data/schema.py)"
                for key in node.keys() if key not in known]
    for f in fields(schema):
        value, key = node.get(f.name), f"{prefix}{f.name}"
        if value is None:
            continue
        kind = _dataclass_of(f.type)
        if kind is not None and typing.get_origin(f.type) is list:
            for i, item in enumerate(value):
                problems += _out_of_range(item, kind, f"{key}[{i}].")
        elif kind is not None:
            problems += _out_of_range(value, kind, key + ".")
        elif f.metadata:
            problems += _bad(key, value, f.metadata)
    return problems


def _dataclass_of(annotation) -> Optional[type]:
    """The dataclass a field holds (Optional[X] included), else None."""
    for kind in (annotation, *typing.get_args(annotation)):
        if is_dataclass(kind):
            return kind
    return None


def _bad(key: str, value, meta: dict) -> list[str]:
    low, high, above, choices = meta["low"], meta["high"], meta["above"], meta["choices"]
    if isinstance(value, float) and value != value:  # NaN passes every comparison
        return [f"{key}=nan: give a number"]
    if choices is not None and value not in choices:
        return [f"{key}={value!r}: choose one of {', '.join(choices)}"]
    if (low, high) == (0.0, 1.0) and not 0.0 <= value <= 1.0:
        return [f"{key}={value!r}: give a share from 0 to 1"]
    if low is not None and value < low:
        return [f"{key}={value!r}: must be {low} or more"]
    if high is not None and value > high:
        return [f"{key}={value!r}: must be {high} or less"]
    if above is not None and value <= above:
        return [f"{key}={value!r}: must be more than {above}"]
    return []


def _plain(value):
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
