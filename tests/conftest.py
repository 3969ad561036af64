import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from drafter_data.worker_processes import dies_with_this_process

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
PROMPT_FIXTURES = SHARED / "fixtures" / "prompts"
KIMI_DIR = SHARED / "fixtures" / "kimi-k2-tokenizer"


def pytest_configure(config):
    """SIGTERM (a user, a CI timeout) ends the run as Ctrl-C does: pytest then tears the fixtures down, and the
    servers they started stop. Every process a test starts (from the main thread: a server, a stage) is also killed
    by the kernel if this one is killed outright (dies_with_this_process)."""
    def interrupted(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupted)
    popen_init = subprocess.Popen.__init__

    def init(self, *args, **kwargs):
        if kwargs.get("preexec_fn") is None and threading.current_thread() is threading.main_thread():
            kwargs["preexec_fn"] = dies_with_this_process()
        popen_init(self, *args, **kwargs)

    subprocess.Popen.__init__ = init


def require_shared(path: Path) -> Path:
    if not path.exists():
        pytest.fail(f"test data missing: {path} (the tests read ../shared beside the repo, as CI lays it out)")
    return path


@pytest.fixture(scope="session")
def mlflow_uri(tmp_path_factory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture
def run_stage(mlflow_uri):
    """Runs `python -m stages.<name> overrides...` from the repo root, as a user or DVC would."""

    def run(name: str, *overrides: str, check: bool = True, env: dict | None = None, timeout: float = 600):
        full_env = {**os.environ, "MLFLOW_TRACKING_URI": mlflow_uri, **(env or {})}
        proc = subprocess.run([sys.executable, "-m", f"stages.{name}", *overrides], cwd=REPO, env=full_env,
                              capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"stage {name} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        return proc

    return run


def read_rows(directory: Path, prefix: str = "") -> list[dict]:
    rows = []
    for path in sorted(Path(directory).glob(f"{prefix}*.parquet")):
        rows += pq.read_table(path).to_pylist()
    return rows


def sources_override(*sources: tuple[str, Path, str]) -> str:
    inner = ",".join(f"{{name:{n},path:'{p}',format:{f}}}" for n, p, f in sources)
    return f"prepare.sources=[{inner}]"


class FakeServerProcess:
    """The fault-injecting test server (tests/fake_openai_server.py) in its own process, on a free loopback port."""

    def __init__(self, config: dict | None = None, port: int = 0):
        import json as _json

        self.config = config or {}
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.fake_openai_server", "--port", str(port),
                                      "--config", _json.dumps(self.config)], cwd=REPO, stdout=subprocess.PIPE,
                                     text=True, start_new_session=True)
        line = self.proc.stdout.readline()
        if not line.startswith("READY"):
            self.stop()
            raise RuntimeError(f"fake server did not start: {line!r}")
        self.port = int(line.split()[1])
        self.url = f"http://127.0.0.1:{self.port}/v1"

    def stats(self, **query) -> dict:
        import urllib.parse

        return self._get(f"/stats?{urllib.parse.urlencode(query)}")

    def requests(self) -> list[dict]:
        """Every chat request received, in order: {"index", "received" (time.time()), "body"}."""
        return self._get("/requests")

    def _get(self, path: str):
        import json as _json
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as resp:
            return _json.loads(resp.read())

    def stop(self) -> None:
        import signal as _signal

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, _signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture
def fake_server():
    started = []

    def start(config: dict | None = None, port: int = 0) -> FakeServerProcess:
        server = FakeServerProcess(config, port)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def write_prompts(directory: Path, n: int, words: int = 3, start: int = 0) -> list[dict]:
    """A prompts directory as prepare writes it, with n distinct prompts."""
    import hashlib

    import pyarrow as pa

    from drafter_data.contract import PROMPTS

    rows = []
    for i in range(start, start + n):
        messages = [{"role": "user", "content": " ".join(f"word{i}-{j}" for j in range(words))}]
        rows.append({"prompt_id": hashlib.sha256(str(messages).encode()).hexdigest()[:32], "source": "test",
                     "messages": messages, "tools": None})
    directory.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=PROMPTS), directory / "prompts-00000.parquet")
    return rows


@pytest.fixture(scope="session")
def llama_server():
    """The real llama-server (built by ./setup.sh) with the Gemma 3 270M GGUF, on a free loopback port."""
    import signal as _signal
    import time as _time

    from omegaconf import OmegaConf

    from drafter_data.server.local import default_binary, default_model_path, free_port, healthy, server_command

    if not default_binary().exists() or not default_model_path().exists():
        pytest.fail(f"llama-server or the model is missing ({default_binary()}, {default_model_path()}): "
                    f"run ./setup.sh first")
    local = OmegaConf.load(REPO / "conf/server/local.yaml").local
    local.chat_template = str(REPO / local.chat_template)
    local.slots, local.context = 8, 8192
    port = free_port()
    proc = subprocess.Popen(server_command(local, "gemma-3-270m", port), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}/v1"
    deadline = _time.monotonic() + 60
    while not healthy(url, timeout=1.0):
        if proc.poll() is not None or _time.monotonic() > deadline:
            pytest.fail(f"llama-server did not start (exit code {proc.poll()})")
        _time.sleep(0.2)
    yield url
    os.killpg(proc.pid, _signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, _signal.SIGKILL)
