"""Servers the tests start die with the test run, however it ends: SIGTERM (a user, a CI timeout) tears the fixtures
down as Ctrl-C does, and a test run killed outright takes them with it (on today's main a SIGTERM left a llama-server
and the fake server running, orphaned)."""
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.conftest import REPO

INNER = '''
import json, os, time
import psutil

def test_holds_servers(fake_server, llama_server):
    fake_server()
    children = [p.pid for p in psutil.Process().children(recursive=True)]
    with open(os.environ["PIDS_FILE"], "w") as fh:
        json.dump(children, fh)
    time.sleep(600)
'''


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_servers_started_by_tests_die_with_the_test_run(tmp_path, sig):
    (tmp_path / "test_inner.py").write_text(INNER)
    pids_file = tmp_path / "pids.json"
    inner = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
                              str(tmp_path / "test_inner.py")], cwd=REPO, env={**os.environ, "PIDS_FILE": str(pids_file)},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while not pids_file.exists() or not pids_file.read_text():
        assert inner.poll() is None and time.monotonic() < deadline, inner.stdout.read()[-3000:]
        time.sleep(0.2)
    time.sleep(0.2)
    servers = json.loads(pids_file.read_text())
    names = {psutil.Process(pid).name() for pid in servers}
    assert "llama-server" in names and len(servers) >= 2, names
    os.kill(inner.pid, sig)  # the pytest process alone, as `kill` or a CI timeout sends it
    inner.wait(60)
    deadline = time.monotonic() + 30
    while any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in servers):
        assert time.monotonic() < deadline, f"still running after the test run ended: {servers}"
        time.sleep(0.2)
