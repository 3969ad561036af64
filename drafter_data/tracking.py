"""MLflow across the pipeline: one experiment, one run per stage execution, traceable to code and data.

Every run logs the stage's resolved config (flattened; secrets never: only the *name* of the key's env var is in the
config), its counts and throughput as metrics, reports/plots as artifacts, and tags with the git commit and the DVC
hashes of the stage's deps and outs as recorded in dvc.lock.
"""
from __future__ import annotations

import os
import re
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import yaml
from omegaconf import DictConfig

from drafter_data.config import flatten

_SECRET = re.compile(r"(api_key|token|secret|password)$", re.I)
_EXPS_TMP = os.sep + os.path.join(".dvc", "tmp", "exps") + os.sep


def repo_root() -> Path:
    """The repo root, also from inside a `dvc exp` temp copy (.dvc/tmp/exps/tmpXXX), whose cwd is thrown away."""
    cwd = str(Path.cwd().resolve())
    if _EXPS_TMP in cwd:
        return Path(cwd.split(_EXPS_TMP)[0])
    return Path(cwd)


def tracking_uri(cfg: DictConfig) -> str:
    configured = cfg.get("mlflow", {}).get("tracking_uri")
    if configured:
        return str(configured)
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return f"sqlite:///{repo_root() / 'mlflow.db'}"


def _public_params(cfg: DictConfig) -> dict[str, str]:
    params = {}
    for key, value in flatten(cfg).items():
        if _SECRET.search(key.split(".")[-1]) and not key.endswith("_env"):
            continue
        text = str(value)
        params[key] = text if len(text) <= 6000 else text[:5990] + "..."
    return params


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--verify", "-q", "HEAD"], capture_output=True, text=True,
                             timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _dvc_tags(stage: str) -> dict[str, str]:
    """The DVC hashes of this stage's data inputs: each dep that another stage produced, as dvc.lock records it
    (DVC writes an upstream stage's lock entry before running the next stage)."""
    try:
        pipeline = yaml.safe_load(Path("dvc.yaml").read_text()) or {}
        lock = yaml.safe_load(Path("dvc.lock").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return {}
    produced = {out["path"]: out["md5"] for entry in lock.get("stages", {}).values()
                for out in entry.get("outs", []) or [] if "md5" in out}
    deps = (pipeline.get("stages", {}).get(stage, {}) or {}).get("deps", []) or []
    return {f"dvc.input.{dep}": produced[dep] for dep in deps if isinstance(dep, str) and dep in produced}


def preload() -> None:
    """Imports mlflow (1.5-2 s) in the background while a stage does its work, so the run is logged at once."""
    import threading

    threading.Thread(target=lambda: __import__("mlflow"), daemon=True).start()


class StageRun:
    """A thin handle over the active MLflow run; metrics are buffered and sent in batches (one call ~20 ms)."""

    def __init__(self, run_id: str, client):
        self.run_id = run_id
        self._client = client
        self._pending = []
        self._last_flush = time.monotonic()

    def metrics(self, values: dict[str, float], step: int | None = None, flush_every_s: float = 10.0) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        self._pending += [Metric(k, float(v), now_ms, step or 0) for k, v in values.items() if v is not None]
        if time.monotonic() - self._last_flush >= flush_every_s:
            self.flush()

    def flush(self) -> None:
        if self._pending:
            self._client.log_batch(self.run_id, metrics=self._pending)
            self._pending = []
        self._last_flush = time.monotonic()

    def artifact(self, path: Path | str, artifact_path: str | None = None) -> None:
        self._client.log_artifact(self.run_id, str(path), artifact_path)


@contextmanager
def stage_run(stage: str, cfg: DictConfig):
    """with stage_run("prepare", cfg) as run: run.metrics({...}); ..."""
    import mlflow
    from mlflow.tracking import MlflowClient

    mlflow.set_tracking_uri(tracking_uri(cfg))
    mlflow.set_experiment(cfg.get("mlflow", {}).get("experiment") or "drafter-data")
    tags = {"stage": stage, **_dvc_tags(stage)}
    commit = _git_commit()
    if commit:
        tags["git_commit"] = commit
    with mlflow.start_run(run_name=stage, tags=tags) as active:
        mlflow.log_params(_public_params(cfg))
        run = StageRun(active.info.run_id, MlflowClient())
        try:
            yield run
        finally:
            run.flush()
