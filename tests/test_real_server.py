"""generate, assess and tokenize against a real OpenAI-compatible server: llama.cpp's llama-server + Gemma 3 270M.
The model is a base model: its words are not sensible, so the checks are on shapes, counts and token accounting."""
import json
import urllib.request

from omegaconf import OmegaConf

from drafter_data.server.endpoints import api_root
from drafter_data.tokens.conversation import ConversationTokenizer
from drafter_data.tokens.tokenizers import ServerTokenizer
from tests.conftest import REPO, read_rows, write_prompts


def real_args(url, *extra):
    return ["server=remote", f"server.base_url={url}", "server.model=gemma-3-270m", "target=gemma3-270m", *extra]


def test_generate_then_tokenize_against_llama_server(run_stage, llama_server, tmp_path):
    prompts = write_prompts(tmp_path / "in", 8)
    run_stage("generate", *real_args(llama_server, f"generate.input={tmp_path / 'in'}",
                                     f"generate.output={tmp_path / 'c'}", "generation.max_tokens=24",
                                     "generation.concurrency=4"))
    rows = read_rows(tmp_path / "c", "completions-")
    assert sorted(r["prompt_id"] for r in rows) == sorted(p["prompt_id"] for p in prompts)
    for r in rows:
        # the prompt opened <think> and the server's template split the reasoning out (reasoning_content)
        assert r["reasoning"] and r["finish_reason"] in ("stop", "length") and 0 < r["completion_tokens"] <= 24
        assert r["prompt_tokens"] > 0 and r["thinking"] is True and r["model"] == "gemma-3-270m"
    # the drift limit is not what this test checks: on its synthetic prompts ~2% of rows are non-canonical samples
    # (e.g. "<", "b", ">" for "<b>"), so one row in eight would cross the default limit by chance
    run_stage("tokenize", *real_args(llama_server, f"tokenize.input={tmp_path / 'c'}",
                                     f"tokenize.output={tmp_path / 't'}", "tokenize.max_drift_rate=1"))
    tokens = {r["prompt_id"]: r for r in read_rows(tmp_path / "t")}
    assert set(tokens) == {r["prompt_id"] for r in rows}
    think = ServerTokenizer(api_root(llama_server)).encode_chat("<think>\n")
    for r in rows:
        t = tokens[r["prompt_id"]]
        start = t["loss_mask"].index(1)
        assert set(t["loss_mask"][start:]) == {1} and len(t["loss_mask"]) == len(t["input_ids"])
        # the context is exactly the prompt the server saw, its "<think>\n" included (prefilled: context, not loss);
        # the loss is exactly the ids the server sampled
        assert start == r["prompt_tokens"] == len(r["prompt_token_ids"])
        assert t["input_ids"][:start] == r["prompt_token_ids"] and r["prompt_token_ids"][-len(think):] == think
        assert t["input_ids"][start:] == r["completion_token_ids"] and len(r["completion_token_ids"]) == \
            r["completion_tokens"]
    meta = json.loads((tmp_path / "t" / "meta.json").read_text())
    assert meta["drift"]["rows_compared"] == 8 and meta["prompt_ids"]["rows_differ"] == 0
    assert meta["special_ids"]["mask_token_id"] == 4 and meta["vocab_size"] == 262144
    assert list(meta["tokenizer"]["files_sha256"]) == ["gemma-3-270m-q4_k_m.gguf"]


def test_our_rendering_is_the_servers(llama_server):
    target = OmegaConf.load(REPO / "conf/target/gemma3-270m.yaml")
    target.chat_template = str(REPO / target.chat_template)
    tok = ServerTokenizer(api_root(llama_server))
    conv = ConversationTokenizer(target, tok, {"enable_thinking": True})
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime number."}]
    ours = conv.render(messages, add_generation_prompt=True)
    theirs = tok.apply_template(messages, enable_thinking=True)
    assert ours == "<bos>" + theirs and theirs.endswith("<start_of_turn>model\n<think>\n")


def test_assess_against_llama_server(run_stage, llama_server, tmp_path):
    run_stage("assess", *real_args(llama_server, f"assess.output={tmp_path / 'a'}", "assess.concurrency=[1,4]",
                                   "assess.requests_per_level=8", "generation.max_tokens=16",
                                   f"assess.input={tmp_path / 'none'}"))
    metrics = json.loads((tmp_path / "a" / "metrics.json").read_text())
    one, four = metrics["levels"]
    assert one["output_tokens_per_s"] > 0 and four["output_tokens_per_s"] > 0 and four["ttft_p50_s"] is not None
    best = max(metrics["levels"], key=lambda lv: lv["output_tokens_per_s"])
    assert metrics["best"] == best and metrics["projection"]["hours"] > 0
    with urllib.request.urlopen(llama_server.removesuffix("/v1") + "/health") as resp:
        assert resp.status == 200


def test_server_local_starts_and_stops_llama_server_itself(run_stage, tmp_path):
    import subprocess

    from drafter_data.server.local import free_port

    write_prompts(tmp_path / "in", 3)
    url = f"http://127.0.0.1:{free_port()}/v1"
    proc = run_stage("generate", "server=local", f"server.base_url={url}", "server.local.slots=2",
                     "server.local.context=4096", f"generate.input={tmp_path / 'in'}",
                     f"generate.output={tmp_path / 'c'}", "generation.max_tokens=8")
    assert "started llama-server" in proc.stderr and len(read_rows(tmp_path / "c", "completions-")) == 3
    port = url.rsplit(":", 1)[1].split("/")[0]
    left = subprocess.run(["pgrep", "-f", f"llama-server.*--port {port}"], capture_output=True, text=True)
    assert left.stdout.strip() == "", "llama-server was left running"


def test_sigterm_before_the_run_loop_still_stops_our_llama_server(tmp_path, mlflow_uri):
    """SIGTERM while the stage starts its server or runs preflight (before generate's own signal handling) unwinds
    like Ctrl-C: the llama-server the stage started is stopped."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from drafter_data.server.local import free_port, healthy

    write_prompts(tmp_path / "in", 3)
    url = f"http://127.0.0.1:{free_port()}/v1"
    proc = subprocess.Popen([sys.executable, "-m", "stages.generate", "server=local", f"server.base_url={url}",
                             "server.local.slots=2", "server.local.context=4096", f"generate.input={tmp_path / 'in'}",
                             f"generate.output={tmp_path / 'c'}"], cwd=REPO,
                            env={**os.environ, "MLFLOW_TRACKING_URI": mlflow_uri}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not healthy(url, timeout=0.5):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "timeout"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # the stage only: its server runs in a session of its own
    assert proc.wait(60) == 128 + signal.SIGTERM
    deadline = time.monotonic() + 15
    while healthy(url, timeout=0.5):
        assert time.monotonic() < deadline, "the stage's llama-server was left running"
        time.sleep(0.2)
