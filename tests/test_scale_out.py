"""Several real servers: generate spreads the prompts over two llama-server processes listed in server.base_url; one
is SIGKILLed mid-run; every prompt is still done exactly once, and the survivor carried the rest.

Which server answered is read from each llama-server's own counter of generated tokens (its /metrics)."""
import json
import os
import re
import signal
import subprocess
import sys
import threading
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


class GenerateProcess:
    """python -m stages.generate in its own process group, its stderr read as it comes."""

    def __init__(self, args: list[str], mlflow_uri: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "stages.generate", *args], cwd=REPO, text=True,
                                     env={**os.environ, "MLFLOW_TRACKING_URI": mlflow_uri},
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        self.lines: list[str] = []
        self.generating = threading.Event()  # preflight passed, the prompts are being sent
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            if " to generate" in line:
                self.generating.set()

    def stderr(self) -> str:
        return "".join(self.lines)[-3000:]

    def wait_until_generating(self, timeout_s: float = 90) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.generating.wait(0.05):
            assert self.proc.poll() is None, f"generate ended before sending prompts:\n{self.stderr()}"
            assert time.monotonic() < deadline, f"generate never started sending:\n{self.stderr()}"

    def finish(self, timeout_s: float = 180) -> int:
        try:
            self.proc.wait(timeout_s)
        finally:
            kill_group(self.proc)
            self.reader.join(10)
        return self.proc.returncode


def kill_after_answers(victim: tuple[subprocess.Popen, str], generate: GenerateProcess, since: int,
                       answers: int = 2) -> int:
    """SIGKILLs the victim's process group once it has generated `answers` more full answers than `since` tokens;
    returns its count just before. Fails if generate ended first: the kill must land mid-run."""
    proc, url = victim
    deadline = time.monotonic() + 90
    while (done := tokens_predicted(url)) < since + answers * MAX_TOKENS:
        assert generate.proc.poll() is None, f"generate ended before the kill:\n{generate.stderr()}"
        assert time.monotonic() < deadline, "the first server never answered"
        time.sleep(0.05)
    kill_group(proc)
    return done


def test_one_of_two_real_servers_killed_mid_run_every_prompt_once_survivor_carries_the_rest(
        two_llama_servers, tmp_path, mlflow_uri):
    (victim, victim_url), (survivor, survivor_url) = two_llama_servers
    prompts = write_prompts(tmp_path / "in", PROMPTS)
    generate = GenerateProcess(["server=remote", f"server.base_url=[{victim_url},{survivor_url}]",
                                "server.model=gemma-3-270m", f"generate.input={tmp_path / 'in'}",
                                f"generate.output={tmp_path / 'out'}", f"generation.max_tokens={MAX_TOKENS}",
                                f"generation.concurrency={2 * SLOTS}"], mlflow_uri)
    try:
        generate.wait_until_generating()
        # what preflight made each server generate is not part of the job
        victim_base, survivor_base = tokens_predicted(victim_url), tokens_predicted(survivor_url)
        victim_work = kill_after_answers((victim, victim_url), generate, victim_base) - victim_base
        survivor_at_kill = tokens_predicted(survivor_url) - survivor_base
    finally:
        returncode = generate.finish()
    assert returncode == 0, generate.stderr()

    rows = read_rows(tmp_path / "out", "completions-")
    assert Counter(r["prompt_id"] for r in rows) == Counter(p["prompt_id"] for p in prompts), "each prompt once"
    assert (tmp_path / "out" / "errors.jsonl").read_text().strip() == ""
    total = sum(r["completion_tokens"] for r in rows)
    survivor_work = tokens_predicted(survivor_url) - survivor_base
    assert victim_work + survivor_at_kill < total, "the kill landed after the work was done"
    assert survivor_work > survivor_at_kill, "the survivor answered nothing after the kill"
    # Everything the victim had not finished when it died, the survivor generated. Slack: answers in flight at the
    # victim when its count was read (at the start and at the kill) may land on either side.
    assert survivor_work >= total - victim_work - 2 * SLOTS * MAX_TOKENS
    summary = json.loads((tmp_path / "out" / "run.json").read_text())
    assert summary["done_total"] == PROMPTS and summary["failed_total"] == 0
