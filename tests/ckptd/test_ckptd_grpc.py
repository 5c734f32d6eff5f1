"""ckptd over real gRPC on loopback, through CkptdClient, with a real SeaweedFS behind it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from ckptd_testing import METADATA, SHARD, chunk, payload, ref, tier_states, wait_for

from ckptd.client import CkptdClient
from ckptd.config import S3Config
from ckptd.datadir import ckptd_running, list_offline
from ckptd.manifest import data_crc32c
from ckptd.server import RunningCkptd
from scaletrain.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
)
from scaletrain.transport import MAX_CHUNK_BYTES, add_health, bind, make_channel, make_server
from scaletrain.v1 import checkpoint_pb2, checkpoint_pb2_grpc, telemetry_pb2, telemetry_pb2_grpc

RunCkptd = Callable[..., RunningCkptd]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def client_for() -> Iterator[Callable[[RunningCkptd], CkptdClient]]:
    clients: list[CkptdClient] = []

    def _client(running: RunningCkptd) -> CkptdClient:
        clients.append(CkptdClient(running.address))
        return clients[-1]

    yield _client
    for client in clients:
        client.close()


def save_two_ranks(client: CkptdClient, run: str, step: int) -> dict[str, bytes]:
    """Save rank 0 and rank 1 shards (several chunks each) and the metadata, then commit."""
    files = {
        "__0_0.distcp": payload(9 << 20, 0),
        "__1_0.distcp": payload((5 << 20) + 3, 1),
        ".metadata": payload(2048, 2),
    }
    save_id = client.open_save(run, step, world_size=2, labels={"layout": "dp2"}).save_id
    client.write_file(save_id, "__0_0.distcp", 0, SHARD, files["__0_0.distcp"])
    # An iterable of odd-sized writes, as a DCP stream produces them.
    data = files["__1_0.distcp"]
    client.write_file(
        save_id,
        "__1_0.distcp",
        1,
        SHARD,
        (data[i : i + 999_999] for i in range(0, len(data), 999_999)),
    )
    client.write_file(save_id, ".metadata", 0, METADATA, files[".metadata"])
    info = client.commit(save_id)
    assert info.committed and dict(info.labels) == {"layout": "dp2"}
    return files


def raw_read(running: RunningCkptd, run: str, step: int, path: str) -> tuple[bytes, set[int]]:
    """ReadFile through the bare stub, to see which tier served each chunk."""
    with make_channel(running.address) as channel:
        replies = list(
            checkpoint_pb2_grpc.CheckpointServiceStub(channel).ReadFile(
                checkpoint_pb2.ReadFileRequest(ref=ref(run, step), path=path)
            )
        )
    return b"".join(r.data for r in replies), {r.tier for r in replies}


def test_two_ranks_save_commit_and_read_back_bit_exact_from_memory_ssd_and_s3(
    run_ckptd: RunCkptd, client_for: Callable, s3_config: S3Config
) -> None:
    running = run_ckptd(s3=s3_config)
    client = client_for(running)
    files = save_two_ranks(client, "llama", 100)

    info = client.get("llama", 100)
    assert tier_states(info)["memory"] == "COMMITTED" and tier_states(info)["ssd"] == "COMMITTED"
    wait_for(lambda: tier_states(client.get("llama"))["s3"] == "COMMITTED", what="the S3 upload")
    assert {f.path: f.crc32c for f in info.files} == {
        path: data_crc32c(data) for path, data in files.items()
    }
    for path, data in files.items():
        assert client.read("llama", 100, path) == data
    shard = files["__0_0.distcp"]
    for offset, length in [(0, 10), (4 << 20, 1), ((4 << 20) - 5, 10), (123_457, 6 << 20)]:
        assert (
            client.read("llama", 100, "__0_0.distcp", offset, length)
            == shard[offset : offset + length]
        )
    assert raw_read(running, "llama", 100, "__0_0.distcp") == (shard, {1})  # from memory
    assert [i.ref.step for i in client.list("llama")] == [100]


def test_a_read_is_served_from_s3_after_the_local_copies_are_lost(
    run_ckptd: RunCkptd, client_for: Callable, s3_config: S3Config
) -> None:
    running = run_ckptd(s3=s3_config, memory_budget_bytes=0)
    client = client_for(running)
    files = save_two_ranks(client, "run", 5)
    wait_for(lambda: tier_states(client.get("run", 5))["s3"] == "COMMITTED", what="S3")
    ssd_dir = running.store.ssd.dir_of(running.store.ssd.list()[0])
    (ssd_dir / "__1_0.distcp").unlink()
    with open(ssd_dir / "__0_0.distcp", "r+b") as f:
        f.seek(5 << 20)
        f.write(b"bit rot")

    assert raw_read(running, "run", 5, "__0_0.distcp") == (files["__0_0.distcp"], {2, 3})
    assert raw_read(running, "run", 5, "__1_0.distcp") == (files["__1_0.distcp"], {3})
    assert tier_states(client.get("run", 5))["ssd"] == "FAILED"


def test_bad_input_gets_the_right_status_code_and_stores_nothing(
    run_ckptd: RunCkptd, client_for: Callable
) -> None:
    running = run_ckptd()
    client = client_for(running)
    save_id = client.open_save("run", 1, world_size=2).save_id

    with pytest.raises(InvalidArgument, match=r"INVALID_ARGUMENT.*inside the checkpoint"):
        client.write_file(save_id, "../../etc/passwd", 0, SHARD, b"x")
    with pytest.raises(InvalidArgument, match="run name"):
        client.open_save("../escape", 1, world_size=1)

    with make_channel(running.address) as channel:
        stub = checkpoint_pb2_grpc.CheckpointServiceStub(channel)
        header = checkpoint_pb2.WriteFileRequest(
            header=checkpoint_pb2.FileHeader(save_id=save_id, path="__0_0.distcp", kind=SHARD)
        )
        data = payload(100, 0)
        bad_crc = [header, checkpoint_pb2.WriteFileRequest(chunk=chunk(0, data, crc=7))]
        with pytest.raises(grpc.RpcError) as err:
            stub.WriteFile(iter(bad_crc))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "CRC-32C mismatch" in err.value.details()
        too_big = [
            header,
            checkpoint_pb2.WriteFileRequest(chunk=chunk(0, bytes(MAX_CHUNK_BYTES + 1))),
        ]
        with pytest.raises(grpc.RpcError) as err:
            stub.WriteFile(iter(too_big))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "over the limit" in err.value.details()
        out_of_order = [header, checkpoint_pb2.WriteFileRequest(chunk=chunk(50, data))]
        with pytest.raises(grpc.RpcError) as err:
            stub.WriteFile(iter(out_of_order))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "expected 0" in err.value.details()
        no_trailer = [header, checkpoint_pb2.WriteFileRequest(chunk=chunk(0, data))]
        with pytest.raises(grpc.RpcError) as err:
            stub.WriteFile(iter(no_trailer))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    client.write_file(save_id, "__0_0.distcp", 0, SHARD, b"rank 0 only")
    client.write_file(save_id, ".metadata", 0, METADATA, b"meta")
    with pytest.raises(FailedPrecondition, match=r"rank\(s\) 1 of world size 2"):
        client.commit(save_id)
    (info,) = client.list(include_uncommitted=True)
    assert sorted(f.path for f in info.files) == [".metadata", "__0_0.distcp"]
    assert not any((running.store.ssd.root / ".incoming").iterdir())

    client.write_file(save_id, "__1_0.distcp", 1, SHARD, b"rank 1")
    client.commit(save_id)
    with pytest.raises(FailedPrecondition, match="already committed"):
        client.write_file(save_id, "__1_1.distcp", 1, SHARD, b"late")
    with pytest.raises(AlreadyExists):
        client.open_save("run", 1, world_size=2)
    with pytest.raises(NotFound, match="NOT_FOUND") as err:
        client.get("unknown-run")
    assert "\n" not in str(err.value)
    with pytest.raises(NotFound):
        client.read("run", 1, "__9_0.distcp")
    with pytest.raises(NotFound):
        client.commit("no-such-save")


def test_an_error_in_the_callers_data_iterable_reaches_the_caller_and_stores_nothing(
    run_ckptd: RunCkptd, client_for: Callable
) -> None:
    running = run_ckptd()
    client = client_for(running)
    save_id = client.open_save("run", 1, world_size=1).save_id

    def broken() -> Iterator[bytes]:
        yield b"some bytes"
        raise RuntimeError("the staging buffer vanished")

    with pytest.raises(RuntimeError, match="staging buffer vanished"):
        client.write_file(save_id, "__0_0.distcp", 0, SHARD, broken())
    (info,) = client.list(include_uncommitted=True)
    assert not info.files


def test_a_restarted_ckptd_lists_its_checkpoints_and_uploads_what_s3_missed(
    run_ckptd: RunCkptd, client_for: Callable, s3_config: S3Config, dead_s3_config: S3Config
) -> None:
    first = run_ckptd(s3=dead_s3_config)
    client = client_for(first)
    files = save_two_ranks(client, "run", 7)
    wait_for(lambda: tier_states(client.get("run", 7))["s3"] == "FAILED", what="S3 failure")
    first.stop(grace=1)
    (offline,) = list_offline(first.store.config.data_dir)
    assert tier_states(offline) == {"memory": "ABSENT", "ssd": "COMMITTED", "s3": "FAILED"}

    again = run_ckptd(s3=s3_config)
    client = client_for(again)
    (info,) = client.list()
    assert info.ref.step == 7 and tier_states(info)["memory"] == "ABSENT"
    wait_for(lambda: tier_states(client.get("run", 7))["s3"] == "COMMITTED", what="re-upload")
    assert client.read("run", 7, "__1_0.distcp") == files["__1_0.distcp"]
    assert client.delete("run", 7) == ([2], [3])
    assert client.list() == []


class RecordingTelemetry(telemetry_pb2_grpc.TelemetryServiceServicer):
    """A stand-in telemetry service that keeps the events it receives."""

    def __init__(self) -> None:
        self.events: list[telemetry_pb2.Event] = []
        self.lock = threading.Lock()

    def ReportEvents(
        self, request: telemetry_pb2.EventBatch, context: grpc.ServicerContext
    ) -> telemetry_pb2.ReportEventsResponse:
        with self.lock:
            self.events.extend(request.events)
        return telemetry_pb2.ReportEventsResponse(accepted=len(request.events))


def test_each_tier_commit_is_reported_to_telemetry_as_an_event(
    run_ckptd: RunCkptd, client_for: Callable, s3_config: S3Config
) -> None:
    telemetry = RecordingTelemetry()
    server = make_server(max_workers=2)
    telemetry_pb2_grpc.add_TelemetryServiceServicer_to_server(telemetry, server)
    add_health(server)
    port = bind(server, "127.0.0.1:0")
    server.start()
    try:
        running = run_ckptd(s3=s3_config, telemetry=f"127.0.0.1:{port}")
        save_two_ranks(client_for(running), "run", 3)
        wait_for(lambda: len(telemetry.events) == 3, what="three telemetry events")
    finally:
        server.stop(0)
    by_tier = {e.checkpoint.tier: e for e in telemetry.events}
    assert sorted(by_tier) == [1, 2, 3]
    for event in telemetry.events:
        assert (event.run_id, event.step, event.rank) == ("run", 3, -1)
        assert event.kind == telemetry_pb2.EVENT_KIND_CHECKPOINT_COMMITTED
        assert event.checkpoint.bytes == (9 << 20) + (5 << 20) + 3 + 2048
        assert event.checkpoint.seconds > 0
    assert by_tier[3].checkpoint.seconds >= by_tier[2].checkpoint.seconds


def test_a_missing_telemetry_service_does_not_fail_or_slow_a_save(
    run_ckptd: RunCkptd, client_for: Callable
) -> None:
    running = run_ckptd(telemetry="127.0.0.1:1")
    assert save_two_ranks(client_for(running), "run", 1)


def test_serve_prints_its_address_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    code = (
        "from pathlib import Path; from ckptd.config import CkptdConfig; "
        "from ckptd.server import serve; "
        f"serve(CkptdConfig(data_dir=Path({str(tmp_path / 'd')!r})))"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        line = process.stdout.readline()
        assert line.startswith("ckptd listening on 127.0.0.1:"), line + process.stderr.read()
        with CkptdClient(line.split()[-1]) as client:
            assert client.list() == []
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0
    finally:
        process.kill()
    assert not ckptd_running(tmp_path / "d")
