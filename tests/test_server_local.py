"""server.kind=local with a server already at server.base_url, all real llama-server processes: reused only when its
/props shows our model file, alias, chat template and context; anything else is left alone and our own is started on a
free port, saying so in one line."""
import os
import signal
import subprocess
import time

import pytest
from omegaconf import OmegaConf

from drafter_data.server.local import (default_binary, default_model_path, free_port, healthy, local_server, props,
                                       server_command)
from tests.conftest import REPO

TEMPLATE = REPO / "conf/templates/gemma3-270m.jinja"


def local_cfg(port: int, model: str = "gemma-3-270m", template=TEMPLATE):
    return OmegaConf.create({"kind": "local", "base_url": f"http://127.0.0.1:{port}/v1", "model": model,
                             "api_key_env": "DRAFTER_API_KEY",
                             "local": {"binary": None, "model_path": None, "chat_template": str(template),
                                       "slots": 2, "context": 4096, "threads": 1, "startup_timeout_s": 60}})


@pytest.fixture
def other_server():
    """Starts "somebody else's" llama-server from a config (its own process group); stops them after the test."""
    if not default_binary().exists() or not default_model_path().exists():
        pytest.fail(f"llama-server or the model is missing ({default_binary()}, {default_model_path()}): "
                    f"run ./setup.sh first")
    started = []

    def start(cfg) -> subprocess.Popen:
        port = int(cfg.base_url.rsplit(":", 1)[1].split("/")[0])
        proc = subprocess.Popen(server_command(cfg.local, cfg.model, port), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        started.append(proc)
        deadline = time.monotonic() + 60
        while not healthy(cfg.base_url, timeout=1.0):
            assert proc.poll() is None and time.monotonic() < deadline, "the other llama-server did not start"
            time.sleep(0.2)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(15)


def test_a_foreign_alias_on_the_port_is_left_alone_and_ours_starts_elsewhere(other_server, capsys):
    port = free_port()
    foreign = other_server(local_cfg(port, model="somebody-elses-model"))
    with local_server(local_cfg(port)) as url:
        assert url != f"http://127.0.0.1:{port}/v1"
        assert props(url)["model_alias"] == "gemma-3-270m"
    err = capsys.readouterr().err
    assert "not reusing the server at" in err and "'somebody-elses-model', not 'gemma-3-270m'" in err
    assert "started llama-server" in err
    assert foreign.poll() is None and healthy(f"http://127.0.0.1:{port}/v1")  # theirs untouched
    assert not healthy(url)  # ours stopped


def test_a_foreign_template_on_the_port_is_left_alone(other_server, tmp_path, capsys):
    port = free_port()
    other_template = tmp_path / "other.jinja"
    other_template.write_text(TEMPLATE.read_text().replace("<think>", "<reasoning>"))
    other_server(local_cfg(port, template=other_template))
    with local_server(local_cfg(port)) as url:
        assert url != f"http://127.0.0.1:{port}/v1"
        assert props(url)["chat_template"].strip() == TEMPLATE.read_text().strip()
    assert "its chat template is not" in capsys.readouterr().err


def test_a_smaller_context_on_the_port_is_left_alone(other_server, capsys):
    port = free_port()
    small = local_cfg(port)
    small.local.context = 2048
    other_server(small)
    with local_server(local_cfg(port)) as url:
        assert url != f"http://127.0.0.1:{port}/v1"
    assert "less than the configured 2048" in capsys.readouterr().err


def test_our_own_server_left_on_the_port_is_reused(other_server, capsys):
    port = free_port()
    left_behind = other_server(local_cfg(port))
    with local_server(local_cfg(port)) as url:
        assert url == f"http://127.0.0.1:{port}/v1"
    err = capsys.readouterr().err
    assert "reusing the llama-server" in err and "started llama-server" not in err
    assert left_behind.poll() is None  # not ours to stop: it was there before
