"""What generate refuses instead of storing rows that are not the target's answers to exactly what was asked, or
ending green with nothing made: answers from another model, a server that ignores the thinking switch, values no
server accepts, a run where every request fails for good, an input holding a prompt twice, an output that is its
input, and a disk that fills up at the end (issue 27)."""
import json
import shutil
from collections import Counter

import pytest

from tests.conftest import read_rows, write_prompts
from tests.test_generate_reliability import run, start, wait_until
from tests.test_generate_server import errors, gen_args, post_config


def last_line(proc) -> str:
    return proc.stderr.strip().splitlines()[-1]


def prompt_requests(server) -> int:
    return sum(1 for e in server.requests() if any("word" in str(m.get("content")) for m in e["body"]["messages"]))


def test_answers_named_by_another_model_are_not_stored_and_stop_the_run(run_stage, fake_server, tmp_path):
    """A router that falls back to another model for most answers: none of them is stored as the target's, and the
    run stops non-zero (on today's main every row was stored as fake-model, exit 0)."""
    server = fake_server({"answer_model": "llama-3-8b-fallback", "answer_model_rate": 0.9, "seed": 3})
    write_prompts(tmp_path / "in", 40)
    proc = run_stage("generate", *gen_args(server.url, tmp_path / "in", tmp_path / "out",
                                           "generate.max_backoff_s=0.05"), check=False)
    rows = read_rows(tmp_path / "out", "completions-")
    assert all(r["model"] == "fake-model" for r in rows)  # each row names the model its answer named
    if proc.returncode == 0:  # a probe can only pass if the router answered it from the target
        pytest.fail(f"exit 0 with {len(rows)} of 40 rows against a router answering 90% from another model")
    assert "llama-3-8b-fallback" in last_line(proc) and "fake-model" in last_line(proc)


@pytest.mark.parametrize("seed", [1, 31])  # 31: the very first answer, preflight's probe, is the fallback's
def test_a_rare_fallback_is_retried_and_every_row_is_the_targets(run_stage, fake_server, tmp_path, seed):
    server = fake_server({"answer_model": "llama-3-8b-fallback", "answer_model_rate": 0.1, "seed": seed})
    prompts = write_prompts(tmp_path / "in", 40)
    proc = run_stage("generate", *gen_args(server.url, tmp_path / "in", tmp_path / "out",
                                           "generate.max_backoff_s=0.05", "generation.concurrency=1"))
    rows = read_rows(tmp_path / "out", "completions-")
    assert Counter(r["prompt_id"] for r in rows) == Counter(p["prompt_id"] for p in prompts)
    assert {r["model"] for r in rows} == {"fake-model"} and "retries" in proc.stderr


def test_preflight_refuses_a_router_that_answers_from_another_model(run_stage, fake_server, tmp_path):
    server = fake_server({"answer_model": "llama-3-8b-fallback"})
    write_prompts(tmp_path / "in", 3)
    proc = run_stage("generate", *gen_args(server.url, tmp_path / "in", tmp_path / "out"), check=False)
    assert proc.returncode == 1 and "'llama-3-8b-fallback', not 'fake-model'" in last_line(proc)
    assert prompt_requests(server) == 0


@pytest.mark.parametrize("mode", ["generation.thinking=false", "generation.thinking_ratio=0.6"])
def test_a_server_that_ignores_the_thinking_switch_is_refused_in_preflight(run_stage, fake_server, tmp_path, mode):
    """With thinking off (or a mix), a server that thinks anyway would give rows whose reasoning contradicts their
    mode (tokenize then dropped them all, or 45% under max_drop_share, exit 0)."""
    server = fake_server({"ignore_thinking": True})
    write_prompts(tmp_path / "in", 6)
    proc = run_stage("generate", *gen_args(server.url, tmp_path / "in", tmp_path / "out", mode), check=False)
    assert proc.returncode == 1 and "ignores the thinking switch" in last_line(proc), proc.stderr[-2000:]
    assert "thinking=false" in last_line(proc) and prompt_requests(server) == 0


def test_an_answer_that_thinks_in_a_row_that_does_not_is_retried_never_stored(fake_server, tmp_path, mlflow_uri):
    """The switch honoured at preflight, then ignored mid-run: such answers are not stored as thinking=False rows;
    they are retried, and requests that fail for good in a row stop the run."""
    server = fake_server({"token_delay_s": 0.01})
    prompts = write_prompts(tmp_path / "in", 200)
    args = gen_args(server.url, tmp_path / "in", tmp_path / "out", "generation.thinking=false",
                    "generation.concurrency=2", "generate.max_backoff_s=0.01", "generate.max_attempts=2")
    proc = start(args, mlflow_uri)
    wait_until(lambda: list((tmp_path / "out").glob("completions-*.parquet")), proc)
    post_config(server, {"ignore_thinking": True})
    _, err = proc.communicate(timeout=120)
    rows = read_rows(tmp_path / "out", "completions-")
    assert all(r["reasoning"] is None and r["thinking"] is False for r in rows)
    assert len(rows) < len(prompts) and proc.returncode == 1
    assert "failed for good" in err.strip().splitlines()[-1] and "thinks although" in err


@pytest.mark.parametrize("hidden,needle", [(False, "does not fit"), (True, "all 6 requests")])
def test_max_tokens_no_server_accepts_fails_before_or_after_a_few_requests(run_stage, fake_server, tmp_path,
                                                                         hidden, needle):
    """max_tokens over a 4096-token context: refused in preflight where the server says its context (vLLM's
    max_model_len), else every request fails for good for one reason and the run exits non-zero (on today's main:
    every request in errors.jsonl, 0 rows, exit 0)."""
    server = fake_server({"max_model_len": 4096, "hide_max_model_len": hidden})
    write_prompts(tmp_path / "in", 6)
    proc = run_stage("generate", *gen_args(server.url, tmp_path / "in", tmp_path / "out",
                                           "generation.max_tokens=8192", "generation.thinking=false"), check=False)
    assert proc.returncode == 1 and needle in last_line(proc), proc.stderr[-2000:]
    assert not read_rows(tmp_path / "out", "completions-")


def test_a_streak_of_requests_failing_for_good_stops_the_run(run_stage, fake_server, tmp_path):
    server = fake_server({"max_model_len": 4096, "hide_max_model_len": True})
    write_prompts(tmp_path / "in", 60)
    proc = run_stage("generate", *gen_args(server.url, tmp_path / "in", tmp_path / "out",
                                           "generation.concurrency=1", "generation.max_tokens=8192"), check=False)
    assert proc.returncode == 1 and "10 requests in a row failed for good" in last_line(proc)
    assert prompt_requests(server) < 20 and len(errors(tmp_path / "out")) == 10


@pytest.mark.parametrize("prompts", [1, 2])
def test_a_run_where_every_request_failed_for_good_is_not_green(run_stage, fake_server, tmp_path, prompts):
    """One prompt (or two) whose request fails for good: nothing was made, so the run is not a success (a single
    failure once ended with exit 0)."""
    server = fake_server({"max_model_len": 4096, "hide_max_model_len": True})
    write_prompts(tmp_path / "in", prompts)
    proc = run_stage("generate", *gen_args(server.url, tmp_path / "in", tmp_path / "out",
                                           "generation.max_tokens=8192"), check=False)
    assert proc.returncode == 1 and "failed for good and none was answered" in last_line(proc), proc.stderr[-2000:]
    assert len(errors(tmp_path / "out")) == prompts


def test_thinking_answers_without_reasoning_and_answers_naming_no_model_are_counted_and_warned(run_stage,
                                                                                              fake_server, tmp_path):
    """Answers that name no model cannot be checked against server.model; thinking answers that came back without
    reasoning are kept (some prompts need none) but neither may pass unnoticed: counted in run.json, warned once."""
    server = fake_server({"name_model": False, "no_reasoning_on": "word1-"})
    write_prompts(tmp_path / "in", 12)
    proc = run_stage("generate", *gen_args(server.url, tmp_path / "in", tmp_path / "out"))
    rows = read_rows(tmp_path / "out", "completions-")
    summary = json.loads((tmp_path / "out" / "run.json").read_text())
    straight = sum(not r["reasoning"] for r in rows)
    assert 0 < straight < len(rows) == 12 and summary["thinking_without_reasoning"] == straight
    assert summary["answers_naming_no_model"] == 12 and all(r["model"] is None for r in rows)
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
    assert any(f"{straight} of 12 answers asked to think came back without reasoning" in w for w in warnings)
    assert any("12 of 12 answers named no model" in w for w in warnings)


def test_a_prompt_found_twice_in_the_input_is_generated_once(run_stage, fake_server, tmp_path):
    """Two copies of a prompt shard: every request was sent twice and tokenize made two rows of each."""
    server = fake_server()
    prompts = write_prompts(tmp_path / "in", 9)
    shutil.copy(tmp_path / "in" / "prompts-00000.parquet", tmp_path / "in" / "prompts-00001.parquet")
    proc = run_stage("generate", *gen_args(server.url, tmp_path / "in", tmp_path / "out"))
    rows = read_rows(tmp_path / "out", "completions-")
    assert Counter(r["prompt_id"] for r in rows) == Counter(p["prompt_id"] for p in prompts)
    assert prompt_requests(server) == 9 and "9 input prompts are copies" in proc.stderr
    assert json.loads((tmp_path / "out" / "run.json").read_text())["prompts"] == 9


@pytest.mark.parametrize("where", ["same", "inside"])
def test_an_output_that_is_or_lies_in_the_input_is_refused(run_stage, fake_server, tmp_path, where):
    server = fake_server()
    write_prompts(tmp_path / "in", 3)
    out = tmp_path / "in" if where == "same" else tmp_path / "in" / "completions"
    proc = run_stage("generate", *gen_args(server.url, tmp_path / "in", out), check=False)
    assert proc.returncode == 1 and "generate.input" in last_line(proc)
    assert sorted(p.name for p in (tmp_path / "in").iterdir()) == ["prompts-00000.parquet"]
    assert prompt_requests(server) == 0


def test_the_summary_counts_what_is_on_disk_when_the_last_write_fails(fake_server, tmp_path, mlflow_uri):
    """Disk full at the end: the summary said '66 completions this run' with 65 on disk."""
    server = fake_server()
    write_prompts(tmp_path / "in", 5)
    (tmp_path / "full").touch()  # every write fails from the start
    code, err = run(gen_args(server.url, tmp_path / "in", tmp_path / "out"), mlflow_uri,
                    inject=f"disk_full_while={tmp_path / 'full'}")
    assert code == 1 and "No space left on device" in err.strip().splitlines()[-1]
    summary = next(line for line in err.splitlines() if line.startswith("generate:"))
    assert summary.startswith("generate: 0 completions this run (5 more answered but not saved) (0 rows")


def test_the_embedded_servers_chat_template_and_weights_key_its_completions(tmp_path):
    """The template the stage starts llama-server with decides what the model sees: a changed template must not
    resume onto completions made with the old one. A server we do not start keeps the identity it always had."""
    import shutil as sh

    import orjson

    from drafter_data.config import compose
    from drafter_data.server.request import RequestSpec
    from tests.conftest import REPO

    template = tmp_path / "t.jinja"
    sh.copy(REPO / "conf/templates/gemma3-270m.jinja", template)
    local = RequestSpec.from_config(compose([f"server.local.chat_template={template}"], root=REPO))
    template.write_text(template.read_text() + "\n")
    changed = RequestSpec.from_config(compose([f"server.local.chat_template={template}"], root=REPO))
    assert local.identity("t") != changed.identity("t")
    weights = tmp_path / "w.gguf"
    weights.write_bytes(b"GGUF" + bytes(60))
    first = RequestSpec.from_config(compose([f"server.local.model_path={weights}"], root=REPO))
    weights.write_bytes(b"GGUF" + bytes(70))
    other = RequestSpec.from_config(compose([f"server.local.model_path={weights}"], root=REPO))
    assert first.identity("t") != other.identity("t") != local.identity("t")
    remote = RequestSpec.from_config(compose(["server=remote"], root=REPO))
    assert set(orjson.loads(remote.identity("t"))) == {"target", "model", "max_tokens", "temperature", "top_p",
                                                        "extra_body"}
