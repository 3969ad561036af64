"""conversations.jsonl: one line per training row, for the trainers that render and tokenize again (Model Optimizer,
NeMo AutoModel, DeepSpec, SpecForge's `train_data_path`).

A line holds the messages exactly as they were sent (each message's extras included), the system message written out
(the one the target's template puts in when a conversation has none: a trainer that adds its own default, as
SpecForge does, would otherwise train on a prompt the target never saw), then the target's answer as an assistant
message (`content`, `reasoning_content`, `tool_calls`). `exact` says whether rendering the line with the target's
template (in the row's thinking mode, with the template kwargs tokenize rendered with) and tokenizing it gives the row's
`input_ids`: a sampled non-canonical split, an answer cut by max_tokens (the template closes it), a tool call's
arguments re-serialized, a row cut to tokenize.max_length all make it false.
"""
from __future__ import annotations

import numpy as np

from drafter_data.tokens.conversation import SENTINEL, ConversationTokenizer, final_assistant_message


class SystemDefault:
    """The system message the template writes when a conversation has none, per thinking mode, found by rendering:
    with a system message whose content is SENTINEL and without one, the text in the sentinel's place is the
    default; kept only when a system message of that text renders exactly as no system message does."""

    def __init__(self, conv: ConversationTokenizer):
        self.conv = conv
        self.found: dict[bool, str | None] = {}

    def text(self, thinking: bool) -> str | None:
        if thinking not in self.found:
            self.found[thinking] = self._find(thinking)
        return self.found[thinking]

    def _find(self, thinking: bool) -> str | None:
        user = [{"role": "user", "content": "Hello."}]
        try:
            without = self.conv.render(user, add_generation_prompt=True, thinking=thinking)
            marked = self.conv.render([{"role": "system", "content": SENTINEL}, *user], add_generation_prompt=True,
                                      thinking=thinking)
        except Exception:  # noqa: BLE001 - a template that refuses a system message has no default to write
            return None
        if marked.count(SENTINEL) != 1:
            return None
        before, after = marked.split(SENTINEL)
        if not (without.startswith(before) and without.endswith(after)) or len(without) < len(before) + len(after):
            return None
        default = without[len(before):len(without) - len(after)]
        if not default:
            return None
        check = self.conv.render([{"role": "system", "content": default}, *user], add_generation_prompt=True,
                                 thinking=thinking)
        return default if check == without else None


def with_system(messages: list[dict], default: str | None) -> list[dict]:
    if default is None or (messages and messages[0].get("role") == "system"):
        return messages
    return [{"role": "system", "content": default}, *messages]


def record(completion, system: SystemDefault) -> dict:
    """The conversations line of one completions row (without `exact`)."""
    turn, extra = completion.turn, completion.extra
    answer = final_assistant_message(turn.content, turn.reasoning, turn.tool_calls, turn.thinking)
    answer.setdefault("reasoning_content", None)
    answer.setdefault("tool_calls", None)
    messages = [*with_system(turn.messages, system.text(turn.thinking)), answer]
    return {"id": f"{turn.prompt_id}#turn{turn.turn}", "conversation_id": turn.prompt_id, "turn": turn.turn,
            "messages": messages, "conversations": messages, "tools": turn.tools, "thinking": turn.thinking,
            "chat_template_kwargs": extra.get("chat_template_kwargs"), "source": extra.get("source"),
            "model": extra.get("model"), "finish_reason": turn.finish_reason}


def exact(conv: ConversationTokenizer, line: dict, input_ids: np.ndarray) -> bool:
    """Whether the line, rendered with the target's template and tokenized, gives exactly these ids."""
    messages = [{k: v for k, v in m.items() if v is not None or k == "content"} for m in line["messages"]]
    try:
        text = conv.render(messages, line["tools"], add_generation_prompt=False, thinking=line["thinking"])
        ids = conv.tokenizer.encode_chat_np(text)
    except Exception:  # noqa: BLE001 - a line the template cannot render is not exact
        return False
    return len(ids) == len(input_ids) and bool(np.array_equal(ids, input_ids))
