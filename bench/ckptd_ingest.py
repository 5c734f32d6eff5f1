"""How close does ckptd's gRPC ingest of one shard come to a raw TCP loopback transfer?

Sends the same 256 MiB shard (1) over a plain TCP socket on loopback into a preallocated buffer,
and (2) through CkptdClient.write_file into a ckptd on loopback (CRC-32C per chunk, SHA-256 and
block CRCs per file, written to its SSD tier and kept in memory), in the same process, best of a
few runs each, and prints the ratio. Run: `.venv/bin/python bench/ckptd_ingest.py [--mib 256]`.
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
import threading
import time
from pathlib import Path

from ckptd.client import CkptdClient
from ckptd.config import CkptdConfig
from ckptd.server import start
from scaletrain.rpc import CHUNK_BYTES
from scaletrain.v1 import checkpoint_pb2


def raw_tcp_seconds(data: bytes) -> float:
    """Seconds to move `data` through a loopback TCP socket into a preallocated buffer."""
    sink = bytearray(len(data))
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]

        def receive() -> None:
            conn, _ = listener.accept()
            with conn:
                view, got = memoryview(sink), 0
                while got < len(data):
                    got += conn.recv_into(view[got : got + CHUNK_BYTES])

        receiver = threading.Thread(target=receive)
        receiver.start()
        started = time.perf_counter()
        with socket.create_connection(("127.0.0.1", port)) as conn:
            view = memoryview(data)
            for offset in range(0, len(data), CHUNK_BYTES):
                conn.sendall(view[offset : offset + CHUNK_BYTES])
        receiver.join()
        return time.perf_counter() - started


def grpc_seconds(client: CkptdClient, data: bytes, step: int) -> float:
    """Seconds for CkptdClient.write_file of `data` as one shard of a fresh save."""
    save_id = client.open_save("bench", step, world_size=1)
    started = time.perf_counter()
    client.write_file(save_id, "__0_0.distcp", 0, checkpoint_pb2.FILE_KIND_SHARD, data)
    elapsed = time.perf_counter() - started
    client.abort(save_id, "benchmark")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="shard size in MiB")
    parser.add_argument("--runs", type=int, default=3, help="best of this many runs each")
    args = parser.parse_args()
    data = os.urandom(args.mib << 20)
    with tempfile.TemporaryDirectory(prefix="ckptd-bench-") as tmp:
        running = start(CkptdConfig(data_dir=Path(tmp)))
        try:
            with CkptdClient(running.address) as client:
                raw = min(raw_tcp_seconds(data) for _ in range(args.runs))
                grpc = min(grpc_seconds(client, data, step) for step in range(args.runs))
        finally:
            running.stop(grace=1)
    mb = len(data) / 1e6
    print(f"raw TCP loopback: {mb / raw:8.0f} MB/s")
    print(f"ckptd gRPC ingest: {mb / grpc:7.0f} MB/s")
    print(f"ratio gRPC/raw: {raw / grpc:.2f}")


if __name__ == "__main__":
    main()
