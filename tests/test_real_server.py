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
    proc = run_stage("generate", *real_args(llama_server, f"generate.input={tmp_path / 'in'}",
                                            f"generate.output={tmp_path / 'c'}", "generation.max_tokens=24",
                                            "generation.concurrency=4"))
    assert "without its token counts" not in proc.stderr  # llama-server streams its usage when asked
    rows = read_rows(tmp_path / "c", "completions-")
    assert sorted(r["prompt_id"] for r in rows) == sorted(p["prompt_id"] for p in prompts)
    assert [r["token_ids_via"] for r in rows] == ["llama_tokens"] * 8, proc.stderr[-3000:]
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
    code = proc.wait(60)
    assert code == 128 + signal.SIGTERM, proc.stderr.read()
    deadline = time.monotonic() + 15
    while healthy(url, timeout=0.5):
        assert time.monotonic() < deadline, "the stage's llama-server was left running"
        time.sleep(0.2)


def test_whole_conversations_are_regenerated_turn_by_turn_on_llama_server(run_stage, llama_server, tmp_path):
    """prepare.turns=all on the sample prompts, then its multi-turn conversations through the real server: every turn
    is regenerated on the target's own earlier answers, and tokenize trains each turn on exactly what it was sent.
    The embedded model is a base model that never stops by itself: a bias on its end-of-turn token (106) makes its
    answers end, so that later turns happen at all."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    run_stage("prepare", "prepare.turns=all", f"prepare.output={tmp_path / 'p'}")
    prompts = pq.read_table(next((tmp_path / "p").glob("prompts-*.parquet")))
    assert prompts.num_rows == 54 and sum(prompts.column("turns").to_pylist()) == 66
    multi = prompts.filter(pa.compute.greater(prompts.column("turns"), 1))
    (tmp_path / "multi").mkdir()
    pq.write_table(multi, tmp_path / "multi" / "prompts-00000.parquet")
    proc = run_stage("generate", *real_args(llama_server, f"generate.input={tmp_path / 'multi'}",
                                            f"generate.output={tmp_path / 'c'}", "generation.max_tokens=96",
                                            "generation.logit_bias={106:16}", "generation.concurrency=8"))
    rows = read_rows(tmp_path / "c", "completions-")
    assert all(r["token_ids_via"] == "llama_tokens" for r in rows), proc.stderr[-3000:]
    by_turn = {(r["prompt_id"], r["turn"]): r for r in rows}
    assert len(by_turn) == len(rows)  # each (prompt_id, turn) once
    summary = json.loads((tmp_path / "c" / "run.json").read_text())
    later = [r for r in rows if r["turn"] > 0]
    assert later, f"no conversation got past its first turn: {summary}"
    for r in later:
        before = by_turn[(r["prompt_id"], r["turn"] - 1)]
        assert before["finish_reason"] == "stop"  # a cut turn ends its conversation
        answers = [m["content"] for m in r["messages"] if m["role"] == "assistant"]
        assert len(answers) == r["turn"] and answers[-1] == before["content"]  # the target's own answer, verbatim
        assert r["messages"][:len(before["messages"])] == before["messages"]
    for conv in {r["prompt_id"] for r in rows}:
        turns = sorted(t for p, t in by_turn if p == conv)
        last = by_turn[(conv, turns[-1])]
        assert turns == list(range(len(turns)))
        assert len(turns) == last["turns"] or last["finish_reason"] == "length"
    # 20 turns asked for; what was not made was stopped by a length cut, counted
    assert summary["completions"] + sum(by_turn[(c, max(t for p, t in by_turn if p == c))]["turns"] - 1 -
                                        max(t for p, t in by_turn if p == c) for c in {p for p, _ in by_turn}) == 20
    run_stage("tokenize", *real_args(llama_server, f"tokenize.input={tmp_path / 'c'}",
                                     f"tokenize.output={tmp_path / 't'}", "tokenize.max_drift_rate=1"))
    tokens = {(t["prompt_id"], t["turn"]): t for t in read_rows(tmp_path / "t")}
    meta = json.loads((tmp_path / "t" / "meta.json").read_text())
    # an answer that is nothing but the end-of-turn token renders without the <think> the prompt ended with: the
    # template's output is then not an extension of the prompt, and the row is dropped, counted
    empty = {key for key, r in by_turn.items() if not r["reasoning"] and not r["content"]}
    assert set(tokens) == set(by_turn) - empty and meta["rows"].get("dropped.prefix_mismatch", 0) == len(empty)
    for key, r in by_turn.items():
        if key in empty:
            continue
        t = tokens[key]
        start = t["loss_mask"].index(1)
        sampled = r["completion_token_ids"]
        assert t["input_ids"][:start] == r["prompt_token_ids"] and set(t["loss_mask"][start:]) == {1}
        assert t["input_ids"][start:start + len(sampled)] == sampled
        # after a stop, only what the template closes the turn with and the engine did not return ("\n" after
        # <end_of_turn>); after a cut, nothing
        rest = t["input_ids"][start + len(sampled):]
        assert rest == ([107] if r["finish_reason"] == "stop" and sampled[-1] == 106 else []), (r, rest)
