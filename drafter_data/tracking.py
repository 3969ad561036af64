"""MLflow across the pipeline: one experiment, one run per stage execution, traceable to code, data and invocation.

Each run is named `thinking=<on|off|mix> · <stage> · <target>` (what tells runs apart first: the UI cuts long names),
starts when its stage's process started (so the UI's duration is the stage's), and is tagged `stage`, `target`, `pipeline_run` (one id shared by the stage runs of one
`dvc repro` / `dvc exp run`), `dvc_exp` under `dvc exp run`, the git commit and the DVC hashes of its data inputs.
Params are the stage's resolved config, flattened; secrets never: keys named like secrets are left out, URLs lose
their user:password, and the API key appears only as the *name* of its environment variable.

Tracking is best effort and isolated: every MLflow call runs on one background thread, so a slow or locked store
never holds up a stage, and a failure is reported once on stderr and never raised: a stage's data never depend on
MLflow.
"""
from __future__ import annotations

import datetime as dt
import hashlib
import os
import queue
import re
import subprocess
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import yaml
from omegaconf import DictConfig

from drafter_data.config import flatten
from drafter_data.redaction import redact_url

EXPERIMENT = "drafter-data"
STAGES = ("prepare", "assess", "generate", "tokenize")  # the stages that log a run, in pipeline order
# What MLflow 3 reads as "a training experiment" (custom_model_development is shown as "Machine learning").
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}
# The longest a stage waits for MLflow (at an artifact upload or at its end) before going on without waiting again.
WAIT_S = 120.0
# A stage stopped by Ctrl-C or SIGTERM waits no longer than this for MLflow to record the run KILLED: the user (or a
# scheduler's grace period) wants it gone, and a store that does not answer would otherwise hold it up for WAIT_S.
STOP_WAIT_S = 10.0
# A tracking server is asked once, at the start, whether it answers at all, within this (see check_reachable).
REACH_TIMEOUT_S = 5.0
# A run's metrics waiting to be sent are capped (oldest dropped) while the store does not answer.
MAX_PENDING_METRICS = 100_000

_SECRET_KEY = re.compile(r"(api_key|token|secret|password)$", re.I)
_EXPS_TMP = os.sep + os.path.join(".dvc", "tmp", "exps") + os.sep
_DVC_COMMANDS = {"repro", "exp"}  # `dvc repro`, `dvc exp run`, and the queue's `dvc exp exec-run` worker


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


def public_params(cfg: DictConfig) -> dict[str, str]:
    params = {}
    for key, value in flatten(cfg).items():
        if _SECRET_KEY.search(key.split(".")[-1]) and not key.endswith("_env"):
            continue
        text = redact_url(value)
        params[key] = text if len(text) <= 6000 else text[:5990] + "..."
    return params


def thinking_label(cfg: DictConfig) -> str:
    generation = cfg.get("generation") or {}
    if generation.get("thinking_ratio") is not None:
        return "mix"
    return "on" if generation.get("thinking", True) else "off"


def target_name(cfg: DictConfig) -> str:
    return str((cfg.get("target") or {}).get("name") or "unknown-target")


def run_name(stage: str, cfg: DictConfig) -> str:
    """What tells two runs apart first (the runs table cuts names): thinking=on · generate · kimi-k2.6."""
    return f"thinking={thinking_label(cfg)} · {stage} · {target_name(cfg)}"


def _is_dvc_invocation(cmdline: list[str]) -> bool:
    """[python, .../dvc, repro, ...], [.../dvc, exp, run, ...], [python, -m, dvc, repro, ...]"""
    head = [os.path.basename(a) for a in cmdline[:3]]
    return "dvc" in head and any(a in _DVC_COMMANDS for a in cmdline[1:4])


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def pipeline_run_id() -> str:
    """One id per `dvc repro` / `dvc exp run` invocation, shared by all the stages it runs: derived from the nearest
    ancestor dvc process (its pid, start time and the boot id), so it needs no state. PIPELINE_RUN_ID overrides it;
    a stage run by hand gets an id of its own."""
    if os.environ.get("PIPELINE_RUN_ID"):
        return os.environ["PIPELINE_RUN_ID"]
    import psutil

    try:
        for proc in psutil.Process().parents():  # nearest first
            try:
                cmdline = proc.cmdline()
            except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
                continue
            if _is_dvc_invocation(cmdline):
                started = proc.create_time()
                digest = hashlib.sha1(f"{_boot_id()}:{proc.pid}:{started}".encode()).hexdigest()[:8]
                return f"{dt.datetime.fromtimestamp(started, dt.timezone.utc):%Y%m%dT%H%M%SZ}-{digest}"
    except psutil.Error:
        pass
    return f"adhoc-{uuid.uuid4().hex[:12]}"


def stage_start_ms() -> int:
    """When this stage's process started: the run's start (a run opens when its stage has checked its config). From
    the process's age in clock ticks since boot (10 ms), not psutil's create_time, whose boot time is whole seconds:
    a run could seem to start up to a second before the previous stage's run ended."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        age_s = time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK")
        return int((time.time() - age_s) * 1000)
    except (OSError, ValueError, IndexError, AttributeError):  # not Linux
        import psutil

        try:
            return int(psutil.Process().create_time() * 1000)
        except psutil.Error:
            return int(time.time() * 1000)


def git_commit() -> str | None:
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


def run_tags(stage: str, cfg: DictConfig) -> dict[str, str]:
    tags = {"stage": stage, "target": target_name(cfg), "thinking": thinking_label(cfg),
            "pipeline_run": pipeline_run_id(), **_dvc_tags(stage)}
    if os.environ.get("DVC_EXP_NAME"):
        tags["dvc_exp"] = os.environ["DVC_EXP_NAME"]
    if os.environ.get("DVC_EXP_BASELINE_REV"):
        tags["dvc_exp_baseline"] = os.environ["DVC_EXP_BASELINE_REV"]
    commit = git_commit()
    if commit:
        tags["git_commit"] = commit
        tags["mlflow.source.git.commit"] = commit
    return {k: redact_url(v) for k, v in tags.items()}


def experiment_name(cfg: DictConfig) -> str:
    return str((cfg.get("mlflow") or {}).get("experiment") or EXPERIMENT)


def _experiment_id(client, name: str, uri: str) -> str:
    """The experiment, created if missing (artifacts beside a sqlite database, not under whatever the cwd is, which
    in a `dvc exp` temp copy is thrown away), tagged as a training experiment."""
    from mlflow.exceptions import MlflowException

    exp = client.get_experiment_by_name(name)
    if exp is None:
        location = None
        if uri.startswith("sqlite:///"):
            location = (Path(uri[len("sqlite:///"):]).parent / "mlruns").resolve().as_uri()
        try:
            return client.create_experiment(name, artifact_location=location, tags=EXPERIMENT_KIND)
        except MlflowException:  # another stage created it at the same moment
            exp = client.get_experiment_by_name(name)
    for key, value in EXPERIMENT_KIND.items():
        if exp.tags.get(key) != value:
            client.set_experiment_tag(exp.experiment_id, key, value)
    return exp.experiment_id


class StageRun:
    """One stage's MLflow run. Calls go, in order, to one background thread; none of them ever raises. Metrics are
    buffered and sent in batches (one call costs ~20 ms on sqlite, far more on a slow server)."""

    def __init__(self, stage: str):
        self.stage = stage
        self.run_id: str | None = None
        self._client = None
        self._calls: queue.Queue = queue.Queue()
        self._pending: list[tuple[str, float, int, int]] = []
        self._pending_lock = threading.Lock()  # stages may log from a thread of their own too
        self._last_flush = time.monotonic()
        self._last_step = 0
        self._reported = False
        self._stalled = False  # MLflow did not answer within WAIT_S once: the stage waits for it no more
        self.stopped_by_signal = False  # a stage that ends by itself after Ctrl-C/SIGTERM: the run is KILLED
        self._thread = threading.Thread(target=self._work, name=f"mlflow-{stage}", daemon=True)
        self._thread.start()

    # --- the stage's side: never blocks long, never raises
    def metrics(self, values: dict[str, float], step: int | None = None, flush_every_s: float = 10.0) -> None:
        try:
            now_ms = int(time.time() * 1000)
            if step is not None:
                self._last_step = max(self._last_step, int(step))
            # A value without a step is a summary: logged at the last step so far, it is the value MLflow shows
            # (the one at the highest step), not the last of the live values logged while the stage ran.
            step = self._last_step if step is None else int(step)
            batch = [(k, float(v), now_ms, step) for k, v in values.items() if v is not None]
            with self._pending_lock:
                self._pending += batch
                del self._pending[:-MAX_PENDING_METRICS]
            if time.monotonic() - self._last_flush >= flush_every_s:
                self._send_pending()
        except Exception as exc:  # a value that is not a number must not stop the stage either
            self._report("metrics", exc)

    def flush(self) -> None:
        """Sends the buffered metrics and waits (bounded) until MLflow has them."""
        self._send_pending()
        self._wait()

    def settle(self, max_s: float) -> None:
        """Waits up to max_s for the calls so far (opening the run: importing MLflow takes ~2.5 s of CPU). Its thread
        shares the interpreter lock with the stage: a stage about to run a hot loop lets it finish first."""
        done = threading.Event()
        self._submit(done.set)
        done.wait(max_s)

    def artifact(self, path: Path | str, artifact_path: str | None = None) -> None:
        """Uploads a file; returns once it is uploaded or failed (bounded), so the file may be removed after."""
        self._submit(self._upload, str(path), artifact_path)
        self._wait()

    def figure(self, png_path: Path | str) -> None:
        """A plot, shown under plots/ in the run."""
        self.artifact(png_path, "plots")

    def tags(self, values: dict[str, str]) -> None:
        """Tags set on the run (e.g. what limited it)."""
        self._submit(self._set_tags, {k: str(v) for k, v in values.items()})

    def open(self, uri: str, experiment: str, name: str, tags: dict, params: dict, start_ms: int) -> None:
        self._submit(self._open, uri, experiment, name, tags, params, start_ms)

    def close(self, status: str, stopping: bool = False) -> None:
        """Ends the run; waits for MLflow up to WAIT_S, or STOP_WAIT_S when the stage is `stopping` (a signal)."""
        self._send_pending()
        self._submit(self._terminate, status, int(time.time() * 1000))
        self._wait(STOP_WAIT_S if stopping else WAIT_S)

    # --- the background thread's side
    def _submit(self, fn, *args) -> None:
        self._calls.put((fn, args))

    def _send_pending(self) -> None:
        with self._pending_lock:
            batch, self._pending = self._pending, []
        if batch:
            self._submit(self._log_metrics, batch)
        self._last_flush = time.monotonic()

    def _wait(self, wait_s: float | None = None) -> None:
        wait_s = WAIT_S if wait_s is None else wait_s
        done = threading.Event()
        self._submit(done.set)
        if not self._stalled and not done.wait(wait_s):
            self._stalled = True
            self._report("waiting", TimeoutError(f"no answer in {wait_s:g} s"))

    def _work(self) -> None:
        while True:
            fn, args = self._calls.get()
            try:
                fn(*args)
            except Exception as exc:
                self._report(fn.__name__.strip("_"), exc)

    def _report(self, what: str, exc: BaseException) -> None:
        if self._reported:
            return
        self._reported = True
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        print(f"warning: MLflow ({what}): {type(exc).__name__}: {redact_url(reason)}; {self.stage} goes on without it "
              f"(its data are not affected; further MLflow errors of this run are not shown)", file=sys.stderr)

    def _open(self, uri: str, experiment: str, name: str, tags: dict, params: dict, start_ms: int) -> None:
        check_reachable(uri)
        os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=uri)
        run = client.create_run(_experiment_id(client, experiment, uri), start_time=start_ms, tags=tags,
                                run_name=name)
        self._client, self.run_id = client, run.info.run_id
        client.log_batch(self.run_id, params=[Param(k, v) for k, v in params.items()])

    def _set_tags(self, values: dict[str, str]) -> None:
        if self.run_id is None:
            return
        from mlflow.entities import RunTag

        self._client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in values.items()])

    def _log_metrics(self, batch: list[tuple[str, float, int, int]]) -> None:
        if self.run_id is None:
            return  # the run could not be opened (reported then)
        from mlflow.entities import Metric

        self._client.log_batch(self.run_id, metrics=[Metric(*m) for m in batch])

    def _upload(self, path: str, artifact_path: str | None) -> None:
        if self.run_id is not None:
            self._client.log_artifact(self.run_id, path, artifact_path)

    def _terminate(self, status: str, end_ms: int) -> None:
        if self.run_id is not None:
            self._client.set_terminated(self.run_id, status, end_time=end_ms)


def check_reachable(uri: str, timeout_s: float = REACH_TIMEOUT_S) -> None:
    """A tracking server (http/https URI) that does not answer within timeout_s raises ConnectionError: the stage
    then runs without tracking at once, instead of waiting out MLflow's own timeouts and retries on every call."""
    if not uri.lower().startswith(("http://", "https://")):
        return
    import ssl
    import urllib.error
    import urllib.request

    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(uri)
    bare = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))  # urllib takes no user:password@
    try:
        with urllib.request.urlopen(bare.rstrip("/") + "/health", timeout=timeout_s):
            return
    except urllib.error.HTTPError as exc:  # it answered: it is there, unless it fails (MLflow would retry for minutes)
        if exc.code >= 500:
            raise ConnectionError(f"the tracking server {redact_url(uri)} answered HTTP {exc.code} ({exc.reason})") \
                from None
        return
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, ssl.SSLError):  # it answered; its certificate is MLflow's business
            return
        raise ConnectionError(f"the tracking server {redact_url(uri)} did not answer within {timeout_s:g} s "
                              f"({reason})") from None


@contextmanager
def stage_run(stage: str, cfg: DictConfig):
    """with stage_run("prepare", cfg) as run: run.metrics({...}); run.artifact(path)"""
    run = StageRun(stage)
    try:
        run.open(tracking_uri(cfg), experiment_name(cfg), run_name(stage, cfg), run_tags(stage, cfg),
                 public_params(cfg), stage_start_ms())
    except Exception as exc:  # the config could not be read for tracking: the stage still runs
        run._report("open", exc)
    status = "FAILED"
    try:
        yield run
        status = "KILLED" if run.stopped_by_signal else "FINISHED"
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C, or SIGTERM (config.run_stage turns it into SystemExit)
        status = "KILLED"
        raise
    finally:
        run.close(status, stopping=status == "KILLED")
