"""Everything that is sent to the server besides the messages, built once from config.

The same object gives the request body (sampling params and the chat-template kwargs: the thinking switch plus the
target's template kwargs, and the fields that ask this server for its token ids), the identity that keys a completion
for resuming, and the kwargs tokenize renders with.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import orjson
from omegaconf import OmegaConf

from drafter_data.errors import StageError
from drafter_data.server.token_ids import id_method
from drafter_data.tokens.chat_template import chat_template_kwargs

TOKEN_ID_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class RequestSpec:
    model: str
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    thinking: bool
    thinking_kwarg: str
    template_kwargs: dict = field(default_factory=dict)
    token_ids: str = "auto"  # generation.token_ids: auto | on | off (what preflight looks for)
    token_ids_via: str | None = None  # how this server is asked for them (token_ids.METHODS), set from preflight
    logit_bias: tuple = ()  # generation.logit_bias as sorted (token id, bias) pairs; () sends none
    # sha256 of the chat template the embedded server is started with (server.kind=local): not sent, but it decides
    # what the model sees, so it keys the completion; None for a server we do not start (its template is its own)
    server_template: str | None = None

    @classmethod
    def from_config(cls, cfg, template_kwargs=None, max_tokens: int | None = None) -> RequestSpec:
        """From the shared groups (server.model, generation, target); template_kwargs replaces the target's."""
        gen, target = cfg.generation, cfg.target
        kwargs = target.get("template_kwargs") if template_kwargs is None else template_kwargs
        return cls(model=str(cfg.server.model), max_tokens=int(max_tokens or gen.max_tokens),
                   temperature=float(gen.temperature), top_p=float(gen.get("top_p", 1.0)),
                   seed=None if gen.get("seed") is None else int(gen.seed), thinking=bool(gen.thinking),
                   thinking_kwarg=str(target.thinking_kwarg),
                   template_kwargs=_plain(kwargs), token_ids=token_id_mode(gen.get("token_ids", "auto")),
                   logit_bias=logit_bias_pairs(gen.get("logit_bias")), server_template=local_template_hash(cfg.server))

    def chat_template_kwargs(self, thinking: bool | None = None) -> dict:
        """The template kwargs of a request: the thinking switch (this spec's mode unless given) and the rest."""
        return chat_template_kwargs(self.thinking_kwarg, self.thinking if thinking is None else thinking,
                                    self.template_kwargs)

    def _deciding(self, thinking: bool | None) -> dict:
        """What decides the answer besides the messages and tools: sent as is, and hashed into the identity."""
        fields = {"model": self.model, "max_tokens": self.max_tokens, "temperature": self.temperature,
                  "top_p": self.top_p, "extra_body": {"chat_template_kwargs": self.chat_template_kwargs(thinking)}}
        if self.seed is not None:
            fields["seed"] = self.seed
        if self.logit_bias:
            fields["logit_bias"] = {str(token): bias for token, bias in self.logit_bias}
        return fields

    def body(self, messages: list[dict], tools: list | None = None, thinking: bool | None = None) -> dict:
        """Keyword arguments for `client.chat.completions.create` (fields outside OpenAI's API go in extra_body)."""
        body = {**self._deciding(thinking), "messages": messages}
        if tools:
            body["tools"] = tools
        method = id_method(self.token_ids_via)
        if method is not None:
            body["extra_body"].update(method.body_fields())
        return body

    def identity(self, target_name: str, thinking: bool | None = None) -> bytes:
        """Everything besides the prompt that determines a completion in mode `thinking` (this spec's unless
        given), as canonical bytes (the request key's input). Unchanged in form since the first release for a server
        we do not start, so completions made then still resume."""
        started = {"server_template": self.server_template} if self.server_template else {}
        return orjson.dumps({"target": target_name, **self._deciding(thinking), **started},
                            option=orjson.OPT_SORT_KEYS)

    def with_max_tokens(self, max_tokens: int) -> RequestSpec:
        return RequestSpec(**{**self.__dict__, "max_tokens": int(max_tokens)})

    def with_thinking(self, thinking: bool) -> RequestSpec:
        return RequestSpec(**{**self.__dict__, "thinking": bool(thinking)})

    def with_token_mode(self, mode: str) -> RequestSpec:
        """This spec with generation.token_ids replaced (auto | on | off)."""
        return RequestSpec(**{**self.__dict__, "token_ids": token_id_mode(mode), "token_ids_via": None})

    def with_token_ids(self, via: str | None) -> RequestSpec:
        """This spec asking for token ids by `via` (ServerFeatures.token_ids from preflight; None: not asking)."""
        id_method(via)  # unknown names fail here, not at the first request
        return RequestSpec(**{**self.__dict__, "token_ids_via": via})


def local_template_hash(server) -> str | None:
    """For the embedded server (server.kind=local), what we start it with decides the answers: sha256 of
    server.local.chat_template and the weights file's name and size (hashing gigabytes at every start would cost
    minutes); else None."""
    local = server.get("local") if server.get("kind") == "local" else None
    if not local:
        return None
    from drafter_data.server.local import default_model_path

    parts = []
    if local.get("chat_template"):
        try:
            parts.append(hashlib.sha256(Path(local.chat_template).read_bytes()).hexdigest())
        except OSError as exc:
            raise StageError(f"cannot read server.local.chat_template {local.chat_template}: "
                             f"{exc.strerror or exc}") from None
    weights = Path(local.get("model_path") or default_model_path())
    if local.get("engine") == "vllm":  # a checkpoint directory: its safetensors are the weights
        from drafter_data.server.vllm_local import checkpoint_dir

        weights = Path(local.get("model_path") or checkpoint_dir()) / "model.safetensors"
    size = weights.stat().st_size if weights.exists() else "absent"
    parts.append(f"weights={weights.name}:{size}")
    return " ".join(parts)


def token_id_mode(value) -> str:
    """generation.token_ids as auto | on | off (YAML may hand over a bool for on/off)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    mode = str(value).lower()
    if mode not in TOKEN_ID_MODES:
        raise StageError(f"generation.token_ids must be auto, on or off, not {value!r}")
    return mode


def logit_bias_pairs(value) -> tuple:
    """generation.logit_bias ({token id: bias}, bias in -100..100 as OpenAI's API takes it; null: none) as sorted
    pairs."""
    if not value:
        return ()
    items = _plain(value).items()
    try:
        pairs = tuple(sorted((int(token), float(bias)) for token, bias in items))
    except (TypeError, ValueError):
        raise StageError(f"generation.logit_bias must map token ids to numbers, e.g. {{106: 5}}, not {value}") from None
    if any(not -100 <= bias <= 100 for _, bias in pairs):
        raise StageError("generation.logit_bias: every bias must be between -100 and 100")
    return pairs


def _plain(kwargs) -> dict:
    if kwargs is None:
        return {}
    if OmegaConf.is_config(kwargs):
        return OmegaConf.to_container(kwargs, resolve=True) or {}
    return dict(kwargs)
