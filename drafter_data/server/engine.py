"""Which engine serves a URL, from the endpoints only that engine has: llama-server's GET /props, SGLang's
GET /server_info (older: /get_server_info), vLLM's GET /version. A few cheap GETs with a short timeout, each sent
again (at once, twice at most) when its connection was lost without an answer: llama-server closes a kept-alive
connection now and then as it is reused, and taken for "unknown" its run went on without token ids. Anything else
unexpected (a timeout, a 5xx, a proxy that forwards only /v1, an auth wall, another engine) is "unknown" at once,
never an error, so a gateway that holds or rate-limits these paths costs seconds, not minutes. Where the engine says
how many requests it runs at once (llama-server's /props total_slots, SGLang's max_running_requests when it was
set and it runs one scheduler), that is its `slots`: concurrency=auto climbs no higher, as more only wait in the
server's queue."""
from __future__ import annotations

from dataclasses import dataclass

import openai
from openai import AsyncOpenAI

from drafter_data.server.endpoints import api_root

PROBE_TIMEOUT_S = 5.0
LOST_CONNECTION_RETRIES = 2


@dataclass(frozen=True)
class Engine:
    name: str  # llama-server, sglang, vllm or unknown
    slots: int | None = None  # the requests it runs at once, where it says


async def detect_engine(client: AsyncOpenAI) -> Engine:
    quick = client.with_options(timeout=PROBE_TIMEOUT_S, max_retries=0)
    root = api_root(str(client.base_url))
    props = await _get_json(quick, f"{root}/props")
    if "default_generation_settings" in props or "build_info" in props:
        return Engine("llama-server", _count(props.get("total_slots")))
    for path in ("/server_info", "/get_server_info"):
        info = await _get_json(quick, root + path)
        if "version" in info and any(k in info for k in ("tp_size", "model_path", "internal_states")):
            # max_running_requests is per scheduler; with data parallelism there are dp_size of them (or, with DP
            # attention, it is divided among them): what the whole server runs is not said plainly, so not used
            single = info.get("dp_size", 1) in (1, None)
            return Engine("sglang", _count(info.get("max_running_requests")) if single else None)
    version = await _get_json(quick, f"{root}/version")
    if isinstance(version.get("version"), str):
        return Engine("vllm")
    return Engine("unknown")


def _count(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


async def _get_json(client: AsyncOpenAI, url: str) -> dict:
    for attempt in range(LOST_CONNECTION_RETRIES + 1):
        try:
            found = await client.get(url, cast_to=object)
        except openai.APIConnectionError as exc:  # a timeout is one too: not sent again
            if isinstance(exc, openai.APITimeoutError) or attempt == LOST_CONNECTION_RETRIES:
                return {}
            continue
        except (openai.APIError, ValueError):
            return {}
        return found if isinstance(found, dict) else {}
