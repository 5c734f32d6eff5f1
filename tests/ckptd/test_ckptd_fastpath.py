"""The fast paths over ckptd's data socket: of WriteFile (OpenUpload, the socket, FinishUpload)
and of ReadFile (OpenRead, then the range's frames), over real loopback sockets against real
ckptds (two as peers for ckptd-to-ckptd reads); with real TLS certificates and tokens where they
matter."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from ckptd_testing import METADATA, SHARD, payload, ref, tier_states

from ckptd.client import CkptdClient
from ckptd.config import ClusterConfig
from ckptd.datapath import FRAME_LENGTH, UNKNOWN_SIZE, frame_crcs
from ckptd.manifest import data_crc32c
from ckptd.readpath import DATA, READ_FRAME, SOURCE, RangeConnection, data_connection
from ckptd.server import RunningCkptd
from ckptd.tiers import CheckpointKey, block_crcs_of
from ckptd.tiers.memory import MemoryFile
from scaletrain.app.stack import free_port
from scaletrain.errors import (
    DataLoss,
    FailedPrecondition,
    NotFound,
    PermissionDenied,
    Unavailable,
)
from scaletrain.security import (
    ClientSecurity,
    Role,
    ServerSecurity,
    TokenTable,
    add_token,
    generate_certs,
)
from scaletrain.transport import make_channel, wait_until_healthy
from scaletrain.v1 import checkpoint_pb2, checkpoint_pb2_grpc

RunCkptd = Callable[..., RunningCkptd]


@pytest.fixture
def stub_for() -> Iterator[Callable[[RunningCkptd], checkpoint_pb2_grpc.CheckpointServiceStub]]:
    channels: list[grpc.Channel] = []

    def _stub(running: RunningCkptd) -> checkpoint_pb2_grpc.CheckpointServiceStub:
        channels.append(make_channel(running.address))
        return checkpoint_pb2_grpc.CheckpointServiceStub(channels[-1])

    yield _stub
    for channel in channels:
        channel.close()


def open_upload(
    stub: checkpoint_pb2_grpc.CheckpointServiceStub, save_id: str, path: str, size: int
) -> checkpoint_pb2.OpenUploadResponse:
    header = checkpoint_pb2.FileHeader(save_id=save_id, path=path, rank=0, kind=SHARD)
    return stub.OpenUpload(checkpoint_pb2.OpenUploadRequest(header=header, size=size))


def send(port: int, ticket: bytes, *frames: tuple[bytes, list[int]]) -> None:
    """Present `ticket`, send (data, block CRCs) frames and hang up; ckptd may hang up first."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        try:
            conn.sendall(ticket)
            for data, crcs in frames:
                conn.sendall(
                    FRAME_LENGTH.pack(len(data)) + frame_crcs(len(data)).pack(*crcs) + data
                )
        except (BrokenPipeError, ConnectionResetError):
            pass


def dropped(port: int, ticket: bytes) -> bool:
    """Whether ckptd hangs up without a word on a connection that presents `ticket` (what it
    does to a ticket it refuses)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(ticket)
        try:
            return conn.recv(1) == b""
        except ConnectionResetError:
            return True


def finish(
    stub: checkpoint_pb2_grpc.CheckpointServiceStub, ticket: bytes, data: bytes
) -> checkpoint_pb2.WriteFileResponse:
    trailer = checkpoint_pb2.FileTrailer(size=len(data), crc32c=data_crc32c(data))
    return stub.FinishUpload(checkpoint_pb2.FinishUploadRequest(ticket=ticket, trailer=trailer))


def refused(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details()


def test_the_fast_path_round_trips_files_bit_for_bit_and_commits_like_write_file(
    run_ckptd: RunCkptd,
) -> None:
    running = run_ckptd()
    files = {"__0_0.distcp": payload((9 << 20) + 3, 0), ".metadata": payload(777, 1)}
    infos = []
    with CkptdClient(running.address) as fast, CkptdClient(running.address, fast_path=False) as rpc:
        for step, client in ((1, fast), (2, rpc)):
            save_id = client.open_save("run", step, world_size=1).save_id
            for path, data in files.items():
                kind = METADATA if path == ".metadata" else SHARD
                reply = client.write_file(save_id, path, 0, kind, data)
                assert reply.crc32c == data_crc32c(data)
            infos.append(client.commit(save_id))
            for path, data in files.items():
                assert client.read("run", step, path) == data
        assert fast.fast_path  # it never had to fall back
    fast_info, rpc_info = infos
    assert fast_info.committed and rpc_info.committed
    assert [(f.path, f.size, f.crc32c) for f in fast_info.files] == [
        (f.path, f.size, f.crc32c) for f in rpc_info.files
    ]
    assert [(t.tier, t.state) for t in fast_info.tiers] == [
        (t.tier, t.state) for t in rpc_info.tiers
    ]


def test_the_data_socket_refuses_a_wrong_a_reused_and_an_expired_ticket(
    run_ckptd: RunCkptd, stub_for: Callable
) -> None:
    running = run_ckptd(upload_ticket_ttl_s=1.0)
    stub = stub_for(running)
    save_id = stub.OpenSave(
        checkpoint_pb2.OpenSaveRequest(
            ref=checkpoint_pb2.CheckpointRef(run="run", step=1), world_size=1
        )
    ).save_id
    data = payload(1000, 0)

    assert dropped(running.data.port, os.urandom(32))
    code, details = refused(lambda: finish(stub, os.urandom(32), data))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "unknown, used or expired upload ticket" in details

    good = open_upload(stub, save_id, "__0_0.distcp", len(data))
    send(good.data_port, good.ticket, (data, block_crcs_of(data)))
    assert finish(stub, good.ticket, data).size == len(data)
    assert dropped(good.data_port, good.ticket)
    code, details = refused(lambda: finish(stub, good.ticket, data))
    assert code == grpc.StatusCode.FAILED_PRECONDITION

    late = open_upload(stub, save_id, "__0_1.distcp", len(data))
    time.sleep(1.5)
    assert dropped(late.data_port, late.ticket)
    code, details = refused(lambda: finish(stub, late.ticket, data))
    assert code == grpc.StatusCode.FAILED_PRECONDITION

    (info,) = stub.ListCheckpoints(
        checkpoint_pb2.ListCheckpointsRequest(include_uncommitted=True)
    ).checkpoints
    assert [f.path for f in info.files] == ["__0_0.distcp"]


def test_truncated_oversized_or_damaged_data_is_refused_and_nothing_is_committed(
    run_ckptd: RunCkptd, stub_for: Callable
) -> None:
    running = run_ckptd()
    stub = stub_for(running)
    with CkptdClient(running.address) as client:
        save_id = client.open_save("run", 1, world_size=1).save_id
        data = payload(1000, 0)

        cases = {
            "the data connection ended after 500 bytes, before the 1000 bytes announced": (
                len(data), [(data[:500], block_crcs_of(data[:500]))]
            ),
            "data frame at offset 0 runs past the 100 bytes announced": (
                100, [(data, block_crcs_of(data))]
            ),
            "CRC-32C mismatch in the block at offset 0": (len(data), [(data, [1234])]),
            "at offset 500 does not start on a 262144-byte block": (
                len(data), [(part, block_crcs_of(part)) for part in (data[:500], data[500:])]
            ),
        }  # fmt: skip
        for expected, (size, frames) in cases.items():
            opened = open_upload(stub, save_id, "__0_0.distcp", size)
            send(opened.data_port, opened.ticket, *frames)
            sent = data[:size]
            code, details = refused(lambda: finish(stub, opened.ticket, sent))  # noqa: B023
            assert (code, expected) == (grpc.StatusCode.INVALID_ARGUMENT, expected)
            assert expected in details and "\n" not in details

        client.write_file(save_id, ".metadata", 0, METADATA, b"meta")
        with pytest.raises(FailedPrecondition, match=r"rank\(s\) 0"):
            client.commit(save_id)

        # Frames that each check out but do not make the file the trailer describes.
        opened = open_upload(stub, save_id, "__0_0.distcp", len(data))
        send(opened.data_port, opened.ticket, (data, block_crcs_of(data)))
        code, details = refused(lambda: finish(stub, opened.ticket, data[::-1]))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert "__0_0.distcp: the trailer's file CRC-32C" in details
        (info,) = client.list(include_uncommitted=True)
        assert [f.path for f in info.files] == [".metadata"]
    assert not any((running.store.ssd.root / ".incoming").iterdir())


def test_the_client_falls_back_to_write_file_when_ckptd_has_no_data_socket(
    run_ckptd: RunCkptd, stub_for: Callable
) -> None:
    running = run_ckptd(data_socket=False)
    code, _ = refused(lambda: open_upload(stub_for(running), "any", "__0_0.distcp", 1))
    assert code == grpc.StatusCode.UNIMPLEMENTED
    data = payload(5 << 20, 0)
    with CkptdClient(running.address) as client:
        assert client.fast_path
        save_id = client.open_save("run", 1, world_size=1).save_id
        client.write_file(save_id, "__0_0.distcp", 0, SHARD, data)
        client.write_file(save_id, ".metadata", 0, METADATA, b"meta")
        assert client.commit(save_id).committed
        assert not client.fast_path
        assert client.read("run", 1, "__0_0.distcp") == data


def test_with_tls_and_tokens_only_a_trainer_of_the_run_gets_and_spends_an_upload_ticket(
    run_ckptd: RunCkptd, tmp_path: Path
) -> None:
    tls = generate_certs(tmp_path / "tls")
    tokens = tmp_path / "tokens.json"
    alpha = add_token(tokens, Role.TRAINER, "alpha")
    beta = add_token(tokens, Role.TRAINER, "beta")
    security = ServerSecurity(tls=tls, tokens=TokenTable(tokens))
    running = run_ckptd(security=security)
    data = payload(3 << 20, 0)
    with (
        CkptdClient(running.address, ClientSecurity(tls, alpha)) as owner,
        CkptdClient(running.address, ClientSecurity(tls, beta)) as other,
        make_channel(running.address, ClientSecurity(tls, alpha)) as alpha_channel,
        make_channel(running.address, ClientSecurity(tls, beta)) as beta_channel,
    ):
        save_id = owner.open_save("alpha", 1, world_size=1).save_id
        with pytest.raises(PermissionDenied, match="may not"):
            other.write_file(save_id, "__0_0.distcp", 0, SHARD, data)

        opened = open_upload(
            checkpoint_pb2_grpc.CheckpointServiceStub(alpha_channel), save_id, "x.distcp", 3
        )
        assert opened.data_host == ""  # TLS: the data socket speaks it too, beside gRPC
        stranger = checkpoint_pb2_grpc.CheckpointServiceStub(beta_channel)
        code, _ = refused(lambda: finish(stranger, opened.ticket, b"abc"))
        assert code == grpc.StatusCode.PERMISSION_DENIED

        owner.write_file(save_id, "__0_0.distcp", 0, SHARD, data)
        owner.write_file(save_id, ".metadata", 0, METADATA, b"meta")
        owner.commit(save_id)
        assert owner.fast_path
        assert owner.read("alpha", 1, "__0_0.distcp") == data


def test_a_stream_of_unknown_size_takes_the_fast_path_and_a_failing_one_stores_nothing(
    run_ckptd: RunCkptd, stub_for: Callable
) -> None:
    """DCP's writer hands its file over in writes of any size, its size unknown until the end."""
    running = run_ckptd()
    stub = stub_for(running)
    data = payload((5 << 20) + 777, 3)
    pieces = [data[:10], data[10 : 3 << 20], data[3 << 20 :]]
    with CkptdClient(running.address) as client:
        save_id = client.open_save("run", 1, world_size=1).save_id
        reply = client.write_file(save_id, "__0_0.distcp", 0, SHARD, iter(pieces))
        assert (reply.size, reply.crc32c) == (len(data), data_crc32c(data))
        assert client.fast_path

        class Broken(Exception):
            pass

        def failing() -> Iterator[bytes]:
            yield data[: 5 << 20]
            raise Broken("the caller's data failed")

        with pytest.raises(Broken):
            client.write_file(save_id, "__0_1.distcp", 0, SHARD, failing())
        client.write_file(save_id, ".metadata", 0, METADATA, b"meta")
        assert client.commit(save_id).committed
        assert client.read("run", 1, "__0_0.distcp") == data
        assert [f.path for f in client.get("run", 1).files] == [".metadata", "__0_0.distcp"]

    # On the wire: frames, then an empty frame ends the file; without it the file is refused.
    save_id = stub.OpenSave(
        checkpoint_pb2.OpenSaveRequest(
            ref=checkpoint_pb2.CheckpointRef(run="run", step=2), world_size=1
        )
    ).save_id
    unknown = open_upload(stub, save_id, "__0_0.distcp", UNKNOWN_SIZE)
    send(unknown.data_port, unknown.ticket, (data[:1000], block_crcs_of(data[:1000])))
    code, details = refused(lambda: finish(stub, unknown.ticket, data[:1000]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "the data connection ended after 1000 bytes, before its end" in details
    ended = open_upload(stub, save_id, "__0_0.distcp", UNKNOWN_SIZE)
    send(ended.data_port, ended.ticket, (data[:1000], block_crcs_of(data[:1000])), (b"", []))
    assert finish(stub, ended.ticket, data[:1000]).size == 1000


# -- the read fast path ----------------------------------------------------------------------------

SSD = 2


def saved(client: CkptdClient, step: int, shard: bytes, run: str = "run") -> None:
    """Commit (run, step): one shard and a metadata file."""
    save_id = client.open_save(run, step, world_size=1).save_id
    client.write_file(save_id, "__0_0.distcp", 0, SHARD, shard)
    client.write_file(save_id, ".metadata", 0, METADATA, b"meta")
    assert client.commit(save_id).committed


def open_read(
    stub: checkpoint_pb2_grpc.CheckpointServiceStub, path: str, offset: int = 0, length: int = 0
) -> checkpoint_pb2.OpenReadResponse:
    request = checkpoint_pb2.OpenReadRequest(
        ref=ref("run", 1), path=path, offset=offset, length=length
    )
    return stub.OpenRead(request)


def relay(port: int, mangle: Callable[[bytearray], bytes]) -> int:
    """A one-connection relay to the data socket at `port` that passes the ticket on, takes
    ckptd's whole answer and hands the client `mangle(answer)` instead: a cut or damaged wire."""
    listener = socket.create_server(("127.0.0.1", 0))

    def run() -> None:
        with listener, listener.accept()[0] as down:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as up:
                up.sendall(down.recv(32, socket.MSG_WAITALL))
                answer = bytearray()
                while piece := up.recv(1 << 20):
                    answer += piece
            down.sendall(mangle(answer))

    threading.Thread(target=run, daemon=True).start()
    return listener.getsockname()[1]


def test_a_range_read_over_the_data_socket_equals_read_files_bytes(run_ckptd: RunCkptd) -> None:
    running = run_ckptd()
    data = payload((9 << 20) + 3, 5)
    ranges = [(0, 0), (123_457, (5 << 20) + 11), (len(data) - 1, 1), (len(data), 0)]
    with CkptdClient(running.address) as fast, CkptdClient(running.address, fast_path=False) as rpc:
        saved(fast, 1, data)
        for offset, length in ranges:
            expected = data[offset : offset + length] if length else data[offset:]
            assert fast.read("run", 1, "__0_0.distcp", offset, length) == expected
            assert rpc.read("run", 1, "__0_0.distcp", offset, length) == expected
            pieces = fast.read_stream("run", 1, "__0_0.distcp", offset, length, tier=SSD)
            assert b"".join(pieces) == expected
        assert fast.fast_path  # every read took the data socket
    assert not rpc.fast_path


def test_the_data_socket_serves_a_read_ticket_once_and_never_a_forged_or_expired_one(
    run_ckptd: RunCkptd, stub_for: Callable
) -> None:
    running = run_ckptd(upload_ticket_ttl_s=1.0)
    stub = stub_for(running)
    data = payload(1000, 6)
    with CkptdClient(running.address) as client:
        saved(client, 1, data)

    assert dropped(running.data.port, os.urandom(32))
    good = open_read(stub, "__0_0.distcp", 10, 20)
    assert (good.offset, good.length) == (10, 20)
    with data_connection("127.0.0.1", good.data_port, 10) as conn:
        conn.sendall(good.ticket)
        head = conn.recv(READ_FRAME.size, socket.MSG_WAITALL)
        kind, tier, offset, length, _crc = READ_FRAME.unpack(head)
        assert kind == SOURCE  # whose copy serves the data frames that follow
        assert conn.recv(length, socket.MSG_WAITALL).decode() == running.store.node
        head = conn.recv(READ_FRAME.size, socket.MSG_WAITALL)
        kind, tier, offset, length, _crc = READ_FRAME.unpack(head)
        assert (kind, tier, offset, length) == (DATA, 1, 10, 20)  # from memory
        assert conn.recv(length, socket.MSG_WAITALL) == data[10:30]
        assert conn.recv(1) == b""  # the range is over
    assert dropped(good.data_port, good.ticket)  # used

    late = open_read(stub, "__0_0.distcp")
    time.sleep(1.5)
    assert dropped(late.data_port, late.ticket)


def test_bad_names_and_ranges_fail_at_open_read_in_one_line(
    run_ckptd: RunCkptd, stub_for: Callable
) -> None:
    running = run_ckptd()
    stub = stub_for(running)
    with CkptdClient(running.address) as client:
        saved(client, 1, payload(1000, 7))
        cases = {
            ("__9_9.distcp", 0, 0): (grpc.StatusCode.NOT_FOUND, "has no file '__9_9.distcp'"),
            ("__0_0.distcp", 990, 11): (grpc.StatusCode.INVALID_ARGUMENT, "beyond its 1000 bytes"),
            ("../x", 0, 0): (grpc.StatusCode.INVALID_ARGUMENT, "../x"),
        }
        for (path, offset, length), (code, message) in cases.items():
            got, details = refused(lambda: open_read(stub, path, offset, length))  # noqa: B023
            assert got == code and message in details and "\n" not in details
        unknown = checkpoint_pb2.OpenReadRequest(ref=ref("run", 2), path="__0_0.distcp")
        got, details = refused(lambda: stub.OpenRead(unknown))
        assert got == grpc.StatusCode.NOT_FOUND and "no committed checkpoint run/2" in details
        with pytest.raises(NotFound, match="no committed checkpoint"):
            client.read_stream("run", 2, "__0_0.distcp")  # before the first piece
        assert client.fast_path


def test_a_damaged_copy_falls_through_to_the_next_tier_or_ends_the_read_with_data_loss(
    run_ckptd: RunCkptd, tmp_path: Path
) -> None:
    data = payload(1 << 20, 8)
    running = run_ckptd()
    with CkptdClient(running.address) as client:
        saved(client, 1, data)
        rotten, damaged = MemoryFile(), bytearray(data)
        damaged[12345] ^= 0xFF
        rotten.append(bytes(damaged))
        running.store.memory._checkpoints[CheckpointKey("run", 1)]["__0_0.distcp"] = rotten
        assert client.read("run", 1, "__0_0.distcp") == data  # from the SSD
        assert tier_states(client.get("run", 1))["memory"] == "FAILED"

    ssd_only = run_ckptd(data_dir=tmp_path / "ssd-only", memory_budget_bytes=0)
    with CkptdClient(ssd_only.address) as client:
        saved(client, 1, data)
        shard = ssd_only.store.ssd.path_of(CheckpointKey("run", 1), "__0_0.distcp")
        with open(shard, "r+b") as f:
            f.seek(700_000)
            f.write(b"\x00\x01\x02")
        with pytest.raises(DataLoss, match=r"^read run/1/__0_0.distcp: no verified copy.*block 2"):
            client.read("run", 1, "__0_0.distcp")
        with pytest.raises(DataLoss, match="no verified copy"):  # the SSD copy is FAILED now
            list(client.read_stream("run", 1, "__0_0.distcp"))


def test_a_cut_or_damaged_data_connection_is_a_clear_error_never_a_hang(
    run_ckptd: RunCkptd, stub_for: Callable
) -> None:
    running = run_ckptd()
    stub = stub_for(running)
    data = payload(5 << 20, 9)
    with CkptdClient(running.address) as client:
        saved(client, 1, data)

    def flip(answer: bytearray) -> bytes:
        answer[READ_FRAME.size + 1000] ^= 1
        return bytes(answer)

    cases = {
        "the data connection ended after 4194304 of 5242880 bytes": lambda a: bytes(a[:-1000]),
        "the frame at offset 0 arrived damaged": flip,
    }
    for expected, mangle in cases.items():
        opened = open_read(stub, "__0_0.distcp")
        conn = data_connection("127.0.0.1", relay(opened.data_port, mangle), 10)
        conn.sendall(opened.ticket)
        fast = RangeConnection(conn, opened, "read run/1/x")
        with fast, pytest.raises((Unavailable, DataLoss)) as err:
            fast.read_into(bytearray(opened.length))
        assert str(err.value) == f"read run/1/x: {expected}"


def test_a_ckptd_reads_a_peers_part_over_its_data_socket_or_else_through_read_file(
    run_ckptd: RunCkptd, tmp_path: Path
) -> None:
    """node0 offers its data socket, node1 does not: each serves the other's part."""
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    nodes = [
        run_ckptd(
            data_dir=tmp_path / f"node{i}",
            listen=addresses[i],
            data_socket=i == 0,
            cluster=ClusterConfig(node=f"node{i}", peers=(addresses[1 - i],)),
        )
        for i in range(2)
    ]
    for address in addresses:  # node0's first hello to node1 failed: wait out its backoff
        wait_until_healthy(address, timeout_s=30)
    shards = [payload((4 << 20) + 5, 10), payload(3 << 20, 11)]
    with CkptdClient(addresses[0]) as first, CkptdClient(addresses[1]) as second:
        opened = first.open_save("run", 1, world_size=2)
        for rank, client in enumerate((first, second)):
            client.join_save(opened, "run", 1, 2)
            client.write_file(opened.save_id, f"__{rank}_0.distcp", rank, SHARD, shards[rank])
        first.write_file(opened.save_id, ".metadata", 0, METADATA, b"meta")
        assert first.commit(opened.save_id).committed
        # Each reads the part on the other node: node1 over node0's data socket, node0 through
        # node1's ReadFile.
        assert second.read("run", 1, "__0_0.distcp") == shards[0]
        assert second.read("run", 1, "__0_0.distcp", 4 << 20, 5) == shards[0][4 << 20 :]
        assert first.read("run", 1, "__1_0.distcp") == shards[1]
        assert first.read("run", 1, "__1_0.distcp", 77, 1000) == shards[1][77:1077]
        assert first.fast_path and not second.fast_path
    assert nodes[0].data is not None and nodes[1].data is None
