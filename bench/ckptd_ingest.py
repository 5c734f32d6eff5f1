"""How close does ckptd's ingest of one shard come to a raw TCP loopback transfer?

Transfers of the same shard from this process to another one, as a trainer rank sends to the
node's ckptd, interleaved run by run, best of a few each:

1. raw TCP: `sendall` of 4 MiB slices into a receiver process that `recv_into`s a preallocated
   buffer (the baseline, `ckptd_common.RawTcp`);
2. ckptd fast path: `CkptdClient.write_file` into a ckptd process over its data socket
   (OpenUpload, frames with a CRC-32C per 256 KiB block computed by the client, FinishUpload with
   the file's checksum; ckptd checks every block and the file's checksum before the reply, and
   keeps the bytes in its memory tier; the SSD write runs behind the reply, a commit waits for
   it) until FinishUpload answers;
3. ckptd gRPC path: the same through WriteFile (the client with `fast_path=False`), as a client
   on another host or with the fast path off sends;
4. for reference, gRPC alone: the same chunks streamed to a handler that only counts bytes, in a
   process started the same way: the ceiling that grpcio's Python transport puts on (3).

Prints MB/s and the ratios of both ckptd paths to raw TCP (target >= 0.5), and the CPU seconds
per GB that each ckptd path costs both processes together (user + system, from one more run of
each): on a shared machine the CPU cost varies less than the wall time.
Run: `.venv/bin/python bench/ckptd_ingest.py [--mib 256] [--runs 3]`.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import grpc
from ckptd_common import (
    CkptdProcess,
    RawTcp,
    bench_parser,
    best_of,
    cpu_seconds,
    line,
    payload,
    timed,
)

from ckptd.client import CkptdClient
from scaletrain.transport import CHUNK_BYTES, make_channel, make_server
from scaletrain.v1 import checkpoint_pb2

_SINK_METHOD = "/bench.Sink/Write"


def serve_grpc_sink() -> None:
    """Receiver process of the gRPC reference: a stream handler that only counts bytes."""

    def write(requests, context) -> bytes:
        return str(sum(len(r) for r in requests)).encode()

    server = make_server()
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler(
            "bench.Sink", {"Write": grpc.stream_unary_rpc_method_handler(write)}
        )]
    )  # fmt: skip
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    server.wait_for_termination()


def _child(*flag: str) -> tuple[subprocess.Popen[str], int]:
    child = subprocess.Popen([sys.executable, __file__, *flag], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    return child, int(child.stdout.readline())


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--serve-grpc", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_grpc:
        return serve_grpc_sink()
    data = payload(args.mib)
    view = memoryview(data)
    tcp = RawTcp(len(data), to_child=True)
    sink, sink_port = _child("--serve-grpc")
    with tempfile.TemporaryDirectory(prefix="ckptd-bench-") as tmp:
        ckptd = CkptdProcess(Path(tmp), "--memory-budget-mb", str(2 * args.mib + 64))
        steps = iter(range(1, 1000))
        try:
            with (
                CkptdClient(ckptd.address, fast_path=True) as fast,
                CkptdClient(ckptd.address, fast_path=False) as slow,
                make_channel(f"127.0.0.1:{sink_port}") as ch,
            ):
                stream_to_sink = ch.stream_unary(_SINK_METHOD)

                def ckptd_ingest(client: CkptdClient) -> float:
                    save_id = client.open_save("bench", next(steps), world_size=1).save_id
                    seconds = timed(
                        lambda: client.write_file(
                            save_id, "__0_0.distcp", 0, checkpoint_pb2.FILE_KIND_SHARD, data
                        )
                    )
                    client.abort(save_id, "benchmark")
                    return seconds

                def grpc_only() -> None:
                    stream_to_sink(
                        bytes(view[i : i + CHUNK_BYTES]) for i in range(0, len(data), CHUNK_BYTES)
                    )

                raw, fast_ingest, grpc_ingest, transport = best_of(
                    args.runs,
                    tcp.transfer,
                    lambda: ckptd_ingest(fast),
                    lambda: ckptd_ingest(slow),
                    lambda: timed(grpc_only),
                )
                if not fast.fast_path:
                    raise SystemExit("ckptd did not offer its fast path to this client")
                cpu = []
                for client in (fast, slow):
                    before = cpu_seconds(ckptd.process.pid) + cpu_seconds()
                    ckptd_ingest(client)
                    spent = cpu_seconds(ckptd.process.pid) + cpu_seconds() - before
                    cpu.append(spent / (len(data) / 1e9))
        finally:
            ckptd.stop()
            tcp.close()
            sink.kill()
    print(line("raw TCP loopback (process to process)", len(data), raw))
    print(line("ckptd fast path (FinishUpload answered)", len(data), fast_ingest))
    print(line("ckptd gRPC path (WriteFile answered)", len(data), grpc_ingest))
    print(line("gRPC transport alone (reference)", len(data), transport))
    print(f"ratio ckptd fast path/raw: {raw / fast_ingest:.2f}  (target >= 0.5)")
    print(f"ratio ckptd gRPC path/raw: {raw / grpc_ingest:.2f}  (target >= 0.5)")
    print(f"ratio gRPC transport alone/raw: {raw / transport:.2f}  (the transport's ceiling)")
    print(f"CPU per GB, client + ckptd: fast path {cpu[0]:.2f} s, gRPC path {cpu[1]:.2f} s")


if __name__ == "__main__":
    main()
