"""Uploads of checkpoint files from a low-priority child process, off the trainer's CPU.

Streaming a shard to ckptd is CPU work (SHA-256, CRC-32C, message framing, gRPC) on the same
cores as the training loop. Measured on the project's 2-core machines, that work slowed training
whether it ran in a thread of the trainer or in another process at the same priority: the loss is
CPU time, not only the GIL. So the DCP writer only serialises each file into a reused in-memory
spool file (a kernel copy into pages allocated once, the GIL released), and a long-lived child,
started once per trainer process at the lowest CPU priority (nice 19), maps the file and streams
it. The child's Python never holds the trainer's GIL and it only takes CPU the trainer leaves idle.

Protocol: one JSON line per request on the child's stdin, one JSON line per reply on its stdout.
The child dies with its parent (PR_SET_PDEATHSIG) or when its stdin closes.

    python -m ckptd.uploader    # started by `Uploader`, never by hand
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
import mmap
import os
import signal
import subprocess
import sys
import threading
from typing import IO, Any

from ckptd.client import CkptdClient
from scaletrain import errors
from scaletrain.errors import ScaletrainError, Unavailable


def _error(kind: str, message: str) -> Exception:
    """The child's error as the class it had, when it is one of scaletrain's domain errors."""
    cls = getattr(errors, kind, None)
    if isinstance(cls, type) and issubclass(cls, ScaletrainError):
        return cls(message)
    return ScaletrainError(f"{kind}: {message}")


class _SpoolFile(io.FileIO):
    """A spool file that ends where this save's bytes end (DCP closes its streams itself)."""

    def close(self) -> None:
        if not self.closed:
            self.truncate()  # at the end of what this save wrote: shorter than last time
        super().close()


class Uploader:
    """The parent's handle on one upload child. Thread-safe; one upload runs at a time.

    Spool files are anonymous memory files (memfd): the child opens them by their /proc path,
    and the kernel frees them with the processes, so a SIGKILLed trainer leaks nothing.
    """

    def __init__(self) -> None:
        self._spool: dict[str, int] = {}
        self._lock = threading.Lock()
        self._child = self._start()

    @staticmethod
    def _start() -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "ckptd.uploader", str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )

    def spool(self, name: str) -> io.BufferedWriter:
        """A stream to serialise `name` into; its pages are reused by the next save of `name`."""
        fd = self._spool.get(name)
        if fd is None:
            fd = self._spool[name] = os.memfd_create(f"scaletrain-spool-{name}")
        os.lseek(fd, 0, os.SEEK_SET)
        return io.BufferedWriter(_SpoolFile(os.dup(fd), "r+"))

    def upload(self, address: str, save_id: str, name: str, rank: int, kind: int) -> None:
        """Stream the spooled `name` into the open save; returns once ckptd has it all."""
        request = {
            "address": address,
            "save_id": save_id,
            "name": name,
            "rank": rank,
            "kind": kind,
            "path": f"/proc/{os.getpid()}/fd/{self._spool[name]}",
        }
        with self._lock:
            if self._child.poll() is not None:
                self._child = self._start()  # died with an earlier upload: a fresh one
            assert self._child.stdin is not None and self._child.stdout is not None
            try:
                self._child.stdin.write(json.dumps(request) + "\n")
                self._child.stdin.flush()
            except BrokenPipeError:
                pass  # reported below, with the exit code
            line = self._child.stdout.readline()
        if not line:
            code = self._child.wait()
            raise Unavailable(f"checkpoint upload process exited (code {code}) sending {name}")
        reply = json.loads(line)
        if "error" in reply:
            raise _error(reply["error"], reply["message"])

    def close(self) -> None:
        with self._lock:
            if self._child.stdin is not None:
                self._child.stdin.close()
            self._child.wait()
            if self._child.stdout is not None:
                self._child.stdout.close()
        for fd in self._spool.values():
            os.close(fd)
        self._spool.clear()


def _die_with(parent: int) -> None:
    """Make the kernel kill this process when its parent dies (a SIGKILLed trainer included)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        sys.exit(0)  # the parent died before the line above


def _serve(requests: IO[str], replies: IO[str]) -> None:
    clients: dict[str, CkptdClient] = {}
    for line in requests:
        request = json.loads(line)
        reply: dict[str, Any] = {"ok": True}
        try:
            client = clients.get(request["address"])
            if client is None:
                client = clients[request["address"]] = CkptdClient(request["address"])
            with open(request["path"], "rb") as file:
                size = os.fstat(file.fileno()).st_size
                data = mmap.mmap(file.fileno(), size, prot=mmap.PROT_READ) if size else b""
            try:
                client.write_file(
                    request["save_id"], request["name"], request["rank"], request["kind"],
                    memoryview(data),
                )  # fmt: skip
            finally:
                if isinstance(data, mmap.mmap):
                    with contextlib.suppress(BufferError):  # a view still alive: unmapped by gc
                        data.close()
        except Exception as exc:  # the parent raises it in the save that asked
            reply = {"error": type(exc).__name__, "message": str(exc)}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()
    for client in clients.values():
        client.close()


def main() -> None:
    _die_with(int(sys.argv[1]))
    os.nice(19)
    # Replies get a private copy of stdout; anything else printed goes to stderr.
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    _serve(sys.stdin, replies)


if __name__ == "__main__":
    main()
