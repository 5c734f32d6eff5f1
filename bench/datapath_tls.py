"""What does TLS on ckptd's data socket cost a restore from a peer?

Two pairs of ckptd processes that list each other as peers (node0 holds the shard, node1 holds
no copy), one pair with mutual TLS (`SCALETRAIN_TLS_DIR`, `SCALETRAIN_TLS_CLIENT_AUTH`), one in
plaintext. A client asks node1 for the shard: node1 sends it to node0's data socket with node0's
ticket (OpenReadRequest.direct), as a restore on another host reads a node's part. Interleaved,
best of a few each:

1. raw TCP: a child process `sendall`s 4 MiB slices, this one `recv_into`s a buffer
   (`ckptd_common.RawTcp`);
2. bare TLS: the same with a TLS socket on each end, made by the very contexts ckptd uses
   (`scaletrain.tls`: TLS 1.3, the same cipher), so that only ckptd's own work differs;
3. the peer restore over the TLS data socket, and 4. over the plaintext one.

Prints MB/s, the ratio of the TLS restore to bare TLS (goal >= 0.8) and to raw TCP, and the CPU
seconds per GB that a TLS and a plaintext restore cost node0 and the client (from one more run
each; all processes share this machine's cores).
Run: `.venv/bin/python bench/datapath_tls.py [--mib 256] [--runs 3] [--metrics]`.
With --metrics, every ckptd serves /metrics and the nonzero ckptd_* series of each pair's two
nodes are printed at the end (which node's tiers served the restores' bytes).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from ckptd_common import (
    ROOT,
    CkptdProcess,
    RawTcp,
    _recv_all,
    bench_parser,
    best_of,
    cpu_seconds,
    line,
    payload,
    timed,
)

from ckptd.client import CkptdClient
from scaletrain.app.stack import free_port
from scaletrain.security import (
    TLS_CLIENT_AUTH_ENV,
    TLS_DIR_ENV,
    ClientSecurity,
    TlsFiles,
    generate_certs,
)
from scaletrain.tls import client_context, server_context
from scaletrain.transport import CHUNK_BYTES
from scaletrain.v1 import checkpoint_pb2

SHARD = "__0_0.distcp"
SHARD_KIND, META_KIND = checkpoint_pb2.FILE_KIND_SHARD, checkpoint_pb2.FILE_KIND_METADATA


def _serve_tls(tls_dir: str, size: int) -> None:
    """The child of `BareTls`: send `size` bytes in CHUNK_BYTES slices over TLS to each
    connection, until killed."""
    context = server_context(TlsFiles(Path(tls_dir)), client_auth=True)
    view = memoryview(bytearray(os.urandom(size)))
    with socket.create_server(("127.0.0.1", 0)) as listener:
        print(listener.getsockname()[1], flush=True)
        while True:
            conn, _ = listener.accept()
            with context.wrap_socket(conn, server_side=True) as tls:
                for offset in range(0, size, CHUNK_BYTES):
                    tls.sendall(view[offset : offset + CHUNK_BYTES])


class BareTls:
    """`size` bytes from a child process over a bare Python TLS socket into a buffer here."""

    def __init__(self, tls: TlsFiles, size: int) -> None:
        self._size, self._context = size, client_context(tls)
        self._child = subprocess.Popen(
            [sys.executable, __file__, str(tls.root), str(size)],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._child.stdout is not None
        self._port = int(self._child.stdout.readline())
        self._buffer = memoryview(bytearray(size))
        self.cipher = ""

    def transfer(self) -> float:
        """One transfer, handshake included (as a restore's connection has one), in seconds."""
        started = time.perf_counter()
        raw = socket.create_connection(("127.0.0.1", self._port))
        with self._context.wrap_socket(raw, server_hostname="127.0.0.1") as conn:
            self.cipher = str(conn.cipher())
            _recv_all(conn, self._buffer)
        return time.perf_counter() - started

    def close(self) -> None:
        self._child.kill()
        self._child.wait()


def peers(
    root: Path, budget_mib: int, env: dict[str, str], metrics: list[int] | None = None
) -> list[CkptdProcess]:
    """node0 and node1, each the other's peer, making no replicas (node1 must hold no copy);
    with `metrics`, node i serves /metrics on port metrics[i]."""
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    return [
        CkptdProcess(
            root / f"node{i}",
            *("--listen", addresses[i], "--node", f"node{i}", "--peers", addresses[1 - i]),
            *("--memory-budget-mb", str(budget_mib), "--replicas", "1"),
            *(("--metrics-port", str(metrics[i])) if metrics else ()),
            env=env,
        )
        for i in range(2)
    ]


def nonzero_metrics(port: int) -> list[str]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    return [
        ln for ln in text.splitlines()
        if ln.startswith(("ckptd_tier_bytes", "ckptd_refused", "ckptd_failures"))
        and not ln.endswith(" 0.0") and "_created" not in ln
    ]  # fmt: skip


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--metrics", action="store_true", help="print the ckptds' counters")
    args = parser.parse_args()
    ports = {n: [free_port(), free_port()] if args.metrics else None for n in ("tls", "plain")}
    data = payload(args.mib)
    gb = len(data) / 1e9
    with tempfile.TemporaryDirectory(prefix="ckptd-tls-bench-") as tmp:
        tls = generate_certs(Path(tmp) / "tls")
        secure_env = {TLS_DIR_ENV: str(tls.root), TLS_CLIENT_AUTH_ENV: "1"}
        plain_env = {TLS_DIR_ENV: "", TLS_CLIENT_AUTH_ENV: ""}
        tcp, bare = RawTcp(len(data), to_child=False), BareTls(tls, len(data))
        budget = args.mib + 64
        pairs = {
            "tls": (
                peers(Path(tmp) / "tls", budget, secure_env, ports["tls"]),
                ClientSecurity(tls),
            ),
            "plain": (
                peers(Path(tmp) / "plain", budget, plain_env, ports["plain"]),
                ClientSecurity(),
            ),
        }
        clients: dict[str, CkptdClient] = {}
        try:
            for name, (nodes, security) in pairs.items():
                with CkptdClient(nodes[0].address, security) as owner:
                    save_id = owner.open_save("bench", 1, world_size=1).save_id
                    for path, kind, raw in (
                        (SHARD, SHARD_KIND, data),
                        (".metadata", META_KIND, b"m"),
                    ):
                        owner.write_file(save_id, path, 0, kind, raw)
                    owner.commit(save_id)
                clients[name] = CkptdClient(nodes[1].address, security)

            def restore(name: str) -> float:
                got = [0]
                seconds = timed(lambda: got.append(len(clients[name].read("bench", 1, SHARD))))
                assert got[-1] == len(data)
                return seconds

            raw, bare_tls, peer_tls, peer_plain = best_of(
                args.runs, tcp.transfer, bare.transfer, lambda: restore("tls"),
                lambda: restore("plain"),
            )  # fmt: skip
            if not all(client.fast_path for client in clients.values()):
                raise SystemExit("a restore fell back to gRPC: the data socket was not offered")
            cpu = {}
            for name, (nodes, _) in pairs.items():
                pid = nodes[0].process.pid
                before = (cpu_seconds(pid), cpu_seconds())
                restore(name)
                after = (cpu_seconds(pid), cpu_seconds())
                cpu[name] = [(a - b) / gb for a, b in zip(after, before, strict=True)]
            served = {name: dict(client.served) for name, client in clients.items()}
            counters = {
                f"{name} node{i}": nonzero_metrics(port)
                for name, pair_ports in ports.items() for i, port in enumerate(pair_ports or [])
            }  # fmt: skip
        finally:
            for client in clients.values():
                client.close()
            for nodes, _ in pairs.values():
                for node in nodes:
                    node.stop()
            tcp.close()
            bare.close()
    print(line("raw TCP loopback (process to process)", len(data), raw))
    print(line("bare Python TLS socket", len(data), bare_tls))
    print(line("restore from a peer, TLS data socket", len(data), peer_tls))
    print(line("restore from a peer, plaintext", len(data), peer_plain))
    print(f"cipher: {bare.cipher}")
    print(f"ratio peer TLS/bare TLS: {bare_tls / peer_tls:.2f}  (goal >= 0.8)")
    print(f"ratio peer TLS/raw TCP: {raw / peer_tls:.2f}")
    print(f"ratio peer plaintext/raw TCP: {raw / peer_plain:.2f}  (for reference)")
    for name, (node0, client) in cpu.items():
        print(f"CPU per GB, {name} restore: ckptd node0 {node0:.2f} s, client {client:.2f} s")
    print(f"where the bytes came from: {served}")
    for name, lines in counters.items():
        print(f"--- {name} ---")
        print("\n".join(lines))


if __name__ == "__main__":
    if len(sys.argv) == 3 and not sys.argv[1].startswith("-"):
        _serve_tls(sys.argv[1], int(sys.argv[2]))
    else:
        main()
