"""How a scaletrain service runs in the foreground: announce itself, serve until SIGTERM or SIGINT,
then leave cleanly. ckptd and telemetry both run through here, so they stop the same way.

A base module: the standard library and gRPC only. Each service keeps what is its own (what
`start` builds, what `stop` releases, in which order); this module owns the rest:

- the signals: installed before the service announces itself, so a parent that reads the line
  and at once sends SIGTERM still gets a graceful stop; restored afterwards;
- the announcement lines on stdout, which parents (the embedded stack, the tests) wait for;
- health: NOT_SERVING from the moment the stop begins, so a readiness probe or a load balancer
  sends nothing more while calls in flight get `grace` seconds to finish;
- the metrics endpoint, an HTTP server that each service's `stop` shuts down (`HttpEndpoint`).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol
from wsgiref.simple_server import WSGIServer

from grpc_health.v1.health import HealthServicer

from scaletrain.errors import UserError

_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# How often the waiting main thread wakes: the signal handler runs only between its bytecodes.
_WAKE_S = 1.0


class Service(Protocol):
    """What a started service offers its serve loop."""

    @property
    def health(self) -> HealthServicer: ...

    def stop(self, grace: float) -> None:
        """Refuse new calls, give calls in flight `grace` seconds, release everything."""
        ...


@dataclass
class HttpEndpoint:
    """An HTTP server on its own thread (a service's /metrics): where it listens, how to stop it."""

    server: WSGIServer
    thread: threading.Thread
    host: str  # as it was asked for: a name stays a name

    @property
    def port(self) -> int:
        return self.server.server_port

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def serve_http(
    listen: str, start: Callable[[str, int], tuple[WSGIServer, threading.Thread]]
) -> HttpEndpoint:
    """Start an HTTP endpoint on `listen` (HOST:PORT, port 0 picks a free one) with
    `start(host, port)`; UserError in one line when the address is malformed or taken."""
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"bad metrics address {listen!r}: expected HOST:PORT")
    try:
        server, thread = start(host, int(port))
    except OSError as exc:
        raise UserError(f"cannot serve metrics on {listen}: {exc.strerror or exc}") from None
    return HttpEndpoint(server, thread, host)


def serve_until_signalled(
    service: Service,
    announce: Sequence[str],
    *,
    name: str,
    grace: float,
    log: logging.Logger,
) -> None:
    """Print the `announce` lines, wait for SIGTERM or SIGINT, then stop `service` within
    `grace` seconds (health NOT_SERVING first) and log how long the stop took.

    Call it from the main thread, with `service` started: it stops the service however the wait
    ends, a signal or an exception alike.
    """
    stopping = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stopping.set()) for sig in _SIGNALS}
    try:
        for line in announce:
            print(line, flush=True)
        while not stopping.wait(_WAKE_S):
            pass
    finally:
        started = time.monotonic()
        service.health.enter_graceful_shutdown()
        try:
            service.stop(grace)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        log.info("%s stopped in %.1fs", name, time.monotonic() - started)
