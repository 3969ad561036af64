"""The target's chat template as the server applies it to a request: the thinking switch of that request, the
template kwargs, and the tools in the form the target's tokenizer code passes them (K2.6: `tools_ts_str`).

Also what the template writes around an answer: the prompt it ends with (`add_generation_prompt=True`, where the
target starts generating) and the text it closes a finished answer with (its end-of-turn).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from drafter_data.errors import StageError
from drafter_data.tokens.chat_template import ChatTemplate
from drafter_data.tokens.kimi_tools import sort_keys_deep, tools_ts_str
from drafter_data.tokens.render_cache import RenderCache
from drafter_data.tokens.tokenizers import load_tokenizer

TOOL_DECLARATIONS = (None, "kimi_typescript")
# Stands for "the answer ends here" inside a render; private-use characters no template or data produces.
SENTINEL = "\ue000\u2063end-of-sample\u2063\ue000"


def load_chat_template(target, tokenizer) -> ChatTemplate:
    if target.get("chat_template"):
        path = Path(target.chat_template)
    else:
        path = Path(target.tokenizer_dir) / "chat_template.jinja"
    if path.is_file():
        source = path.read_text(encoding="utf-8")
    elif getattr(tokenizer, "chat_template_in_config", None):
        source = tokenizer.chat_template_in_config
    else:
        raise StageError(f"chat template not found: {path} (the target's model directory must hold chat_template.jinja)")
    return ChatTemplate(source, tokenizer.special_tokens_map)


def final_assistant_message(content: str, reasoning: str | None, tool_calls: str | list | None = None,
                            thinking: bool = False) -> dict:
    """The answer as an assistant message. A thinking answer whose reasoning came back empty still thought: it is
    passed as "" (templates that test `is none` then still write the think block the prompt opened)."""
    msg = {"role": "assistant", "content": content}
    if reasoning is not None or thinking:
        msg["reasoning_content"] = reasoning or ""
    if tool_calls:
        msg["tool_calls"] = json.loads(tool_calls) if isinstance(tool_calls, str) else tool_calls
    return msg


class ConversationTokenizer:
    """chat_kwargs: the template kwargs exactly as a request sends them (RequestSpec.chat_template_kwargs): the
    thinking switch and the target's template kwargs. `thinking=` on a call renders one request's own mode."""

    def __init__(self, target, tokenizer, chat_kwargs: dict):
        declarations = target.get("tool_declarations")
        if declarations not in TOOL_DECLARATIONS:
            raise StageError(f"target.tool_declarations={declarations!r}: use kimi_typescript or null")
        self.tokenizer = tokenizer
        self.template = load_chat_template(target, tokenizer)
        self.thinking_kwarg = str(target.thinking_kwarg)
        self.kwargs = dict(chat_kwargs)
        self.tool_declarations = declarations
        self._end_of_turn: dict[bool, tuple[str, np.ndarray]] = {}
        self._renders = RenderCache(self._render_with, self.template.source)

    def kwargs_for(self, thinking: bool | None) -> dict:
        return self.kwargs if thinking is None else {**self.kwargs, self.thinking_kwarg: bool(thinking)}

    def tool_kwargs(self, tools) -> dict:
        """How `tools` reach the template: as given, or (kimi_typescript) key-sorted plus K2.6's `tools_ts_str`."""
        if not tools:
            return {"tools": None}
        if self.tool_declarations == "kimi_typescript":
            return {"tools": sort_keys_deep(tools), "tools_ts_str": tools_ts_str(tools)}
        return {"tools": tools}

    def render(self, messages: list[dict], tools=None, add_generation_prompt: bool = False,
               thinking: bool | None = None) -> str:
        return self.template.render(messages, add_generation_prompt=add_generation_prompt,
                                    **self.tool_kwargs(tools), **self.kwargs_for(thinking))

    def _render_with(self, messages: list[dict], add_generation_prompt: bool, kwargs: dict) -> str:
        return self.template.render(messages, add_generation_prompt=add_generation_prompt, **kwargs)

    def prompt_and_full(self, messages: list[dict], answer: dict, tools=None, thinking: bool | None = None
                        ) -> tuple[str, str]:
        """(messages rendered with the generation prompt, messages + answer rendered): what `render` gives for each,
        pasted from the render cache where the row's shape is trusted (see render_cache)."""
        return self._renders.texts(messages, answer, {**self.tool_kwargs(tools), **self.kwargs_for(thinking)})

    def prompt_ids(self, messages: list[dict], tools=None, thinking: bool | None = None) -> list[int]:
        """The prompt as the server sees it when asked to answer `messages`."""
        return self.tokenizer.encode_chat(self.render(messages, tools, add_generation_prompt=True, thinking=thinking))

    def end_of_turn(self, thinking: bool) -> tuple[str, np.ndarray]:
        """(text, ids) the template writes after a finished answer (K2.6: `<|im_end|>`; Gemma: `<end_of_turn>\\n`)."""
        if thinking not in self._end_of_turn:
            answer = final_assistant_message(SENTINEL, None, thinking=thinking)
            text = self.render([{"role": "user", "content": "x"}, answer], thinking=thinking)
            if text.count(SENTINEL) != 1:
                raise StageError("the chat template does not render an assistant answer's content once")
            closing = text.split(SENTINEL)[1]
            self._end_of_turn[thinking] = closing, self.tokenizer.encode_chat_np(closing)
        return self._end_of_turn[thinking]


def prompt_token_counter(target, chat_kwargs: dict):
    """(messages, tools) -> tokens of the rendered prompt (with the generation prompt), as the server will see it; for
    prepare.max_prompt_tokens, which needs a local tokenizer."""
    if target.tokenizer == "server":
        raise StageError(f"prepare.max_prompt_tokens needs a local tokenizer, but target {target.name} "
                         f"tokenizes on the server; set prepare.max_prompt_tokens=null for it")
    conv = ConversationTokenizer(target, load_tokenizer(target), chat_kwargs)
    return lambda messages, tools=None: len(conv.prompt_ids(messages, tools))
