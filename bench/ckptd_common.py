"""What the ckptd benchmarks share: incompressible payloads, best-of timing, a ckptd process, and
the raw TCP loopback baseline (`RawTcp`) that both ingest and restore are measured against.

Each benchmark measures its baseline in the same command as the thing it compares, interleaved
run by run, because this machine's disk and CPUs are shared and noisy: only the ratio of two
figures taken side by side means something.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ckptd.manifest import data_crc32c
from ckptd.store import CheckpointStore
from ckptd.wire import Chunk, crc32c
from scaletrain.transport import CHUNK_BYTES
from scaletrain.v1.checkpoint_pb2 import (
    FILE_KIND_METADATA,
    FILE_KIND_SHARD,
    CheckpointRef,
    FileHeader,
    FileTrailer,
)

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20


def payload(mib: int) -> bytes:
    """`mib` MiB of random bytes (incompressible: nothing gets faster by compressing)."""
    return os.urandom(mib * MiB)


def bench_parser(doc: str) -> argparse.ArgumentParser:
    """The options every ckptd benchmark takes: the shard size and how many runs to take the
    best of."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="shard size in MiB")
    parser.add_argument("--runs", type=int, default=3, help="best of this many runs each")
    return parser


def best_of(runs: int, *measures: Callable[[], float]) -> list[float]:
    """Run each measure `runs` times, interleaved; the best (lowest) seconds of each."""
    best = [float("inf")] * len(measures)
    for _ in range(runs):
        for i, measure in enumerate(measures):
            best[i] = min(best[i], measure())
    return best


def line(label: str, nbytes: int, seconds: float) -> str:
    return f"{label:<40} {nbytes / seconds / 1e6:9.0f} MB/s"


class CkptdProcess:
    """ckptd as its own process, as in production (the trainer is another process). Its log
    goes to `log_path`, beside its data dir: a benchmark may time events by it, which costs the
    process measured nothing (polling its metrics would take its CPU)."""

    def __init__(self, data_dir: Path, *extra: str, env: dict[str, str] | None = None) -> None:
        argv = [
            sys.executable, "-m", "scaletrain", "ckptd", "--listen", "127.0.0.1:0",
            "--data-dir", str(data_dir), "--log-format", "text", *extra,
        ]  # fmt: skip
        full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        self.log_path = data_dir.parent / f"{data_dir.name}.log"
        data_dir.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                argv, env=full_env, stdout=subprocess.PIPE, stderr=log, text=True
            )
        assert self.process.stdout is not None
        first = self.process.stdout.readline()
        if not first.startswith("ckptd listening on "):
            self.process.kill()
            raise SystemExit(f"ckptd did not start: {first!r}")
        self.address = first.split()[3].rstrip(",")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of every thread of process `pid` so far (None: this one)."""
    if pid is None:
        own = os.times()
        return own.user + own.system
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def chunked(data: bytes) -> tuple[list[Chunk], FileTrailer]:
    """`data` as ckptd's servicer hands it to the store: 4 MiB chunks (views, as `ckptd.wire`
    decodes them) with their CRC-32C, and the file's trailer."""
    view = memoryview(data)
    chunks = []
    for offset in range(0, len(data), CHUNK_BYTES):
        piece = view[offset : offset + CHUNK_BYTES]
        chunks.append(Chunk(offset, piece, crc32c(piece)))
    return chunks, FileTrailer(size=len(data), crc32c=data_crc32c(data))


def save_one_shard(store: CheckpointStore, step: int, shard: tuple[list, FileTrailer]) -> None:
    """Open, receive one shard (prepared by `chunked`) and a tiny metadata file, and commit."""
    save_id = store.saves.open_save(CheckpointRef(run="bench", step=step), world_size=1)
    for path, kind, (chunks, trailer) in (
        ("__0_0.distcp", FILE_KIND_SHARD, shard),
        (".metadata", FILE_KIND_METADATA, chunked(b"metadata")),
    ):
        store.saves.write_file(FileHeader(save_id=save_id, path=path, kind=kind), chunks, trailer)
    store.saves.commit(save_id)


def _serve_raw_tcp(direction: str, size: int, source_port: int = 0) -> None:
    """The child process of `RawTcp`: accept, then take `size` bytes into a preallocated buffer
    (and ack) or send `size` bytes in CHUNK_BYTES slices, once per connection, until killed. A
    relay sends on the `size` bytes it receives from a source at `source_port`, CHUNK_BYTES at
    a time through one preallocated buffer."""
    buffer = bytearray(os.urandom(size) if direction == "source" else size)
    view = memoryview(buffer)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        print(listener.getsockname()[1], flush=True)
        while True:
            conn, _ = listener.accept()
            with conn:
                if direction == "source":
                    for offset in range(0, size, CHUNK_BYTES):
                        conn.sendall(view[offset : offset + CHUNK_BYTES])
                elif direction == "relay":
                    with socket.create_connection(("127.0.0.1", source_port)) as source:
                        for offset in range(0, size, CHUNK_BYTES):
                            piece = view[: min(CHUNK_BYTES, size - offset)]
                            _recv_all(source, piece)
                            conn.sendall(piece)
                else:
                    _recv_all(conn, view)
                    conn.sendall(b"k")


def _recv_all(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got : got + CHUNK_BYTES])
        if n == 0:
            raise ConnectionError(f"the raw TCP peer hung up after {got} bytes")
        got += n


class RawTcp:
    """The baseline of the ckptd benchmarks: `size` bytes over a plain loopback TCP connection
    between this process and a child process, as fast as Python moves them (`sendall` of
    CHUNK_BYTES slices, `recv_into` a preallocated buffer). `to_child` sends from here, as a
    trainer rank sends a save to ckptd; otherwise the child sends, as ckptd serves a restore.
    With `relay`, the sending child's bytes reach this process through a second child that
    passes them on, as a peer's bytes reach a trainer through its node's ckptd: the floor of a
    two-hop path on the same cores, for reference."""

    def __init__(self, size: int, to_child: bool, relay: bool = False) -> None:
        self._size, self._to_child = size, to_child
        self._children = [self._spawn("sink" if to_child else "source", size)]
        if relay:
            self._children.append(self._spawn("relay", size, self._port))
        self._buffer = memoryview(bytearray(os.urandom(size) if to_child else size))

    def _spawn(self, direction: str, *args: int) -> subprocess.Popen[str]:
        child = subprocess.Popen(
            [sys.executable, __file__, direction, *map(str, args)],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdout is not None
        self._port = int(child.stdout.readline())
        return child

    def transfer(self) -> float:
        """One transfer, in seconds."""
        started = time.perf_counter()
        with socket.create_connection(("127.0.0.1", self._port)) as conn:
            if self._to_child:
                for offset in range(0, self._size, CHUNK_BYTES):
                    conn.sendall(self._buffer[offset : offset + CHUNK_BYTES])
                conn.recv(1)
            else:
                _recv_all(conn, self._buffer)
        return time.perf_counter() - started

    def close(self) -> None:
        for child in self._children:
            child.kill()
            child.wait()


if __name__ == "__main__":
    _serve_raw_tcp(sys.argv[1], *map(int, sys.argv[2:]))
