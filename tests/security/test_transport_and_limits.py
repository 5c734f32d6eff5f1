"""TLS, mutual TLS, the plaintext policy and the per-client limits, over real gRPC.

The limits are checked on a bare server made by `scaletrain.transport.make_server` with a generic
handler, so each test controls exactly when a call ends; the checkpoint size limit on ckptd.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from security_testing import SHARD, running_services, save_checkpoint

from ckptd.client import CkptdClient
from scaletrain.errors import ResourceExhausted, Unavailable, UserError
from scaletrain.guard import Limits
from scaletrain.security import ClientSecurity, ServerSecurity, TlsFiles
from scaletrain.transport import bind, make_channel, make_server


def _without_client_cert(certs: TlsFiles, tmp_path: Path) -> TlsFiles:
    """A copy of the CA alone: a client that trusts the server but has no certificate."""
    only_ca = TlsFiles(tmp_path / "only-ca")
    only_ca.root.mkdir()
    only_ca.ca.write_bytes(certs.ca.read_bytes())
    return only_ca


def test_over_tls_a_client_trusting_the_ca_saves_and_a_plaintext_client_gets_nothing(
    tmp_path: Path, certs: TlsFiles
):
    with running_services(tmp_path, tls=certs) as services:
        plaintext = ClientSecurity(token=services.tokens.alpha)
        with CkptdClient(services.ckptd.address, plaintext) as client, pytest.raises(Unavailable):
            client.get("alpha")
        with services.ckptd_client(services.tokens.alpha) as client:
            shard = save_checkpoint(client, "alpha", 1)
            assert client.read("alpha", 1, "__0_0.distcp") == shard


def test_with_mutual_tls_a_client_without_a_certificate_is_refused(tmp_path: Path, certs: TlsFiles):
    with running_services(tmp_path, tls=certs, client_auth=True) as services:
        anonymous_tls = _without_client_cert(certs, tmp_path)
        with (
            CkptdClient(
                services.ckptd.address, ClientSecurity(anonymous_tls, services.tokens.reader)
            ) as stranger,
            pytest.raises(Unavailable),
        ):
            stranger.list()
        with services.ckptd_client(services.tokens.reader) as reader:
            assert reader.list() == []


@pytest.mark.parametrize("address", ["0.0.0.0:0", "[::]:0"])
def test_plaintext_is_refused_off_loopback_unless_explicitly_allowed(address: str):
    server = make_server(security=ServerSecurity())
    with pytest.raises(UserError, match=r"refusing to listen on .* in plaintext"):
        bind(server, address)
    allowed = make_server(security=ServerSecurity(allow_plaintext=True))
    assert bind(allowed, address) > 0
    allowed.stop(None)


@dataclass
class Bare:
    address: str
    release: threading.Event  # ends every Hold call
    started: threading.Semaphore  # released once per Hold call that runs


@pytest.fixture
def bare_server() -> Iterator[Bare]:
    """A server with tight limits: `Hold` blocks until released; `Drain` reads a stream."""
    release, started = threading.Event(), threading.Semaphore(0)

    def hold(request: bytes, context: grpc.ServicerContext) -> bytes:
        started.release()
        while not release.wait(0.05) and context.is_active():
            pass
        return b"done"

    def drain(requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        return str(sum(1 for _ in requests)).encode()

    server = make_server(
        max_workers=8,
        limits=Limits(calls_per_client=2, idle_stream_s=0.5),
        security=ServerSecurity(),
    )
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "test.Bare",
                {
                    "Hold": grpc.unary_unary_rpc_method_handler(hold),
                    "Drain": grpc.stream_unary_rpc_method_handler(drain),
                },
            )
        ]
    )
    port = bind(server, "127.0.0.1:0")
    server.start()
    yield Bare(f"127.0.0.1:{port}", release, started)
    release.set()
    server.stop(None)


def test_a_client_over_its_concurrent_call_limit_is_refused_until_a_call_ends(bare_server: Bare):
    with make_channel(bare_server.address, ClientSecurity()) as channel:
        hold = channel.unary_unary("/test.Bare/Hold")
        running = [hold.future(b"", timeout=10) for _ in range(2)]
        for _ in running:
            assert bare_server.started.acquire(timeout=10)
        with pytest.raises(grpc.RpcError) as refused:
            hold(b"", timeout=5)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "too many calls at once from this client (limit 2)" in refused.value.details()
        bare_server.release.set()
        assert [call.result() for call in running] == [b"done", b"done"]
        assert hold(b"", timeout=5) == b"done"


def test_a_client_stream_that_goes_quiet_is_cancelled_by_the_server(bare_server: Bare):
    address = bare_server.address
    stalled = threading.Event()

    def requests() -> Iterator[bytes]:
        yield b"one"
        stalled.wait(10)  # a client that stops sending but keeps the stream open

    with make_channel(address, ClientSecurity()) as channel:
        drain = channel.stream_unary("/test.Bare/Drain")
        with pytest.raises(grpc.RpcError) as refused:
            drain(requests(), timeout=8)
        stalled.set()
        assert refused.value.code() == grpc.StatusCode.CANCELLED
        assert drain(iter([b"a", b"b"]), timeout=5) == b"2"


def test_a_checkpoint_over_the_size_limit_is_refused_and_the_next_save_works(tmp_path: Path):
    with (
        running_services(tmp_path, max_checkpoint_bytes=1 << 20) as services,
        services.ckptd_client(services.tokens.alpha) as client,
    ):
        save_id = client.open_save("alpha", 1, 1).save_id
        client.write_file(save_id, "__0_0.distcp", 0, SHARD, b"a" * (700 << 10))
        with pytest.raises(ResourceExhausted, match="max_checkpoint_bytes"):
            client.write_file(save_id, "__0_1.distcp", 0, SHARD, b"b" * (700 << 10))
        # The refused file is not part of the save; a smaller copy of the first replaces it.
        client.write_file(save_id, "__0_0.distcp", 0, SHARD, b"c" * (300 << 10))
        client.write_file(save_id, ".metadata", 0, 2, b"m")
        info = client.commit(save_id)
        assert [(f.path, f.size) for f in info.files] == [
            (".metadata", 1), ("__0_0.distcp", 300 << 10)
        ]  # fmt: skip
        assert client.read("alpha", 1, "__0_0.distcp") == b"c" * (300 << 10)
