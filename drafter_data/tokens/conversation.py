"""A conversation -> (input_ids, loss_mask) exactly as the target renders and tokenizes it.

One render per conversation; the loss mask starts after the header of the final assistant turn, found in that render
and mapped to a token index by the tokenizer (no prefix is re-encoded).
"""
from __future__ import annotations

import json
from pathlib import Path

from drafter_data.errors import StageError
from drafter_data.tokens.chat_template import ChatTemplate
from drafter_data.tokens.tokenizers import load_tokenizer


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


def final_assistant_message(content: str, reasoning: str | None, tool_calls: str | None = None) -> dict:
    msg = {"role": "assistant", "content": content}
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    if tool_calls:
        msg["tool_calls"] = json.loads(tool_calls)
    return msg


class ConversationTokenizer:
    """chat_kwargs: the template kwargs exactly as a request sends them (RequestSpec.chat_template_kwargs): the
    thinking switch and the target's template kwargs."""

    def __init__(self, target, tokenizer, chat_kwargs: dict):
        self.tokenizer = tokenizer
        self.template = load_chat_template(target, tokenizer)
        self.header = target.assistant_header
        self.kwargs = dict(chat_kwargs)

    def render(self, messages: list[dict], tools=None, add_generation_prompt: bool = False) -> str:
        return self.template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools, **self.kwargs)

    def prompt_ids(self, messages: list[dict], tools=None) -> list[int]:
        """The prompt as the server sees it when asked to answer `messages`."""
        return self.tokenizer.encode_chat(self.render(messages, tools, add_generation_prompt=True))

    def mask_start_char(self, text: str, final: dict) -> int:
        """Where the final assistant turn's body starts: after the last header that is not inside that turn's own
        text (content, reasoning or tool calls may spell the header literally)."""
        inside = sum(json.dumps(final.get(k), ensure_ascii=False).count(self.header.replace("\n", "\\n"))
                     if k == "tool_calls" else str(final.get(k) or "").count(self.header)
                     for k in ("content", "reasoning_content", "reasoning", "tool_calls"))
        end = len(text)
        for _ in range(inside + 1):
            end = text.rfind(self.header, 0, end)
            if end < 0:
                raise ValueError(f"the rendered conversation has no final assistant header {self.header!r}")
        return end + len(self.header)

    def tokenize(self, messages: list[dict], tools=None):
        """messages end with the assistant turn to learn. Returns (rendered text, input_ids as an int32 array,
        first masked index)."""
        text = self.render(messages, tools)
        ids, start = self.tokenizer.encode_chat_split(text, self.mask_start_char(text, messages[-1]))
        return text, ids, start


def prompt_token_counter(target, chat_kwargs: dict):
    """(messages, tools) -> tokens of the rendered prompt (with the generation prompt), as the server will see it; for
    prepare.max_prompt_tokens, which needs a local tokenizer."""
    if target.tokenizer == "server":
        raise StageError(f"prepare.max_prompt_tokens needs a local tokenizer, but target {target.name} "
                         f"tokenizes on the server; set prepare.max_prompt_tokens=null for it")
    conv = ConversationTokenizer(target, load_tokenizer(target), chat_kwargs)
    return lambda messages, tools=None: len(conv.prompt_ids(messages, tools))
