"""Fair limits on ckptd's data socket, against real ckptds over loopback: an upload whose
connection fails gives its slot back at once, a caller over its share is refused naming its own
count and limit while other runs go on saving, idle connections are closed, and refusals are
counted and logged a few times instead of once each."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from ckptd_testing import METADATA, SHARD, payload, wait_for

from ckptd.client import CkptdClient
from ckptd.config import DataLimits
from ckptd.datapath import FRAME_LENGTH
from ckptd.limits import Owner
from ckptd.manifest import data_crc32c
from ckptd.server import RunningCkptd
from scaletrain.errors import ResourceExhausted
from scaletrain.security import ClientSecurity, Role, ServerSecurity, TokenTable, add_token
from scaletrain.transport import make_channel
from scaletrain.v1 import checkpoint_pb2, checkpoint_pb2_grpc

RunCkptd = Callable[..., RunningCkptd]
CKPTD_LOGGERS = ("ckptd.datapath",)


def open_upload(
    stub: checkpoint_pb2_grpc.CheckpointServiceStub, save_id: str, path: str, size: int
) -> checkpoint_pb2.OpenUploadResponse:
    header = checkpoint_pb2.FileHeader(save_id=save_id, path=path, rank=0, kind=SHARD)
    return stub.OpenUpload(checkpoint_pb2.OpenUploadRequest(header=header, size=size))


def finish_refusal(
    stub: checkpoint_pb2_grpc.CheckpointServiceStub, ticket: bytes
) -> tuple[grpc.StatusCode, str]:
    trailer = checkpoint_pb2.FileTrailer(size=1000, crc32c=data_crc32c(b"x" * 1000))
    with pytest.raises(grpc.RpcError) as err:
        stub.FinishUpload(checkpoint_pb2.FinishUploadRequest(ticket=ticket, trailer=trailer))
    return err.value.code(), err.value.details()


def connect(port: int, first: bytes = b"") -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", port), timeout=10)
    if first:
        conn.sendall(first)
    return conn


def save(client: CkptdClient, run: str, step: int, size: int = 300_000) -> None:
    save_id = client.open_save(run, step, world_size=2).save_id
    for rank in range(2):
        client.write_file(save_id, f"__{rank}_0.distcp", rank, SHARD, payload(size, rank + step))
    client.write_file(save_id, ".metadata", 0, METADATA, b"meta")
    assert client.commit(save_id).committed


def test_an_upload_whose_connection_fails_frees_its_slot_at_once_and_finish_upload_says_why(
    run_ckptd: RunCkptd,
) -> None:
    limits = DataLimits(uploads_per_caller=3, uploads_per_run=3, uploads=6, read_timeout_s=0.5)
    running = run_ckptd(limits=limits)
    with make_channel(running.address) as channel, CkptdClient(running.address) as client:
        stub = checkpoint_pb2_grpc.CheckpointServiceStub(channel)
        save_id = client.open_save("bad", 1, world_size=1).save_id
        garbage, cut, silent = (open_upload(stub, save_id, f"f{i}", 1000) for i in range(3))
        with pytest.raises(grpc.RpcError) as full:
            open_upload(stub, save_id, "f3", 1000)
        assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert full.value.details() == (
            "f3: caller host 127.0.0.1 holds 3 uploads waiting for their bytes (limit 3 per caller)"
        )

        port = garbage.data_port
        started = time.monotonic()
        connect(port, garbage.ticket + FRAME_LENGTH.pack(2**32 - 1)).close()
        connect(port, cut.ticket + FRAME_LENGTH.pack(1000) + b"\0" * 10).close()
        quiet = connect(port, silent.ticket + FRAME_LENGTH.pack(1000))
        owner = Owner("host:127.0.0.1", "", "bad")
        wait_for(lambda: running.data.held(owner)["run"] == 0, 5, "the three slots back")
        assert time.monotonic() - started < 5  # not the ticket's 30 s
        open_upload(stub, save_id, "f3", 1000)  # a free slot

        reasons = {name: finish_refusal(stub, opened.ticket) for name, opened in
                   (("garbage", garbage), ("cut", cut), ("silent", silent))}  # fmt: skip
        quiet.close()
        assert reasons == {
            "garbage": (grpc.StatusCode.INVALID_ARGUMENT,
                        "f0: data frame of 4294967295 bytes at offset 0; a frame holds 1 to "
                        "15728640 bytes"),
            "cut": (grpc.StatusCode.INVALID_ARGUMENT,
                    "f1: the data connection ended after 0 bytes, before the 1000 bytes "
                    "announced"),
            "silent": (grpc.StatusCode.INVALID_ARGUMENT,
                       "f2: the data connection went silent for 0.5s after 0 bytes, before the "
                       "1000 bytes announced"),
        }  # fmt: skip
        refused = running.store.metrics.refused_connections
        assert refused.labels("bad_frame")._value.get() == 1
        assert refused.labels("cut")._value.get() == 2


def _tokens(tmp_path: Path, runs: list[str]) -> tuple[ServerSecurity, dict[str, str]]:
    path = tmp_path / "tokens.json"
    tokens = {run: add_token(path, Role.TRAINER, run, name=f"trainer of {run}") for run in runs}
    return ServerSecurity(tokens=TokenTable(path)), tokens


def test_four_runs_save_while_a_fifth_client_abuses_the_data_socket_and_meets_its_own_limit(
    run_ckptd: RunCkptd, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The abuser holds idle connections (more than may wait for a ticket), sends connections of
    random bytes, and opens uploads without end, sending garbage after half of them and nothing
    for the others; four runs with tokens of their own save all the while. Limits are small so
    that the abuser reaches them fast."""
    runs = [f"run{i}" for i in range(4)]
    security, tokens = _tokens(tmp_path, [*runs, "abuse"])
    limits = DataLimits(
        uploads_per_caller=16,
        uploads_per_run=16,
        uploads=64,
        waiting_connections_per_host=40,
        waiting_connections=80,
        ticket_wait_s=1.0,
        read_timeout_s=1.0,
        log_every_s=60,
    )
    running = run_ckptd(security=security, limits=limits)
    caplog.set_level(logging.WARNING, logger="ckptd.datapath")
    stop, refusals, idle = threading.Event(), [], []
    garbage_connections = 300

    def abuse() -> None:
        with CkptdClient(running.address, ClientSecurity(token=tokens["abuse"])) as client:
            save_id = client.open_save("abuse", 1, world_size=1).save_id
            stub = client._stub
            port = running.data.port
            idle.extend(connect(port) for _ in range(60))  # 20 more than may wait
            for _ in range(garbage_connections):
                connect(port, os.urandom(64)).close()
            opened = []
            while not stop.is_set():
                try:
                    opened.append(open_upload(stub, save_id, f"g{len(opened)}", 1 << 20))
                except grpc.RpcError as exc:
                    refusals.append((exc.code(), exc.details()))
                    time.sleep(0.01)
                    continue
                if len(opened) % 2:  # garbage after the ticket (its slot is back at once)
                    with connect(port, opened[-1].ticket) as conn:
                        conn.sendall(os.urandom(16))
                # The others never bring their bytes: they hold their slots for their ticket's
                # lifetime, until the abuser meets its limit.

    abuser = threading.Thread(target=abuse)
    abuser.start()
    errors: list[BaseException] = []

    def train(run: str) -> None:
        try:
            with CkptdClient(running.address, ClientSecurity(token=tokens[run])) as client:
                for step in range(1, 4):
                    save(client, run, step)
        except BaseException as exc:
            errors.append(exc)

    savers = [threading.Thread(target=train, args=(run,)) for run in runs]
    for thread in savers:
        thread.start()
    for thread in savers:
        thread.join(120)
    wait_for(lambda: len(refusals) > 0, 30, "the abuser to meet its limit")
    stop.set()
    abuser.join(30)

    assert errors == []
    with CkptdClient(running.address, ClientSecurity(token=tokens["run0"])) as client:
        assert [c.ref.step for c in client.list("run0")] == [1, 2, 3]
    assert client.fast_path
    code, details = refusals[0]
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "caller trainer of abuse holds 16 uploads waiting for their bytes (limit 16 per " in (
        details
    )
    # The idle connections: those past the waiting limit at once, the rest after ticket_wait_s.
    for conn in idle:
        conn.settimeout(10)
        assert conn.recv(1) == b""
        conn.close()
    refused = running.store.metrics.refused_connections

    def without_ticket() -> float:
        return sum(refused.labels(r)._value.get() for r in ("bad_ticket", "no_ticket", "evicted"))

    wait_for(lambda: without_ticket() == garbage_connections + len(idle), 10,
             "every connection without a good ticket counted once")  # fmt: skip
    assert refused.labels("evicted")._value.get() >= 20
    lines = [r for r in caplog.records if r.name in CKPTD_LOGGERS]
    refused_total = without_ticket() + sum(
        refused.labels(r)._value.get() for r in ("bad_frame", "cut")
    )
    print(f"\n{refused_total:.0f} bad connections, {len(lines)} warning lines")
    assert refused_total > garbage_connections and len(lines) <= 8


def test_limits_that_do_not_fit_inside_each_other_are_refused_in_one_line() -> None:
    with pytest.raises(
        ValueError, match=r"uploads_per_run \(300\) must not exceed uploads \(200\)"
    ):
        DataLimits(uploads_per_run=300, uploads=200)
    with pytest.raises(ValueError, match="ticket_wait_s must be > 0"):
        DataLimits(ticket_wait_s=0)


def test_a_resource_exhausted_upload_is_a_domain_error_for_the_client(run_ckptd: RunCkptd) -> None:
    running = run_ckptd(limits=DataLimits(uploads_per_caller=1, uploads_per_run=1, uploads=2))
    with make_channel(running.address) as channel, CkptdClient(running.address) as client:
        save_id = client.open_save("one", 1, world_size=1).save_id
        open_upload(checkpoint_pb2_grpc.CheckpointServiceStub(channel), save_id, "held", 10)
        with pytest.raises(ResourceExhausted, match=r"limit 1 per caller"):
            client.write_file(save_id, "__0_0.distcp", 0, SHARD, b"x" * 10)


def test_open_reads_count_against_the_callers_share_until_they_are_sent(
    run_ckptd: RunCkptd,
) -> None:
    """Reads have shares as uploads do: a caller holding its share of open reads is refused,
    naming its count and limit, and a read gives its share back once it is sent."""
    running = run_ckptd(limits=DataLimits(reads_per_caller=2, reads_per_run=2, reads=4))
    with make_channel(running.address) as channel, CkptdClient(running.address) as client:
        save(client, "a", 1)
        stub = checkpoint_pb2_grpc.CheckpointServiceStub(channel)
        request = checkpoint_pb2.OpenReadRequest(
            ref=checkpoint_pb2.CheckpointRef(run="a", step=1), path="__0_0.distcp"
        )
        first, _second = stub.OpenRead(request), stub.OpenRead(request)
        with pytest.raises(grpc.RpcError) as full:
            stub.OpenRead(request)
        assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert full.value.details() == (
            "__0_0.distcp: caller host 127.0.0.1 holds 2 reads open (limit 2 per caller)"
        )
        assert running.store.metrics.refused_reads.labels("caller")._value.get() == 1
        with connect(first.data_port, first.ticket) as conn:
            while conn.recv(1 << 16):  # the whole range, then ckptd hangs up
                pass
        owner = Owner("host:127.0.0.1", "", "a")
        wait_for(lambda: running.data.reads_held(owner)["caller"] == 1, 5, "a share back")
        stub.OpenRead(request)  # room again
