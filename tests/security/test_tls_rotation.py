"""A certificate renewed in place (cert-manager writing a Kubernetes Secret volume) reaches a
running gRPC server: new connections get it, connections already open go on, nothing restarts."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from scaletrain.security import ClientSecurity, ServerSecurity, TlsFiles, generate_certs
from scaletrain.transport import add_health, bind, make_channel, make_server

NAMES = ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")


def _serving(channel: grpc.Channel) -> bool:
    """Whether a health check over `channel` succeeds (False when its handshake fails)."""
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _fresh_channel(address: str, tls: TlsFiles) -> grpc.Channel:
    """A channel with its own connection, trusting `tls`'s CA and showing its client certificate:
    gRPC would otherwise reuse an open connection made with the same credentials."""
    credentials = grpc.ssl_channel_credentials(
        tls.ca.read_bytes(), tls.client_key.read_bytes(), tls.client_cert.read_bytes()
    )
    return grpc.secure_channel(address, credentials, [("grpc.use_local_subchannel_pool", 1)])


def _copy_over(source: TlsFiles, served: TlsFiles) -> None:
    """Write each file in place, one after the other, as `cp` does."""
    for name in NAMES:
        shutil.copy(source.root / name, served.root / name)


def _swap_secret_volume(source: TlsFiles, served: TlsFiles) -> None:
    """Renew as the kubelet updates a Secret volume: each file is a symlink through `..data` to a
    timestamped directory, and `..data` is pointed at a new one at once."""
    fresh = Path(shutil.copytree(source.root, served.root / f"..{os.urandom(4).hex()}"))
    link = served.root / "..data_tmp"
    link.symlink_to(fresh.name)
    os.replace(link, served.root / "..data")


def _as_secret_volume(files: TlsFiles) -> None:
    """Lay out `files.root` as a mounted Secret (see `_swap_secret_volume`)."""
    keep = Path(shutil.copytree(files.root, files.root.with_name("first")))
    for name in NAMES:
        (files.root / name).unlink()
        (files.root / name).symlink_to(Path("..data") / name)
    _swap_secret_volume(TlsFiles(keep), files)


@pytest.fixture(params=[_copy_over, _swap_secret_volume], ids=["copied-over", "secret-volume"])
def renew(request: pytest.FixtureRequest) -> Callable[[TlsFiles, TlsFiles], None]:
    return request.param


@pytest.fixture
def two_cert_sets(
    tmp_path: Path, renew: Callable[[TlsFiles, TlsFiles], None]
) -> tuple[TlsFiles, TlsFiles]:
    """The served directory and a renewal from another CA, so either one's use is visible."""
    served = generate_certs(tmp_path / "served")
    if renew is _swap_secret_volume:
        _as_secret_volume(served)
    return served, generate_certs(tmp_path / "renewed")


@pytest.fixture
def old(two_cert_sets: tuple[TlsFiles, TlsFiles], tmp_path: Path) -> TlsFiles:
    """A copy of the served files before any renewal."""
    return TlsFiles(Path(shutil.copytree(two_cert_sets[0].root, tmp_path / "old")))


@pytest.fixture(params=[False, True], ids=["tls", "mutual-tls"])
def server(
    request: pytest.FixtureRequest, two_cert_sets: tuple[TlsFiles, TlsFiles]
) -> Iterator[str]:
    served, _ = two_cert_sets
    server = make_server(security=ServerSecurity(tls=served, client_auth=request.param))
    add_health(server)
    port = bind(server, "127.0.0.1:0")
    server.start()
    yield f"localhost:{port}"
    server.stop(None)


def test_a_renewed_certificate_serves_new_connections_while_open_ones_go_on(
    server: str,
    two_cert_sets: tuple[TlsFiles, TlsFiles],
    old: TlsFiles,
    renew: Callable[[TlsFiles, TlsFiles], None],
) -> None:
    served, renewed = two_cert_sets
    with make_channel(server, ClientSecurity(tls=served)) as open_before:
        assert _serving(open_before)
        renew(renewed, served)

        with _fresh_channel(server, renewed) as trusting_the_new_ca:
            assert _serving(trusting_the_new_ca)
        with _fresh_channel(server, old) as trusting_only_the_old_ca:
            assert not _serving(trusting_only_the_old_ca)
        assert _serving(open_before)
    with make_channel(server, ClientSecurity(tls=served)) as made_after:
        assert _serving(made_after)


@pytest.mark.parametrize("renew", [_copy_over], ids=["copied-over"], indirect=True)
def test_a_key_that_is_not_the_certificates_keeps_the_last_good_pair(
    server: str,
    two_cert_sets: tuple[TlsFiles, TlsFiles],
    old: TlsFiles,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A renewal caught halfway (the new key beside the old certificate, as a copy file by file
    leaves it) is not taken: the server goes on with the pair it has, and takes the renewal once
    it is whole."""
    served, renewed = two_cert_sets
    shutil.copy(renewed.server_key, served.server_key)
    with (
        caplog.at_level(logging.WARNING, "scaletrain.filewatch"),
        _fresh_channel(server, old) as trusting_the_old_ca,
    ):
        assert _serving(trusting_the_old_ca)
    assert "is not the key of" in caplog.text

    _copy_over(renewed, served)
    with _fresh_channel(server, renewed) as trusting_the_new_ca:
        assert _serving(trusting_the_new_ca)
