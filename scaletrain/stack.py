"""The embedded stack: SeaweedFS, ckptd and telemetry as child processes, and a training job.

`scaletrain run` uses it to do on one machine what the Helm chart does on a cluster. Every child
runs in its own process group with its output in `<workdir>/logs/`, so that stopping the stack,
on success, on failure or on Ctrl-C, stops each child and everything it started.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from scaletrain.errors import UserError
from scaletrain.rpc import wait_until_healthy
from scaletrain.seaweed import SeaweedS3
from scaletrain.security import ClientSecurity, EmbeddedCredentials, Role

S3_BUCKET = "scaletrain"


@dataclass(frozen=True)
class Workdir:
    """Where the embedded stack keeps its state; everything `scaletrain` reads offline is here."""

    root: Path

    @property
    def ckptd(self) -> Path:
        return self.root / "ckptd"

    @property
    def s3(self) -> Path:
        return self.root / "s3"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def telemetry_db(self) -> Path:
        return self.root / "telemetry.db"

    @property
    def db_url(self) -> str:
        return f"sqlite:///{self.telemetry_db.resolve()}"

    @property
    def last_run_file(self) -> Path:
        return self.root / "last_run.json"

    def create(self) -> None:
        for path in (self.root, self.ckptd, self.s3, self.logs):
            path.mkdir(parents=True, exist_ok=True)

    def last_run_id(self) -> str | None:
        try:
            return json.loads(self.last_run_file.read_text())["run_id"]
        except (OSError, ValueError, KeyError):
            return None

    def remember_run(self, run_id: str) -> None:
        self.last_run_file.write_text(json.dumps({"run_id": run_id}) + "\n")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _tail(path: Path, lines: int = 5) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(text[-lines:])


class Child:
    """One child process in its own process group, its output appended to a log file."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str]) -> None:
        self.name, self.log = name, log
        self._argv, self._env = argv, env
        self._log_file: IO[bytes] = log.open("ab")
        self.proc = self._spawn()
        self._terminated: subprocess.Popen[bytes] | None = None  # the process sent SIGTERM

    def _spawn(self) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            self._argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=self._env,
            start_new_session=True,
        )

    def kill(self) -> None:
        """SIGKILL the whole group at once: the child dies as in a crash."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def restart(self) -> None:
        """Start the same command again (after it died or was killed), logging to the same file."""
        if self.proc.poll() is None:
            raise RuntimeError(f"{self.name} is still running")
        self.proc = self._spawn()

    def failed_message(self) -> str:
        return f"{self.name} exited with code {self.proc.returncode}: {_tail(self.log)}"

    def terminate(self) -> None:
        """SIGTERM the whole group once, without waiting (`stop` waits): a second SIGTERM could
        cut short the clean shutdown the first one started."""
        if self.proc.poll() is None and self._terminated is not self.proc:
            self._terminated = self.proc
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM the whole group, then SIGKILL what is still there after `timeout_s`."""
        if self.proc.poll() is None:
            self.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout_s)
        # The leader may be gone while its children linger: kill the group regardless.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._log_file.close()


def _scaletrain_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "scaletrain", *args]


class Stack:
    """S3, telemetry and ckptd on free loopback ports; `close` stops them in reverse order."""

    def __init__(
        self,
        workdir: Workdir,
        memory_budget_mb: int = 512,
        secure: bool = False,
        ckptd_args: tuple[str, ...] = (),
    ) -> None:
        self.workdir = workdir
        self.memory_budget_mb = memory_budget_mb
        self.secure = secure
        # With `secure`: TLS between every part and a token for each (EmbeddedCredentials).
        self.credentials: EmbeddedCredentials | None = None
        # More `scaletrain ckptd` options (retry backoff, retention, ...).
        self.ckptd_args = ckptd_args
        self.children: list[Child] = []
        self.s3: SeaweedS3 | None = None
        self.ckptd_address = ""
        self.telemetry_address = ""

    def __enter__(self) -> Stack:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Start S3, telemetry and ckptd, overlapping their start-ups.

        Telemetry needs nothing else, so it is spawned first and imports while S3 comes up;
        ckptd needs S3's endpoint but not a telemetry that answers yet (its reporting retries),
        so both are waited for together at the end: a run starts ~2 s sooner than when each
        service is waited for before the next is spawned.
        """
        self.workdir.create()
        base_env = dict(os.environ)
        if self.secure:
            self.credentials = EmbeddedCredentials(
                self.workdir.root / "tls", self.workdir.root / "tokens.json"
            )
            base_env |= self.credentials.server_env()
        self.telemetry_address = f"127.0.0.1:{free_port()}"
        telemetry = self._spawn(
            "telemetry",
            _scaletrain_argv(
                "telemetry", "--listen", self.telemetry_address, "--db", self.workdir.db_url
            ),
            base_env,
        )
        self.s3 = SeaweedS3(self.workdir.s3)
        self.s3.start()
        self.ckptd_address = f"127.0.0.1:{free_port()}"
        ckptd_env = base_env | {
            "AWS_ACCESS_KEY_ID": self.s3.access_key_id,
            "AWS_SECRET_ACCESS_KEY": self.s3.secret_access_key,
        }
        if self.credentials is not None:
            ckptd_env |= self.credentials.client_env(self.credentials.service_token)
        ckptd = self._spawn(
            "ckptd",
            _scaletrain_argv(
                "ckptd",
                "--listen",
                self.ckptd_address,
                "--data-dir",
                str(self.workdir.ckptd),
                "--memory-budget-mb",
                str(self.memory_budget_mb),
                "--s3-endpoint",
                self.s3.endpoint_url,
                "--s3-bucket",
                S3_BUCKET,
                "--telemetry",
                self.telemetry_address,
                *self.ckptd_args,
            ),
            ckptd_env,
        )
        self._wait_healthy(telemetry, self.telemetry_address)
        self._wait_healthy(ckptd, self.ckptd_address)

    def _spawn(self, name: str, argv: list[str], env: dict) -> Child:
        """Start service `name` (logging to logs/<name>.log); `close` stops it from now on."""
        child = Child(name, argv, self.workdir.logs / f"{name}.log", env)
        self.children.append(child)
        return child

    def service(self, name: str) -> Child:
        """The running child `name` ("telemetry" or "ckptd")."""
        return next(child for child in self.children if child.name == name)

    def restart_service(self, name: str) -> None:
        """Start service `name` again at its address (it died or was killed), wait until healthy."""
        child = self.service(name)
        child.restart()
        address = self.ckptd_address if name == "ckptd" else self.telemetry_address
        self._wait_healthy(child, address)

    def _wait_healthy(self, child: Child, address: str) -> None:
        name = child.name
        deadline = time.monotonic() + 60
        while True:
            if child.proc.poll() is not None:
                raise UserError(f"could not start {child.failed_message()}")
            try:
                wait_until_healthy(address, timeout_s=1.0, security=self.client_security())
                return
            except UserError:
                if time.monotonic() > deadline:
                    raise UserError(
                        f"{name} did not become healthy at {address} within 60 s; see {child.log}"
                    ) from None

    def client_security(self, role: Role | None = None, run: str = "*") -> ClientSecurity | None:
        """How this process talks to the stack: with a new `role` token on `run` when secure
        (none: TLS alone, for health checks); None (the environment's) when not."""
        if self.credentials is None:
            return None
        return self.credentials.client(self.credentials.mint(role, run) if role else None)

    def train(
        self,
        run_id: str,
        nproc: int,
        trainer_args: list[str],
        out: IO[str],
        max_restarts: int = 0,
        on_start: Callable[[subprocess.Popen[str]], None] | None = None,
    ) -> int:
        """Run the training job under torchrun; its output goes to `out` and to the log.

        torchrun's elastic agent (c10d rendezvous on this host) restarts every rank up to
        `max_restarts` times after any rank fails; the ranks then resume from the latest committed
        checkpoint. `on_start` is handed the agent's process once it runs.
        """
        argv = [
            sys.executable, "-m", "torch.distributed.run",
            "--standalone", "--nproc-per-node", str(nproc),
            "--max-restarts", str(max_restarts),
            "-m", "trainer",
            "--run-id", run_id,
            "--ckptd", self.ckptd_address,
            "--telemetry", self.telemetry_address,
            *trainer_args,
        ]  # fmt: skip
        env = dict(os.environ) | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        if self.credentials is not None:
            # The run's own token: it may write this run's checkpoints and telemetry only.
            token = self.credentials.mint(Role.TRAINER, run_id, f"trainer of {run_id}")
            env |= self.credentials.client_env(token)
        log_path = self.workdir.logs / "trainer.log"
        with log_path.open("a") as log:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=env,
                text=True,
                start_new_session=True,
            )
            try:
                if on_start is not None:
                    on_start(proc)
                assert proc.stdout is not None
                for line in proc.stdout:
                    log.write(line)
                    out.write(line)
                    out.flush()
                return proc.wait()
            finally:
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGTERM)
                    try:
                        proc.wait(15)
                    except subprocess.TimeoutExpired:
                        os.killpg(proc.pid, signal.SIGKILL)
                        proc.wait()

    def close(self) -> None:
        """Stop every service, then S3. All are sent SIGTERM first, so a shutdown takes as long
        as the slowest service's, not the sum of their grace periods (over a minute at worst)."""
        for child in self.children:
            child.terminate()
        while self.children:
            self.children.pop().stop()
        if self.s3 is not None:
            self.s3.stop()
            self.s3 = None


@contextlib.contextmanager
def s3_for_reading(workdir: Workdir) -> Iterator[SeaweedS3]:
    """Start the work directory's S3 server alone, to read what it stores (export, verify)."""
    server = SeaweedS3(workdir.s3)
    server.start()
    try:
        yield server
    finally:
        server.stop()
