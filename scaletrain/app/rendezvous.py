"""The job's rendezvous endpoint, off the training nodes: the c10d store torchrun's agents meet in.

torchrun's c10d rendezvous keeps its state (who takes part in which round, the spares waiting in
its redundancy list, each agent's keep-alive) in a TCPStore. By default the first agent hosts it
(`is_host`), so losing that training node loses the rendezvous and with it the job. Here the
store is a small process of its own (`scaletrain rendezvous --listen HOST:PORT`, a Deployment in
the Helm chart), and every agent, spares included, joins it as a client (`is_host=false`).
"""

from __future__ import annotations

import signal
import socket
import threading
import time

from scaletrain.errors import UserError

# An elastic job with fewer than MIN nodes left waits this long (seconds) for machines to join
# before it stops (--capacity-wait-s; torchrun's own join_timeout default).
CAPACITY_WAIT_S = 600.0


def split_address(listen: str) -> tuple[str, int]:
    """HOST:PORT as (host, port); UserError names a malformed one."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"--listen {listen!r}: expected HOST:PORT with a port of 1 to 65535")
    return host, int(port)


def serve(listen: str) -> None:
    """Host the store at `listen` until SIGTERM or SIGINT."""
    import torch.distributed as dist

    host, port = split_address(listen)
    try:
        store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False)
    except (RuntimeError, OSError) as exc:
        raise UserError(f"rendezvous: cannot listen on {listen}: {exc}") from None
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"[rendezvous] c10d store on {host}:{port}", flush=True)
    stop.wait()
    del store


def wait_listening(address: str, timeout_s: float) -> None:
    """Until something accepts TCP connections at `address`; UserError when the time is up."""
    host, port = split_address(address)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError as exc:
            if time.monotonic() > deadline:
                raise UserError(f"rendezvous did not listen at {address}: {exc}") from None
            time.sleep(0.1)
