"""The exact token ids of an answer: how each engine is asked for them, where they come back, and the check that
they are whole (as many as the server's usage counts) before a completion may carry them.

    vLLM (>= 0.10.2)      `return_token_ids: true`; top-level `prompt_token_ids` (streaming: in the first chunk),
                          `choices[0].token_ids` (streaming: the ids of each chunk, a chunk sent for every token)
    SGLang (>= 0.5.20)    `return_input_ids_in_sglext` / `return_output_ids_in_sglext`; top-level
                          `sglext.input_ids` and `sglext.output_ids[0]` (streaming: one extra chunk at the end)
    SGLang 0.5.17-0.5.19  `return_token_ids: true`, not streamed (a stream is refused with 400);
                          `choices[0].prompt_token_ids` and `choices[0].response_token_ids` (0.5.17: `token_ids`)
    llama-server          `return_tokens: true, verbose: true`, not streamed: `__verbose.tokens` holds every sampled
                          token. Its streamed logprobs drop tokens that show no text (`</think>`, EOS, held-back stop
                          text), and a streamed `__verbose` has no tokens, so ids are only exact unstreamed. The
                          prompt ids are the server's own /tokenize of its /apply-template (BOS added, specials
                          parsed), which is how it tokenizes a chat prompt.
"""
from __future__ import annotations

from dataclasses import dataclass

from drafter_data.server.endpoints import api_root
from drafter_data.server.faults import IncompleteTokenIds


@dataclass(frozen=True)
class IdMethod:
    name: str
    fields: tuple  # (key, value) pairs added to the request body
    streams: bool  # the ids are whole in a stream; else the request is sent unstreamed
    described: str

    def body_fields(self) -> dict:
        return {key: list(value) if isinstance(value, tuple) else value for key, value in self.fields}


METHODS = {m.name: m for m in (
    IdMethod("return_token_ids", (("return_token_ids", True),), True,
             "return_token_ids (vLLM 0.10.2+; SGLang 0.5.17+ unstreamed)"),
    IdMethod("sglext", (("return_input_ids_in_sglext", True), ("return_output_ids_in_sglext", True)), True,
             "SGLang's sglext ids (0.5.20+)"),
    IdMethod("return_token_ids_unstreamed", (("return_token_ids", True),), False,
             "SGLang's return_token_ids (0.5.17+, unstreamed)"),
    IdMethod("llama_tokens", (("return_tokens", True), ("verbose", True),
                              ("response_fields", ("tokens", "tokens_predicted", "tokens_evaluated", "stop_type"))),
             False, "llama-server's return_tokens (unstreamed) and /tokenize of /apply-template"),
)}

# What to try per engine, best first (an engine we could not identify gets every remote method).
CANDIDATES = {
    "llama-server": ("llama_tokens",),
    "vllm": ("return_token_ids",),
    "sglang": ("sglext", "return_token_ids_unstreamed"),
    "unknown": ("return_token_ids", "sglext", "return_token_ids_unstreamed"),
}


def id_method(name: str | None) -> IdMethod | None:
    if name is None:
        return None
    if name not in METHODS:
        raise ValueError(f"unknown token-id method {name!r} (known: {', '.join(METHODS)})")
    return METHODS[name]


def _extra(obj) -> dict:
    return getattr(obj, "model_extra", None) or {}


def _first_row(ids):
    """sglext lists per choice ([[...]]); a flat list is already the one row."""
    if ids and isinstance(ids[0], list):
        return ids[0]
    return ids


class IdCollector:
    """The ids of one answer as they arrive: a whole response, or chunk by chunk."""

    def __init__(self, method: IdMethod):
        self.method = method
        self.prompt: list[int] | None = None
        self.completion: list[int] | None = None

    def add(self, obj) -> None:
        """A response or a stream chunk; per-chunk ids (vLLM) are appended, whole lists replace."""
        top = _extra(obj)
        choice = _extra(obj.choices[0]) if getattr(obj, "choices", None) else {}
        name = self.method.name
        if name.startswith("return_token_ids"):
            self._set_prompt(top.get("prompt_token_ids") or choice.get("prompt_token_ids"))
            self._append(choice.get("token_ids") or choice.get("response_token_ids"))
        elif name == "sglext" and isinstance(top.get("sglext"), dict):
            self._set_prompt(_first_row(top["sglext"].get("input_ids")))
            self._set_completion(_first_row(top["sglext"].get("output_ids")))
        elif name == "llama_tokens" and isinstance(top.get("__verbose"), dict):
            self._set_completion(top["__verbose"].get("tokens"))

    def _set_prompt(self, ids) -> None:
        if ids is not None:
            self.prompt = [int(i) for i in ids]

    def _set_completion(self, ids) -> None:
        if ids is not None:
            self.completion = [int(i) for i in ids]

    def _append(self, ids) -> None:
        if ids is not None:
            self.completion = (self.completion or []) + [int(i) for i in ids]

    async def fetch_prompt(self, client, body: dict) -> None:
        """llama-server returns no prompt ids: its /tokenize of its /apply-template is what it evaluated."""
        if self.method.name != "llama_tokens":
            return
        root = api_root(str(client.base_url))
        render = {"messages": body["messages"],
                  "chat_template_kwargs": body.get("extra_body", {}).get("chat_template_kwargs") or {}}
        if body.get("tools"):
            render["tools"] = body["tools"]
        prompt = await client.post(f"{root}/apply-template", body=render, cast_to=object)
        tokens = await client.post(f"{root}/tokenize", body={"content": prompt["prompt"], "add_special": True,
                                                              "parse_special": True}, cast_to=object)
        self._set_prompt(tokens["tokens"])

    def checked(self, prompt_tokens: int, completion_tokens: int) -> tuple[list[int], list[int]]:
        """(prompt ids, completion ids), each exactly as many as the server's usage counts; else
        IncompleteTokenIds (the completion is retried, never stored with partial ids)."""
        how = self.method.described
        if not self.completion:
            raise IncompleteTokenIds(f"asked for token ids ({how}), but the answer carried no completion ids")
        if len(self.completion) != completion_tokens:
            raise IncompleteTokenIds(f"asked for token ids ({how}), but got {len(self.completion)} completion ids "
                                     f"for {completion_tokens} completion tokens (usage)")
        if self.prompt is None:
            raise IncompleteTokenIds(f"asked for token ids ({how}), but the answer carried no prompt ids")
        if len(self.prompt) != prompt_tokens:
            raise IncompleteTokenIds(f"asked for token ids ({how}), but got {len(self.prompt)} prompt ids for "
                                     f"{prompt_tokens} prompt tokens (usage)")
        return self.prompt, self.completion
