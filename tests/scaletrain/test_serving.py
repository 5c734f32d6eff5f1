"""The one serve loop of ckptd and telemetry (`scaletrain.serving`), on a stand-in service."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from wsgiref.simple_server import WSGIServer

import pytest
from grpc_health.v1 import health_pb2
from grpc_health.v1.health import HealthServicer

from scaletrain.errors import UserError
from scaletrain.serving import serve_http, serve_until_signalled


class StandIn:
    """Records what the loop asked of it, and the health status it saw when asked to stop."""

    def __init__(self) -> None:
        self.health = HealthServicer()
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.stopped_with: list[float] = []
        self.status_at_stop: int | None = None

    def stop(self, grace: float) -> None:
        request = health_pb2.HealthCheckRequest(service="")
        self.status_at_stop = self.health.Check(request, None).status
        self.stopped_with.append(grace)


def _signal_once_handled(sig: signal.Signals) -> None:
    """Send `sig` to this process from another thread once the loop has its handler installed
    (the default handler of SIGTERM would end the test run)."""
    before = signal.getsignal(sig)

    def send() -> None:
        while signal.getsignal(sig) is before:
            time.sleep(0.01)
        os.kill(os.getpid(), sig)

    threading.Thread(target=send, daemon=True).start()


def test_a_signal_stops_the_service_gracefully_after_health_says_not_serving(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    service = StandIn()
    before = signal.getsignal(signal.SIGTERM)
    _signal_once_handled(signal.SIGTERM)
    with caplog.at_level(logging.INFO):
        serve_until_signalled(
            service,
            ["svc listening on a:1", "metrics on b"],
            name="svc",
            grace=2.5,
            log=logging.getLogger("test"),
        )
    assert capsys.readouterr().out == "svc listening on a:1\nmetrics on b\n"
    assert service.stopped_with == [2.5]
    assert service.status_at_stop == health_pb2.HealthCheckResponse.NOT_SERVING
    assert signal.getsignal(signal.SIGTERM) is before
    assert any(r.getMessage().startswith("svc stopped in ") for r in caplog.records)


def test_the_handlers_are_restored_when_the_stop_fails() -> None:
    class FailingStop(StandIn):
        def stop(self, grace: float) -> None:
            raise RuntimeError("stop failed")

    before = signal.getsignal(signal.SIGINT)
    _signal_once_handled(signal.SIGINT)
    with pytest.raises(RuntimeError, match="stop failed"):
        serve_until_signalled(FailingStop(), [], name="svc", grace=0, log=logging.getLogger("t"))
    assert signal.getsignal(signal.SIGINT) is before


def test_a_metrics_address_taken_or_malformed_is_one_line() -> None:
    def taken(host: str, port: int) -> tuple[WSGIServer, threading.Thread]:
        raise OSError(98, "Address already in use")

    with pytest.raises(UserError) as caught:
        serve_http("127.0.0.1:9100", taken)
    assert str(caught.value) == "cannot serve metrics on 127.0.0.1:9100: Address already in use"
    with pytest.raises(UserError) as caught:
        serve_http("9100", taken)
    assert str(caught.value) == "bad metrics address '9100': expected HOST:PORT"
