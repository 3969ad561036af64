"""Remote storage: the pipeline's real outputs (a tiny `dvc exp run` on the real llama-server, in a temporary clone)
go to an S3-compatible store on loopback (moto's server, in memory) with `dvc push`, and a second fresh clone gets
them back byte-identical with `dvc pull`. The same run's four MLflow runs are checked as a user reads them: named,
tagged with one pipeline_run and the experiment name, timed from each stage's start."""
import contextlib
import os
import re
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from drafter_data.server.local import free_port
from tests.test_dvc_sources import clone_repo, dvc, dvc_env, ran, server_overrides, write_jsonl_prompts
from tests.conftest import sources_override

S3_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
STAGES = ("prepare", "assess", "generate", "tokenize", "export")


def _s3_answers(endpoint: str) -> bool:
    try:
        with urllib.request.urlopen(endpoint + "/", timeout=1):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def s3_server(*buckets: str):
    """moto's S3 server on a free loopback port with these buckets; yields its endpoint URL. Skips the test (with the
    reason) only when the server cannot start."""
    port = free_port()
    log = open(os.devnull, "w")
    proc = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while not _s3_answers(endpoint):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.skip(f"moto's S3 server did not start on {endpoint} (exit code {proc.poll()})")
            time.sleep(0.1)
        client = s3_client(endpoint)
        for bucket in buckets:
            client.create_bucket(Bucket=bucket)
        yield endpoint
    finally:
        os.killpg(proc.pid, 9)
        proc.wait(10)
        log.close()


def s3_client(endpoint: str):
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=S3_CREDENTIALS["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=S3_CREDENTIALS["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1")


def s3_keys(endpoint: str, bucket: str, prefix: str = "") -> list[str]:
    pages = s3_client(endpoint).get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return [obj["Key"] for page in pages for obj in page.get("Contents", [])]


def tree_bytes(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def tracked_bytes(repo: Path, env: dict, out: str) -> dict[str, bytes]:
    """The files of an output that DVC versions: without those .dvcignore leaves out (generate's .lock file)."""
    files = tree_bytes(repo / out)
    proc = subprocess.run([str(Path(sys.executable).parent / "dvc"), "check-ignore", *(f"{out}/{f}" for f in files)],
                          cwd=repo, env=env, capture_output=True, text=True)
    ignored = {line.strip().removeprefix(out + "/") for line in proc.stdout.splitlines()}
    return {name: data for name, data in files.items() if name not in ignored}


@pytest.fixture(scope="module")
def pipeline_repo(tmp_path_factory, llama_server, mlflow_uri):
    """A clone of the repo after one whole tiny `dvc exp run` (every stage, outside prompt file), committed."""
    tmp = tmp_path_factory.mktemp("storage")
    repo = clone_repo(tmp / "repo")
    env = dvc_env(mlflow_uri)
    outside = write_jsonl_prompts(tmp / "prompts" / "q.jsonl", ["Name a prime.", "Name a colour.", "Name a cat."])
    exp_name = f"storage-{uuid.uuid4().hex[:8]}"
    started = time.time()
    # over 3 rows of 8 tokens one answer the model split its own way is a drift rate of 0.33: the drift guard is not
    # what these tests are about (tests/test_tokenize_ids.py), as in the other real-server runs
    out = dvc(repo, env, "exp", "run", "-n", exp_name, "-S", sources_override(("q", outside, "auto")),
              *server_overrides(llama_server), "-S", "assess.concurrency=[1]", "-S", "assess.requests_per_level=3",
              "-S", "tokenize.max_drift_rate=1")
    assert all(ran(out, stage) for stage in STAGES), out
    subprocess.run(["git", "add", "-A"], cwd=repo, env=env, check=True)
    subprocess.run(["git", "commit", "-qm", "tiny pipeline run"], cwd=repo, env=env, check=True)
    return {"repo": repo, "env": env, "exp_name": exp_name, "started": started, "mlflow_uri": mlflow_uri}


def test_push_then_pull_in_a_fresh_clone_restores_byte_identical_outputs(pipeline_repo, tmp_path):
    repo, env = pipeline_repo["repo"], {**pipeline_repo["env"], **S3_CREDENTIALS}
    with s3_server("dvc-store") as endpoint:
        dvc(repo, env, "remote", "add", "-d", "store", "s3://dvc-store/drafter-data")
        dvc(repo, env, "remote", "modify", "store", "endpointurl", endpoint)
        subprocess.run(["git", "commit", "-qam", "remote"], cwd=repo, env=env, check=True)
        dvc(repo, env, "push")
        assert "in sync" in dvc(repo, env, "status", "--cloud")
        assert len(s3_keys(endpoint, "dvc-store", "drafter-data/files/md5/")) > 5

        fresh = tmp_path / "fresh"
        subprocess.run(["git", "clone", "-q", str(repo), str(fresh)], env=env, check=True)
        assert not (fresh / "data" / "tokens").exists()
        dvc(fresh, env, "pull")
    for out in ("data/tokens", "data/completions", "data/prompts"):
        original, pulled = tracked_bytes(repo, env, out), tree_bytes(fresh / out)
        assert original and pulled == original, f"{out} differs after dvc pull"
    assert any(name.endswith(".parquet") for name in tree_bytes(fresh / "data" / "tokens"))


def test_the_stage_runs_of_one_exp_run_share_a_pipeline_run_and_their_real_times(pipeline_repo):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(pipeline_repo["mlflow_uri"])
    exp = client.get_experiment_by_name("drafter-data")
    assert exp.tags.get("mlflow.experimentKind") == "custom_model_development"
    runs = client.search_runs([exp.experiment_id], f"tags.dvc_exp = '{pipeline_repo['exp_name']}'")
    by_stage = {r.data.tags["stage"]: r for r in runs}
    assert sorted(by_stage) == sorted(STAGES) and len(runs) == len(STAGES)
    assert {r.info.run_name for r in runs} == {f"thinking=on · {s} · gemma3-270m" for s in STAGES}
    assert len({r.data.tags["pipeline_run"] for r in runs}) == 1
    assert re.fullmatch(r"\d{8}T\d{6}Z-[0-9a-f]{8}", runs[0].data.tags["pipeline_run"])
    assert all(r.data.tags["target"] == "gemma3-270m" and r.info.status == "FINISHED" for r in runs)
    spans = [(by_stage[s].info.start_time, by_stage[s].info.end_time) for s in STAGES]
    assert spans[0][0] >= pipeline_repo["started"] * 1000
    for (_, end), (next_start, _) in zip(spans, spans[1:]):
        assert end <= next_start + 100, "DVC runs the stages one after another: their runs must not overlap"
    # each run spans its stage's process, so together they cover most of the pipeline's time (runs opened at the
    # end of a stage covered a few percent)
    covered = sum(end - start for start, end in spans)
    assert covered >= 0.5 * (spans[-1][1] - spans[0][0])
