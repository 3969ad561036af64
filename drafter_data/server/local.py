"""The embedded default server: llama.cpp's llama-server on loopback, started for a stage and stopped after it; or,
with server.local.engine=vllm (experiment=vllm-local), vLLM's OpenAI server on the same model converted
(drafter_data/server/vllm_local.py), started and stopped the same way.

`python -m drafter_data.server.local --setup` assembles the GGUF into the cache (setup.sh calls it);
`local_server(cfg)` reuses a healthy server already at server.base_url only when its GET /props shows the configured
model file, alias, chat template and context (one left by a killed run); anything else there (somebody else's
server, another model or template) is left alone and our own is started on a free port. Ours runs in its own process
group, so the whole group is stopped on exit, Ctrl-C or error. Stages reach it through `serving.servers`.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse

from drafter_data.errors import StageError
from drafter_data.worker_processes import dies_with_this_process
from drafter_data.redaction import redact_url
from drafter_data.server.cache import assemble_model, cache_dir, default_model_path  # noqa: F401 - also used here
from drafter_data.server.endpoints import api_root
from drafter_data.server import vllm_local

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
BUILD_TAG = "noamx"  # as scripts/build_llama_server.sh names its cache (a change of build flags builds again)


def default_binary() -> Path:
    return cache_dir() / f"llama-server-{LLAMA_CPP_PYTHON_VERSION}-{BUILD_TAG}" / "llama-server"


def healthy(base_url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{api_root(base_url)}/health", timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def props(base_url: str, timeout: float = 5.0) -> dict | None:
    """llama-server's GET /props (model file, alias, chat template, context per slot), None if not answered."""
    try:
        with urllib.request.urlopen(f"{api_root(base_url)}/props", timeout=timeout) as resp:
            found = json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def engine_of(local) -> str:
    return str(local.get("engine") or "llama-server")


def vllm_foreign_reason(base_url: str, server_cfg) -> str | None:
    """Why the server at base_url is not the vLLM this config would start (by its GET /v1/models: the served name,
    the model directory as its root, the context as max_model_len); None when it is."""
    try:
        with urllib.request.urlopen(f"{base_url.rstrip('/')}/models", timeout=5.0) as resp:
            models = json.loads(resp.read()).get("data") or []
    except (urllib.error.URLError, OSError, ValueError, AttributeError):
        return "it does not answer GET /v1/models"
    local = server_cfg.local
    found = {m.get("id"): m for m in models if isinstance(m, dict)}.get(str(server_cfg.model))
    if found is None:
        return f"it does not serve {server_cfg.model!r}"
    model = os.path.realpath(local.get("model_path") or vllm_local.checkpoint_dir())
    if os.path.realpath(str(found.get("root") or "")) != model:
        return f"it serves {found.get('root')}, not {model}"
    if found.get("max_model_len") != int(local.get("context", 2048)):
        return f"its max_model_len is {found.get('max_model_len')}, not the configured {local.get('context')}"
    return None


def foreign_reason(base_url: str, server_cfg) -> str | None:
    """Why the server at base_url is not the server this config would start; None when it is."""
    if engine_of(server_cfg.local) == "vllm":
        return vllm_foreign_reason(base_url, server_cfg)
    found = props(base_url)
    if found is None:
        return "it does not answer llama-server's GET /props"
    local = server_cfg.local
    model = os.path.realpath(local.get("model_path") or default_model_path())
    if os.path.realpath(str(found.get("model_path") or "")) != model:
        return f"it serves the model file {found.get('model_path')}, not {model}"
    if found.get("model_alias") != str(server_cfg.model):
        return f"it serves the model as {found.get('model_alias')!r}, not {server_cfg.model!r}"
    template = local.get("chat_template")
    if template and str(found.get("chat_template") or "").strip() != template_text(template).strip():
        return f"its chat template is not {template}"
    per_slot = (found.get("default_generation_settings") or {}).get("n_ctx") or 0
    wanted = int(local.get("context", 32768)) // int(local.get("slots", 16))
    if per_slot < wanted:
        return f"its context is {per_slot} tokens per slot, less than the configured {wanted}"
    return None


def template_text(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise StageError(f"cannot read the chat template {path} (server.local.chat_template): {exc}") from None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds: TIME_WAIT is no obstacle
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def server_command(local, model_alias: str, port: int) -> list[str]:
    """llama-server's argv for server.local (engine: llama-server)."""
    binary = Path(local.get("binary") or default_binary())
    model = Path(local.get("model_path") or default_model_path())
    if not binary.exists():
        raise StageError(f"llama-server not found at {binary}; run ./setup.sh (it builds and caches it) "
                         f"or set server.local.binary")
    if not model.exists():
        raise StageError(f"model file not found at {model}; run ./setup.sh or set server.local.model_path")
    cmd = [str(binary), "-m", str(model), "-a", model_alias, "--host", "127.0.0.1", "--port", str(port),
           "-c", str(local.get("context", 32768)), "-np", str(local.get("slots", 16)),
           "-t", str(local.get("threads", 2)), "--no-webui"]
    if local.get("chat_template"):
        cmd += ["--chat-template-file", str(Path(local.chat_template).resolve())]
    return cmd


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(15)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


def command(local, model_alias: str, port: int) -> tuple[list[str], dict]:
    """(argv, extra environment) of the configured engine."""
    if engine_of(local) == "vllm":
        return vllm_local.server_command(local, model_alias, port)
    return server_command(local, model_alias, port), {}


def start(local, model_alias: str, port: int, log_path: Path | None = None) -> tuple[subprocess.Popen, str]:
    cmd, extra_env = command(local, model_alias, port)
    name = engine_of(local)
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env={**os.environ, **extra_env} if extra_env else None,
                            start_new_session=True, preexec_fn=dies_with_this_process())
    base_url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + float(local.get("startup_timeout_s", 60))
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise StageError(f"{name} exited with code {proc.returncode} at start-up: {' '.join(cmd)}"
                                 + (f" (log: {log_path})" if log_path else ""))
            if healthy(base_url, timeout=1.0):
                return proc, base_url
            time.sleep(0.2)
    except BaseException:  # Ctrl-C or SIGTERM while it starts: it must not outlive us
        stop(proc)
        raise
    stop(proc)
    raise StageError(f"{name} did not become healthy within {local.get('startup_timeout_s', 60)} s on port "
                     f"{port}")


@contextmanager
def local_server(server_cfg, log_path: Path | None = None):
    """Yields the base URL of the embedded server (llama-server, or vLLM): the one already answering at server.base_url if it is what
    this config would start, else our own."""
    configured = str(server_cfg.base_url).rstrip("/")
    port = urlparse(configured).port or 8123
    if healthy(configured):
        reason = foreign_reason(configured, server_cfg)
        if reason is None:
            print(f"reusing the {engine_of(server_cfg.local)} at {redact_url(configured)} (same model, alias, "
                  f"template, context)",
                  file=sys.stderr)
            yield configured
            return
        port = free_port()
        print(f"not reusing the server at {redact_url(configured)}: {reason}; starting our own on port {port}",
              file=sys.stderr)
    elif not _port_free(port):
        port = free_port()
    proc, base_url = start(server_cfg.local, server_cfg.model, port, log_path)
    print(f"started {engine_of(server_cfg.local)} (pid {proc.pid}) at {base_url}", file=sys.stderr)
    try:
        yield base_url
    finally:
        stop(proc)


if __name__ == "__main__":
    if sys.argv[1:] == ["--setup"]:
        print(f"model: {assemble_model()}")
        binary = default_binary()
        print(f"llama-server: {binary}" if binary.exists() else f"llama-server: missing at {binary}")
    else:
        print("usage: python -m drafter_data.server.local --setup", file=sys.stderr)
        sys.exit(2)
