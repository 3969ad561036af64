"""MLflow across the pipeline: a stage run logged to a tracking server on loopback, found through its REST API."""
import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest

from drafter_data.server.local import free_port
from tests.conftest import REPO, write_prompts


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    mlflow_bin = os.path.join(os.path.dirname(sys.executable), "mlflow")
    proc = subprocess.Popen([mlflow_bin, "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
                             "--backend-store-uri", f"sqlite:///{tmp / 'mlflow.db'}",
                             "--artifacts-destination", str(tmp / "artifacts")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail("the MLflow tracking server did not start")
            time.sleep(0.5)
    yield url
    os.killpg(proc.pid, 15)
    proc.wait(30)


def rest(url, path, body=None):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def test_a_stage_run_is_found_with_params_metrics_tags_and_artifacts(run_stage, fake_server, mlflow_server,
                                                                    tmp_path):
    server = fake_server()
    write_prompts(tmp_path / "in", 5)
    secret = "sk-test-must-not-leak-42"
    run_stage("generate", "server=remote", f"server.base_url={server.url}", "server.model=fake-model",
              f"generate.input={tmp_path / 'in'}", f"generate.output={tmp_path / 'out'}", "server.api_key_env=MY_KEY",
              f"mlflow.tracking_uri={mlflow_server}", env={"MY_KEY": secret})
    exp = rest(mlflow_server, "/api/2.0/mlflow/experiments/get-by-name?experiment_name=drafter-data")["experiment"]
    runs = rest(mlflow_server, "/api/2.0/mlflow/runs/search",
                {"experiment_ids": [exp["experiment_id"]], "filter": "tags.stage = 'generate'"})["runs"]
    assert len(runs) == 1
    run = runs[0]
    params = {p["key"]: p["value"] for p in run["data"]["params"]}
    metrics = {m["key"]: m["value"] for m in run["data"]["metrics"]}
    tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
    assert params["server.model"] == "fake-model" and params["generation.thinking"] == "True"
    assert params["server.api_key_env"] == "MY_KEY"
    assert metrics["done_total"] == 5 and metrics["output_tokens_per_s"] > 0
    assert tags["stage"] == "generate" and len(tags.get("git_commit", "")) == 40
    assert secret not in json.dumps(run)
    arts = rest(mlflow_server, f"/api/2.0/mlflow/artifacts/list?run_id={run['info']['run_id']}")
    assert {"run.json", "errors.jsonl"} <= {f["path"] for f in arts["files"]}


def test_compare_runs_prints_a_table(mlflow_server):
    out = subprocess.run([sys.executable, "-m", "drafter_data.compare_runs", "--last", "5"], cwd=REPO,
                         env={**os.environ, "MLFLOW_TRACKING_URI": mlflow_server}, capture_output=True, text=True)
    assert out.returncode == 0 and "generate" in out.stdout and "fake-model" in out.stdout
