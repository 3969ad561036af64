"""Renders a model's own chat template the way Hugging Face transformers does (sandboxed jinja2, same options,
same `tojson`, `raise_exception` and `strftime_now`), so the text is what the serving engine renders."""
from __future__ import annotations

import hashlib
import json
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def chat_template_kwargs(thinking_kwarg: str, thinking: bool, template_kwargs: dict | None = None) -> dict:
    """The kwargs a chat template is rendered with, by the server for a request and by us for the same request:
    the target's thinking switch (`thinking` for Kimi, `enable_thinking` for Qwen/Gemma) and its other kwargs."""
    return {thinking_kwarg: bool(thinking), **dict(template_kwargs or {})}


def kwargs_text(kwargs: dict) -> str:
    """The form a completion stores its request's chat_template_kwargs in (sorted JSON)."""
    return json.dumps(kwargs, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


class _Sandbox(ImmutableSandboxedEnvironment):
    """Hugging Face's sandbox, with its verdicts on attributes of a dict, list or str remembered: for these types
    they depend only on the type and the attribute's name (a quarter of the render time otherwise)."""

    _verdicts: dict = {}  # (type, attribute) -> is_safe_attribute
    _plain: dict = {}  # (type, attribute) -> the attribute exists, is safe and needs no str.format wrapper

    def is_safe_attribute(self, obj, attr, value) -> bool:
        kind = type(obj)
        if kind is not dict and kind is not list and kind is not str:
            return super().is_safe_attribute(obj, attr, value)
        verdict = self._verdicts.get((kind, attr))
        if verdict is None:
            verdict = self._verdicts[(kind, attr)] = super().is_safe_attribute(obj, attr, value)
        return verdict

    def getattr(self, obj, attribute):
        kind = type(obj)
        if kind is dict or kind is list or kind is str:
            plain = self._plain.get((kind, attribute))
            if plain is None:
                value = getattr(obj, attribute, _MISSING)
                plain = self._plain[(kind, attribute)] = value is not _MISSING and self.wrap_str_format(
                    value) is None and self.is_safe_attribute(obj, attribute, value)
            if plain:
                return getattr(obj, attribute)
        return super().getattr(obj, attribute)


_MISSING = object()


@lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str] | None = None):
        self.source = source
        self.sha256 = hashlib.sha256(source.encode()).hexdigest()
        self._template = compile_template(source)
        self._specials = dict(special_tokens or {})

    def render(self, messages: list[dict], add_generation_prompt: bool = False, tools=None, **kwargs) -> str:
        return self._template.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                     **self._specials, **kwargs)
