"""A fault-injecting OpenAI-compatible chat server for tests: real HTTP on loopback, JSON and SSE streaming, the three
reasoning conventions, configurable latency, capacity (slots) and fault rates, and a /stats endpoint that says what
it served and when.

    python -m tests.fake_openai_server --port 0 --config '{"reasoning": "reasoning_content", "fault_rate": 0.1}'
prints `READY <port>` when it listens.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import time

from aiohttp import web

DEFAULTS = {
    "models": ["fake-model"],
    "reasoning": "reasoning_content",  # reasoning_content | reasoning | inline | none
    "reasoning_words": 6,
    "content_words": 6,
    "token_delay_s": 0.0,  # per generated token, per request
    "ttft_s": 0.0,
    "slots": 0,  # 0 = unlimited parallel requests; else requests beyond queue (like a real engine)
    "fault_rate": 0.0,  # probability that a request gets one of `faults`
    "faults": ["429", "500", "503", "drop", "truncate", "garbage"],
    "chat_404": False,
    "models_404": False,
    "context_limit_words": 0,  # >0: prompts longer than this get a 400 context-length error
    "seed": 0,
}


def words_for(messages: list[dict], kind: str, n: int) -> list[str]:
    """The deterministic text this server answers for a prompt: tests recompute it to check what was stored."""
    h = hashlib.sha256(json.dumps(messages, sort_keys=True, ensure_ascii=False).encode()).hexdigest()
    return [f"{kind}-{h[i % 32: i % 32 + 4]}-{i}" for i in range(n)]


def expected(messages: list[dict], config: dict | None = None) -> tuple[str, str]:
    cfg = {**DEFAULTS, **(config or {})}
    reasoning = " ".join(words_for(messages, "r", cfg["reasoning_words"]))
    content = " ".join(words_for(messages, "c", cfg["content_words"]))
    return reasoning, content


class FakeServer:
    def __init__(self, config: dict):
        self.cfg = {**DEFAULTS, **config}
        self.rng = random.Random(self.cfg["seed"])
        self.slots = asyncio.Semaphore(self.cfg["slots"]) if self.cfg["slots"] else None
        self.requests = 0
        self.completed: dict[str, int] = {}
        self.token_times: list[float] = []
        self.faults_served: dict[str, int] = {}

    async def models(self, request):
        if self.cfg["models_404"]:
            return web.json_response({"detail": "Not Found"}, status=404)
        return web.json_response({"object": "list", "data": [{"id": m, "object": "model", "owned_by": "fake"}
                                                              for m in self.cfg["models"]]})

    async def stats(self, request):
        since = float(request.query.get("since", 0))
        until = float(request.query.get("until", time.time() + 1))
        tokens = sum(1 for t in self.token_times if since <= t < until)
        return web.json_response({"requests": self.requests, "completed": self.completed, "faults": self.faults_served,
                                  "tokens_in_window": tokens, "tokens_total": len(self.token_times)})

    async def chat(self, request):
        self.requests += 1
        if self.cfg["chat_404"]:
            return web.json_response({"detail": "Not Found"}, status=404)
        body = await request.json()
        fault = None
        if self.cfg["fault_rate"] and self.rng.random() < self.cfg["fault_rate"]:
            fault = self.rng.choice(self.cfg["faults"])
            self.faults_served[fault] = self.faults_served.get(fault, 0) + 1
        if fault in ("429", "500", "503"):
            headers = {"Retry-After": "0.05"} if fault == "429" else {}
            return web.json_response({"error": {"message": f"injected {fault}", "code": int(fault)}},
                                     status=int(fault), headers=headers)
        if fault == "garbage":
            return web.Response(text="<html>oops</html>", content_type="application/json")
        if fault == "drop":
            request.transport.close()
            return web.Response()
        messages = body["messages"]
        limit = self.cfg["context_limit_words"]
        if limit and sum(len(str(m.get("content", "")).split()) for m in messages) > limit:
            return web.json_response({"error": {"message": "request exceeds the available context size",
                                                "type": "exceed_context_size_error", "code": 400}}, status=400)
        thinking = any(v for v in (body.get("chat_template_kwargs") or {}).values())
        r_words = words_for(messages, "r", self.cfg["reasoning_words"]) if thinking else []
        c_words = words_for(messages, "c", self.cfg["content_words"])
        budget = int(body.get("max_tokens") or 10**9)
        tokens = [("r", w) for w in r_words] + [("c", w) for w in c_words]
        finish = "stop" if len(tokens) <= budget else "length"
        tokens = tokens[:budget]
        if self.slots:
            async with self.slots:
                return await self._answer(request, body, messages, tokens, finish, fault)
        return await self._answer(request, body, messages, tokens, finish, fault)

    def _pieces(self, tokens):
        """(field, text) per token in the configured reasoning convention."""
        style = self.cfg["reasoning"]
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

    async def _answer(self, request, body, messages, tokens, finish, fault):
        key = hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()[:16]
        pieces = self._pieces(tokens)
        usage = {"prompt_tokens": sum(len(str(m.get("content", "")).split()) for m in messages),
                 "completion_tokens": len(tokens), "total_tokens": 0}
        await asyncio.sleep(self.cfg["ttft_s"])
        base = {"id": f"chatcmpl-{key}", "created": int(time.time()), "model": body.get("model")}
        if not body.get("stream"):
            for _ in tokens:
                await asyncio.sleep(self.cfg["token_delay_s"])
                self.token_times.append(time.time())
            message = {"role": "assistant", "content": "".join(t for f, t in pieces if f == "content")}
            for fld in ("reasoning_content", "reasoning"):
                text = "".join(t for f, t in pieces if f == fld)
                if text:
                    message[fld] = text
            self.completed[key] = self.completed.get(key, 0) + 1
            return web.json_response({**base, "object": "chat.completion", "usage": usage,
                                      "choices": [{"index": 0, "message": message, "finish_reason": finish}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(obj):
            await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

        chunk = {**base, "object": "chat.completion.chunk"}
        await send({**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": None},
                                          "finish_reason": None}]})
        if not self.cfg["token_delay_s"] and fault != "truncate":  # instant: the whole stream in one write
            now = time.time()
            self.token_times.extend([now] * len(pieces))
            events = [{**chunk, "choices": [{"index": 0, "delta": {f: t}, "finish_reason": None}]} for f, t in pieces]
            events.append({**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
            if (body.get("stream_options") or {}).get("include_usage"):
                events.append({**chunk, "choices": [], "usage": usage})
            await resp.write("".join(f"data: {json.dumps(e)}\n\n" for e in events).encode() + b"data: [DONE]\n\n")
            self.completed[key] = self.completed.get(key, 0) + 1
            return resp
        cut = len(pieces) // 2 if fault == "truncate" else None
        for i, (fld, text) in enumerate(pieces):
            if cut is not None and i == cut:
                request.transport.close()  # the stream stops mid-answer: no finish_reason, no [DONE]
                return resp
            await asyncio.sleep(self.cfg["token_delay_s"])
            self.token_times.append(time.time())
            await send({**chunk, "choices": [{"index": 0, "delta": {fld: text}, "finish_reason": None}]})
        await send({**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
        if (body.get("stream_options") or {}).get("include_usage"):
            await send({**chunk, "choices": [], "usage": usage})
        await resp.write(b"data: [DONE]\n\n")
        self.completed[key] = self.completed.get(key, 0) + 1
        return resp


def make_app(config: dict) -> web.Application:
    server = FakeServer(config)
    app = web.Application()
    app.router.add_get("/v1/models", server.models)
    app.router.add_post("/v1/chat/completions", server.chat)
    app.router.add_get("/stats", server.stats)
    app.router.add_get("/health", lambda r: web.json_response({"status": "ok"}))
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
