"""The generate stage against servers that misbehave in the ways real engines do (aborted answers, errors inside a 200
stream, absurd Retry-After, a key or model that goes away mid-run, credentials in the URL), tool calls end to end,
and the exact token ids of vLLM (the fake, K2.6 ids) and of the real llama-server."""
import hashlib
import json
import os
import subprocess
import sys
import time
import urllib.request

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import KIMI_DIR, REPO, read_rows, require_shared, write_prompts
from tests.fake_openai_server import (expected, expected_ids, expected_prompt_ids, expected_tool_call, is_split,
                                      request_key)

TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a word up",
                                            "parameters": {"type": "object",
                                                           "properties": {"arg": {"type": "string"}}}}}]


def gen_args(url, inp, out, *extra):
    return ["server=remote", f"server.base_url={url}", "server.model=fake-model", "target=kimi-k2.6",
            f"generate.input={inp}", f"generate.output={out}", "generation.concurrency=8", *extra]


def run_json(out) -> dict:
    return json.loads((out / "run.json").read_text())


def errors(out) -> list[dict]:
    return [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]


def post_config(server, update: dict) -> None:
    req = urllib.request.Request(f"http://127.0.0.1:{server.port}/config", data=json.dumps(update).encode(),
                                 headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=10).read()


def received(server) -> list[dict]:
    return [r["body"] for r in server.requests()]


def last_line(proc) -> str:
    return proc.stderr.strip().splitlines()[-1]


# --- 10.5: only real endings are completions -----------------------------------------------------------------------

@pytest.mark.parametrize("stream", [True, False])
def test_aborted_answers_are_retried_never_stored(run_stage, fake_server, tmp_path, stream):
    server = fake_server({"fault_rate": 0.4, "faults": ["abort"], "seed": 5})
    prompts = write_prompts(tmp_path / "in", 30)
    run_stage("generate", *gen_args(server.url, tmp_path / "in", tmp_path / "out", "generate.max_attempts=30",
                                    "generation.token_ids=off", f"generate.stream={stream}"))
    rows = read_rows(tmp_path / "out", "completions-")
    assert sorted(r["prompt_id"] for r in rows) == sorted(p["prompt_id"] for p in prompts)
    for r in rows:
        assert r["finish_reason"] == "stop" and (r["reasoning"], r["content"]) == expected(r["messages"])
    aborts = server.stats()["faults"]["abort"]
    assert aborts >= 5 and run_json(tmp_path / "out")["retries"] >= aborts - 5  # a few hit the preflight probe
    assert errors(tmp_path / "out") == []


# --- 10.6: every wait is bounded -----------------------------------------------------------------------------------

@pytest.mark.parametrize("headers", [{"retry_after": "86400"}, {"retry_after": "inf"},
                                     {"retry_after": "nan", "retry_after_ms": "1e12"}])
def test_absurd_retry_after_waits_at_most_max_backoff(run_stage, fake_server, tmp_path, headers):
    # seed 1: the first two chat requests (preflight's probe) are 429s, and so are half of the rest
    server = fake_server({"fault_rate": 0.5, "faults": ["429"], "seed": 1, **headers})
    prompts = write_prompts(tmp_path / "in", 20)
    t0 = time.monotonic()
    run_stage("generate", *gen_args(server.url, tmp_path / "in", tmp_path / "out", "generate.max_backoff_s=0.5",
                                    "generate.max_attempts=30", "generation.token_ids=off"), timeout=100)
    assert time.monotonic() - t0 < 45
    assert len(read_rows(tmp_path / "out", "completions-")) == len(prompts)
    assert server.stats()["faults"]["429"] >= 10


# --- 10.8: errors inside a 200 stream ------------------------------------------------------------------------------

def test_a_context_error_inside_the_stream_fails_after_one_attempt(run_stage, fake_server, tmp_path):
    server = fake_server({"context_limit_words": 5, "context_error_in_stream": True})
    short = write_prompts(tmp_path / "in", 4, words=3)
    write_prompts(tmp_path / "long", 3, words=12, start=100)
    os.replace(tmp_path / "long" / "prompts-00000.parquet", tmp_path / "in" / "prompts-00001.parquet")
    run_stage("generate", *gen_args(server.url, tmp_path / "in", tmp_path / "out", "generation.token_ids=off"))
    assert len(read_rows(tmp_path / "out", "completions-")) == len(short)
    failed = errors(tmp_path / "out")
    assert len(failed) == 3
    for e in failed:
        assert e["attempts"] == 1 and "maximum context length" in e["reason"] and "code 400" in e["reason"]
    assert server.stats()["requests"] <= len(short) + 3 + 6  # the long ones once each (+ preflight's probes)


# --- 10.4: run-wide faults stop the run ----------------------------------------------------------------------------

def start_generate(args, mlflow_uri, env=None):
    full_env = {**os.environ, "MLFLOW_TRACKING_URI": mlflow_uri, **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "stages.generate", *args], cwd=REPO, env=full_env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_for_completions(server, n, proc, timeout=60):
    deadline = time.monotonic() + timeout
    while sum(server.stats()["completed"].values()) < n:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "slow"
        time.sleep(0.05)


@pytest.mark.parametrize("change,needle", [
    ({"api_key": "rotated-elsewhere"}, "DRAFTER_TEST_KEY"),
    ({"models": ["renamed-after-restart"], "check_model": True}, "does not serve the model 'fake-model'"),
])
def test_a_key_or_model_gone_mid_run_stops_the_run_in_one_line(fake_server, tmp_path, mlflow_uri, change, needle):
    server = fake_server({"token_delay_s": 0.01, "api_key": "sekrit-value-42"})
    write_prompts(tmp_path / "in", 300)
    args = gen_args(server.url, tmp_path / "in", tmp_path / "out", "server.api_key_env=DRAFTER_TEST_KEY",
                    "generation.token_ids=off")
    proc = start_generate(args, mlflow_uri, {"DRAFTER_TEST_KEY": "sekrit-value-42"})
    wait_for_completions(server, 20, proc)
    post_config(server, change)
    assert proc.wait(60) == 1
    stderr = proc.stderr.read()
    line = stderr.strip().splitlines()[-1]
    assert needle in line and "in a row" in line and "sekrit-value-42" not in stderr
    saved = read_rows(tmp_path / "out", "completions-")
    assert 10 <= len(saved) < 300  # what finished is kept; the rest was not burned into errors.jsonl
    assert len(errors(tmp_path / "out")) == 0


def test_a_rejected_key_at_start_names_the_variable(run_stage, fake_server, tmp_path):
    server = fake_server({"api_key": "the-right-one"})
    write_prompts(tmp_path / "in", 3)
    proc = run_stage("generate", *gen_args(server.url, tmp_path / "in", tmp_path / "out",
                                           "server.api_key_env=DRAFTER_TEST_KEY"),
                     check=False, env={"DRAFTER_TEST_KEY": "an-old-key-value"})
    assert proc.returncode == 1
    assert "HTTP 401" in last_line(proc) and "DRAFTER_TEST_KEY" in last_line(proc)
    assert "an-old-key-value" not in proc.stderr


# --- 10.18: secrets never reach logs or outputs --------------------------------------------------------------------

def test_credentials_in_the_base_url_stay_out_of_messages_and_outputs(run_stage, fake_server, tmp_path):
    from drafter_data.server.local import free_port

    write_prompts(tmp_path / "in", 3)
    nothing = f"http://bob:hunter2@127.0.0.1:{free_port()}/v1"
    proc = run_stage("generate", *gen_args(nothing, tmp_path / "in", tmp_path / "x"), check=False)
    assert proc.returncode == 1 and "cannot reach the server at http://127.0.0.1:" in last_line(proc)
    assert "hunter2" not in proc.stderr
    server = fake_server({"fault_rate": 0.3, "faults": ["500", "abort"], "seed": 1})
    url = server.url.replace("http://", "http://bob:hunter2@")
    proc = run_stage("generate", *gen_args(url, tmp_path / "in", tmp_path / "out", "generate.max_attempts=2"))
    assert "hunter2" not in proc.stderr
    for path in (tmp_path / "out").rglob("*"):
        if path.is_file():
            assert b"hunter2" not in path.read_bytes(), path


@pytest.mark.parametrize("value", ["sk-proj-abcdef0123456789", "my key"])
def test_a_key_pasted_as_api_key_env_is_refused_without_echoing_it(run_stage, fake_server, tmp_path, value):
    server = fake_server()
    write_prompts(tmp_path / "in", 2)
    proc = run_stage("generate", *gen_args(server.url, tmp_path / "in", tmp_path / "out",
                                           f"server.api_key_env='{value}'"), check=False)
    assert proc.returncode == 1 and "server.api_key_env must be the NAME" in last_line(proc)
    assert value not in proc.stderr


# --- 12.3: tool calls in, tool calls out ---------------------------------------------------------------------------

def write_tool_prompts(directory, n: int) -> list[dict]:
    from drafter_data.contract import PROMPTS

    rows = []
    for i in range(n):
        messages = [{"role": "user", "content": f"look up word number {i}"}]
        rows.append({"prompt_id": hashlib.sha256(str(messages).encode()).hexdigest()[:32], "source": "test",
                     "messages": messages, "tools": json.dumps(TOOLS)})
    directory.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=PROMPTS), directory / "prompts-00000.parquet")
    return rows


@pytest.mark.parametrize("stream", [True, False])
def test_tool_calls_are_sent_and_stored_in_openai_form(run_stage, fake_server, tmp_path, stream):
    server = fake_server({"tool_calls": True})
    prompts = write_tool_prompts(tmp_path / "in", 6)
    run_stage("generate", *gen_args(server.url, tmp_path / "in", tmp_path / "out", f"generate.stream={stream}"))
    rows = read_rows(tmp_path / "out", "completions-")
    assert len(rows) == len(prompts)
    for r in rows:
        assert r["finish_reason"] == "tool_calls"
        assert json.loads(r["tool_calls"]) == [expected_tool_call(r["messages"], TOOLS)]
    assert all(b["tools"] == TOOLS for b in received(server) if "look up" in b["messages"][-1]["content"])


# --- 11.1: exact token ids -----------------------------------------------------------------------------------------

def sent_kwargs(server) -> dict:
    """chat_template_kwargs per prompt, as the server received them (the target's own kwargs included)."""
    return {request_key(b["messages"]): b.get("chat_template_kwargs") for b in received(server)}


@pytest.mark.parametrize("stream", [True, False])
def test_vllm_ids_are_stored_exactly_as_the_server_sampled_them(run_stage, fake_server, tmp_path, stream):
    config = {"token_ids": "vllm", "tokenizer_dir": str(require_shared(KIMI_DIR)), "split_token_every": 3,
              "engine": "vllm"}
    server = fake_server(config)
    prompts = write_prompts(tmp_path / "in", 12)
    proc = run_stage("generate", *gen_args(server.url, tmp_path / "in", tmp_path / "out", "generation.token_ids=on",
                                           f"generate.stream={stream}"))
    assert "returns them via return_token_ids" in proc.stderr
    rows = read_rows(tmp_path / "out", "completions-")
    assert len(rows) == len(prompts)
    kwargs = sent_kwargs(server)
    assert any(is_split(r["messages"], config) for r in rows)  # some prompts were sampled non-canonically
    for r in rows:
        sent = kwargs[request_key(r["messages"])]
        assert r["completion_token_ids"] == expected_ids(r["messages"], config, chat_template_kwargs=sent)
        assert r["prompt_token_ids"] == expected_prompt_ids(r["messages"], config, chat_template_kwargs=sent)
        assert len(r["completion_token_ids"]) == r["completion_tokens"]
        assert len(r["prompt_token_ids"]) == r["prompt_tokens"]


def test_token_ids_on_against_a_server_without_them_fails_in_preflight(run_stage, fake_server, tmp_path):
    server = fake_server()
    write_prompts(tmp_path / "in", 5)
    t0 = time.monotonic()
    proc = run_stage("generate", *gen_args(server.url, tmp_path / "in", tmp_path / "out", "generation.token_ids=on"),
                     check=False)
    assert proc.returncode == 1 and time.monotonic() - t0 < 60
    line = last_line(proc)
    assert "generation.token_ids=on" in line and server.url in line and "tried" in line
    assert not read_rows(tmp_path / "out", "completions-") if (tmp_path / "out").exists() else True
    probes = [b for b in received(server) if b["messages"][-1]["content"] != "Say hello."]
    assert probes == []  # no prompt was sent


def test_ids_shorter_than_usage_are_never_stored(run_stage, fake_server, tmp_path):
    """auto against a server whose ids miss the stop token: preflight sees it and goes on without ids (said in one
    line), so no row carries partial ids."""
    server = fake_server({"token_ids": "vllm", "tokenizer_dir": str(require_shared(KIMI_DIR)),
                          "drop_end_ids": True, "reasoning_words": 1, "content_words": 1})
    write_prompts(tmp_path / "in", 4)
    proc = run_stage("generate", *gen_args(server.url, tmp_path / "in", tmp_path / "out", "generation.token_ids=auto"))
    assert "completions are stored without ids" in proc.stderr
    for r in read_rows(tmp_path / "out", "completions-"):
        assert r["completion_token_ids"] is None and r["prompt_token_ids"] is None


def real_args(url, *extra):
    return ["server=remote", f"server.base_url={url}", "server.model=gemma-3-270m", "target=gemma3-270m", *extra]


@pytest.mark.parametrize("stream", [True, False])
def test_llama_server_ids_match_its_usage_exactly(run_stage, llama_server, tmp_path, stream):
    from drafter_data.server.endpoints import api_root
    from drafter_data.tokens.tokenizers import ServerTokenizer

    write_prompts(tmp_path / "in", 6)
    proc = run_stage("generate", *real_args(llama_server, f"generate.input={tmp_path / 'in'}",
                                            f"generate.output={tmp_path / 'c'}", "generation.max_tokens=24",
                                            "generation.concurrency=4", "generation.token_ids=on",
                                            f"generate.stream={stream}"))
    assert "(llama-server) returns them via llama-server's return_tokens" in proc.stderr
    rows = read_rows(tmp_path / "c", "completions-")
    assert len(rows) == 6
    tok = ServerTokenizer(api_root(llama_server))
    for r in rows:
        assert len(r["completion_token_ids"]) == r["completion_tokens"] > 0
        assert len(r["prompt_token_ids"]) == r["prompt_tokens"] and r["prompt_token_ids"][0] == 2  # <bos>
        rendered = tok.apply_template(r["messages"], enable_thinking=True)
        assert r["prompt_token_ids"] == [2] + tok.encode_chat(rendered)
        if r["finish_reason"] == "stop":
            assert r["completion_token_ids"][-1] == 1  # <eos>, which a streamed logprob list leaves out
