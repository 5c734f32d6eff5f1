"""Many tenants: the save stall of 4 runs on one ckptd while a fifth client abuses it, over the
same 4 runs' stall without the abuser, measured side by side in one command (target <= 1.2).

ckptd runs as its own process with tokens (each run its own trainer token, as `scaletrain run
--secure` gives them) and its default limits. The four runs save at once, each a save of 2
ranks' files and the metadata (open, write, commit: the stall a trainer's checkpoint thread
sees), from threads of this process. The abuser is another process with a token of its own: it
holds 300 idle connections on the data socket, sends 2,000 connections of random bytes, opens
400 uploads and sends garbage after each ticket, then goes on opening uploads and connections
for as long as the runs save. Rounds alternate without and with the abuser; the ratio is of the
medians.

    .venv/bin/python bench/ckptd_tenants.py [--mib 8] [--saves 4] [--rounds 2] [--tls]

With --tls, ckptd serves gRPC and its data socket with TLS (SCALETRAIN_TLS_DIR, as `scaletrain
run --secure` runs it: server certificate, tokens); the runs and the abuser's gRPC calls and
uploads (ticket then garbage) use TLS, while its idle connections and random-byte connections
stay plaintext TCP against the TLS socket (garbage where a handshake should be).
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
from ckptd_common import CkptdProcess, bench_parser

from ckptd.client import CkptdClient
from scaletrain.security import (
    TLS_DIR_ENV,
    ClientSecurity,
    Role,
    TlsFiles,
    add_token,
    generate_certs,
)
from scaletrain.tls import client_context
from scaletrain.transport import make_channel
from scaletrain.v1 import checkpoint_pb2, checkpoint_pb2_grpc

RUNS = 4
SHARD, METADATA = checkpoint_pb2.FILE_KIND_SHARD, checkpoint_pb2.FILE_KIND_METADATA


def abuse(address: str, token: str, tls_dir: str = "") -> None:
    """The hostile client (run in its own process until killed)."""
    tls = TlsFiles(Path(tls_dir)) if tls_dir else None
    context = client_context(tls) if tls else None
    with CkptdClient(address, ClientSecurity(tls=tls, token=token)) as client:
        save_id = client.open_save("abuse", 1, world_size=1).save_id
    channel = make_channel(address, ClientSecurity(tls=tls, token=token))
    stub = checkpoint_pb2_grpc.CheckpointServiceStub(channel)
    counts = {"uploads": 0, "refused": 0, "last_refusal": ""}

    def upload() -> int | None:
        header = checkpoint_pb2.FileHeader(save_id=save_id, path=f"g{time.time_ns()}", kind=SHARD)
        try:
            opened = stub.OpenUpload(checkpoint_pb2.OpenUploadRequest(header=header, size=1 << 20))
        except grpc.RpcError as exc:
            counts["refused"] += 1
            counts["last_refusal"] = exc.details()
            return None
        counts["uploads"] += 1
        with socket.create_connection(("127.0.0.1", opened.data_port)) as raw:
            if context is None:
                raw.sendall(opened.ticket + os.urandom(64))
            else:
                try:
                    with context.wrap_socket(raw, server_hostname="127.0.0.1") as conn:
                        conn.sendall(opened.ticket + os.urandom(64))
                except (OSError, ssl.SSLError) as exc:
                    counts["refused"] += 1
                    counts["last_refusal"] = f"TLS: {exc}"
        return opened.data_port

    port = None
    while port is None:
        port = upload()
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(300)]
    print("abusing", flush=True)
    for _ in range(2000):
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.sendall(os.urandom(64))
    for _ in range(400):
        upload()
        print(json.dumps(counts), flush=True)
    while True:  # on and on, at a pace: a new idle connection and an upload attempt
        time.sleep(0.02)
        idle.append(socket.create_connection(("127.0.0.1", port)))
        upload()
        if len(idle) > 600:
            idle.pop(0).close()
        print(json.dumps(counts), flush=True)


def save_round(
    address: str, tokens: dict[str, str], step: int, data: bytes, tls: TlsFiles | None = None
) -> list[float]:
    """One save of each run at once; each one's seconds from open to committed."""
    stalls: list[float] = []
    errors: list[BaseException] = []

    def one(run: str) -> None:
        try:
            with CkptdClient(address, ClientSecurity(tls=tls, token=tokens[run])) as client:
                started = time.perf_counter()
                save_id = client.open_save(run, step, world_size=2).save_id
                for rank in range(2):
                    client.write_file(save_id, f"__{rank}_0.distcp", rank, SHARD, data)
                client.write_file(save_id, ".metadata", 0, METADATA, b"meta")
                client.commit(save_id)
                stalls.append(time.perf_counter() - started)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(f"run{i}",)) for i in range(RUNS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise SystemExit(f"a run's save failed: {errors[0]}")
    return stalls


def main() -> None:
    if sys.argv[1:2] == ["--abuser"]:
        abuse(*sys.argv[2:5])
        return
    parser = bench_parser(__doc__)
    parser.set_defaults(mib=8)
    parser.add_argument("--saves", type=int, default=4, help="saves per run per round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds without, then with")
    parser.add_argument("--tls", action="store_true", help="ckptd, runs and abuser with TLS")
    args = parser.parse_args()
    data = os.urandom(args.mib << 20)
    with tempfile.TemporaryDirectory(prefix="ckptd-tenants-") as tmp:
        tokens_file = Path(tmp) / "tokens.json"
        names = [f"run{i}" for i in range(RUNS)] + ["abuse"]
        tokens = {run: add_token(tokens_file, Role.TRAINER, run, name=f"trainer of {run}")
                  for run in names}  # fmt: skip
        env = {"SCALETRAIN_TOKENS_FILE": str(tokens_file)}
        tls = generate_certs(Path(tmp) / "tls") if args.tls else None
        env[TLS_DIR_ENV] = str(tls.root) if tls else ""
        ckptd = CkptdProcess(
            Path(tmp) / "ckptd", "--keep-memory", "1", "--keep-ssd", "1", env=env,
        )  # fmt: skip
        alone: list[float] = []
        abused: list[float] = []
        last = "{}"
        step = 0
        try:
            for _ in range(args.rounds):
                for _ in range(args.saves):
                    step += 1
                    alone += save_round(ckptd.address, tokens, step, data, tls)
                abuser = subprocess.Popen(
                    [sys.executable, __file__, "--abuser", ckptd.address, tokens["abuse"],
                     str(tls.root) if tls else ""],
                    stdout=subprocess.PIPE, text=True,
                )  # fmt: skip
                assert abuser.stdout is not None
                assert abuser.stdout.readline().strip() == "abusing"
                for _ in range(args.saves):
                    step += 1
                    abused += save_round(ckptd.address, tokens, step, data, tls)
                abuser.kill()
                last = abuser.stdout.read().strip().splitlines()[-1:] or ["{}"]
                last = last[0]
                abuser.wait()
        finally:
            ckptd.stop()
    base, hit = statistics.median(alone), statistics.median(abused)
    print(f"TLS: {'on' if args.tls else 'off'}")
    print(f"saves of {RUNS} runs x 2 ranks x {args.mib} MiB, {len(alone)} each way")
    print(f"{'save stall, median, without the abuser':<44} {base * 1e3:8.1f} ms")
    print(f"{'save stall, median, with the abuser':<44} {hit * 1e3:8.1f} ms")
    print(f"abuser: {last}")
    print(f"ratio save stall with/without abuser {hit / base:.2f} (target <= 1.2)")


if __name__ == "__main__":
    main()
