"""The telemetry service over real gRPC on loopback, driven by the real client."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from scaletrain.errors import InvalidArgument, NotFound, UserError
from scaletrain.transport import make_channel, wait_until_healthy
from scaletrain.v1 import common_pb2, telemetry_pb2, telemetry_pb2_grpc
from telemetry import queries
from telemetry.client import TelemetryClient, event, rank_step
from telemetry.config import TelemetryConfig
from telemetry.db import connect, migrate
from telemetry.models import RankStep
from telemetry.server import SERVICE_NAME, RunningTelemetry, start
from telemetry.store import TelemetryStore

RANKS = 4
STEPS = 25


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'telemetry.db'}"


@pytest.fixture
def service(db_url: str) -> Iterator[RunningTelemetry]:
    running = start(TelemetryConfig(db_url=db_url))
    yield running
    running.stop(grace=0)


@pytest.fixture
def stub(service: RunningTelemetry) -> Iterator[telemetry_pb2_grpc.TelemetryServiceStub]:
    with make_channel(service.address) as channel:
        yield telemetry_pb2_grpc.TelemetryServiceStub(channel)


def register(client: TelemetryClient, run_id: str = "run-1") -> bool:
    """Register the test run; True when it was new."""
    reply = client.register_run(
        telemetry_pb2.RegisterRunRequest(
            run_id=run_id,
            world_size=RANKS,
            name="service test",
            layout=common_pb2.ParallelLayout(dp_shard=2, tp=2),
            ranks=[
                telemetry_pb2.RankInfo(rank=r, host="localhost", device="cpu") for r in range(RANKS)
            ],
        )
    )
    return reply.created


def step_record(step: int, rank: int, run_id: str = "run-1") -> telemetry_pb2.RankStep:
    return rank_step(
        run_id,
        step,
        rank,
        loss=2.0 / (step + 1),
        tokens=256,
        times={"step": 0.01},
        offset=((step + 1) * 8, (step + 1) * 8 + rank * 2, 0),
    )


def stored_records(db_url: str) -> list[tuple[int, int]]:
    engine = connect(db_url, read_only=True)
    try:
        with Session(engine) as session:
            rows = session.execute(select(RankStep.step, RankStep.rank)).all()
            return [(step, rank) for step, rank in rows]
    finally:
        engine.dispose()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_records_from_four_ranks_arrive_exactly_once_and_a_resent_batch_counts_as_duplicates(
    service: RunningTelemetry, stub: telemetry_pb2_grpc.TelemetryServiceStub, db_url: str
) -> None:
    clients = [
        TelemetryClient(service.address, batch_size=8, flush_interval_s=0.05) for _ in range(RANKS)
    ]
    assert register(clients[0]) is True
    assert register(clients[1]) is False
    for step in range(STEPS):
        for rank, client in enumerate(clients):
            client.report_step(step_record(step, rank))
    for client in clients:
        assert client.close(timeout_s=10)
        assert (client.dropped, client.rejected) == (0, 0)

    stored = stored_records(db_url)
    assert sorted(stored) == [(s, r) for s in range(STEPS) for r in range(RANKS)]

    batch = telemetry_pb2.StepBatch(records=[step_record(s, 0) for s in range(STEPS)])
    reply = stub.ReportSteps(iter([batch, batch]))
    assert (reply.accepted, reply.duplicates) == (0, 2 * STEPS)


def test_resume_point_is_the_latest_committed_step_with_each_ranks_offsets(
    service: RunningTelemetry,
) -> None:
    with TelemetryClient(service.address, flush_interval_s=0.05) as client:
        register(client)
        assert client.resume_point("run-1").found is False
        for step in range(12):
            for rank in range(RANKS):
                client.report_step(step_record(step, rank))
            if step in (4, 9):
                client.report_event(event("run-1", "checkpoint_committed", step=step, tier="ssd"))
        assert client.flush(timeout_s=10)

        point = client.resume_point("run-1")
        assert (point.found, point.step) == (True, 9)
        assert [(o.rank, o.offset.global_sample, o.offset.rank_sample) for o in point.offsets] == [
            (rank, 80, 80 + 2 * rank) for rank in range(RANKS)
        ]
        assert client.resume_point("run-1", step=4).offsets[3].offset.rank_sample == 46


def test_the_client_keeps_records_while_the_service_is_down_and_delivers_them_after_a_restart(
    service: RunningTelemetry, db_url: str
) -> None:
    client = TelemetryClient(service.address, flush_interval_s=0.05)
    register(client)
    for rank in range(RANKS):
        client.report_step(step_record(0, rank))
    assert client.flush(timeout_s=10)

    service.stop(grace=0)
    for step in range(1, 6):
        for rank in range(RANKS):
            client.report_step(step_record(step, rank))
    client.report_event(event("run-1", "checkpoint_committed", step=5, tier="memory"))
    assert client.flush(timeout_s=0.5) is False
    assert client.pending == 5 * RANKS + 1
    assert "UNAVAILABLE" in (client.last_error or "")

    restarted = start(TelemetryConfig(db_url=db_url, listen=f"127.0.0.1:{service.port}"))
    try:
        assert client.flush(timeout_s=20)
        assert (client.pending, client.dropped, client.last_error) == (0, 0, None)
        assert len(stored_records(db_url)) == 6 * RANKS
        assert client.resume_point("run-1").step == 5
    finally:
        client.close(timeout_s=5)
        restarted.stop(grace=0)


def start_registered(db_url: str, port: int) -> RunningTelemetry:
    """The service on `port`, with run-1 registered behind the back of a client waiting for it:
    the client's sender may deliver before any register call of its own would."""
    engine = connect(db_url)
    migrate(engine)
    TelemetryStore(engine).register_run(
        telemetry_pb2.RegisterRunRequest(run_id="run-1", world_size=RANKS)
    )
    engine.dispose()
    return start(TelemetryConfig(db_url=db_url, listen=f"127.0.0.1:{port}"))


def test_reporting_never_blocks_and_a_full_queue_drops_the_oldest_records_counting_them(
    db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()
    client = TelemetryClient(f"127.0.0.1:{port}", max_queue=10, flush_interval_s=0.05)
    began = time.monotonic()
    for step in range(25):
        client.report_step(step_record(step, 0))
    assert time.monotonic() - began < 0.5
    assert client.pending == 10
    # An evicted record counts as dropped once the failing call that carried it has returned.
    deadline = time.monotonic() + 5
    while client.dropped < 15 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.dropped == 15
    assert "queue full" in caplog.text and "dropped the oldest record" in caplog.text

    service = start_registered(db_url, port)
    try:
        assert client.flush(timeout_s=20)
        assert sorted(stored_records(db_url)) == [(step, 0) for step in range(15, 25)]
    finally:
        client.close(timeout_s=5)
        service.stop(grace=0)


def test_the_client_rejects_invalid_records_and_still_delivers_the_valid_ones_around_them(
    service: RunningTelemetry, db_url: str
) -> None:
    with TelemetryClient(service.address, batch_size=4, flush_interval_s=0.05) as client:
        register(client)
        for step in range(10):
            client.report_step(step_record(step, 0))
            if step == 6:
                client.report_step(step_record(step, RANKS))  # outside the world
                client.report_step(step_record(step, 1, run_id="unregistered"))
        assert client.flush(timeout_s=10)
        assert client.rejected == 2
    assert sorted(stored_records(db_url)) == [(step, 0) for step in range(10)]


def test_bad_requests_get_invalid_argument_and_unknown_runs_not_found(
    service: RunningTelemetry, stub: telemetry_pb2_grpc.TelemetryServiceStub
) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        stub.RegisterRun(telemetry_pb2.RegisterRunRequest(run_id="", world_size=1))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == "run_id is empty"

    with pytest.raises(grpc.RpcError) as caught:
        stub.ReportSteps(iter([telemetry_pb2.StepBatch(records=[step_record(0, 0, "ghost")])]))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND

    with pytest.raises(grpc.RpcError) as caught:
        stub.GetResumePoint(telemetry_pb2.GetResumePointRequest(run_id="ghost"))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND

    with TelemetryClient(service.address) as client:
        with pytest.raises(NotFound, match="run 'ghost' is not registered"):
            client.resume_point("ghost", timeout_s=5)
        with pytest.raises(InvalidArgument, match="world_size must be at least 1"):
            client.register_run(telemetry_pb2.RegisterRunRequest(run_id="run-1"), timeout_s=5)


def test_the_service_reports_serving_on_the_health_service(service: RunningTelemetry) -> None:
    wait_until_healthy(service.address, timeout_s=5, service=SERVICE_NAME)


def test_serve_prints_its_address_and_stops_cleanly_on_sigterm(db_url: str) -> None:
    program = (
        "import sys; from telemetry.config import TelemetryConfig; "
        "from telemetry.server import serve; serve(TelemetryConfig(db_url=sys.argv[1]))"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", program, db_url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        line = process.stdout.readline() if process.stdout else ""
        assert line.startswith("telemetry listening on 127.0.0.1:")
        wait_until_healthy(line.split()[-1], timeout_s=10, service=SERVICE_NAME)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_the_service_flags_a_rank_that_stays_slow_and_serves_the_runs_metrics(
    db_url: str,
) -> None:
    running = start(TelemetryConfig(db_url=db_url, metrics_listen="127.0.0.1:0"))
    try:
        with TelemetryClient(running.address, flush_interval_s=0.05) as client:
            register(client)
            for step in range(1, 11):
                for rank in range(RANKS):
                    # Rank 2 computes 3x longer from step 4 on; every step waits for it.
                    slow = rank == 2 and step >= 4
                    times = {"step": 0.4, "compute": 0.3 if slow else 0.1}
                    client.report_step(
                        rank_step("run-1", step, rank, loss=2.0, tokens=100, times=times)
                    )
            assert client.flush(timeout_s=10)
        engine = connect(db_url, read_only=True)
        try:
            flagged = queries.events(engine, "run-1", kinds=["straggler"])
        finally:
            engine.dispose()
        # Slow at steps 4, 5 and 6: flagged at the third, once.
        assert list(zip(flagged["step"], flagged["rank"], strict=True)) == [(6, 2)]
        assert flagged.iloc[0]["attributes"]["relative_score"] == "0.333"

        with urllib.request.urlopen(f"http://{running.metrics.address}/metrics") as reply:
            metrics = reply.read().decode()
        assert 'scaletrain_step{run_id="run-1"} 10.0' in metrics
        assert 'scaletrain_tokens_per_second{run_id="run-1"} 1000.0' in metrics
        assert 'scaletrain_events_total{kind="straggler",run_id="run-1"} 1.0' in metrics
        relative = 'scaletrain_rank_straggler_score{rank="2",run_id="run-1",score="relative"}'
        assert f"{relative} 0.333" in metrics
    finally:
        running.stop(grace=0)


def test_a_metrics_address_that_is_taken_is_refused_with_one_line(db_url: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(UserError, match=f"cannot serve metrics on 127.0.0.1:{port}: "):
            start(TelemetryConfig(db_url=db_url, metrics_listen=f"127.0.0.1:{port}"))


def test_a_client_that_must_lose_nothing_waits_for_room_until_the_service_takes_its_records(
    db_url: str,
) -> None:
    port = free_port()
    client = TelemetryClient(
        f"127.0.0.1:{port}", max_queue=10, flush_interval_s=0.05, when_full="wait"
    )
    reported = threading.Thread(
        target=lambda: [client.report_step(step_record(step, 0)) for step in range(25)]
    )
    reported.start()
    reported.join(timeout=1.0)
    assert reported.is_alive(), "a full queue made the report wait"
    assert (client.pending, client.dropped) == (10, 0)

    service = start_registered(db_url, port)
    try:
        reported.join(timeout=30)
        assert not reported.is_alive()
        assert client.flush(timeout_s=20)
        assert client.dropped == 0
        assert sorted(stored_records(db_url)) == [(step, 0) for step in range(25)]
    finally:
        client.close(timeout_s=5)
        service.stop(grace=0)
