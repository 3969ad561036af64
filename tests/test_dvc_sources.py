"""The user's prompt files are versioned data: DVC re-runs prepare (and what it feeds) when one of them changes by a
single byte, wherever it lives, and skips it when nothing changed. Runs real `dvc exp run` / `dvc repro` in a
temporary clone of the repo (never the repo's own dvc.lock or params.yaml); generate runs against the real
llama-server, so "downstream re-runs" is checked by generate actually answering the changed prompt."""
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, read_rows, sources_override

VENV_BIN = Path(sys.executable).parent
GIT_IDENTITY = {"GIT_AUTHOR_NAME": "test", "GIT_AUTHOR_EMAIL": "test@localhost", "GIT_COMMITTER_NAME": "test",
                "GIT_COMMITTER_EMAIL": "test@localhost"}


def clone_repo(dest: Path) -> Path:
    """A clone of the repo's committed state: what CI checks out."""
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(REPO), str(dest)], check=True)
    return dest


def dvc_env(mlflow_uri: str, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DVC_")}  # never the outer DVC's stage vars
    return {**env, **GIT_IDENTITY, "PATH": f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}", "DVC_NO_ANALYTICS": "1",
            "MLFLOW_TRACKING_URI": mlflow_uri, **extra}


def dvc(repo: Path, env: dict, *args: str, timeout: float = 300) -> str:
    proc = subprocess.run([str(VENV_BIN / "dvc"), *args], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=timeout)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"dvc {' '.join(args)} failed ({proc.returncode}):\n{output[-4000:]}"
    return output


def ran(output: str, stage: str) -> bool:
    return f"Running stage '{stage}'" in output


def skipped(output: str, stage: str) -> bool:
    return f"Stage '{stage}' didn't change, skipping" in output and not ran(output, stage)


def flip_one_byte(path: Path, old: bytes, new: bytes) -> None:
    """Rewrites the file with the one place `old` occurs replaced by `new`, which differs from it in one byte."""
    data = path.read_bytes()
    assert data.count(old) == 1 and len(old) == len(new) and sum(a != b for a, b in zip(old, new)) == 1
    path.write_bytes(data.replace(old, new))


def write_jsonl_prompts(path: Path, prompts: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path


def prompt_texts(prompts_dir: Path) -> set[str]:
    return {m["content"] for row in read_rows(prompts_dir, "prompts-") for m in row["messages"] if m["role"] == "user"}


def server_overrides(url: str) -> list[str]:
    """A tiny generate against an already-running server (the real llama-server in these tests)."""
    return ["-S", "server=remote", "-S", f"server.base_url={url}", "-S", "server.model=gemma-3-270m",
            "-S", "generation.max_tokens=8", "-S", "generation.concurrency=4"]


def test_outside_and_in_repo_sources_rerun_prepare_and_downstream_only_when_changed(tmp_path, llama_server,
                                                                                   mlflow_uri):
    repo = clone_repo(tmp_path / "repo")
    env = dvc_env(mlflow_uri)
    outside = write_jsonl_prompts(tmp_path / "elsewhere" / "questions.jsonl",
                                  ["Name a red fruit.", "Name a blue bird.", "Name a green tree."])
    write_jsonl_prompts(repo / "my_prompts" / "mine.jsonl", ["Name a small cat."])
    subprocess.run(["git", "add", "my_prompts"], cwd=repo, check=True, env=env)
    subprocess.run(["git", "commit", "-qm", "my prompts"], cwd=repo, check=True, env=env)
    sources = ["-S", sources_override(("outside", outside, "auto"), ("mine", "my_prompts/mine.jsonl", "auto"))]

    first = dvc(repo, env, "exp", "run", "generate", *sources, *server_overrides(llama_server))
    assert ran(first, "sources") and ran(first, "prepare") and ran(first, "generate")
    assert "Name a red fruit." in prompt_texts(repo / "data" / "prompts")

    unchanged = dvc(repo, env, "repro", "generate")
    assert ran(unchanged, "sources") and skipped(unchanged, "prepare") and skipped(unchanged, "generate")

    flip_one_byte(outside, b"red", b"bed")  # outside the repo
    after_outside_edit = dvc(repo, env, "repro", "generate")
    assert ran(after_outside_edit, "prepare") and ran(after_outside_edit, "generate")
    assert "Name a bed fruit." in prompt_texts(repo / "data" / "prompts")
    answered = {m["content"] for r in read_rows(repo / "data" / "completions", "completions-")
                for m in r["messages"] if m["role"] == "user"}
    assert "Name a bed fruit." in answered

    flip_one_byte(repo / "my_prompts" / "mine.jsonl", b"small", b"smell")  # in the repo
    after_repo_edit = dvc(repo, env, "exp", "run", "prepare", *sources, *server_overrides(llama_server))
    assert ran(after_repo_edit, "prepare") and "Name a smell cat." in prompt_texts(repo / "data" / "prompts")
    status = dvc(repo, env, "status", "generate")
    assert "data/prompts" in status, "generate must show as changed once prepare's output changed:\n" + status
