"""Several real servers: generate spreads the prompts over two llama-server processes listed in server.base_url; one
is SIGKILLed mid-run; every prompt is still done exactly once, and the survivor carried the rest.

Which server answered is read from each llama-server's own counter of generated tokens (its /metrics)."""
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter

import pytest
from omegaconf import OmegaConf

from drafter_data.server.local import default_binary, default_model_path, free_port, healthy, server_command
from tests.conftest import REPO, read_rows, write_prompts

MAX_TOKENS = 8
SLOTS = 2
PROMPTS = 16


def start_llama_server() -> tuple[subprocess.Popen, str]:
    """A small llama-server (2 slots, 1 thread, metrics on) on a free loopback port, in its own process group."""
    local = OmegaConf.load(REPO / "conf/server/local.yaml").local
    local.chat_template = str(REPO / local.chat_template)
    local.slots, local.context, local.threads = SLOTS, 2048, 1
    port = free_port()
    proc = subprocess.Popen(server_command(local, "gemma-3-270m", port) + ["--metrics"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}/v1"


def wait_healthy(servers: list[tuple[subprocess.Popen, str]], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    for proc, url in servers:
        while not healthy(url, timeout=1.0):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"llama-server at {url} did not start (exit code {proc.poll()})")
            time.sleep(0.2)


def tokens_predicted(url: str) -> int:
    with urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=5) as resp:
        return int(float(re.search(r"^llamacpp:tokens_predicted_total (\S+)$", resp.read().decode(), re.M)[1]))


def kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


@pytest.fixture
def two_llama_servers():
    if not default_binary().exists() or not default_model_path().exists():
        pytest.fail(f"llama-server or the model is missing ({default_binary()}, {default_model_path()}): "
                    f"run ./setup.sh first")
    servers = [start_llama_server(), start_llama_server()]
    try:
        wait_healthy(servers)
        yield servers
    finally:
        for proc, _ in servers:
            kill_group(proc)


def kill_once_it_has_answered(victim: tuple[subprocess.Popen, str], generate: subprocess.Popen,
                              answers: int = 2) -> int:
    """SIGKILLs the victim's process group once it has generated `answers` full answers; returns its token count
    just before. Fails if generate ended first (the kill must land mid-run)."""
    proc, url = victim
    deadline = time.monotonic() + 90
    while (done := tokens_predicted(url)) < answers * MAX_TOKENS:
        assert generate.poll() is None, f"generate ended before the kill:\n{generate.stderr.read()}"
        assert time.monotonic() < deadline, "the first server never answered"
        time.sleep(0.05)
    kill_group(proc)
    return done


def test_one_of_two_real_servers_killed_mid_run_every_prompt_once_survivor_carries_the_rest(
        two_llama_servers, tmp_path, mlflow_uri):
    (victim, victim_url), (survivor, survivor_url) = two_llama_servers
    prompts = write_prompts(tmp_path / "in", PROMPTS)
    args = ["server=remote", f"server.base_url=[{victim_url},{survivor_url}]", "server.model=gemma-3-270m",
            f"generate.input={tmp_path / 'in'}", f"generate.output={tmp_path / 'out'}",
            f"generation.max_tokens={MAX_TOKENS}", f"generation.concurrency={2 * SLOTS}"]
    generate = subprocess.Popen([sys.executable, "-m", "stages.generate", *args], cwd=REPO, text=True,
                                env={**os.environ, "MLFLOW_TRACKING_URI": mlflow_uri}, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, start_new_session=True)
    try:
        victim_tokens = kill_once_it_has_answered((victim, victim_url), generate)
        survivor_at_kill = tokens_predicted(survivor_url)
        _, stderr = generate.communicate(timeout=180)
    finally:
        kill_group(generate)
    assert generate.returncode == 0, stderr[-3000:]

    rows = read_rows(tmp_path / "out", "completions-")
    assert Counter(r["prompt_id"] for r in rows) == Counter(p["prompt_id"] for p in prompts), "each prompt once"
    assert (tmp_path / "out" / "errors.jsonl").read_text().strip() == ""
    total = sum(r["completion_tokens"] for r in rows)
    survivor_tokens = tokens_predicted(survivor_url)
    assert victim_tokens + survivor_at_kill < total, "the kill landed after the work was done"
    assert survivor_tokens > survivor_at_kill, "the survivor answered nothing after the kill"
    # everything the victim had not finished when it died, the survivor generated (the victim could at most finish
    # its in-flight answers between the count and the kill)
    assert survivor_tokens >= total - victim_tokens - SLOTS * MAX_TOKENS
    summary = json.loads((tmp_path / "out" / "run.json").read_text())
    assert summary["done_total"] == PROMPTS and summary["failed_total"] == 0
