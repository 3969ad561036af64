"""What makes tokenize stop instead of writing a dataset that is not what was asked for: a drop reason taking most
rows, a server tokenizer that is down, an output directory whose removal would destroy something else. And what it
reports: the reasoning/answer length plot and metrics in MLflow."""
import json
import shutil
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from omegaconf import OmegaConf

from drafter_data.errors import StageError
from drafter_data.tokens.checks import check_output_dir
from drafter_data.tokens.conversation import ConversationTokenizer
from drafter_data.tokens.rows import per_turn_row
from drafter_data.tokens.tokenizers import KimiTokenizer
from drafter_data.tokens.turns import Turn
from tests.conftest import KIMI_DIR, REPO, read_rows
from tests.test_tokenize import completion_row, kimi_overrides, write_completions

QA = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi", "reasoning_content": "greet"}]


def rows_with_finish(*reasons: str) -> list[dict]:
    return [completion_row(f"r{i}", QA, finish_reason=reason) for i, reason in enumerate(reasons)]


def test_a_drop_reason_over_max_drop_share_fails_after_writing_meta(run_stage, tmp_path):
    inp = write_completions(tmp_path / "in", rows_with_finish("abort", "abort", "stop"))
    proc = run_stage("tokenize", *kimi_overrides(inp, tmp_path / "out"), check=False)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and "2 of 3 rows were dropped as unknown_finish_reason" in last
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["rows"] == {"read": 3, "kept": 1, "dropped.unknown_finish_reason": 2}
    run_stage("tokenize", *kimi_overrides(inp, tmp_path / "out"), "tokenize.max_drop_share=0.7")
    inp = write_completions(tmp_path / "in2", rows_with_finish("abort", "stop", "stop"))
    run_stage("tokenize", *kimi_overrides(inp, tmp_path / "out"))


@pytest.mark.parametrize("limit", ["tokenize.max_prompt_mismatch_rate=2", "tokenize.max_drift_rate=null",
                                   "~tokenize.max_prompt_mismatch_rate"])
def test_a_limit_that_is_not_a_share_fails_before_any_work(run_stage, tmp_path, limit):
    """e.g. a params.yaml composed before max_prompt_mismatch_rate existed: one line at the start, not a traceback
    after every row was tokenized."""
    inp = write_completions(tmp_path / "in", rows_with_finish("stop"))
    proc = run_stage("tokenize", *kimi_overrides(inp, tmp_path / "out"), limit, check=False)
    last = proc.stderr.strip().splitlines()[-1]
    key = limit.lstrip("~").split("=")[0]
    assert proc.returncode == 1 and f"{key}=" in last and "share from 0 to 1" in last, proc.stderr[-2000:]
    assert not (tmp_path / "out").exists()


class FlakyTokenizerServer:
    """Answers llama-server's /props and the first `answers` /tokenize calls, then fails every request (HTTP 503)."""

    def __init__(self, answers: int):
        state = {"left": answers, "calls": 0}

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                self.reply(200, {"model_path": "", "bos_token": "<bos>", "eos_token": "<eos>"})

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                state["calls"] += 1
                state["left"] -= 1
                self.reply(200, {"tokens": [1]}) if state["left"] >= 0 else self.reply(503, {"error": "down"})

            def reply(self, code, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.state = state
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def gemma_args(url: str, inp, out) -> list[str]:
    return ["target=gemma3-270m", "server=remote", f"server.base_url={url}", f"tokenize.input={inp}",
            f"tokenize.output={out}"]


def test_a_server_tokenizer_that_is_down_fails_fast_with_one_line(run_stage, tmp_path):
    from drafter_data.server.local import free_port

    inp = write_completions(tmp_path / "in", [completion_row(f"r{i}", QA) for i in range(50)])
    proc = run_stage("tokenize", *gemma_args(f"http://127.0.0.1:{free_port()}/v1", inp, tmp_path / "out"),
                     check=False, timeout=60)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and "unreachable" in lines[0], proc.stderr[-2000:]
    server = FlakyTokenizerServer(answers=3)  # the start-up lookups (bos, eos, </think>), then down
    try:
        proc = run_stage("tokenize", *gemma_args(server.url, inp, tmp_path / "out"), check=False, timeout=60)
    finally:
        server.close()
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and "failing (HTTP 503)" in lines[-1] and len(lines) <= 2, proc.stderr[-2000:]
    assert server.state["calls"] < 20  # stopped at the first rows, not one failure per row


def test_output_that_would_delete_the_input_or_the_tokenizer_is_refused(run_stage, tmp_path):
    inp = write_completions(tmp_path / "in", [completion_row("x", QA)])
    proc = run_stage("tokenize", *kimi_overrides(inp, inp), check=False)
    assert proc.returncode == 1 and "would delete the input" in proc.stderr.strip().splitlines()[-1]
    assert (inp / "completions-00000.parquet").exists()
    model = tmp_path / "models" / "kimi"
    shutil.copytree(KIMI_DIR, model)
    args = kimi_overrides(inp, tmp_path / "models")
    args[1] = f"target.tokenizer_dir={model}"
    proc = run_stage("tokenize", *args, check=False)
    assert proc.returncode == 1 and "would delete the tokenizer directory" in proc.stderr.strip().splitlines()[-1]
    assert (model / "tiktoken.model").exists()


def test_output_guard_protects_the_repo_and_what_contains_it(tmp_path):
    protected = {"the repo": REPO, "the input": tmp_path / "data" / "completions", "nothing": None}
    for out in (REPO, REPO.parent, tmp_path, tmp_path / "data", tmp_path / "data" / "completions"):
        with pytest.raises(StageError, match="would delete"):
            check_output_dir(out, protected)
    check_output_dir(tmp_path / "data" / "tokens", protected)
    check_output_dir(tmp_path / "data" / "completions" / "tokens", protected)


def test_reasoning_and_answer_tokens_per_turn():
    target = OmegaConf.load(REPO / "conf/target/kimi-k2.6.yaml")
    target.tokenizer_dir = str(KIMI_DIR)
    tok = KimiTokenizer(KIMI_DIR)
    conv = ConversationTokenizer(target, tok, {"thinking": True, "preserve_thinking": True})
    reasoning, content = "Let me count the letters one by one.", "There are three."
    turn = Turn("p", 0, [QA[0]], None, True, reasoning, content, None, "stop")
    row = per_turn_row(conv, turn, Counter())
    assert row.turn_lengths == [(len(tok.encode(reasoning)), 1 + len(tok.encode(content)) + 1)]  # </think> .. im_end


def test_mlflow_run_has_the_length_plot_and_the_new_metrics(run_stage, tmp_path, mlflow_uri):
    from mlflow.tracking import MlflowClient

    inp = write_completions(tmp_path / "in", [completion_row(f"r{i}", QA) for i in range(3)])
    out = tmp_path / "out"
    run_stage("tokenize", *kimi_overrides(inp, out))
    client = MlflowClient(mlflow_uri)
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])
            if r.data.params.get("tokenize.output") == str(out)]
    assert len(runs) == 1
    run = runs[0]
    assert [a.path for a in client.list_artifacts(run.info.run_id, "plots")] == ["plots/token_lengths.png"]
    png = client.download_artifacts(run.info.run_id, "plots/token_lengths.png", str(tmp_path))
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    metrics = run.data.metrics
    assert metrics["drift.rows_compared"] == 0 and metrics["thinking_rows.on"] == 3 and metrics["rows.kept"] == 3
    assert read_rows(out) and len(read_rows(out)) == 3


def kimi_thinking_rows(n: int = 4, **extra) -> list[dict]:
    return [completion_row(f"k{i}", [{"role": "user", "content": f"question {i}"},
                                     {"role": "assistant", "content": f"answer {i}", "reasoning_content": f"thought {i}"}],
                           thinking=True, **extra) for i in range(n)]


def test_tokenize_template_kwargs_add_to_the_targets_own(run_stage, tmp_path):
    """tokenize.template_kwargs adds to K2.6's {preserve_thinking: true}: setting another kwarg must not drop it (on
    today's main it replaced it: the reasoning left every row's loss while meta.json said thinking: true)."""
    inp = write_completions(tmp_path / "in", kimi_thinking_rows())
    base = ["target=kimi-k2.6", f"target.tokenizer_dir={KIMI_DIR}", f"tokenize.input={inp}"]
    run_stage("tokenize", *base, f"tokenize.output={tmp_path / 'plain'}")
    run_stage("tokenize", *base, f"tokenize.output={tmp_path / 'extra'}", "tokenize.template_kwargs={foo:1}")
    plain, extra = read_rows(tmp_path / "plain"), read_rows(tmp_path / "extra")
    assert [r["input_ids"] for r in extra] == [r["input_ids"] for r in plain]
    assert [sum(r["loss_mask"]) for r in extra] == [sum(r["loss_mask"]) for r in plain]
    meta = json.loads((tmp_path / "extra" / "meta.json").read_text())
    assert meta["template_kwargs"] == {"preserve_thinking": True, "foo": 1}
    tok = KimiTokenizer(KIMI_DIR)
    assert "thought 0" in tok.decode(plain[0]["input_ids"][plain[0]["loss_mask"].index(1):])


def test_completions_sent_with_other_template_kwargs_are_refused(run_stage, tmp_path):
    """Each completion knows the chat_template_kwargs it was sent with: rendering it with others is refused in one
    line, before any work."""
    sent = '{"preserve_thinking":true,"thinking":true}'
    inp = write_completions(tmp_path / "in", kimi_thinking_rows(chat_template_kwargs=sent))
    base = ["target=kimi-k2.6", f"target.tokenizer_dir={KIMI_DIR}", f"tokenize.input={inp}"]
    run_stage("tokenize", *base, f"tokenize.output={tmp_path / 'ok'}")  # the same kwargs: fine
    proc = run_stage("tokenize", *base, f"tokenize.output={tmp_path / 'out'}",
                     "tokenize.template_kwargs={preserve_thinking:false}", check=False)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) <= 2, proc.stderr[-2000:]
    assert "sent with chat_template_kwargs" in last and '"preserve_thinking":false' in last
    assert not (tmp_path / "out").exists()


def test_kwargs_are_checked_in_every_shard_and_mode(run_stage, tmp_path):
    """Completions sent with the right kwargs in several shards and both thinking modes are all tokenized (a name
    reused inside the check once turned the second shard's check into a false refusal); a wrong one in a later
    shard is still refused."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    on = '{"preserve_thinking":true,"thinking":true}'
    off = '{"preserve_thinking":true,"thinking":false}'
    plain = lambda i: completion_row(f"n{i}", [{"role": "user", "content": f"q {i}"},  # noqa: E731
                                               {"role": "assistant", "content": f"a {i}"}],
                                     thinking=False, chat_template_kwargs=off)
    shards = [kimi_thinking_rows(2, chat_template_kwargs=on), [plain(0), plain(1)],
              [{**r, "prompt_id": r["prompt_id"] + "b"} for r in kimi_thinking_rows(2, chat_template_kwargs=on)]]
    inp = tmp_path / "in"
    inp.mkdir()
    for i, rows in enumerate(shards):
        pq.write_table(pa.Table.from_pylist(rows), inp / f"completions-{i:05d}.parquet")
    base = ["target=kimi-k2.6", f"target.tokenizer_dir={KIMI_DIR}", f"tokenize.input={inp}",
            "generation.thinking_ratio=0.5"]
    run_stage("tokenize", *base, f"tokenize.output={tmp_path / 'out'}")
    assert len(read_rows(tmp_path / "out")) == 6
    wrong = [{**r, "prompt_id": r["prompt_id"] + "c"} for r in kimi_thinking_rows(1, chat_template_kwargs=off)]
    pq.write_table(pa.Table.from_pylist(wrong), inp / "completions-00003.parquet")
    proc = run_stage("tokenize", *base, f"tokenize.output={tmp_path / 'out2'}", check=False)
    assert proc.returncode == 1 and "sent with chat_template_kwargs" in proc.stderr.strip().splitlines()[-1]


def test_a_row_found_twice_is_one_training_row_and_two_different_ones_are_refused(run_stage, tmp_path):
    """A completions shard copied (or a kill during an older generate's compaction) must not make two token rows
    of one (prompt_id, turn): identical copies are read once; two different answers to one request are refused."""
    rows = kimi_thinking_rows(3)
    inp = write_completions(tmp_path / "in", rows)
    shutil.copy(inp / "completions-00000.parquet", inp / "completions-00001.parquet")
    for rows_kind in ("per_turn", "conversation"):
        out = tmp_path / f"out-{rows_kind}"
        run_stage("tokenize", *kimi_overrides(inp, out), f"tokenize.rows={rows_kind}")
        assert Counter(r["prompt_id"] for r in read_rows(out)) == Counter(r["prompt_id"] for r in rows)
        assert json.loads((out / "meta.json").read_text())["rows"]["read"] == 3
    changed = [dict(r) for r in rows]
    changed[1]["content"] = "another answer"
    write_completions(tmp_path / "in2", changed)
    shutil.copy(inp / "completions-00000.parquet", tmp_path / "in2" / "completions-00001.parquet")
    proc = run_stage("tokenize", *kimi_overrides(tmp_path / "in2", tmp_path / "out2"), check=False)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and "two different completions for prompt k1 turn 0" in last
    assert not (tmp_path / "out2").exists()


def test_a_full_disk_while_tokenizing_is_one_line_and_the_old_output_stays(run_stage, tmp_path, mlflow_uri):
    import os
    import subprocess
    import sys

    rows = kimi_thinking_rows(8)
    inp = write_completions(tmp_path / "in", rows[4:])
    shutil.move(inp / "completions-00000.parquet", inp / "completions-00001.parquet")
    write_completions(inp, rows[:4])  # two shards: two tasks, in worker processes
    run_stage("tokenize", *kimi_overrides(inp, tmp_path / "out"))
    before = read_rows(tmp_path / "out")
    assert len(before) == 8
    (tmp_path / "full").touch()
    proc = subprocess.run([sys.executable, "-m", "tests.inject", f"disk_full_while={tmp_path / 'full'}", "--",
                           "stages.tokenize", *kimi_overrides(inp, tmp_path / "out")], cwd=REPO,
                          env={**os.environ, "MLFLOW_TRACKING_URI": mlflow_uri}, capture_output=True, text=True,
                          timeout=300)
    lines = [line for line in proc.stderr.strip().splitlines() if not line.startswith("20")]  # MLflow's own log
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("error: No space left on device") and "free some space" in lines[0]
    assert read_rows(tmp_path / "out") == before


def test_tokenizing_the_completions_of_an_unfinished_generate_run_is_never_unnoticed(run_stage, fake_server, tmp_path):
    """generate stopped (a run-wide fault, Ctrl-C) or killed, then tokenize by hand: it tokenized the part that was
    there with exit 0 and not a word. Allowed (a run in progress may be looked at), but warned."""
    from tests.conftest import write_prompts
    from tests.test_generate_server import gen_args

    server = fake_server()
    write_prompts(tmp_path / "p", 12)
    run_stage("generate", *gen_args(server.url, tmp_path / "p", tmp_path / "done"))
    summary = json.loads((tmp_path / "done" / "run.json").read_text())
    assert summary["conversations_left"] == 0 and summary["stopped_reason"] is None
    cases = {"finished": summary, "killed": None,
             "stopped": {**summary, "conversations_left": 9, "stopped_reason": "5 requests in a row failed"},
             "interrupted": {**summary, "conversations_left": 4}}
    for case, run_json in cases.items():
        completions = tmp_path / case
        shutil.copytree(tmp_path / "done", completions)
        if run_json is None:
            (completions / "run.json").unlink()
        else:
            (completions / "run.json").write_text(json.dumps(run_json))
        proc = run_stage("tokenize", "target=kimi-k2.6", f"target.tokenizer_dir={KIMI_DIR}",
                         f"tokenize.input={completions}", f"tokenize.output={tmp_path / ('t-' + case)}")
        warned = [line for line in proc.stderr.splitlines() if line.startswith("warning:") and "finish" in line]
        assert bool(warned) == (case != "finished"), (case, proc.stderr[-2000:])
        if case == "stopped":
            assert "9 conversations left undone" in warned[0] and "it stopped: 5 requests" in warned[0]
