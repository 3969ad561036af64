"""A fault-injecting OpenAI-compatible chat server for tests: real HTTP on loopback, JSON and SSE streaming, the
reasoning conventions, configurable latency, capacity (slots) and faults, optional Kimi K2.6 token ids, tool calls,
and endpoints that say what it received and served. It stands in for vLLM / SGLang / llama-server.

    python -m tests.fake_openai_server --port 0 --config '{"reasoning": "reasoning_content", "fault_rate": 0.1}'
prints `READY <port>` when it listens.

Config keys (defaults in DEFAULTS; every addition is off by default, so the plain behaviour stays the default):
  models ["fake-model"]        ids listed by GET /v1/models
  reasoning "reasoning_content" where reasoning goes: reasoning_content | reasoning | inline (`<think>` in content)
                               | none (reasoning words returned as content)
  reasoning_words 6, content_words 6   length of the deterministic answer (`expected(messages, config)`)
  thinking_kwargs ["thinking", "enable_thinking"]  chat_template_kwargs keys read as the thinking switch, first
                               present wins; absent -> thinking off (no reasoning)
  ignore_thinking False        the switch is ignored: every answer thinks (a template that does not read it)
  no_reasoning_on None         substring: thinking answers to prompts containing it come without reasoning (a
                               model that answers some prompts straight away); words mode only
  name_model True              False: answers name no model (an empty `model`, as some proxies send)
  answer_model None            answers name this model instead of the one asked for (a router falling back to
                               another model), for a share `answer_model_rate` 1.0 of them (seeded rng)
  max_model_len 0              >0: the context (prompt words + max_tokens): a request over it gets vLLM's 400, and
                               GET /v1/models lists it as vLLM does, unless hide_max_model_len
  token_delay_s 0.0            delay per generated token per request (0: a stream is written in one go)
  ttft_s 0.0                   delay before the first token
  no_usage False               streams end without the usage chunk even when asked for it (a proxy that drops
                               stream_options.include_usage)
  slots 0                      0 = unlimited parallel requests; else requests beyond queue (like a real engine)
  knee 0, knee_penalty 1.5     throughput knee: with more than `knee` requests generating, the per-token delay is
                               token_delay_s * (generating / knee) ** knee_penalty (total tokens/s falls beyond it)
  bend 0                       >0: decode batching with diminishing returns from the start: the per-token delay is
                               also x (1 + (generating - 1) / bend) (tok/s bends early, long before the knee)
  content_words_range None     [lo, hi]: each prompt's answer has lo..hi content words (by its hash) instead of
                               content_words
  fault_rate 0.0               probability that a request gets one of `faults` (drawn with a seeded rng)
  faults [...]                 names: 429 500 503 (HTTP errors), drop (connection closed, no answer), truncate
                               (stream stops mid-answer, no finish_reason), garbage (non-JSON body), abort (HTTP 200,
                               finish_reason "abort" after a few tokens), stream_error (HTTP 200 SSE, an in-stream
                               error event after a few tokens; non-streaming: HTTP 500)
  seed 0                       seed of the fault rng
  retry_after "0.05"           Retry-After header of injected 429s; retry_after_ms None: also `retry-after-ms`
  chat_404 False, models_404 False   the endpoints answer 404 (not an OpenAI-compatible API / no chat)
  context_limit_words 0        >0: prompts with more words get HTTP 400 (llama-server's body)
  context_error_in_stream False  ... or, for streaming requests, HTTP 200 and an SSE error event (code 400, vLLM's
                               "maximum context length" wording)
  api_key None                 set: /v1/* requests without `Authorization: Bearer <key>` get HTTP 401
  check_model False            chat requests whose `model` is not in `models` get vLLM's 404
  crash_on None                substring: a prompt containing it "crashes the engine": the connections of every
                               request in flight (and its own) are closed without an answer; serving goes on
  tool_calls False             requests with `tools` (whose last message is not a tool result) are answered with
                               one call of the first tool (`expected_tool_call`), finish_reason "tool_calls"
  token_ids "none"             "vllm": the answer is Kimi K2.6 token ids; with `return_token_ids: true` they are
                               returned as vLLM does. "sglext": as SGLang 0.5.20+ (`return_output_ids_in_sglext`).
                               "sglang": as SGLang 0.5.18-0.5.19 (`return_token_ids`, unstreamed only: a stream
                               asking for them gets SGLang's 400). "llama": as llama-server, in logprobs (request
                               `logprobs: true`), or unstreamed in `__verbose.tokens` (`return_tokens` + `verbose`;
                               streamed: tokens []); POST /apply-template and /tokenize render and encode the prompt.
                               "none": words are the tokens, no ids.
  drop_end_ids False           token-id modes: the stop token's id (<|im_end|>) is left out of the ids shown, as
                               llama-server's streamed logprobs leave out EOS (usage still counts it)
  engine "none"                which engine-only endpoint answers: "vllm" GET /version, "sglang" GET /server_info,
                               "llama" GET /props (all others 404)
                               /props says total_slots = slots, or 4 when unlimited (llama-server's own default
                               -np); /server_info max_running_requests = slots (unset when unlimited) and dp_size
  dp_size 1                    SGLang's data-parallel schedulers, said in /server_info
  engine_drops 0               the first N GETs of the engine's own endpoint are closed without an answer (a
                               connection lost to a keep-alive race, as llama-server's now and then are)
  vllm_wire False               True: the shapes a real vLLM 0.32 sends (checked against one by tests/test_vllm.py):
                               the first chunk's content is "" (not null); finish_reason "length" comes on the last
                               token's chunk, a stop by EOS in a chunk of its own with content "", the EOS id and
                               `stop_reason` (the id); an answer that only thought has content null; usage carries
                               completion_tokens_details.reasoning_tokens; GET /v1/models adds `root`; max_tokens over
                               max_model_len is a 400 (param max_tokens), a prompt over it a 400 even when streamed
                               (param input_tokens), a prompt that fits with max_tokens over the rest is answered
                               with fewer tokens; an unknown model's 404 lists the "Valid aliases"; a request with
                               tools gets a 400 unless tool_call_parser is set (vLLM's --tool-call-parser)
  tool_call_parser None        (vllm_wire) the tool-call parser the server was started with
  think_in_reasoning False     token-id modes: the model samples `<think>` halfway through its reasoning, and (as
                               vLLM's text-based qwen3 reasoning parser does) its text is dropped from the reasoning
                               while its id stays in token_ids (a chunk with an empty delta)
  tokenizer_dir <shared fixtures>/kimi-k2-tokenizer, chat_template None (-> tokenizer_dir/chat_template.jinja)
  split_token_every 0          k > 0 (token-id modes): for prompts with int(request_key, 16) % k == 0, one
                               multi-byte content token is sampled as several ids with the same bytes (text
                               unchanged, ids not canonical); GET /split lists them

The token-id answer, in K2.6's format: the prompt is the chat template rendered with add_generation_prompt and the
request's chat_template_kwargs and tools, encoded with KimiTokenizer.encode_chat. If it ends with `<think>`,
ids = encode(reasoning) + [</think>] + encode(content) + [<|im_end|>] (reasoning empty when thinking is off);
otherwise encode(content) + [<|im_end|>]. A tool call replaces the content by
<|tool_calls_section_begin|><|tool_call_begin|>{id}<|tool_call_argument_begin|>{arguments}<|tool_call_end|>
<|tool_calls_section_end|>. max_tokens cuts the ids (finish_reason length); the text is the decode of the ids sent,
markers omitted (except `</think>` in the inline convention). One token per streamed chunk.

Endpoints: POST /v1/chat/completions, GET /v1/models, GET /health, GET /props, /version, /server_info (see
`engine`), POST /apply-template, /tokenize (token-id modes), GET /stats (?since=&until= for the tokens window,
and the first token's time since), GET /requests (?since_index=N: every chat body received, with its receive
time), GET /split,
POST /config (merges a JSON object into the live config). /stats: requests, completed (request_key -> answers
finished; abort, stream_error, truncated streams, drop and crashes are not), faults, tokens_in_window,
tokens_total, split_prompts, crashes, crash_counts, inflight (chat requests in the handler, queued ones included),
inflight_peak.

Wire formats followed (read in the public sources):
  * vLLM return_token_ids (PR vllm-project/vllm#22587, vllm/entrypoints/openai/serving_chat.py): non-streaming
    top-level `prompt_token_ids` and `choices[i].token_ids`; streaming: the first chunk (delta role) carries the
    top-level `prompt_token_ids`, every later chunk `choices[i].token_ids` with the ids of that chunk (chunks with
    an empty delta are still sent for them), the finish chunk the last ids (the stop token included).
  * vLLM errors inside a stream (serving_chat.py, serving_engine.create_streaming_error_response and
    GenerationError): `data: {"error": {"message": "Internal server error", "type": "InternalServerError",
    "param": null, "code": 500}}` then `data: [DONE]`; non-streaming the same body with HTTP 500. Context too long:
    "This model's maximum context length is N tokens. However, ..." with type BadRequestError, code 400.
  * vLLM / SGLang finish_reason "abort" (vLLM FinishReason.ABORT; SGLang FINISH_ABORT -> "abort").
  * vLLM model check: HTTP 404 `{"error": {"message": "The model `X` does not exist.", "type": "NotFoundError",
    "param": "model", "code": 404}}`. OpenAI's wrong key: HTTP 401, code "invalid_api_key".
  * Tool calls: OpenAI delta format (first delta with index, id, type, name and arguments "", then argument
    fragments); ids `functions.<name>:<n>` as vLLM's kimi_k2 tool-call ids (n = tool calls earlier in the
    conversation); the id section as the K2.6 chat template's `render_toolcalls`.
  * llama-server logprobs (llama.cpp tools/server, completion_token_output::to_json / probs_vector_to_json, from
    PR ggml-org/llama.cpp#10783): `choices[0].logprobs = {"content": [{"id", "token" (text cut to valid UTF-8),
    "bytes", "logprob", "top_logprobs": []}]}`, per chunk when streaming. No prompt ids in this mode. The fake also
    lists `</think>` and `<|im_end|>` (so the entries hold the whole sampled sequence).
"""
from __future__ import annotations

import argparse
import asyncio
import codecs
import hashlib
import json
import random
import time
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path

from aiohttp import web

DEFAULT_TOKENIZER_DIR = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "kimi-k2-tokenizer"

DEFAULTS = {
    "models": ["fake-model"],
    "reasoning": "reasoning_content",  # reasoning_content | reasoning | inline | none
    "reasoning_words": 6,
    "content_words": 6,
    "thinking_kwargs": ["thinking", "enable_thinking"],
    "ignore_thinking": False,
    "no_reasoning_on": None,
    "name_model": True,
    "answer_model": None,
    "answer_model_rate": 1.0,
    "max_model_len": 0,
    "hide_max_model_len": False,
    "token_delay_s": 0.0,  # per generated token, per request
    "no_usage": False,  # streams end without the usage chunk, whatever stream_options asks
    "ttft_s": 0.0,
    "slots": 0,  # 0 = unlimited parallel requests; else requests beyond queue (like a real engine)
    "knee": 0,
    "knee_penalty": 1.5,
    "bend": 0,
    "content_words_range": None,
    "fault_rate": 0.0,  # probability that a request gets one of `faults`
    "faults": ["429", "500", "503", "drop", "truncate", "garbage"],
    "seed": 0,
    "retry_after": "0.05",
    "retry_after_ms": None,
    "chat_404": False,
    "models_404": False,
    "context_limit_words": 0,  # >0: prompts longer than this get a 400 context-length error
    "context_error_in_stream": False,
    "api_key": None,
    "check_model": False,
    "crash_on": None,
    "tool_calls": False,
    "token_ids": "none",  # none | vllm | sglext | sglang | llama
    "drop_end_ids": False,
    "engine": "none",  # none | vllm | sglang | llama: whose own endpoint answers (/version, /server_info, /props)
    "engine_drops": 0,
    "dp_size": 1,
    "tokenizer_dir": str(DEFAULT_TOKENIZER_DIR),
    "chat_template": None,
    "split_token_every": 0,
    "vllm_wire": False,
    "tool_call_parser": None,
    "think_in_reasoning": False,
}

REASONING_FIELD = {"reasoning_content": "reasoning_content", "reasoning": "reasoning", "inline": "content",
                   "none": "content"}
GENERATION_ERROR = {"error": {"message": "Internal server error", "type": "InternalServerError", "param": None,
                              "code": 500}}
SGLANG_NO_STREAMED_IDS = ("return_token_ids is not supported with streaming on /v1/chat/completions. Please set "
                          "stream=false when using return_token_ids=true.")
VLLM_TOOLS_NEED_PARSER = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
FEW_TOKENS = 3  # abort / stream_error come after this many tokens (at most half the answer)


# --- the deterministic answer: tests recompute it ------------------------------------------------------------------

def words_for(messages: list[dict], kind: str, n: int) -> list[str]:
    """The deterministic text this server answers for a prompt: tests recompute it to check what was stored."""
    h = hashlib.sha256(json.dumps(messages, sort_keys=True, ensure_ascii=False).encode()).hexdigest()
    return [f"{kind}-{h[i % 32: i % 32 + 4]}-{i}" for i in range(n)]


def expected(messages: list[dict], config: dict | None = None) -> tuple[str, str]:
    cfg = {**DEFAULTS, **(config or {})}
    reasoning = " ".join(words_for(messages, "r", cfg["reasoning_words"]))
    content = " ".join(words_for(messages, "c", content_words(messages, cfg)))
    return reasoning, content


def content_words(messages: list[dict], cfg: dict) -> int:
    """content_words, or with content_words_range a count in it picked by the prompt's hash."""
    if not cfg.get("content_words_range"):
        return cfg["content_words"]
    lo, hi = cfg["content_words_range"]
    return lo + int(request_key(messages), 16) % (hi - lo + 1)


def request_key(messages: list[dict]) -> str:
    """The key of a prompt in /stats `completed`, `split_prompts`, `crash_counts` and GET /split."""
    return hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()[:16]


def prompt_words(messages: list[dict]) -> int:
    return sum(len(str(m.get("content", "")).split()) for m in messages)


def thinking_of(template_kwargs: dict | None, config: dict | None = None) -> bool:
    """The thinking switch of a request: the first of `thinking_kwargs` present in its chat_template_kwargs."""
    kwargs, cfg = template_kwargs or {}, {**DEFAULTS, **(config or {})}
    if cfg["ignore_thinking"]:
        return True
    for key in cfg["thinking_kwargs"]:
        if key in kwargs:
            return bool(kwargs[key])
    return False


def expected_tool_call(messages: list[dict], tools: list[dict]) -> dict:
    """The call this server answers when tool calls are on: the first tool, arguments {"arg": <word>}."""
    name = tools[0]["function"]["name"]
    earlier = sum(len(m.get("tool_calls") or []) for m in messages if m.get("role") == "assistant")
    arguments = json.dumps({"arg": words_for(messages, "a", 1)[0]})
    return {"id": f"functions.{name}:{earlier}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def is_split(messages: list[dict], config: dict | None = None) -> bool:
    """Whether this prompt's content ids get a non-canonical split (token-id modes with split_token_every)."""
    k = int({**DEFAULTS, **(config or {})}["split_token_every"] or 0)
    return bool(k) and int(request_key(messages), 16) % k == 0


def wants_tool_call(body: dict, config: dict) -> bool:
    messages = body["messages"]
    return bool(config["tool_calls"] and body.get("tools") and messages and messages[-1].get("role") != "tool")


# --- the answer: steps of (field, text, ids), one generated token each ---------------------------------------------

@dataclass(frozen=True)
class Step:
    field: str | None  # reasoning_content | reasoning | content | tool_head | tool_args | None (no text)
    text: str = ""
    ids: tuple[int, ...] = ()


@dataclass
class Answer:
    steps: list[Step]
    finish: str
    prompt_tokens: int
    end_ids: list[int] = field(default_factory=list)  # <|im_end|> in token-id modes (in the finish chunk)
    tool_call: dict | None = None
    prompt_ids: list[int] | None = None
    split_at: int | None = None  # index of the step where a non-canonical split starts

    @property
    def completion_tokens(self) -> int:
        return len(self.steps) + len(self.end_ids)

    @property
    def ids(self) -> list[int]:
        return [i for s in self.steps for i in s.ids] + self.end_ids

    @property
    def split(self) -> bool:
        return self.split_at is not None and self.split_at < len(self.steps)

    def cut(self, n: int, finish: str) -> Answer:
        return replace(self, steps=self.steps[:n], end_ids=[], finish=finish)

    def within(self, budget: int) -> Answer:
        return self if self.completion_tokens <= budget else self.cut(budget, "length")

    def text(self, fld: str) -> str:
        return "".join(s.text for s in self.steps if s.field == fld)


# --- Kimi K2.6 tokens ---------------------------------------------------------------------------------------------

class Vocab:
    """The K2.6 tokenizer and chat template, as the fake's "engine" uses them."""

    def __init__(self, tokenizer_dir: str, chat_template: str | None = None):
        from drafter_data.tokens.chat_template import ChatTemplate
        from drafter_data.tokens.tokenizers import KimiTokenizer

        self.tok = KimiTokenizer(tokenizer_dir)
        source = Path(chat_template or Path(tokenizer_dir) / "chat_template.jinja").read_text()
        self.template = ChatTemplate(source, self.tok.special_tokens_map)
        self.special = self.tok.specials

    def render(self, messages: list[dict], tools=None, template_kwargs: dict | None = None) -> str:
        return self.template.render(messages, add_generation_prompt=True, tools=tools, **(template_kwargs or {}))

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text)

    def token_bytes(self, token_id: int) -> bytes:
        return self.tok._enc.decode_single_token_bytes(token_id)

    def text_steps(self, ids: list[int], fld: str) -> list[Step]:
        """One step per id; the text of each is what its bytes complete (an incomplete character waits)."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        return [Step(fld, decoder.decode(self.token_bytes(i)), (i,)) for i in ids]

    def marks(self, *names: str) -> list[Step]:
        return [Step(None, "", (self.special[n],)) for n in names]

    def split(self, ids: list[int]) -> tuple[list[int], int | None]:
        """The first multi-byte token replaced by its first byte's id plus the id of the rest (or single bytes)."""
        enc = self.tok._enc
        for pos, token in enumerate(ids):
            data = self.token_bytes(token)
            if len(data) < 2:
                continue
            try:
                rest = [enc.encode_single_token(data[1:])]
            except KeyError:
                rest = [enc.encode_single_token(bytes([b])) for b in data[1:]]
            return ids[:pos] + [enc.encode_single_token(data[:1])] + rest + ids[pos + 1:], pos
        return ids, None

    def logprob(self, token_id: int) -> dict:
        data = self.token_bytes(token_id)
        return {"id": token_id, "token": valid_utf8_prefix(data), "bytes": list(data),
                "logprob": -round(0.01 + (token_id % 97) / 100, 4), "top_logprobs": []}


def valid_utf8_prefix(data: bytes) -> str:
    """The longest prefix of data that is whole UTF-8 characters (llama.cpp's validate_utf8 cut)."""
    for end in range(len(data), max(len(data) - 4, 0) - 1, -1):
        try:
            return data[:end].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return data.decode("utf-8", errors="ignore")


@lru_cache(maxsize=4)
def load_vocab(tokenizer_dir: str, chat_template: str | None = None) -> Vocab:
    return Vocab(tokenizer_dir, chat_template)


def vocab_for(config: dict | None = None) -> Vocab:
    cfg = {**DEFAULTS, **(config or {})}
    return load_vocab(str(cfg["tokenizer_dir"]), cfg["chat_template"])


# --- building the answer -----------------------------------------------------------------------------------------

def word_pieces(tokens: list[tuple[str, str]], style: str) -> list[tuple[str, str]]:
    """(field, text) per word token in the configured reasoning convention."""
    out, first_content = [], True
    for i, (kind, word) in enumerate(tokens):
        sep = " " if i and tokens[i - 1][0] == kind else ""
        if kind == "r":
            if style == "inline":
                out.append(("content", ("<think>" if i == 0 else "") + sep + word))
            elif style == "none":
                out.append(("content", sep + word))
            else:
                out.append((style, sep + word))
        else:
            prefix = "</think>\n\n" if style == "inline" and first_content and i else ""
            prefix = " " if style == "none" and first_content and i else prefix
            first_content = False
            out.append(("content", prefix + sep + word))
    return out


def tool_call_steps(call: dict, width: int = 8) -> list[Step]:
    args = call["function"]["arguments"]
    return [Step("tool_head")] + [Step("tool_args", args[i: i + width]) for i in range(0, len(args), width)]


def word_answer(body: dict, cfg: dict, thinking: bool, call: dict | None) -> Answer:
    """Words as tokens (token_ids "none"): the plain behaviour."""
    messages = body["messages"]
    straight = cfg["no_reasoning_on"] is not None and cfg["no_reasoning_on"] in str(messages[-1].get("content"))
    r_words = words_for(messages, "r", cfg["reasoning_words"]) if thinking and not straight else []
    c_words = [] if call else words_for(messages, "c", content_words(messages, cfg))
    tokens = [("r", w) for w in r_words] + [("c", w) for w in c_words]
    steps = [Step(f, t) for f, t in word_pieces(tokens, cfg["reasoning"])]
    if call:
        steps += tool_call_steps(call)
    return Answer(steps, "tool_calls" if call else "stop", prompt_words(messages), tool_call=call)


def id_tool_steps(vocab: Vocab, call: dict) -> list[Step]:
    steps = vocab.marks("<|tool_calls_section_begin|>", "<|tool_call_begin|>")
    steps += [Step(None, "", (i,)) for i in vocab.encode(call["id"])]
    steps.append(Step("tool_head", "", (vocab.special["<|tool_call_argument_begin|>"],)))
    steps += vocab.text_steps(vocab.encode(call["function"]["arguments"]), "tool_args")
    return steps + vocab.marks("<|tool_call_end|>", "<|tool_calls_section_end|>")


def id_answer(body: dict, cfg: dict, vocab: Vocab, thinking: bool, call: dict | None) -> Answer:
    """K2.6 token ids: what the model would sample after the rendered prompt."""
    messages, style = body["messages"], cfg["reasoning"]
    prompt = vocab.render(messages, body.get("tools"), body.get("chat_template_kwargs"))
    prompt_ids = vocab.tok.encode_chat(prompt)
    reasoning, content = expected(messages, cfg)
    steps: list[Step] = []
    if prompt.endswith("<think>"):
        thought = vocab.text_steps(vocab.encode(reasoning if thinking else ""), REASONING_FIELD[style])
        if cfg["think_in_reasoning"] and thought:
            half = len(thought) // 2
            thought = thought[:half] + vocab.marks("<think>") + thought[half:]
        steps += thought
        end_think = vocab.special["</think>"]
        steps.append(Step("content", "</think>", (end_think,)) if style == "inline" else Step(None, "", (end_think,)))
    split_at = None
    if call:
        steps += id_tool_steps(vocab, call)
    else:
        ids = vocab.encode(content)
        if is_split(messages, cfg):
            ids, pos = vocab.split(ids)
            split_at = None if pos is None else len(steps) + pos
        steps += vocab.text_steps(ids, "content")
    return Answer(steps, "tool_calls" if call else "stop", len(prompt_ids), [vocab.special["<|im_end|>"]], call,
                  prompt_ids, split_at)


def build_answer(body: dict, config: dict | None = None, vocab: Vocab | None = None) -> Answer:
    """The whole answer to a chat request body (max_tokens applied), as the server sends it."""
    cfg = {**DEFAULTS, **(config or {})}
    thinking = thinking_of(body.get("chat_template_kwargs"), cfg)
    call = expected_tool_call(body["messages"], body["tools"]) if wants_tool_call(body, cfg) else None
    if cfg["token_ids"] == "none":
        answer = word_answer(body, cfg, thinking, call)
    else:
        answer = id_answer(body, cfg, vocab or vocab_for(cfg), thinking, call)
    return answer.within(int(body.get("max_tokens") or body.get("max_completion_tokens") or 10**9))


def expected_ids(messages: list[dict], config: dict | None = None, tools: list | None = None,
                 chat_template_kwargs: dict | None = None, max_tokens: int | None = None) -> list[int]:
    """The completion ids this server samples for a request (token-id modes), <|im_end|> included when reached."""
    cfg = {"token_ids": "vllm", **(config or {})}
    body = {"messages": messages, "tools": tools, "chat_template_kwargs": chat_template_kwargs,
            "max_tokens": max_tokens}
    return build_answer(body, cfg).ids


def expected_prompt_ids(messages: list[dict], config: dict | None = None, tools: list | None = None,
                        chat_template_kwargs: dict | None = None) -> list[int]:
    vocab = vocab_for(config)
    return vocab.tok.encode_chat(vocab.render(messages, tools, chat_template_kwargs))


# --- wire pieces --------------------------------------------------------------------------------------------------

def step_delta(step: Step, call: dict | None) -> dict:
    if step.field == "tool_head":
        return {"tool_calls": [{"index": 0, "id": call["id"], "type": "function",
                                "function": {"name": call["function"]["name"], "arguments": ""}}]}
    if step.field == "tool_args":
        return {"tool_calls": [{"index": 0, "function": {"arguments": step.text}}]} if step.text else {}
    return {step.field: step.text} if step.field and step.text else {}


def message_of(answer: Answer, vllm_wire: bool = False) -> dict:
    """The non-streaming message: what the stream's deltas add up to (vLLM: content null when it only thought)."""
    message = {"role": "assistant", "content": answer.text("content")}
    if vllm_wire and not message["content"] and reasoning_steps(answer):
        message["content"] = None
    for fld in ("reasoning_content", "reasoning"):
        if text := answer.text(fld):
            message[fld] = text
    if any(s.field == "tool_head" for s in answer.steps):
        call = answer.tool_call
        message["tool_calls"] = [{**call, "function": {**call["function"], "arguments": answer.text("tool_args")}}]
        message["content"] = message["content"] or None
    return message


def reasoning_steps(answer: Answer) -> int:
    return sum(1 for s in answer.steps if s.field in ("reasoning_content", "reasoning"))


def usage_of(answer: Answer, vllm_wire: bool = False) -> dict:
    usage = {"prompt_tokens": answer.prompt_tokens, "completion_tokens": answer.completion_tokens,
             "total_tokens": answer.prompt_tokens + answer.completion_tokens}
    if vllm_wire:
        usage.update(prompt_tokens_details=None,
                     completion_tokens_details={"reasoning_tokens": reasoning_steps(answer)})
    return usage


def error_body(message: str, type_: str, code, param=None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def context_error(limit: int, words: int) -> dict:
    return error_body(f"This model's maximum context length is {limit} tokens. However, your request has {words} "
                      f"input tokens. Please reduce the length of the input messages.", "BadRequestError", 400)


class Crashed(Exception):
    """The engine crashed under this request (crash_on): its connection is gone."""


@dataclass(eq=False)
class Flight:
    request: web.Request
    crashed: bool = False


class SSE:
    """Server-sent events, written one by one, or all in one write at the end (`buffered`: instant answers)."""

    def __init__(self, resp: web.StreamResponse, buffered: bool):
        self.resp, self.buffered, self.pending = resp, buffered, []

    async def send(self, obj) -> None:
        line = b"data: [DONE]\n\n" if obj == "[DONE]" else f"data: {json.dumps(obj)}\n\n".encode()
        self.pending.append(line)
        if not self.buffered:
            await self.flush()

    async def flush(self) -> None:
        if self.pending:
            data, self.pending = b"".join(self.pending), []
            await self.resp.write(data)


def shown_ids(body: dict, cfg: dict) -> str | None:
    """How this request's ids are shown, given the server's token_ids mode and what the request asked for."""
    mode = cfg["token_ids"]
    if mode == "vllm" and body.get("return_token_ids"):
        return "token_ids"
    if mode == "sglext" and body.get("return_output_ids_in_sglext"):
        return "sglext"
    if mode == "sglang" and body.get("return_token_ids"):
        return "sglang_token_ids"
    if mode == "llama" and body.get("return_tokens") and body.get("verbose"):
        return "verbose"
    if mode == "llama" and body.get("logprobs"):
        return "logprobs"
    return None


class Reply:
    """What one request is answered with: the answer, the fault that cuts it, and how ids are shown."""

    def __init__(self, body: dict, answer: Answer, fault: str | None, cfg: dict, vocab: Vocab | None,
                 model: str | None = None):
        self.body, self.answer, self.fault, self.vocab = body, answer, fault, vocab
        self.show = shown_ids(body, cfg)
        self.drop_end_ids = bool(cfg["drop_end_ids"])
        self.vllm_wire = bool(cfg["vllm_wire"])
        self.finished_early = False  # vllm_wire: finish_reason length went out on the last token's chunk
        few = min(FEW_TOKENS, len(answer.steps) // 2)
        if fault == "abort":
            self.answer = answer.cut(few, "abort")
        self.stop = {"truncate": len(answer.steps) // 2, "stream_error": few}.get(fault)
        self.base = {"id": f"chatcmpl-{request_key(body['messages'])}", "created": int(time.time()),
                     "model": (model or body.get("model")) if cfg["name_model"] else ""}

    def extras(self, ids) -> dict:
        """Per-choice id fields of a chunk (its ids) or of a whole response (all ids)."""
        if self.show == "token_ids":
            return {"token_ids": list(ids)}
        if self.show == "logprobs":
            return {"logprobs": {"content": [self.vocab.logprob(i) for i in ids]}}
        return {}

    def top_extras(self, streamed: bool) -> dict:
        """Top-level id fields of the first chunk (streamed) or of a whole response."""
        answer = self.answer
        if self.show == "token_ids":
            return {"prompt_token_ids": answer.prompt_ids}
        if self.show == "sglext" and not streamed:
            return {"sglext": self.sglext()}
        if self.show == "verbose":  # llama-server: a streamed __verbose carries no tokens
            return {"__verbose": {"tokens": [] if streamed else self.ids_shown(), "tokens_predicted": len(answer.ids),
                                  "tokens_evaluated": answer.prompt_tokens, "stop_type": "eos"}}
        return {}

    def sglext(self) -> dict:
        return {"input_ids": self.answer.prompt_ids, "output_ids": [self.ids_shown()]}

    def chunk(self, delta: dict, ids=None, finish=None, **top) -> dict:
        extras = {} if ids is None else self.extras(ids)
        choice = {"index": 0, "delta": delta, "finish_reason": finish, **extras}
        return {**self.base, "object": "chat.completion.chunk", **top, "choices": [choice]}

    def first_chunk(self) -> dict:
        top = self.top_extras(streamed=True) if self.show == "token_ids" else {}
        return self.chunk({"role": "assistant", "content": "" if self.vllm_wire else None}, **top)

    def finish_chunk(self) -> dict:
        top = self.top_extras(streamed=True) if self.show == "verbose" else {}
        end_ids = [] if self.drop_end_ids else self.answer.end_ids
        if not self.vllm_wire:
            return self.chunk({}, end_ids, self.answer.finish, **top)
        chunk = self.chunk({"content": ""} if end_ids else {}, end_ids, self.answer.finish, **top)
        chunk["choices"][0]["stop_reason"] = self.stop_reason()
        return chunk

    def stop_reason(self):
        """vLLM's stop_reason: the EOS id it stopped on, else null."""
        return self.answer.end_ids[-1] if self.answer.finish == "stop" and self.answer.end_ids else None

    def ids_shown(self) -> list[int]:
        """The whole answer's ids as shown (the stop token left out with drop_end_ids)."""
        ids = self.answer.ids
        return ids[:len(ids) - len(self.answer.end_ids)] if self.drop_end_ids else ids

    def step_chunk(self, step: Step, last: bool = False) -> dict | None:
        delta = step_delta(step, self.answer.tool_call)
        if last and self.vllm_wire and self.answer.finish == "length" and not self.answer.end_ids:
            self.finished_early = True  # vLLM: the cut comes on the last token's own chunk
            chunk = self.chunk(delta, step.ids, "length")
            chunk["choices"][0]["stop_reason"] = None
            return chunk
        return self.chunk(delta, step.ids) if delta or (self.show and step.ids) else None

    def completion(self) -> dict:
        answer = self.answer
        choice = {"index": 0, "message": message_of(answer, self.vllm_wire), "finish_reason": answer.finish,
                  **self.extras(self.ids_shown())}
        if self.vllm_wire:
            choice["stop_reason"] = self.stop_reason()
        if self.show == "sglang_token_ids":
            choice.update(prompt_token_ids=answer.prompt_ids, response_token_ids=self.ids_shown())
        return {**self.base, "object": "chat.completion", **self.top_extras(streamed=False),
                "usage": usage_of(answer, self.vllm_wire), "choices": [choice]}


# --- the server ---------------------------------------------------------------------------------------------------

class FakeServer:
    def __init__(self, config: dict):
        self.cfg = {**DEFAULTS, **config}
        self.rng = random.Random(self.cfg["seed"])
        self.slots = asyncio.Semaphore(self.cfg["slots"]) if self.cfg["slots"] else None
        self.requests = 0
        self.completed: dict[str, int] = {}
        self.token_times: list[float] = []
        self.faults_served: dict[str, int] = {}
        self.request_log: list[dict] = []
        self.split_served: dict[str, int] = {}
        self.crash_counts: dict[str, int] = {}
        self.inflight: set[Flight] = set()
        self.inflight_peak = 0
        self.generating = 0
        if self.cfg["token_ids"] != "none":
            self.vocab()  # load the tokenizer before the first request

    def vocab(self) -> Vocab | None:
        return None if self.cfg["token_ids"] == "none" else vocab_for(self.cfg)

    # control and introspection

    async def stats(self, request):
        since = float(request.query.get("since", 0))
        until = float(request.query.get("until", time.time() + 1))
        tokens = sum(1 for t in self.token_times if since <= t < until)
        first = next((t for t in self.token_times if t >= since), None)
        return web.json_response({"requests": self.requests, "completed": self.completed, "faults": self.faults_served,
                                  "tokens_in_window": tokens, "tokens_total": len(self.token_times),
                                  "first_token_since": first,
                                  "split_prompts": sorted(self.split_served),
                                  "crashes": sum(self.crash_counts.values()), "crash_counts": self.crash_counts,
                                  "inflight": len(self.inflight), "inflight_peak": self.inflight_peak})

    async def requests_log(self, request):
        return web.json_response(self.request_log[int(request.query.get("since_index", 0)):])

    async def split(self, request):
        return web.json_response({"count": len(self.split_served), "prompts": sorted(self.split_served),
                                  "served": self.split_served})

    async def set_config(self, request):
        update = await request.json()
        self.cfg.update(update)
        if "slots" in update:
            self.slots = asyncio.Semaphore(self.cfg["slots"]) if self.cfg["slots"] else None
        if "seed" in update:
            self.rng = random.Random(self.cfg["seed"])
        self.vocab()
        return web.json_response(self.cfg)

    # refusals

    def _unauthorized(self, request) -> web.Response | None:
        key = self.cfg["api_key"]
        if key and request.headers.get("Authorization") != f"Bearer {key}":
            return web.json_response(error_body("Incorrect API key provided", "invalid_request_error",
                                                "invalid_api_key"), status=401)
        return None

    def _refusal(self, request, body: dict) -> web.Response | None:
        """Answers that come before any generation: auth, missing routes, unknown model."""
        if denied := self._unauthorized(request):
            return denied
        if self.cfg["chat_404"]:
            return web.json_response({"detail": "Not Found"}, status=404)
        if self.cfg["token_ids"] == "sglang" and body.get("return_token_ids") and body.get("stream"):
            return web.json_response({"object": "error", "message": SGLANG_NO_STREAMED_IDS, "type": "BadRequest",
                                      "param": None, "code": 400}, status=400)
        if self.cfg["check_model"] and body.get("model") not in self.cfg["models"]:
            aliases = f" Valid aliases: {', '.join(self.cfg['models'])}." if self.cfg["vllm_wire"] else ""
            return web.json_response(error_body(f"The model `{body.get('model')}` does not exist.{aliases}",
                                                "NotFoundError", 404, "model"), status=404)
        if self.cfg["vllm_wire"] and body.get("tools") and not self.cfg["tool_call_parser"]:
            return web.json_response(error_body(VLLM_TOOLS_NEED_PARSER, "BadRequestError", 400), status=400)
        return None

    @staticmethod
    def _vllm_length_refusal(context: int, words: int, asked: int) -> web.Response | None:
        """vLLM 0.32: max_tokens over max_model_len, or a prompt that alone fills the context, is a 400 (streamed
        requests too); a prompt that fits is answered with at most the rest of the context."""
        if asked > context:
            return web.json_response(error_body(
                f"max_tokens={asked} cannot be greater than max_model_len={context}. Please request fewer output "
                f"tokens. (parameter=max_tokens, value={asked})", "BadRequestError", 400, "max_tokens"), status=400)
        if words >= context:
            return web.json_response(error_body(
                f"This model's maximum context length is {context} tokens. However, your prompt contains at least "
                f"{context + 1} input tokens, which exceeds this limit even without any output tokens. Please reduce "
                f"the length of the input prompt. (parameter=input_tokens, value={context + 1})", "BadRequestError",
                400, "input_tokens"), status=400)
        return None

    def _pick_fault(self) -> str | None:
        if not (self.cfg["fault_rate"] and self.rng.random() < self.cfg["fault_rate"]):
            return None
        fault = self.rng.choice(self.cfg["faults"])
        self.faults_served[fault] = self.faults_served.get(fault, 0) + 1
        return fault

    def _immediate_fault(self, request, fault: str | None) -> web.Response | None:
        if fault in ("429", "500", "503"):
            headers = {}
            if fault == "429":
                headers["Retry-After"] = str(self.cfg["retry_after"])
                if self.cfg["retry_after_ms"] is not None:
                    headers["retry-after-ms"] = str(self.cfg["retry_after_ms"])
            return web.json_response({"error": {"message": f"injected {fault}", "code": int(fault)}},
                                     status=int(fault), headers=headers)
        if fault == "garbage":
            return web.Response(text="<html>oops</html>", content_type="application/json")
        if fault == "drop":
            request.transport.close()
            return web.Response()
        return None

    def _crash(self, key: str) -> web.Response:
        """The engine dies: every connection in flight (this one included) is closed without an answer."""
        self.crash_counts[key] = self.crash_counts.get(key, 0) + 1
        for flight in list(self.inflight):
            flight.crashed = True
            if flight.request.transport is not None:
                flight.request.transport.close()
        return web.Response()

    async def _context_error(self, request, body: dict, words: int) -> web.StreamResponse:
        limit = self.cfg["context_limit_words"]
        if not (self.cfg["context_error_in_stream"] and body.get("stream")):
            return web.json_response({"error": {"message": "request exceeds the available context size",
                                                "type": "exceed_context_size_error", "code": 400}}, status=400)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(f"data: {json.dumps(context_error(limit, words))}\n\ndata: [DONE]\n\n".encode())
        return resp

    # what only one engine has: how clients tell them apart (`engine`), and llama-server's template/tokenizer

    def _engine_dropped(self, request, engine: str) -> bool:
        if self.cfg["engine"] != engine or self.cfg["engine_drops"] <= 0:
            return False
        self.cfg["engine_drops"] -= 1
        request.transport.close()
        return True

    async def props(self, request):
        if self._engine_dropped(request, "llama"):
            return web.Response()
        if self.cfg["engine"] != "llama":
            return web.json_response({"error": {"message": "File Not Found", "code": 404}}, status=404)
        return web.json_response({
            "default_generation_settings": {"n_ctx": 4096}, "total_slots": self.cfg["slots"] or 4,
            "model_alias": self.cfg["models"][0],
            "model_path": "/fake/model.gguf", "chat_template": "{{ fake }}", "build_info": "fake"})

    async def version(self, request):
        if self._engine_dropped(request, "vllm"):
            return web.Response()
        if self.cfg["engine"] != "vllm":
            return web.json_response({"detail": "Not Found"}, status=404)
        return web.json_response({"version": "0.32.0"})

    async def server_info(self, request):
        if self._engine_dropped(request, "sglang"):
            return web.Response()
        if self.cfg["engine"] != "sglang":
            return web.json_response({"detail": "Not Found"}, status=404)
        return web.json_response({"version": "0.5.23", "model_path": "/fake", "tp_size": 1,
                                  "dp_size": self.cfg["dp_size"], "max_running_requests": self.cfg["slots"] or None})

    async def apply_template(self, request):
        body = await request.json()
        prompt = vocab_for(self.cfg).render(body["messages"], body.get("tools"), body.get("chat_template_kwargs"))
        return web.json_response({"prompt": prompt})

    async def tokenize(self, request):
        body = await request.json()
        return web.json_response({"tokens": vocab_for(self.cfg).tok.encode_chat(body["content"])})

    # chat

    async def models(self, request):
        if denied := self._unauthorized(request):
            return denied
        if self.cfg["models_404"]:
            return web.json_response({"detail": "Not Found"}, status=404)
        shown = self.cfg["max_model_len"] and not self.cfg["hide_max_model_len"]
        length = {"max_model_len": self.cfg["max_model_len"]} if shown else {}
        if self.cfg["vllm_wire"]:
            length.update(root=f"/models/{self.cfg['models'][0]}", parent=None)
        return web.json_response({"object": "list", "data": [{"id": m, "object": "model", "owned_by": "fake", **length}
                                                              for m in self.cfg["models"]]})

    async def chat(self, request):
        self.requests += 1
        try:
            body = await request.json()
        except ConnectionResetError:  # the client went away before its body came (generate withdrew the request)
            return web.Response(status=499)
        self.request_log.append({"index": len(self.request_log), "received": time.time(), "body": body})
        flight = Flight(request)
        self.inflight.add(flight)
        self.inflight_peak = max(self.inflight_peak, len(self.inflight))
        try:
            return await self._chat(request, body, flight)
        finally:
            self.inflight.discard(flight)

    async def _chat(self, request, body: dict, flight: Flight):
        if refused := self._refusal(request, body):
            return refused
        fault = self._pick_fault()
        if (early := self._immediate_fault(request, fault)) is not None:
            return early
        messages = body["messages"]
        crash_on = self.cfg["crash_on"]
        if crash_on and any(crash_on in str(m.get("content", "")) for m in messages):
            return self._crash(request_key(messages))
        limit, words = self.cfg["context_limit_words"], prompt_words(messages)
        if limit and words > limit:
            return await self._context_error(request, body, words)
        context, asked = self.cfg["max_model_len"], int(body.get("max_tokens") or 0)
        if context and self.cfg["vllm_wire"]:
            if refused := self._vllm_length_refusal(context, words, asked):
                return refused
            body = {**body, "max_tokens": min(asked or context, context - words)}  # the rest of the context
        elif context and words + asked > context:
            return web.json_response(error_body(
                f"This model's maximum context length is {context} tokens. However, you requested {words + asked} "
                f"tokens ({words} in the messages, {asked} in the completion). Please reduce the length of the "
                f"messages or completion.", "BadRequestError", 400), status=400)
        vocab = self.vocab()
        fallback = self.cfg["answer_model"] if self.cfg["answer_model"] and \
            self.rng.random() < self.cfg["answer_model_rate"] else None
        reply = Reply(body, build_answer(body, self.cfg, vocab), fault, self.cfg, vocab, fallback)
        if self.slots:
            async with self.slots:
                return await self._generate(request, reply, flight)
        return await self._generate(request, reply, flight)

    async def _generate(self, request, reply: Reply, flight: Flight):
        self.generating += 1
        try:
            await asyncio.sleep(self.cfg["ttft_s"])
            if flight.crashed:
                return web.Response()
            if reply.body.get("stream"):
                return await self._stream(request, reply, flight)
            return await self._json(reply, flight)
        finally:
            self.generating -= 1

    def _token_delay(self) -> float:
        delay, knee = self.cfg["token_delay_s"], self.cfg["knee"]
        if knee and self.generating > knee:
            delay *= (self.generating / knee) ** self.cfg["knee_penalty"]
        if self.cfg["bend"]:
            delay *= 1 + max(self.generating - 1, 0) / self.cfg["bend"]
        return delay

    async def _tick(self, flight: Flight, sleep: bool = True) -> None:
        """One generated token: its delay, then it counts as served (unless the engine crashed meanwhile)."""
        if sleep:
            await asyncio.sleep(self._token_delay())
        if flight.crashed:
            raise Crashed
        self.token_times.append(time.time())

    def _done(self, reply: Reply) -> None:
        key = request_key(reply.body["messages"])
        self.completed[key] = self.completed.get(key, 0) + 1
        if reply.answer.split:
            self.split_served[key] = self.split_served.get(key, 0) + 1

    async def _json(self, reply: Reply, flight: Flight):
        try:
            for _ in reply.answer.steps[:reply.stop if reply.fault == "stream_error" else None]:
                await self._tick(flight)
        except Crashed:
            return web.Response()
        if reply.fault == "stream_error":
            return web.json_response(GENERATION_ERROR, status=500)
        if reply.fault != "abort":
            self._done(reply)
        return web.json_response(reply.completion())

    async def _stream(self, request, reply: Reply, flight: Flight):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        sse = SSE(resp, buffered=not self.cfg["token_delay_s"])
        try:
            await sse.send(reply.first_chunk())
            last = len(reply.answer.steps) - 1
            for i, step in enumerate(reply.answer.steps):
                if i == reply.stop:
                    break
                await self._tick(flight, sleep=not sse.buffered)
                if (chunk := reply.step_chunk(step, last=i == last and reply.stop is None)) is not None:
                    await sse.send(chunk)
            await self._stream_end(request, reply, sse)
        except (Crashed, ConnectionResetError):
            pass
        return resp

    async def _stream_end(self, request, reply: Reply, sse: SSE) -> None:
        if reply.fault == "truncate":  # the stream stops mid-answer: no finish_reason, no [DONE]
            await sse.flush()
            request.transport.close()
            return
        if reply.fault == "stream_error":
            await sse.send(GENERATION_ERROR)
        else:
            answer = reply.answer
            if not reply.finished_early:
                await sse.send(reply.finish_chunk())
            if reply.show == "sglext":
                await sse.send({**reply.base, "object": "chat.completion.chunk", "choices": [], "usage": None,
                                "sglext": reply.sglext()})
            if (reply.body.get("stream_options") or {}).get("include_usage") and not self.cfg["no_usage"]:
                await sse.send({**reply.base, "object": "chat.completion.chunk", "choices": [],
                                "usage": usage_of(answer, reply.vllm_wire)})
        await sse.send("[DONE]")
        await sse.flush()
        if reply.fault not in ("abort", "stream_error"):
            self._done(reply)


def make_app(config: dict) -> web.Application:
    server = FakeServer(config)
    app = web.Application()
    app.router.add_get("/v1/models", server.models)
    app.router.add_post("/v1/chat/completions", server.chat)
    app.router.add_get("/stats", server.stats)
    app.router.add_get("/requests", server.requests_log)
    app.router.add_get("/split", server.split)
    app.router.add_post("/config", server.set_config)
    app.router.add_get("/health", lambda r: web.json_response({"status": "ok"}))
    app.router.add_get("/props", server.props)
    app.router.add_get("/version", server.version)
    app.router.add_get("/server_info", server.server_info)
    app.router.add_post("/apply-template", server.apply_template)
    app.router.add_post("/tokenize", server.tokenize)
    return app


async def _serve(port: int, config: dict) -> None:
    runner = web.AppRunner(make_app(config), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    print(f"READY {site._server.sockets[0].getsockname()[1]}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--config", default="{}")
    args = parser.parse_args()
    asyncio.run(_serve(args.port, json.loads(args.config)))
