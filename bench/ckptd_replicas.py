"""Peer replicas: how fast one ckptd copies a peer's part, and what replication costs training.

Two measures, each beside its baseline in the same command:

- **Replication throughput.** Two ckptd processes on loopback, peers of each other, copying
  without a rate limit: a save puts a shard of --mib MiB on node 1, and node 0 copies it into
  its memory tier and SSD (read from node 1 over the data socket, every block CRC-checked).
  Beside the raw TCP loopback baseline of the same bytes (`RawTcp`), two times from the
  commit's return: until the copy *counts* (held in node 0's memory, every block checked: the
  part is on 2 nodes, node-loss safe; the ratio the target names), and until it is also
  *durable* on node 0's SSD (files and marker fsynced: it survives a restart of node 0 too).
  Both are read from node 0's log (the timestamps of the lines that say so,
  `ReplicaHolding.copy_job`), and the SSD copy is checked in its metrics afterwards. Earlier
  versions polled node 0's /metrics every 2 ms instead: each scrape cost node 0 ~0.7 ms of CPU
  and this process ~2 ms, about half a core of this 2-core machine taken from the copy timed.
  Measured twice: with the data dirs on this machine's disk, and on tmpfs (/dev/shm), which
  leaves the disk's write speed out of the durable time.
- **Training while replicating.** The same 2-node `scaletrain run` with R=2 (each part copied to
  the other node after every save) and with R=1 (no copies), tokens/s from its summary;
  the runs alternate, one pair after another.

Run: `OMP_NUM_THREADS=1 .venv/bin/python bench/ckptd_replicas.py [--mib 256] [--runs 3]
[--train-pairs 1] [--ranks 4] [--steps 30]`.

With `--tls`, instead: the replication throughput of a pair of ckptds with mutual TLS on gRPC
and the data socket (`SCALETRAIN_TLS_DIR`, `SCALETRAIN_TLS_CLIENT_AUTH`, as `scaletrain run
--secure` runs them) beside a plaintext pair, saves alternating between the pairs, best of
--runs each; the ratio TLS / plaintext, and the TLS pair's nonzero ckptd_* metrics (the peer
read by a client is in bench/datapath_tls.py --metrics).
"""

from __future__ import annotations

import argparse
import io
import json
import re
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.request
from datetime import datetime
from pathlib import Path

from ckptd_cluster import Nodes
from ckptd_common import RawTcp, bench_parser, payload

from scaletrain.app.embedded import RunOptions, run
from scaletrain.app.stack import Workdir, free_port
from scaletrain.security import TLS_CLIENT_AUTH_ENV, TLS_DIR_ENV, ClientSecurity, generate_certs
from scaletrain.v1 import checkpoint_pb2

SHARD = checkpoint_pb2.FILE_KIND_SHARD
METADATA = checkpoint_pb2.FILE_KIND_METADATA
_REPLICA_SSD = re.compile(r'^ckptd_replica_bytes\{tier="SSD"\} (\S+)$', re.M)
_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ", re.M)


def replica_bytes(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    found = _REPLICA_SSD.search(text)
    return float(found.group(1)) if found else 0.0


def logged_at(log: Path, message: str, deadline: float) -> float:
    """The time (time.time()) of the first line of `log` that contains `message`."""
    while True:
        text = log.read_text(errors="replace")
        at = text.find(message)
        if at >= 0:
            stamp = _LOG_TIME.findall(text[: text.find("\n", at)])[-1]
            return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if time.time() > deadline:
            raise SystemExit(f"node 0 did not log {message!r} within 120 s")
        time.sleep(0.01)


def replicate_once(
    nodes: Nodes, metrics_port: int, step: int, shard: bytes, run: str = "bench"
) -> tuple[float, float]:
    """Seconds from the commit of a save whose big shard is on node 1 to node 0 holding it in
    memory (the copy counts), and to its SSD copy being durable."""
    opened = nodes.clients[0].open_save(run, step, 2)
    for rank, data in ((0, b"s" * 4096), (1, shard)):
        client = nodes.clients[rank]
        client.join_save(opened, run, step, 2)
        client.write_file(opened.save_id, f"__{rank}_0.distcp", rank, SHARD, data)
    nodes.clients[0].write_file(opened.save_id, ".metadata", 0, METADATA, b"m" * 4096)
    before = replica_bytes(metrics_port)
    nodes.clients[0].commit(opened.save_id)
    committed = time.time()
    log, deadline = nodes.procs[0].log_path, committed + 120
    part = f"node node1's part of {run}/{step}"
    held = logged_at(log, f"{part} is held in memory here", deadline) - committed
    durable = logged_at(log, f"copied {part} ", deadline) - committed
    if replica_bytes(metrics_port) < before + len(shard):
        raise SystemExit("node 0 logged the copy but its metrics do not show it on SSD")
    nodes.clients[0].delete(run, step)  # from every node: keep memory and disk small
    return held, durable


def replication(args: argparse.Namespace, where: str | None) -> dict[str, float]:
    """Replication throughput with the data dirs under `where` (None: the default temp dir)."""
    shard = payload(args.mib)
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="ckptd-replicas-bench-", dir=where) as tmp:
        budget = str(3 * args.mib + 256)
        nodes = Nodes(
            Path(tmp), 2, "--replica-mb-s", "0", "--memory-budget-mb", budget,
            per_node=[("--metrics-port", str(port)), ()],
        )  # fmt: skip
        raw = RawTcp(len(shard), to_child=False)
        try:
            copies, baseline = [], []
            for run_ in range(args.runs):
                copies.append(replicate_once(nodes, port, run_ + 1, shard))
                baseline.append(raw.transfer())
        finally:
            raw.close()
            nodes.close()
    rate = len(shard) / min(held for held, _ in copies) / 1e6
    durable = len(shard) / min(durable for _, durable in copies) / 1e6
    raw_rate = len(shard) / min(baseline) / 1e6
    disk = "on tmpfs" if where else "on disk"
    print(f"raw TCP loopback                         {raw_rate:9.0f} MB/s")
    print(f"replication node 1 -> node 0, {disk:<10} {rate:9.0f} MB/s  (held in memory: counts)")
    print(f"  and durable on node 0's SSD {disk:<10} {durable:9.0f} MB/s")
    print(f"ratio replication ({disk}) / raw TCP: {rate / raw_rate:.2f} (target >= 0.5)")
    print(f"ratio durable replication ({disk}) / raw TCP: {durable / raw_rate:.2f}")
    return {
        "replication_mb_s": rate,
        "durable_mb_s": durable,
        "raw_tcp_mb_s": raw_rate,
        "ratio": rate / raw_rate,
        "durable_ratio": durable / raw_rate,
    }


def nonzero_metrics(port: int) -> list[str]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    return [
        ln for ln in text.splitlines()
        if ln.startswith("ckptd_") and not ln.endswith(" 0.0") and "_bucket" not in ln
        and "_created" not in ln
    ]  # fmt: skip


def _ss(*args: str) -> list[str]:
    return subprocess.run(
        ["ss", "-tnpH", *args], capture_output=True, text=True
    ).stdout.splitlines()


def data_socket_copy(nodes: Nodes, metrics_ports: tuple[int, int], step: int, shard: bytes) -> str:
    """One more replicated save, node 0's TCP connections sampled (ss, every 5 ms) while it
    copies: which of node 1's listening ports (gRPC, data socket) node 0 connected to."""
    pids = [proc.process.pid for proc in nodes.procs]
    grpc_port = int(nodes.procs[1].address.rsplit(":", 1)[1])
    listening = {
        int(ln.split()[3].rsplit(":", 1)[1]) for ln in _ss("-l") if f"pid={pids[1]}," in ln
    }
    data_ports = listening - {grpc_port, metrics_ports[1]}
    seen: set[int] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            for ln in _ss("state", "established"):
                if f"pid={pids[0]}," in ln:
                    seen.add(int(ln.split()[3].rsplit(":", 1)[1]))  # the peer's port
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        replicate_once(nodes, metrics_ports[0], step, shard)
    finally:
        done.set()
        watcher.join()
    return (
        f"node 1's data port(s) {sorted(data_ports & seen)} (of listening {sorted(data_ports)}),"
        f" its gRPC port {grpc_port}: {'yes' if grpc_port in seen else 'no'}"
    )


def tls_replication(args: argparse.Namespace) -> dict[str, float]:
    """Replication throughput, a TLS pair beside a plaintext pair, saves alternating."""
    shard = payload(args.mib)
    with tempfile.TemporaryDirectory(prefix="ckptd-replicas-tls-bench-") as tmp:
        tls = generate_certs(Path(tmp) / "certs")
        envs = {
            "tls": {TLS_DIR_ENV: str(tls.root), TLS_CLIENT_AUTH_ENV: "1"},
            "plain": {TLS_DIR_ENV: "", TLS_CLIENT_AUTH_ENV: ""},
        }
        security = {"tls": ClientSecurity(tls), "plain": ClientSecurity()}
        budget = str(3 * args.mib + 256)
        ports = {name: (free_port(), free_port()) for name in envs}
        pairs: dict[str, Nodes] = {}
        try:
            for name, env in envs.items():
                pairs[name] = Nodes(
                    Path(tmp) / name, 2, "--replica-mb-s", "0", "--memory-budget-mb", budget,
                    per_node=[("--metrics-port", str(p),) for p in ports[name]],
                    env=env, security=security[name],
                )  # fmt: skip
            times: dict[str, list[tuple[float, float]]] = {name: [] for name in pairs}
            for run_ in range(args.runs):
                for name, nodes in pairs.items():
                    times[name].append(replicate_once(nodes, ports[name][0], run_ + 1, shard))
            seen = data_socket_copy(pairs["tls"], ports["tls"], args.runs + 1, shard)
            metrics = {i: nonzero_metrics(p) for i, p in enumerate(ports["tls"])}
        finally:
            for nodes in pairs.values():
                nodes.close()
    rate = {n: len(shard) / min(h for h, _ in t) / 1e6 for n, t in times.items()}
    durable = {n: len(shard) / min(d for _, d in t) / 1e6 for n, t in times.items()}
    for name in pairs:
        print(f"replication node 1 -> node 0, {name:<6} {rate[name]:9.0f} MB/s held in memory, "
              f"{durable[name]:9.0f} MB/s durable on SSD")  # fmt: skip
    print(f"ratio replication TLS / plaintext: {rate['tls'] / rate['plain']:.2f} (held), "
          f"{durable['tls'] / durable['plain']:.2f} (durable)")  # fmt: skip
    print(f"all held times (s): { {n: [round(h, 3) for h, _ in t] for n, t in times.items()} }")
    print(f"TLS pair, one more copy watched with ss: node 0 connected to {seen}")
    for i, lines in metrics.items():
        print(f"--- TLS node{i} nonzero metrics ---")
        print("\n".join(lines))
    return {
        "tls_mb_s": rate["tls"], "plain_mb_s": rate["plain"],
        "ratio": rate["tls"] / rate["plain"],
        "durable_ratio": durable["tls"] / durable["plain"],
    }  # fmt: skip


def train(root: Path, replicas: int, args: argparse.Namespace) -> float:
    """Tokens/s of a 2-node run saving every --ckpt-every steps with R = `replicas`."""
    options = RunOptions(
        workdir=Workdir(root),
        ranks=args.ranks,
        nodes=2,
        steps=args.steps,
        ckpt_every=args.ckpt_every,
        trainer_args=[
            *("--dim", str(args.dim), "--n-layers", str(args.layers)),
            *("--replicas", str(replicas)),
        ],
        upload_wait_s=0,
    )
    return run(options, io.StringIO()).tokens_per_s


def training(args: argparse.Namespace) -> dict[str, float]:
    speed: dict[int, list[float]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory(prefix="replicas-train-bench-") as tmp:
        for pair in range(args.train_pairs):
            for r in (2, 1):
                speed[r].append(train(Path(tmp) / f"pair{pair}-r{r}", r, args))
    med = {r: statistics.median(v) for r, v in speed.items()}
    print(f"training, R=1 (no copies)                {med[1]:9,.0f} tokens/s")
    print(f"training, R=2 (a copy of every part)     {med[2]:9,.0f} tokens/s")
    print(f"ratio training while replicating / without: {med[2] / med[1]:.3f} (target >= 0.95)")
    return {"tokens_s_r1": med[1], "tokens_s_r2": med[2], "ratio": med[2] / med[1]}


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--train-pairs", type=int, default=1, help="R=2/R=1 run pairs (0: none)")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--ckpt-every", type=int, default=3)
    parser.add_argument("--dim", type=int, default=256, help="model width (state size)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tls", action="store_true", help="replication TLS vs plaintext only")
    args = parser.parse_args()
    if args.tls:
        result = tls_replication(args)
        print(json.dumps({"replication_tls": {n: round(v, 3) for n, v in result.items()}}))
        return
    results = {"replication": replication(args, None)}
    if Path("/dev/shm").is_dir():
        results["replication_tmpfs"] = replication(args, "/dev/shm")
    if args.train_pairs:
        results["training"] = training(args)
    print(json.dumps({k: {n: round(v, 3) for n, v in r.items()} for k, r in results.items()}))


if __name__ == "__main__":
    main()
