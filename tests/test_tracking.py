"""MLflow across the pipeline: a stage run logged to a tracking server on loopback (database backend, artifacts in an
S3-compatible store), found through its REST API; run names, tags and the pipeline_run id; tracking that never
stops a stage; compare_runs."""
import contextlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
import urllib.request

import pytest
from omegaconf import OmegaConf

from drafter_data import tracking
from drafter_data.server.local import free_port
from tests.conftest import REPO, sources_override, write_prompts
from tests.test_storage import S3_CREDENTIALS, s3_client, s3_keys, s3_server

ARTIFACT_BUCKET = "mlflow"


@pytest.fixture(scope="module")
def s3_endpoint():
    """moto's S3 server for the tracking server's artifacts, or None when it cannot start (the S3 check skips)."""
    with contextlib.ExitStack() as stack:
        try:
            endpoint = stack.enter_context(s3_server(ARTIFACT_BUCKET))
        except pytest.skip.Exception as why:
            print(f"artifacts stay local: {why}")
            endpoint = None
        yield endpoint


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory, s3_endpoint):
    tmp = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    mlflow_bin = os.path.join(os.path.dirname(sys.executable), "mlflow")
    artifacts = f"s3://{ARTIFACT_BUCKET}/artifacts" if s3_endpoint else str(tmp / "artifacts")
    env = {**os.environ, **S3_CREDENTIALS, "MLFLOW_S3_ENDPOINT_URL": s3_endpoint or "",
           "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    proc = subprocess.Popen([mlflow_bin, "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
                             "--backend-store-uri", f"sqlite:///{tmp / 'mlflow.db'}",
                             "--artifacts-destination", artifacts],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(url, proc)
        yield url
    finally:
        os.killpg(proc.pid, 9)
        proc.wait(30)


def wait_for_health(url: str, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail("the MLflow tracking server did not start")
            time.sleep(0.5)


def rest(url, path, body=None):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def with_userinfo(url: str, userinfo: str) -> str:
    scheme, rest_of_url = url.split("://", 1)
    return f"{scheme}://{userinfo}@{rest_of_url}"


def test_a_stage_run_is_found_with_params_metrics_tags_and_artifacts(run_stage, fake_server, mlflow_server,
                                                                    s3_endpoint, tmp_path):
    server = fake_server()
    write_prompts(tmp_path / "in", 5)
    secret, url_password, tracking_password = "sk-test-must-not-leak-42", "pw-in-base-url-77", "pw-in-tracking-88"
    run_stage("generate", "server=remote", f"server.base_url={with_userinfo(server.url, 'alice:' + url_password)}",
              "server.model=fake-model", f"generate.input={tmp_path / 'in'}", f"generate.output={tmp_path / 'out'}",
              "server.api_key_env=MY_KEY", f"mlflow.tracking_uri={with_userinfo(mlflow_server, 'bob:' + tracking_password)}",
              env={"MY_KEY": secret, "PIPELINE_RUN_ID": "pr-test-1"})
    exp = rest(mlflow_server, "/api/2.0/mlflow/experiments/get-by-name?experiment_name=drafter-data")["experiment"]
    runs = rest(mlflow_server, "/api/2.0/mlflow/runs/search",
                {"experiment_ids": [exp["experiment_id"]], "filter": "tags.stage = 'generate'"})["runs"]
    assert len(runs) == 1
    run = runs[0]
    params = {p["key"]: p["value"] for p in run["data"]["params"]}
    metrics = {m["key"]: m["value"] for m in run["data"]["metrics"]}
    tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
    assert run["info"]["run_name"] == "generate · gemma3-270m · thinking=on"
    assert params["server.model"] == "fake-model" and params["generation.thinking"] == "True"
    assert params["server.api_key_env"] == "MY_KEY" and params["server.base_url"] == server.url
    assert params["mlflow.tracking_uri"] == mlflow_server
    assert metrics["done_total"] == 5 and metrics["output_tokens_per_s"] > 0
    assert tags["stage"] == "generate" and tags["target"] == "gemma3-270m" and tags["pipeline_run"] == "pr-test-1"
    assert len(tags.get("git_commit", "")) == 40 and "dvc_exp" not in tags
    for leak in (secret, url_password, tracking_password):
        assert leak not in json.dumps(run)
    arts = rest(mlflow_server, f"/api/2.0/mlflow/artifacts/list?run_id={run['info']['run_id']}")
    assert {"run.json", "errors.jsonl"} <= {f["path"] for f in arts["files"]}
    assert {"key": "mlflow.experimentKind", "value": "custom_model_development"} in exp.get("tags", [])


def test_the_tracking_servers_artifacts_land_in_the_object_store(mlflow_server, s3_endpoint):
    if s3_endpoint is None:
        pytest.skip("moto's S3 server could not start: the artifacts went to a local folder instead")
    exp = rest(mlflow_server, "/api/2.0/mlflow/experiments/get-by-name?experiment_name=drafter-data")["experiment"]
    run = rest(mlflow_server, "/api/2.0/mlflow/runs/search",
               {"experiment_ids": [exp["experiment_id"]], "filter": "tags.stage = 'generate'"})["runs"][0]
    prefix = f"artifacts/{exp['experiment_id']}/{run['info']['run_id']}/artifacts/"
    assert {prefix + "run.json", prefix + "errors.jsonl"} <= set(s3_keys(s3_endpoint, ARTIFACT_BUCKET, prefix))
    body = s3_client(s3_endpoint).get_object(Bucket=ARTIFACT_BUCKET, Key=prefix + "run.json")["Body"].read()
    assert json.loads(body)["done_total"] == 5


def test_compare_runs_prints_a_table(mlflow_server):
    out = subprocess.run([sys.executable, "-m", "drafter_data.compare_runs", "--last", "5"], cwd=REPO,
                         env={**os.environ, "MLFLOW_TRACKING_URI": mlflow_server}, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "pr-test-1" in out.stdout and "generate" in out.stdout and "fake-model @ 127.0.0.1" in out.stdout


def cfg(**generation):
    return OmegaConf.create({"target": {"name": "kimi-k2.6"}, "generation": {"thinking": True, "thinking_ratio": None,
                                                                           **generation}})


def test_run_names_say_stage_target_and_thinking_mode():
    assert tracking.run_name("generate", cfg()) == "generate · kimi-k2.6 · thinking=on"
    assert tracking.run_name("assess", cfg(thinking=False)) == "assess · kimi-k2.6 · thinking=off"
    assert tracking.run_name("tokenize", cfg(thinking_ratio=0.5)) == "tokenize · kimi-k2.6 · thinking=mix"


def test_credentials_are_stripped_from_logged_urls():
    config = OmegaConf.create({"server": {"base_url": ["http://u:p4ss@gpu-1:30000/v1", "https://gpu-2/v1?api_key=k3y"],
                                          "api_key": "never", "api_key_env": "DRAFTER_API_KEY"},
                               "mlflow": {"tracking_uri": "https://me:t0ken@mlflow.example:5000"}})
    params = tracking.public_params(config)
    logged = json.dumps(params)
    assert "p4ss" not in logged and "k3y" not in logged and "t0ken" not in logged and "never" not in logged
    assert "gpu-1:30000/v1" in params["server.base_url"] and params["mlflow.tracking_uri"] == "https://mlflow.example:5000"
    assert params["server.api_key_env"] == "DRAFTER_API_KEY"


FAKE_DVC = """import os, subprocess, sys
for _ in range(2):  # two "stages", each through a shell as DVC runs them
    subprocess.run(["sh", "-c", f"{sys.executable} -c 'from drafter_data.tracking import pipeline_run_id; "
                    f"print(pipeline_run_id())'"], check=True, env={**os.environ, "PYTHONPATH": sys.argv[-1]})
"""


def test_the_stages_of_one_dvc_invocation_share_a_pipeline_run_id(tmp_path):
    fake_dvc = tmp_path / "dvc"
    fake_dvc.write_text(FAKE_DVC)
    env = {k: v for k, v in os.environ.items() if k != "PIPELINE_RUN_ID"}

    def invocation(*args):
        out = subprocess.run([sys.executable, str(fake_dvc), *args, str(REPO)], env=env, capture_output=True,
                             text=True, check=True)
        return out.stdout.split()

    first, second, exp = invocation("repro"), invocation("repro"), invocation("exp", "run")
    assert first[0] == first[1] and second[0] == second[1] and exp[0] == exp[1]
    assert len({first[0], second[0], exp[0]}) == 3
    by_hand = invocation("status")  # not a pipeline run: each stage gets its own id
    assert by_hand[0] != by_hand[1] and by_hand[0].startswith("adhoc-")
    env["PIPELINE_RUN_ID"] = "forced"
    assert invocation("repro") == ["forced", "forced"]


def test_a_locked_tracking_database_never_stops_a_stage(run_stage, mlflow_uri, tmp_path):
    from mlflow.tracking import MlflowClient

    MlflowClient(mlflow_uri).search_experiments()  # the session's database, created once (migrations take seconds)
    db = tmp_path / "mlflow.db"
    shutil.copy(mlflow_uri.removeprefix("sqlite:///"), db)
    (tmp_path / "p.jsonl").write_text('{"prompt": "Name a fish."}\n')
    lock = sqlite3.connect(db, isolation_level=None)
    lock.execute("BEGIN EXCLUSIVE")  # what a long write by another process looks like to this stage
    try:  # sqlite's own wait for a lock shortened from 5 s: the outcome is the same, the test faster
        proc = run_stage("prepare", sources_override(("p", tmp_path / "p.jsonl", "auto")),
                         f"prepare.output={tmp_path / 'out'}", env={"MLFLOW_TRACKING_URI": f"sqlite:///{db}?timeout=0.5"})
    finally:
        lock.execute("ROLLBACK")
        lock.close()
    assert (tmp_path / "out" / "stats.json").exists() and list((tmp_path / "out").glob("prompts-*.parquet"))
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning: MLflow")]
    assert len(warnings) == 1 and "locked" in warnings[0], proc.stderr


class FailingClient:
    def __getattr__(self, name):
        def fail(*args, **kwargs):
            raise ConnectionError(f"{name}: store unreachable at http://u:hunter2@mlflow:5000")
        return fail


def test_failing_mlflow_calls_are_reported_once_and_never_raised(tmp_path, capsys):
    run = tracking.StageRun("generate")
    run.run_id, run._client = "r1", FailingClient()  # as if opened, then the store went away
    (tmp_path / "a.json").write_text("{}")
    run.metrics({"tok_s": 1.0}, flush_every_s=0)
    run.metrics({"tok_s": "not a number"})
    run.artifact(tmp_path / "a.json")
    run.figure(tmp_path / "a.json")
    run.flush()
    run.close("FINISHED")
    err = capsys.readouterr().err
    assert err.count("warning: MLflow") == 1 and "generate goes on" in err and "hunter2" not in err


def log_pipeline_run(client, exp_id: str, pipeline_run: str, thinking: str, start_s: float, figures: dict) -> None:
    """Stage runs of one pipeline run, as the stages log them (names, tags, params, metrics)."""
    for i, (stage, metrics) in enumerate(figures.items()):
        start_ms = int((start_s + 60 * i) * 1000)
        run = client.create_run(exp_id, start_time=start_ms, run_name=f"{stage} · t · thinking={thinking}",
                                tags={"stage": stage, "pipeline_run": pipeline_run, "thinking": thinking,
                                      "target": "t"})
        client.log_param(run.info.run_id, "server.base_url", "['http://gpu-1:30000/v1', 'http://gpu-2:30000/v1']")
        client.log_param(run.info.run_id, "server.model", "kimi-k2.6")
        for key, value in metrics.items():
            client.log_metric(run.info.run_id, key, value)
        client.set_terminated(run.info.run_id, "FINISHED", end_time=start_ms + 50_000)


def test_compare_runs_puts_two_pipeline_runs_side_by_side(mlflow_uri):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_uri)
    name = f"compare-{os.getpid()}-{time.time_ns()}"
    exp_id = client.create_experiment(name)
    log_pipeline_run(client, exp_id, "pr-on", "on", 1_000_000, {
        "assess": {"best.output_tokens_per_s": 1000.0, "projection.days": 20.0},
        "generate": {"output_tokens_per_s": 800.0, "throughput_vs_assessed": 0.8, "length_cut_share": 0.05,
                     "stopped_at_length": 0,
                     "completions": 100, "done_total": 100, "failed_total": 0},
        "tokenize": {"tokens": 123456, "drift.rate": 0.0125}})
    log_pipeline_run(client, exp_id, "pr-off", "off", 2_000_000, {
        "assess": {"best.output_tokens_per_s": 2000.0, "projection.days": 5.0},
        "generate": {"output_tokens_per_s": 3000.0, "assessed_output_tokens_per_s": 2000.0, "length_cut_share": 0.0,
                     "completions": 50, "done_total": 50, "failed_total": 1}})
    out = subprocess.run([sys.executable, "-m", "drafter_data.compare_runs", "--experiment", name, "--last", "2"],
                         cwd=REPO, env={**os.environ, "MLFLOW_TRACKING_URI": mlflow_uri}, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    rows = {line.split("  ")[0].strip(): line.split()[-2:] for line in out.stdout.splitlines() if "  " in line}
    assert rows["pipeline run"] == ["pr-on", "pr-off"]  # the older on the left
    assert rows["thinking"] == ["on", "off"]
    assert rows["output tok/s"] == ["800.0", "3,000.0"] and rows["projected days"] == ["20.00", "5.00"]
    # logged by generate (its steady rate); a run that logged none shows none, not its whole-run rate
    (ratio_line,) = [line for line in out.stdout.splitlines() if line.startswith("real/projected tok/s")]
    assert ratio_line.split()[2:] == ["0.80"] and "1.50" not in ratio_line
    assert rows["length-cut share"] == ["5.0%", "0.0%"]  # answers cut, not conversations stopped before their end
    assert rows["tokens made"][-1] == "123,456" and rows["drift rate"][-1] == "0.0125"
    assert "gpu-1:30000 gpu-2:30000" in out.stdout
    assert f"#/experiments/{exp_id}/runs?workflowType=machine_learning" in out.stdout
    picked = subprocess.run([sys.executable, "-m", "drafter_data.compare_runs", "--experiment", name,
                             "--pipeline-run", "pr-off", "--pipeline-run", "pr-on"], cwd=REPO,
                            env={**os.environ, "MLFLOW_TRACKING_URI": mlflow_uri}, capture_output=True, text=True)
    assert picked.returncode == 0, picked.stderr
    assert [line.split()[-2:] for line in picked.stdout.splitlines() if line.startswith("pipeline run")] == \
        [["pr-on", "pr-off"]]


class HangingClient:
    def __getattr__(self, name):
        return lambda *args, **kwargs: time.sleep(3600)


def test_a_tracking_store_that_never_answers_holds_a_stage_up_once_for_at_most_the_wait(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(tracking, "WAIT_S", 0.5)
    run = tracking.StageRun("assess")
    run.run_id, run._client = "r1", HangingClient()
    (tmp_path / "a.json").write_text("{}")
    started = time.monotonic()
    for _ in range(5):
        run.artifact(tmp_path / "a.json")
    run.close("FINISHED")
    assert time.monotonic() - started < 2.0
    assert capsys.readouterr().err.count("warning: MLflow (waiting)") == 1


def test_a_stage_that_fails_leaves_a_failed_run_that_started_with_its_process(mlflow_uri):
    import psutil
    from mlflow.tracking import MlflowClient

    name = f"failing-{os.getpid()}-{time.time_ns()}"
    config = OmegaConf.merge(cfg(), {"mlflow": {"tracking_uri": mlflow_uri, "experiment": name}})
    entered_ms = time.time() * 1000
    with pytest.raises(RuntimeError):
        with tracking.stage_run("tokenize", config) as run:
            run.metrics({"rows_per_s": 7.0}, step=5)  # live values while the stage runs
            time.sleep(0.01)
            run.metrics({"rows": 3, "rows_per_s": 2.0})  # the summary: what the UI and compare_runs must show
            raise RuntimeError("the stage's own error goes through")
    client = MlflowClient(mlflow_uri)
    [logged] = client.search_runs([client.get_experiment_by_name(name).experiment_id])
    assert logged.info.status == "FAILED" and logged.data.metrics["rows"] == 3
    assert logged.data.metrics["rows_per_s"] == 2.0
    # the process's start (psutil's create_time agrees to its whole-second boot time; tests/test_storage.py checks
    # that a pipeline's stage runs, one process after another, do not overlap)
    assert abs(logged.info.start_time - psutil.Process().create_time() * 1000) < 1100
    assert logged.info.start_time < entered_ms
    assert logged.info.run_name == "tokenize · kimi-k2.6 · thinking=on"


@pytest.mark.parametrize("how", ["Ctrl-C", "a stage that ends by itself after a signal"])
def test_a_stopped_stage_waits_only_briefly_for_a_store_that_never_answers(monkeypatch, how):
    """Stopping (Ctrl-C, SIGTERM) waits STOP_WAIT_S for MLflow to record KILLED, not WAIT_S; finishing still waits."""
    monkeypatch.setattr(tracking, "WAIT_S", 30.0)
    monkeypatch.setattr(tracking, "STOP_WAIT_S", 0.3)
    monkeypatch.setattr(tracking.StageRun, "_open", lambda self, *args: time.sleep(3600))  # the store never answers
    started = time.monotonic()
    with contextlib.suppress(KeyboardInterrupt):
        with tracking.stage_run("prepare", cfg()) as run:
            if how == "Ctrl-C":
                raise KeyboardInterrupt
            run.stopped_by_signal = True
    assert time.monotonic() - started < 10
    monkeypatch.setattr(tracking, "WAIT_S", 1.0)
    started = time.monotonic()
    with tracking.stage_run("prepare", cfg()):
        pass
    assert time.monotonic() - started >= 1.0  # a stage that finished waits the whole WAIT_S


def test_a_tracking_server_that_never_answers_costs_a_stage_seconds_not_minutes(run_stage, tmp_path):
    """A tracking URI whose server accepts connections and never answers added 120 s to every stage: it is asked once
    at the start, briefly, and the stage runs without tracking, with one warning."""
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # connections are accepted by the kernel, never answered
    uri = f"http://127.0.0.1:{silent.getsockname()[1]}"
    try:
        started = time.monotonic()
        proc = run_stage("prepare", sources_override(("s", REPO / "data/sample_prompts/prompts.jsonl", "auto")),
                         f"prepare.output={tmp_path / 'out'}", f"mlflow.tracking_uri={uri}", timeout=120)
        took = time.monotonic() - started
    finally:
        silent.close()
    assert took < tracking.REACH_TIMEOUT_S + 30, took
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning: MLflow")]
    assert len(warnings) == 1 and "did not answer within 5 s" in warnings[0]
    assert (tmp_path / "out" / "stats.json").exists()


def test_a_tracking_server_answering_server_errors_costs_a_stage_seconds_too(run_stage, tmp_path):
    """A tracking server that answers every call with HTTP 503 (a proxy in front of a dead MLflow): MLflow's own
    retries would add minutes to every stage; it is asked once and the stage runs without tracking, warned once."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Failing(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_POST = do_GET

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Failing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        started = time.monotonic()
        proc = run_stage("prepare", sources_override(("s", REPO / "data/sample_prompts/prompts.jsonl", "auto")),
                         f"prepare.output={tmp_path / 'out'}",
                         f"mlflow.tracking_uri=http://127.0.0.1:{server.server_address[1]}", timeout=300)
        took = time.monotonic() - started
    finally:
        server.shutdown()
    assert took < tracking.REACH_TIMEOUT_S + 30, took
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning: MLflow")]
    assert len(warnings) == 1 and "answered HTTP 503" in warnings[0], proc.stderr[-2000:]
    assert (tmp_path / "out" / "stats.json").exists()
