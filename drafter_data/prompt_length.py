"""Prompt length in the target's own tokens, for prepare's prepare.max_prompt_tokens filter."""
from __future__ import annotations

from drafter_data.config import StageError
from drafter_data.conversation_tokens import ConversationTokenizer
from drafter_data.tokenizers import load_tokenizer


def prompt_token_counter(cfg):
    """messages -> number of tokens of the rendered prompt (with the generation prompt), as the server will see it."""
    if cfg.target.tokenizer == "server":
        raise StageError(f"prepare.max_prompt_tokens needs a local tokenizer, but target {cfg.target.name} "
                         f"tokenizes on the server; set prepare.max_prompt_tokens=null for it")
    conv = ConversationTokenizer(cfg.target, load_tokenizer(cfg.target), cfg.generation.thinking,
                                 cfg.tokenize.get("template_kwargs"))
    return lambda messages: len(conv.prompt_ids(messages))
