"""Launching the dashboard as a real Streamlit server process."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from ui import launch
from ui.launch import APP_PATH, run_ui, ui_command, ui_environment
from ui.source import DB_ENV


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_command_runs_streamlit_headless_on_the_given_address() -> None:
    command = ui_command(host="0.0.0.0", port=9000)
    assert command[:5] == [sys.executable, "-m", "streamlit", "run", str(APP_PATH)]
    options = command[5:]
    assert dict(zip(options[::2], options[1::2], strict=True)) == {
        "--server.headless": "true",
        "--server.address": "0.0.0.0",
        "--server.port": "9000",
        "--browser.gatherUsageStats": "false",
    }


def test_the_database_url_reaches_streamlit_in_its_environment_not_its_command_line() -> None:
    secret = "postgresql+psycopg://ui:s3cret@db.example/telemetry"
    assert ui_environment(secret)[DB_ENV] == secret
    assert not any("s3cret" in argument for argument in ui_command())


def test_run_ui_serves_the_dashboard_until_streamlit_exits(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    started: list[subprocess.Popen[Any]] = []
    real_popen = subprocess.Popen

    def recording_popen(*args: Any, **kwargs: Any) -> subprocess.Popen[Any]:
        started.append(real_popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(launch.subprocess, "Popen", recording_popen)
    port = free_port()
    db_url = f"sqlite:///{tmp_path / 't.db'}"
    result: list[int] = []
    runner = threading.Thread(target=lambda: result.append(run_ui(db_url, port=port)))
    runner.start()
    try:
        deadline = time.monotonic() + 45
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health") as reply:
                    assert reply.read() == b"ok"
                    break
            except OSError:
                assert time.monotonic() < deadline, "streamlit did not come up"
                assert runner.is_alive(), "streamlit exited early"
                time.sleep(0.2)
        # What `ps` shows of the server, and what only its own user can read.
        proc = Path(f"/proc/{started[0].pid}")
        assert db_url.encode() not in (proc / "cmdline").read_bytes()
        assert f"{DB_ENV}={db_url}".encode() in (proc / "environ").read_bytes().split(b"\0")
    finally:
        while not started:
            time.sleep(0.05)
        started[0].terminate()
        runner.join(timeout=20)
    assert not runner.is_alive()
    assert len(result) == 1


class _InterruptedProcess:
    """A child whose first wait is interrupted by Ctrl-C, as a terminal would do."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        self.command = command
        self.terminated = False
        self._waits = 0

    def wait(self, timeout: float | None = None) -> int:
        self._waits += 1
        if self._waits == 1:
            raise KeyboardInterrupt
        return -15

    def terminate(self) -> None:
        self.terminated = True

    def kill(self) -> None:
        raise AssertionError("a child that stops in time is not killed")


def test_ctrl_c_stops_streamlit_and_reaches_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    children: list[_InterruptedProcess] = []

    def start_child(command: list[str], env: dict[str, str]) -> _InterruptedProcess:
        children.append(_InterruptedProcess(command, env))
        return children[-1]

    monkeypatch.setattr(launch.subprocess, "Popen", start_child)
    with pytest.raises(KeyboardInterrupt):
        run_ui("sqlite:///t.db")
    assert children[0].terminated
