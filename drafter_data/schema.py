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
    name: str = MISSING
    path: str = MISSING
    format: str = ranged("auto", choices=("auto", "jsonl", "sharegpt", "openai", "alpaca", "prompt"))
    quota: Optional[int] = ranged(None, low=0)
    fields: Optional[Dict[str, str]] = None


@dataclass
class LocalServer:
    # llama-server (the embedded default) or vllm (experiment=vllm-local; drafter_data/server/vllm_local.py)
    engine: str = ranged("llama-server", choices=("llama-server", "vllm"))
    binary: Optional[str] = None
    model_path: Optional[str] = None
    chat_template: Optional[str] = None
    slots: int = ranged(16, **POSITIVE)
    context: int = ranged(32768, **POSITIVE)
    threads: int = ranged(2, **POSITIVE)
    startup_timeout_s: float = ranged(60.0, above=0)
    # vllm only: its environment's Python (null: the one ./setup.sh --with-vllm installs), VLLM_CPU_KVCACHE_SPACE,
    # --dtype, --reasoning-parser, and any further arguments
    python: Optional[str] = None
    kv_cache_gb: int = ranged(2, **POSITIVE)
    dtype: str = "bfloat16"
    reasoning_parser: Optional[str] = None
    extra_args: List[str] = field(default_factory=list)


@dataclass
class Server:
    kind: str = ranged("remote", choices=("local", "remote"))
    base_url: Any = MISSING  # one URL or a list of URLs
    model: str = MISSING
    api_key_env: Optional[str] = None
    request_timeout_s: float = ranged(1800.0, above=0)
    local: Optional[LocalServer] = None


@dataclass
class Target:
    name: str = MISSING
    tokenizer_dir: Optional[str] = None
    tokenizer: str = ranged(MISSING, choices=("kimi_tiktoken", "hf_tokenizers", "server"))
    chat_template: Optional[str] = None
    thinking_kwarg: str = MISSING
    template_kwargs: Dict[str, Any] = field(default_factory=dict)
    assistant_header: str = MISSING
    mask_token_id: Optional[int] = ranged(None, low=0)
    tool_declarations: Optional[str] = ranged(None, choices=("kimi_typescript",))
    max_drift_rate: float = ranged(0.02, **SHARE)


@dataclass
class Generation:
    thinking: bool = True
    thinking_ratio: Optional[float] = ranged(None, **SHARE)
    history_reasoning: str = ranged("drop", choices=("drop", "keep"))
    token_ids: str = ranged("auto", choices=("auto", "on", "off"))
    max_tokens: int = ranged(MISSING, **POSITIVE)
    temperature: float = ranged(MISSING, low=0.0, high=2.0)
    top_p: float = ranged(1.0, above=0.0, high=1.0)
    concurrency: Any = 16  # requests in flight (>= 1) or "auto": checked in `check`
    concurrency_min: int = ranged(1, **POSITIVE)
    concurrency_max: int = ranged(256, **POSITIVE)
    seed: Optional[int] = None
    logit_bias: Optional[Dict[Any, float]] = None


@dataclass
class Data:
    sources: List[Source] = field(default_factory=list)
    sample: Optional[int] = ranged(None, low=0)


@dataclass
class Prepare:
    sources: List[Source] = field(default_factory=list)
    output: str = MISSING
    sample: Optional[int] = ranged(None, low=0)
    seed: int = 0
    turns: str = ranged("first", choices=("first", "last", "all"))
    max_prompt_chars: int = ranged(32768, **POSITIVE)
    max_record_bytes: int = ranged(16777216, **POSITIVE)
    max_prompt_tokens: Optional[int] = ranged(None, **POSITIVE)
    shard_rows: int = ranged(100000, **POSITIVE)
    workers: int = ranged(2, **POSITIVE)
    split_mb: float = ranged(64.0, above=0)
    fast_path: bool = True


@dataclass
class Generate:
    input: str = MISSING
    output: str = MISSING
    shard_rows: int = ranged(256, **POSITIVE)
    server_down_timeout_s: float = ranged(600.0, low=0)
    max_attempts: int = ranged(8, **POSITIVE)
    max_connection_failures: int = ranged(6, **POSITIVE)
    max_backoff_s: float = ranged(60.0, low=0)
    max_run_wide_failures: int = ranged(5, **POSITIVE)
    max_failed_in_a_row: int = ranged(10, **POSITIVE)
    grace_period_s: float = ranged(300.0, low=0)
    stream: bool = True
    assessment: Optional[str] = None


@dataclass
class Tokenize:
    input: str = MISSING
    output: str = MISSING
    template_kwargs: Any = None  # a mapping added to target.template_kwargs; Any, so `={k: v}` may add new keys
    max_length: int = ranged(16384, **POSITIVE)
    overlength: str = ranged("truncate", choices=("drop", "truncate"))
    on_length_finish: str = ranged("keep", choices=("keep", "drop"))
    on_mask_token_text: str = ranged("escape", choices=("escape", "drop"))
    rows: str = ranged("per_turn", choices=("per_turn", "conversation"))
    max_drift_rate: float = ranged(0.02, **SHARE)
    max_prompt_mismatch_rate: float = ranged(0.02, **SHARE)
    max_drop_share: float = ranged(0.5, **SHARE)
    shard_rows: int = ranged(2000, **POSITIVE)
    workers: int = ranged(2, **POSITIVE)


@dataclass
class Assess:
    input: str = MISSING
    output: str = MISSING
    concurrency: List[int] = field(default_factory=lambda: [1, 4, 16])
    requests_per_level: int = ranged(24, **POSITIVE)
    max_tokens: int = ranged(MISSING, **POSITIVE)
    num_completions: int = ranged(900000, **POSITIVE)
    completion_tokens: int = ranged(2000, **POSITIVE)


@dataclass
class Mlflow:
    tracking_uri: Optional[str] = None
    experiment: str = "drafter-data"


@dataclass
class Config:
    target: Target = field(default_factory=Target)
    server: Server = field(default_factory=Server)
    generation: Generation = field(default_factory=Generation)
    data: Data = field(default_factory=Data)
    prepare: Prepare = field(default_factory=Prepare)
    generate: Generate = field(default_factory=Generate)
    tokenize: Tokenize = field(default_factory=Tokenize)
    assess: Assess = field(default_factory=Assess)
    mlflow: Mlflow = field(default_factory=Mlflow)


def register() -> None:
    """Puts the schema in Hydra's ConfigStore as `schema` (conf/config.yaml's first default)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="schema", node=Config)


def typed(plain) -> Any:
    """A loaded params.yaml (a DictConfig) merged onto the schema: wrong types, unknown and missing keys refused."""
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
    return f"{key}: {text}" if key and not text.startswith(str(key)) else text


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
    extra = cfg.tokenize.template_kwargs
    if extra is not None and not OmegaConf.is_dict(extra):
        problems.append(f"tokenize.template_kwargs={extra!r}: give a mapping of kwargs, e.g. {{preserve_thinking: "
                        f"true}}, or null")
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
    if choices is not None and value not in choices:
        return [f"{key}={value!r}: choose one of {', '.join(choices)}"]
    if low is not None and value < low:
        return [f"{key}={value!r}: must be {low} or more"]
    if high is not None and value > high:
        return [f"{key}={value!r}: must be {high} or less"]
    if above is not None and value <= above:
        return [f"{key}={value!r}: must be more than {above}"]
    return []
