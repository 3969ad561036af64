import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
PROMPT_FIXTURES = SHARED / "fixtures" / "prompts"
KIMI_DIR = SHARED / "fixtures" / "kimi-k2-tokenizer"


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
