"""generate never exits 0 with an incomplete dataset and never hangs: a task that dies ends the run loudly, a failed
write loses nothing, one writer per output, poison prompts are bounded, broken shards are set aside, nothing moves
before preflight, Ctrl-C keeps in-flight work, and slow tracking never stalls the streams (issue 10)."""
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import pyarrow.parquet as pq
import pytest

from tests.conftest import REPO, read_rows, write_prompts
from tests.fake_openai_server import request_key
from tests.test_generate import check_exactly_once, gen_args


def start(args, mlflow_uri, inject: str | None = None, stdout=subprocess.DEVNULL):
    env = {**os.environ, "MLFLOW_TRACKING_URI": mlflow_uri}
    prefix = ["-m", "tests.inject", inject, "--"] if inject else ["-m"]
    return subprocess.Popen([sys.executable, *prefix, "stages.generate", *args], cwd=REPO, env=env, stdout=stdout,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def run(args, mlflow_uri, inject: str | None = None, timeout: float = 120):
    proc = start(args, mlflow_uri, inject)
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


def served(server) -> int:
    return sum(server.stats()["completed"].values())


def served_prompts(server, prompts) -> int:
    """Answers the server finished for these prompts (preflight probes not counted)."""
    completed = server.stats()["completed"]
    return sum(completed.get(request_key(p["messages"]), 0) for p in prompts)


def wait_until(condition, proc, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the stage ended early:\n{proc.stderr.read()[-3000:]}"
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def test_an_input_shard_lost_mid_run_stops_the_run_with_one_line(fake_server, tmp_path, mlflow_uri):
    server = fake_server({"token_delay_s": 0.02})
    write_prompts(tmp_path / "in", 40)
    write_prompts(tmp_path / "in2", 40, start=100)
    os.replace(tmp_path / "in2" / "prompts-00000.parquet", tmp_path / "in" / "prompts-00001.parquet")
    proc = start(gen_args(server.url, tmp_path / "in", tmp_path / "out", "generation.concurrency=2"), mlflow_uri)
    wait_until(lambda: served(server) >= 3, proc)  # preflight + the first prompts: the reader is in shard 0
    (tmp_path / "in" / "prompts-00001.parquet").unlink()  # a concurrent prepare rewrote the input
    assert proc.wait(60) == 1
    last = proc.stderr.read().strip().splitlines()[-1]
    assert last.startswith("error: reading the input failed") and "prompts-00001.parquet" in last
    rows = read_rows(tmp_path / "out", "completions-")
    assert rows and len(rows) == len({r["prompt_id"] for r in rows})  # what finished is saved, once


def test_tracking_that_fails_never_stops_the_run_or_its_flushes(fake_server, tmp_path, mlflow_uri):
    server = fake_server({"token_delay_s": 0.04})  # a run of ~20 s: several 2 s flushes before the end's compaction
    prompts = write_prompts(tmp_path / "in", 150)
    args = gen_args(server.url, tmp_path / "in", tmp_path / "out", "generate.shard_rows=100000",
                    "generation.concurrency=4")
    proc = start(args, mlflow_uri, inject="mlflow_fails")
    # shards keep coming (the 2 s flush) although every metrics call raises
    wait_until(lambda: len(list((tmp_path / "out").glob("completions-*.parquet"))) >= 3, proc, timeout=90)
    assert proc.wait(120) == 0
    assert proc.stderr.read().count("database is locked") == 1  # reported, once
    check_exactly_once(prompts, tmp_path / "out")


def test_a_full_disk_that_frees_up_loses_nothing(fake_server, tmp_path, mlflow_uri):
    server = fake_server({"token_delay_s": 0.005})
    prompts = write_prompts(tmp_path / "in", 60)
    full = tmp_path / "disk-full"
    full.touch()
    proc = start(gen_args(server.url, tmp_path / "in", tmp_path / "out", "generate.shard_rows=5"), mlflow_uri,
                 inject=f"disk_full_while={full}")
    wait_until(lambda: served(server) >= 30, proc)
    time.sleep(1.0)
    full.unlink()  # space freed while the writes are being retried
    assert proc.wait(60) == 0, proc.stderr.read()
    check_exactly_once(prompts, tmp_path / "out")


def test_a_disk_that_stays_full_stops_the_run_and_counts_what_was_not_saved(fake_server, tmp_path, mlflow_uri):
    server = fake_server({"token_delay_s": 0.005})
    prompts = write_prompts(tmp_path / "in", 30)
    full = tmp_path / "disk-full"
    full.touch()
    code, err = run(gen_args(server.url, tmp_path / "in", tmp_path / "out"), mlflow_uri,
                    inject=f"disk_full_while={full}")
    last = err.strip().splitlines()[-1]
    assert code == 1 and "cannot write completions" in last and "No space left on device" in last
    not_saved = int(last.split("; ")[1].split()[0])
    assert not_saved == served_prompts(server, prompts) > 0  # every answer the server gave is counted
    assert (tmp_path / "out" / "errors.jsonl").read_text() == ""


def test_a_second_writer_is_refused_at_once_naming_the_first(run_stage, fake_server, tmp_path, mlflow_uri):
    server = fake_server({"token_delay_s": 0.05})
    prompts = write_prompts(tmp_path / "in", 40)
    args = gen_args(server.url, tmp_path / "in", tmp_path / "out", "generation.concurrency=2")
    first = start(args, mlflow_uri)
    wait_until(lambda: served(server) >= 2, first)
    t0 = time.monotonic()
    second = run_stage("generate", *args, check=False)
    assert second.returncode == 1 and time.monotonic() - t0 < 30
    last = second.stderr.strip().splitlines()[-1]
    assert f"pid {first.pid}" in last and str(tmp_path / "out") in last
    assert first.wait(120) == 0
    check_exactly_once(prompts, tmp_path / "out")


def test_duplicates_inside_one_shard_are_kept_once(run_stage, fake_server, tmp_path):
    server = fake_server()
    prompts = write_prompts(tmp_path / "in", 10)
    args = gen_args(server.url, tmp_path / "in", tmp_path / "out")
    run_stage("generate", *args)
    (shard,) = (tmp_path / "out").glob("completions-*.parquet")
    table = pq.read_table(shard)
    pq.write_table(table.take(list(range(10)) + [0, 1, 2]), shard)  # as two writers once left it
    proc = run_stage("generate", *args)
    assert "10 already done, 0 to generate" in proc.stderr
    check_exactly_once(prompts, tmp_path / "out")


def test_a_prompt_that_crashes_the_engine_fails_for_good_and_the_rest_completes(run_stage, fake_server, tmp_path):
    server = fake_server({"crash_on": "word3-0", "token_delay_s": 0.01})
    prompts = write_prompts(tmp_path / "in", 12)  # prompt 3's text holds "word3-0"
    proc = run_stage("generate", *gen_args(server.url, tmp_path / "in", tmp_path / "out",
                                           "generate.max_connection_failures=4", "generation.concurrency=3"))
    poison = next(p for p in prompts if "word3-0" in p["messages"][0]["content"])
    rows = read_rows(tmp_path / "out", "completions-")
    assert Counter(r["prompt_id"] for r in rows) == Counter(p["prompt_id"] for p in prompts if p is not poison)
    (error,) = [json.loads(line) for line in (tmp_path / "out" / "errors.jsonl").read_text().splitlines()]
    assert error["prompt_id"] == poison["prompt_id"] and "connection broke 4 times" in error["reason"]
    assert server.stats()["crashes"] == 4  # sent 4 times, not max_attempts or forever
    assert "1 failed for good" in proc.stderr


def test_unreadable_shards_are_quarantined_and_their_prompts_generated_again(run_stage, fake_server, tmp_path):
    server = fake_server()
    prompts = write_prompts(tmp_path / "in", 20)
    args = gen_args(server.url, tmp_path / "in", tmp_path / "out", "generate.shard_rows=5")
    run_stage("generate", *args)
    run_stage("generate", *args, "generation.max_tokens=200")  # other params: the first rows go to .stale
    run_stage("generate", *args)  # ... and come back
    shards = sorted((tmp_path / "out").glob("completions-*.parquet"))
    data = shards[0].read_bytes()
    shards[0].write_bytes(data[: len(data) // 2])  # truncated
    (tmp_path / "out" / "completions-zero.parquet").write_bytes(b"")  # 0 bytes
    proc = run_stage("generate", *args)
    assert proc.stderr.count("moved unreadable shard") == 2
    quarantined = list((tmp_path / "out.quarantine").rglob("*.parquet"))
    assert {p.name for p in quarantined} == {shards[0].name, "completions-zero.parquet"}
    assert not list((tmp_path / "out").glob("*/"))  # never a subfolder a Parquet reader would pick up
    check_exactly_once(prompts, tmp_path / "out")


def test_nothing_moves_aside_before_preflight_passes(run_stage, fake_server, tmp_path):
    server = fake_server()
    write_prompts(tmp_path / "in", 10)
    args = gen_args(server.url, tmp_path / "in", tmp_path / "out")
    run_stage("generate", *args)
    before = sorted(p.name for p in (tmp_path / "out").iterdir())
    proc = run_stage("generate", *args, "generation.max_tokens=3", "server.model=mistyped", check=False)
    assert proc.returncode == 1 and "not served" in proc.stderr.strip().splitlines()[-1]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == before
    assert not (tmp_path / "out.stale").exists()


def test_reverting_a_config_change_reuses_the_rows_moved_aside(run_stage, fake_server, tmp_path):
    server = fake_server()
    prompts = write_prompts(tmp_path / "in", 10)
    args = gen_args(server.url, tmp_path / "in", tmp_path / "out")
    run_stage("generate", *args)
    first = {r["prompt_id"]: r["content"] for r in read_rows(tmp_path / "out", "completions-")}
    run_stage("generate", *args, "generation.max_tokens=3")
    answered_before = served_prompts(server, prompts)
    proc = run_stage("generate", *args)
    assert "restored 10 completions" in proc.stderr and "10 already done, 0 to generate" in proc.stderr
    assert served_prompts(server, prompts) == answered_before  # nothing asked again
    rows = check_exactly_once(prompts, tmp_path / "out")
    assert {r["prompt_id"]: r["content"] for r in rows} == first
    # the max_tokens=3 rows moved aside in turn, ready to come back too
    assert sum(pq.ParquetFile(p).metadata.num_rows for p in (tmp_path / "out.stale").rglob("*.parquet")) == 10


def test_first_signal_lets_in_flight_requests_finish_second_stops_at_once(fake_server, tmp_path, mlflow_uri):
    server = fake_server({"token_delay_s": 0.25, "reasoning_words": 6, "content_words": 6})  # 3 s per answer
    prompts = write_prompts(tmp_path / "in", 40)
    args = gen_args(server.url, tmp_path / "in", tmp_path / "out", "generation.concurrency=4")
    proc = start(args, mlflow_uri)
    wait_until(lambda: server.stats()["inflight"] >= 4, proc)
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(30) == 128 + signal.SIGINT
    rows = read_rows(tmp_path / "out", "completions-")
    assert len(rows) >= 4 and served_prompts(server, prompts) == len(rows)  # in-flight ones finished, were saved
    assert "in-flight ones get up to 300 s" in proc.stderr.read()

    proc = start(args, mlflow_uri)
    wait_until(lambda: server.stats()["inflight"] >= 4, proc)
    time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(0.3)
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(30) == 128 + signal.SIGINT and time.monotonic() - t0 < 10
    assert "again: stopping now" in proc.stderr.read()


def test_a_slow_tracking_store_never_stalls_the_streams(fake_server, tmp_path, mlflow_uri):
    server = fake_server({"token_delay_s": 0.01})
    prompts = write_prompts(tmp_path / "in", 120)
    args = gen_args(server.url, tmp_path / "in", tmp_path / "out", "generation.concurrency=4")
    proc = start(args, mlflow_uri, inject="mlflow_slow=8")
    assert proc.wait(180) == 0, proc.stderr.read()
    summary = json.loads((tmp_path / "out" / "run.json").read_text())
    # ~4 s of requests; a blocked event loop would add 8 s per MLflow batch
    assert summary["elapsed_s"] < 8
    check_exactly_once(prompts, tmp_path / "out")


def test_the_run_rates_cover_the_request_phase_not_the_writing_after_it(fake_server, tmp_path, mlflow_uri):
    """requests/s and tok/s in run.json (and MLflow, and the bench's ratio) end with the last answer: the final
    compaction, however slow, is not counted in them."""
    server = fake_server({"token_delay_s": 0.01})
    prompts = write_prompts(tmp_path / "in", 40)
    args = gen_args(server.url, tmp_path / "in", tmp_path / "out", "generation.concurrency=8")
    proc = start(args, mlflow_uri, inject="compact_slow=6")
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    assert "injected: compaction delayed 6 s" in err  # the delay was there, after the last answer
    summary = json.loads((tmp_path / "out" / "run.json").read_text())
    # not frozen too early either: at least from the first prompt's request to the last one's
    asked = {p["messages"][-1]["content"] for p in prompts}
    sent = [r["received"] for r in server.requests() if r["body"]["messages"][-1]["content"] in asked]
    assert len(sent) == 40 and max(sent) - min(sent) > 0.3
    assert max(sent) - min(sent) <= summary["elapsed_s"] < 5, (max(sent) - min(sent), summary["elapsed_s"])
    assert summary["requests_per_s"] == pytest.approx(summary["completions"] / summary["elapsed_s"])
    check_exactly_once(prompts, tmp_path / "out")


def test_token_ids_on_never_reuses_rows_made_without_them(run_stage, fake_server, tmp_path):
    from tests.conftest import KIMI_DIR

    server = fake_server({"token_ids": "vllm", "tokenizer_dir": str(KIMI_DIR), "engine": "vllm"})
    prompts = write_prompts(tmp_path / "in", 8)
    args = gen_args(server.url, tmp_path / "in", tmp_path / "out")
    run_stage("generate", *args, "generation.token_ids=off")
    assert all(r["completion_token_ids"] is None for r in read_rows(tmp_path / "out", "completions-"))
    proc = run_stage("generate", *args, "generation.token_ids=on")
    assert "moved 8 completions" in proc.stderr
    rows = check_exactly_once(prompts, tmp_path / "out")
    assert all(len(r["completion_token_ids"]) == r["completion_tokens"] and r["token_ids_via"] for r in rows)
    proc = run_stage("generate", *args, "generation.token_ids=auto")  # rows with ids serve any mode
    assert "8 already done, 0 to generate" in proc.stderr


def test_a_signal_under_auto_concurrency_starts_no_new_request(fake_server, tmp_path, mlflow_uri):
    """concurrency=auto keeps a worker per possible level, most of them waiting for room: a slot freed during the
    grace period must not start a new request."""
    server = fake_server({"token_delay_s": 0.1, "reasoning_words": 6, "content_words": 6})  # ~1.2 s per answer
    prompts = write_prompts(tmp_path / "in", 300)
    args = gen_args(server.url, tmp_path / "in", tmp_path / "out", "generation.concurrency=auto",
                    "generation.concurrency_max=64", "generate.grace_period_s=60")
    proc = start(args, mlflow_uri)
    wait_until(lambda: server.stats()["inflight"] >= 4, proc)
    os.killpg(proc.pid, signal.SIGINT)
    sent_at_signal = server.stats()["requests"]
    assert proc.wait(60) == 128 + signal.SIGINT
    assert server.stats()["requests"] - sent_at_signal <= 1  # at most one already on its way at the signal
    rows = read_rows(tmp_path / "out", "completions-")
    assert rows and served_prompts(server, prompts) == len(rows)


def test_a_disk_that_fills_after_shards_were_written_ends_in_one_line(fake_server, tmp_path, mlflow_uri):
    """The final compaction also meets the full disk: the reason the run stopped stays the message, no traceback."""
    server = fake_server({"token_delay_s": 0.005})
    prompts = write_prompts(tmp_path / "in", 150)
    full = tmp_path / "disk-full"
    args = gen_args(server.url, tmp_path / "in", tmp_path / "out", "generate.shard_rows=5", "generation.concurrency=4")
    proc = start(args, mlflow_uri, inject=f"disk_full_while={full}")
    wait_until(lambda: len(list((tmp_path / "out").glob("completions-*.parquet"))) >= 3, proc)
    full.touch()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert "cannot write completions" in last and "No space left on device" in last
    not_saved = int(last.split("; ")[1].split()[0])
    assert not_saved + len(read_rows(tmp_path / "out", "completions-")) == served_prompts(server, prompts)


def test_a_shard_with_a_broken_column_is_quarantined_and_regenerated(run_stage, fake_server, tmp_path):
    """Its key columns read (the plan counts its rows), its text does not: found when the shard is read whole (here
    by the final compaction), set aside, the run exits non-zero saying so, and the next run makes its rows again."""
    server = fake_server()
    prompts = write_prompts(tmp_path / "in", 40)
    write_prompts(tmp_path / "first", 20)
    run_stage("generate", *gen_args(server.url, tmp_path / "first", tmp_path / "out"))
    shard = next((tmp_path / "out").glob("completions-*.parquet"))
    meta = pq.ParquetFile(shard).metadata
    names = [meta.schema.column(i).name for i in range(meta.num_columns)]
    chunk = meta.row_group(0).column(names.index("reasoning"))
    data = bytearray(shard.read_bytes())
    data[chunk.data_page_offset: chunk.data_page_offset + 12] = b"\xff" * 12  # the page header
    shard.write_bytes(bytes(data))
    args = gen_args(server.url, tmp_path / "in", tmp_path / "out")
    proc = run_stage("generate", *args, check=False)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "unreadable" in last and shard.name in last and "re-run generate" in last
    assert [p.name for p in (tmp_path / "out.quarantine").rglob("*.parquet")] == [shard.name]
    assert "20 to generate" in run_stage("generate", *args).stderr
    check_exactly_once(prompts, tmp_path / "out")


def offline_runner(store, rows: int):
    """A Runner writing to `store` whose server is never asked (nothing listens on port 9), `rows` rows pending and a
    flush due: the tick's writing alone. Made inside the event loop; close its `pool.states[0].client` after."""
    from drafter_data.generation.runner import Runner, RunSettings
    from drafter_data.server.client import make_client
    from drafter_data.server.pool import ServerPool, ServerState
    from drafter_data.server.request import RequestSpec

    class Run:
        def metrics(self, *a, **k):
            pass

    spec = RequestSpec(model="m", max_tokens=8, temperature=0.0, top_p=1.0, seed=None, thinking=False,
                       thinking_kwarg="thinking")
    settings = RunSettings(concurrency=1, stream=True, max_attempts=1, shard_rows=2, grace_s=1, target="t")
    state = ServerState("http://127.0.0.1:9/v1", make_client("http://127.0.0.1:9/v1", "k", 1, 5))
    runner = Runner(spec, settings, ServerPool([state], 5), store, None, Run())
    runner.progress.start(rows)
    runner.pending += [{"n": i} for i in range(rows)]
    runner._flush_due.set()
    return runner


def test_a_write_the_disk_holds_up_stops_neither_the_bar_nor_the_levels(tmp_path):
    """A shard write stuck in the disk (an fsync held up for a minute was seen in CI) runs beside the once-a-second
    tick: the progress and the concurrency controllers go on, no second write starts beside it, and the rows that
    came meanwhile are written once it is through, each once and in order."""
    import asyncio
    import threading

    release, first_write = threading.Event(), threading.Event()
    writes: list[list[int]] = []

    class StuckStore:
        dir = tmp_path

        def write(self, rows):
            first_write.set()
            assert release.wait(30)
            writes.append([r["n"] for r in rows])

    async def go() -> tuple[int, int]:
        runner = offline_runner(StuckStore(), 2)
        ticks: list[float] = []
        runner.follow_servers = lambda: ticks.append(time.monotonic())
        ticker = asyncio.create_task(runner.tick())
        assert await asyncio.to_thread(first_write.wait, 10)
        runner.pending += [{"n": 2}, {"n": 3}]  # a full shard more while the first is stuck
        runner._flush_due.set()
        before = len(ticks)
        await asyncio.sleep(3.5)
        ticks_while_stuck, writes_while_stuck = len(ticks) - before, len(writes)
        release.set()
        for _ in range(50):
            if runner.saved == 4:
                break
            await asyncio.sleep(0.1)
        ticker.cancel()
        await asyncio.gather(ticker, *runner._background, return_exceptions=True)
        await runner.pool.states[0].client.close()
        return ticks_while_stuck, writes_while_stuck

    ticks_while_stuck, writes_while_stuck = asyncio.run(go())
    assert ticks_while_stuck >= 3, "the tick stopped while a write was stuck"
    assert writes_while_stuck == 0
    assert writes == [[0, 1], [2, 3]]


def test_a_failed_write_the_tick_did_not_see_leaves_no_unretrieved_task_error(monkeypatch):
    """The run ends (its ticker cancelled) in the moment a background write fails for good: the rows stay pending for
    the final flush, which meets the same disk and says so; no 'Task exception was never retrieved' at exit (the
    reviewer's forced timing)."""
    import asyncio
    import errno
    import gc

    import drafter_data.generation.runner as runner_module
    from drafter_data.errors import StageError

    class FullStore:
        dir = "/nowhere"

        def write(self, rows):
            raise OSError(errno.ENOSPC, "No space left on device (injected)")

    monkeypatch.setattr(runner_module, "WRITE_ATTEMPTS", 1)
    unretrieved: list[dict] = []

    async def go() -> str:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: unretrieved.append(context))
        runner = offline_runner(FullStore(), 2)
        ticker = asyncio.create_task(runner.tick())
        while not any(t.get_name() == "flush" for t in runner._background):
            await asyncio.sleep(0)
        flush = next(t for t in runner._background if t.get_name() == "flush")
        flush.add_done_callback(lambda t: ticker.cancel())  # the run ends in the same step as the write fails
        del flush
        await asyncio.gather(ticker, return_exceptions=True)
        await asyncio.gather(*runner._background, return_exceptions=True)  # as run_all's finally
        try:
            await runner.flush()
            message = ""
        except StageError as exc:
            message = str(exc)
        await runner.pool.states[0].client.close()
        gc.collect()
        await asyncio.sleep(0)
        return message

    message = asyncio.run(go())
    assert "cannot write completions" in message and "2 answers not saved" in message
    assert not [c for c in unretrieved if "never retrieved" in str(c.get("message"))], unretrieved
