"""ckptd's data socket with TLS on, over real loopback sockets against real ckptds: uploads and
reads take it (never WriteFile or ReadFile) byte for byte, also from another host and between
peers; wrong certificates, plaintext clients, stalled handshakes, another client's certificate
and hostile clients are refused and counted; a renewed certificate serves new connections while
a transfer in progress finishes on its old one."""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import ssl
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from ckptd_testing import METADATA, SHARD, payload, wait_for
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import Encoding
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

import ckptd.cluster
from ckptd.client import CkptdClient
from ckptd.config import ClusterConfig, DataLimits
from ckptd.datapath import FRAME_LENGTH, frame_crcs
from ckptd.manifest import data_crc32c
from ckptd.readpath import RangeConnection, data_connection
from ckptd.server import RunningCkptd
from ckptd.tiers import block_crcs_of
from scaletrain.app.stack import free_port
from scaletrain.errors import PermissionDenied, Unavailable
from scaletrain.security import (
    TLS_DIR_ENV,
    ClientSecurity,
    ServerSecurity,
    TlsFiles,
    generate_certs,
)
from scaletrain.tls import client_context
from scaletrain.transport import make_channel, wait_until_healthy
from scaletrain.v1 import checkpoint_pb2, checkpoint_pb2_grpc

RunCkptd = Callable[..., RunningCkptd]
WAIT_S = 0.5  # ticket_wait_s where a test waits it out


class Pki:
    """A CA that keeps its key (`generate_certs` does not), to sign a server certificate anew
    (a renewal) and client certificates of several names, into certificate directories."""

    def __init__(self, root: Path) -> None:
        self.files = TlsFiles(root)
        root.mkdir(parents=True)
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test CA")])
        ca = self._sign(self._name, self._key, None, (), ca=True)
        self.files.ca.write_bytes(ca.public_bytes(Encoding.PEM))
        self.server()

    def _sign(
        self,
        subject: x509.Name,
        key: ec.EllipticCurvePrivateKey,
        usage: x509.ObjectIdentifier | None,
        sans: tuple[x509.GeneralName, ...],
        ca: bool = False,
    ) -> x509.Certificate:
        now = datetime.datetime.now(datetime.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self._name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if usage is not None:
            builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return builder.sign(self._key, hashes.SHA256())

    def _issue(
        self,
        cert_path: Path,
        key_path: Path,
        name: str,
        usage: x509.ObjectIdentifier,
        sans: tuple[x509.GeneralName, ...],
    ) -> bytes:
        """Write a certificate of `name` and its key, each by a rename as a renewal does;
        returns the certificate (DER)."""
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        cert = self._sign(subject, key, usage, sans)
        pem = key.private_bytes(
            Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        for path, raw in ((key_path, pem), (cert_path, cert.public_bytes(Encoding.PEM))):
            path.with_suffix(".new").write_bytes(raw)
            os.replace(path.with_suffix(".new"), path)
        return cert.public_bytes(Encoding.DER)

    def server(self) -> bytes:
        """(Re)issue the server certificate, good for loopback; returns it (DER)."""
        sans = (x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
        return self._issue(self.files.server_cert, self.files.server_key, "test server",
                           ExtendedKeyUsageOID.SERVER_AUTH, sans)  # fmt: skip

    def client(self, name: str) -> TlsFiles:
        """A directory with this CA and a client certificate of `name`, with DNS, IPv4 and IPv6
        alternative names (which gRPC and `ssl` spell differently)."""
        files = TlsFiles(self.files.root.parent / name)
        files.root.mkdir()
        files.ca.write_bytes(self.files.ca.read_bytes())
        sans = (
            x509.DNSName(f"{name}.example"),
            x509.IPAddress(ipaddress.ip_address("10.0.0.7")),
            x509.IPAddress(ipaddress.ip_address("fd00::7")),
        )
        self._issue(files.client_cert, files.client_key, name, ExtendedKeyUsageOID.CLIENT_AUTH,
                    sans)  # fmt: skip
        return files


def refused(running: RunningCkptd) -> dict[str, float]:
    """ckptd_refused_connections_total by reason, the zeros left out."""
    counter = running.store.metrics.refused_connections
    return {s.labels["reason"]: s.value for m in counter.collect() for s in m.samples
            if s.name.endswith("_total") and s.value}  # fmt: skip


def stub(channel: grpc.Channel) -> checkpoint_pb2_grpc.CheckpointServiceStub:
    return checkpoint_pb2_grpc.CheckpointServiceStub(channel)


def open_upload(
    channel: grpc.Channel, save_id: str, path: str, size: int
) -> checkpoint_pb2.OpenUploadResponse:
    header = checkpoint_pb2.FileHeader(save_id=save_id, path=path, rank=0, kind=SHARD)
    return stub(channel).OpenUpload(checkpoint_pb2.OpenUploadRequest(header=header, size=size))


def finish(channel: grpc.Channel, ticket: bytes, data: bytes) -> checkpoint_pb2.WriteFileResponse:
    trailer = checkpoint_pb2.FileTrailer(size=len(data), crc32c=data_crc32c(data))
    request = checkpoint_pb2.FinishUploadRequest(ticket=ticket, trailer=trailer)
    return stub(channel).FinishUpload(request, timeout=30)


def frame(data: bytes) -> bytes:
    return FRAME_LENGTH.pack(len(data)) + frame_crcs(len(data)).pack(*block_crcs_of(data))


def connect(port: int, tls: ssl.SSLContext | None) -> socket.socket:
    """A data connection, plaintext or over TLS, as a client makes it."""
    return data_connection("127.0.0.1", port, 10.0, tls)


def hung_up(conn: socket.socket) -> bool:
    """Whether ckptd closes `conn` without a byte (what it does to a connection it refuses)."""
    try:
        return conn.recv(1) == b""
    except (ConnectionResetError, ssl.SSLError):
        return True


@pytest.fixture
def certs(tmp_path: Path) -> TlsFiles:
    return generate_certs(tmp_path / "tls")


@pytest.fixture
def tls_ckptd(run_ckptd: RunCkptd, certs: TlsFiles) -> Callable[..., RunningCkptd]:
    """A ckptd with TLS (mutual with client_auth=True) from `certs`; kwargs go to CkptdConfig."""

    def _start(client_auth: bool = True, **kwargs: object) -> RunningCkptd:
        return run_ckptd(security=ServerSecurity(tls=certs, client_auth=client_auth), **kwargs)

    return _start


def save_and_read_back(client: CkptdClient, run: str, data: bytes) -> None:
    """Save one shard (known size) and one stream (unknown size), then read them back whole
    and in ranges, byte for byte."""
    save_id = client.open_save(run, 1, world_size=1).save_id
    client.write_file(save_id, "__0_0.distcp", 0, SHARD, data)
    client.write_file(save_id, ".metadata", 0, METADATA, iter([b"me", b"ta"]))
    assert client.commit(save_id).committed
    assert client.read(run, 1, "__0_0.distcp") == data
    assert client.read(run, 1, ".metadata") == b"meta"
    ranged = b"".join(client.read_stream(run, 1, "__0_0.distcp", 77, 1 << 20))
    assert ranged == data[77 : 77 + (1 << 20)]


def test_with_tls_uploads_and_reads_take_the_data_socket_byte_for_byte(
    tls_ckptd: Callable[..., RunningCkptd], certs: TlsFiles
) -> None:
    running = tls_ckptd()
    with CkptdClient(running.address, ClientSecurity(certs)) as client:
        save_and_read_back(client, "run", payload((5 << 20) + 3, 1))
        assert client.fast_path  # it turns off for good at the first fallback to gRPC
    assert refused(running) == {}


def test_a_caller_on_another_host_is_offered_the_tls_data_socket(
    run_ckptd: RunCkptd, tmp_path: Path
) -> None:
    """Reached at a non-loopback address, ckptd used to answer UNIMPLEMENTED with TLS on."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # sends nothing: picks the route's source address
            host = probe.getsockname()[0]
        except OSError:
            host = "127.0.0.1"
    if ipaddress.ip_address(host).is_loopback:
        pytest.skip("this machine has no non-loopback address")
    certs = generate_certs(tmp_path / "tls", hosts=(host,))
    running = run_ckptd(security=ServerSecurity(tls=certs, client_auth=True), listen=f"{host}:0")
    with CkptdClient(running.address, ClientSecurity(certs)) as client:
        save_id = client.open_save("run", 1, world_size=1).save_id
        with make_channel(running.address, ClientSecurity(certs)) as channel:
            opened = open_upload(channel, save_id, "x.distcp", 3)
        assert opened.data_host == ""  # the host the caller reached ckptd at
        save_and_read_back(client, "run", payload(2 << 20, 2))
        assert client.fast_path


def test_a_client_of_another_ca_is_refused_at_the_handshake_with_a_clear_error_and_counted(
    tls_ckptd: Callable[..., RunningCkptd],
    certs: TlsFiles,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    running = tls_ckptd()
    assert running.data is not None
    stranger = generate_certs(tmp_path / "stranger")
    with pytest.raises(ssl.SSLCertVerificationError, match="certificate verify failed"):
        connect(running.data.port, client_context(stranger))  # it does not trust ckptd
    # It trusts ckptd, but shows a certificate ckptd's CA did not sign (TLS 1.3: ckptd says so
    # after the client's half of the handshake).
    mixed = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    mixed.load_verify_locations(certs.ca)
    mixed.load_cert_chain(stranger.client_cert, stranger.client_key)
    with connect(running.data.port, mixed) as conn:
        assert hung_up(conn)
    wait_for(lambda: refused(running) == {"tls": 2}, 5, "two refusals counted as tls")
    assert "its TLS handshake failed" in caplog.text


def test_a_plaintext_client_on_a_tls_data_socket_and_a_tls_client_on_a_plaintext_one_are_refused(
    tls_ckptd: Callable[..., RunningCkptd], run_ckptd: RunCkptd, certs: TlsFiles, tmp_path: Path
) -> None:
    secure = tls_ckptd()
    plain = run_ckptd(data_dir=tmp_path / "plain")
    assert secure.data is not None and plain.data is not None
    with connect(secure.data.port, None) as conn:
        conn.sendall(os.urandom(32))  # a ticket's worth of bytes, in the clear
        assert hung_up(conn)
    with pytest.raises(OSError):
        connect(plain.data.port, client_context(certs))
    wait_for(lambda: refused(secure) == {"tls": 1}, 5, "the plaintext client counted")
    wait_for(lambda: refused(plain) == {"tls": 1}, 5, "the TLS client counted")


@pytest.mark.parametrize("first", [b"", b"\x16\x03\x01"], ids=["silent", "half a hello"])
def test_a_handshake_that_never_finishes_is_closed_after_ticket_wait_s(
    tls_ckptd: Callable[..., RunningCkptd], first: bytes
) -> None:
    running = tls_ckptd(limits=DataLimits(ticket_wait_s=WAIT_S))
    assert running.data is not None
    with socket.create_connection(("127.0.0.1", running.data.port), timeout=5) as conn:
        conn.sendall(first)
        started = time.monotonic()
        assert hung_up(conn)  # within the 5 s timeout, not never
        assert time.monotonic() - started >= WAIT_S * 0.9
    wait_for(lambda: refused(running) == {"no_ticket": 1}, 5, "the connection counted")


def test_a_ticket_spent_with_another_clients_certificate_is_refused_in_one_line(
    run_ckptd: RunCkptd, tmp_path: Path
) -> None:
    pki = Pki(tmp_path / "pki")
    alice, mallory = pki.client("alice"), pki.client("mallory")
    running = run_ckptd(security=ServerSecurity(tls=pki.files, client_auth=True))
    assert running.data is not None
    data = payload((1 << 20) + 1000, 3)
    with (
        CkptdClient(running.address, ClientSecurity(alice)) as client,
        make_channel(running.address, ClientSecurity(alice)) as channel,
    ):
        save_and_read_back(client, "run", data)  # alice's own tickets: her certificate matches
        assert client.fast_path
        save_id = client.open_save("run", 2, world_size=1).save_id
        opened = open_upload(channel, save_id, "x.distcp", len(data))
        with connect(running.data.port, client_context(mallory)) as conn:
            conn.sendall(opened.ticket)
            assert hung_up(conn)
        with pytest.raises(grpc.RpcError) as err:
            finish(channel, opened.ticket, data)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert err.value.details() == (
            "x.distcp: the data connection's client certificate names 'mallory' "
            "(10.0.0.7, fd00::7, mallory.example), the ticket was issued to 'alice' "
            "(10.0.0.7, alice.example, fd00::7)"
        )
        request = checkpoint_pb2.OpenReadRequest(
            ref=checkpoint_pb2.CheckpointRef(run="run", step=1), path="__0_0.distcp"
        )
        opened_read = stub(channel).OpenRead(request)
        with pytest.raises(PermissionDenied, match="names 'mallory'") as read_err:
            conn = connect(running.data.port, client_context(mallory))
            conn.sendall(opened_read.ticket)
            with RangeConnection(conn, opened_read, "read run/1/__0_0.distcp") as fast:
                fast.read_into(bytearray(fast.length))
        assert "\n" not in str(read_err.value)
    assert refused(running) == {"identity": 2}


def test_a_renewed_certificate_serves_new_connections_while_an_upload_in_progress_finishes(
    run_ckptd: RunCkptd, tmp_path: Path
) -> None:
    pki = Pki(tmp_path / "pki")
    client = pki.client("client")
    running = run_ckptd(security=ServerSecurity(tls=pki.files))
    assert running.data is not None
    port = running.data.port
    old = pki.files.server_cert.read_bytes()
    data = payload(1 << 20, 4)
    half = len(data) // 2
    with (
        CkptdClient(running.address, ClientSecurity(client)) as ckptd_client,
        make_channel(running.address, ClientSecurity(client)) as channel,
    ):
        save_id = ckptd_client.open_save("run", 1, world_size=1).save_id
        opened = open_upload(channel, save_id, "__0_0.distcp", len(data))
        with connect(port, client_context(client)) as before:
            before.sendall(opened.ticket + frame(data[:half]) + data[:half])
            renewed = pki.server()
            assert pki.files.server_cert.read_bytes() != old

            def new_certificate() -> bool:
                with connect(port, client_context(client)) as after:
                    return after.getpeercert(binary_form=True) == renewed

            wait_for(new_certificate, 5, "a new connection to show the renewed certificate")
            before.sendall(frame(data[half:]) + data[half:])
        assert finish(channel, opened.ticket, data).size == len(data)


@pytest.mark.parametrize("secure", [False, True], ids=["plaintext", "tls"])
def test_hostile_clients_are_closed_and_counted_and_their_uploads_fail_in_one_line(
    run_ckptd: RunCkptd, certs: TlsFiles, secure: bool
) -> None:
    """The hostile clients of test_ckptd_fair_limits, with and without TLS: a connection that
    idles, one that sends a ticket of garbage, one with a good ticket and a frame of garbage and
    one that goes silent after its ticket."""
    limits = DataLimits(ticket_wait_s=WAIT_S, read_timeout_s=WAIT_S)
    security = ServerSecurity(tls=certs if secure else None, client_auth=secure)
    running = run_ckptd(security=security, limits=limits)
    assert running.data is not None
    tls, port = client_context(certs) if secure else None, running.data.port
    client_security = ClientSecurity(certs if secure else None)
    with make_channel(running.address, client_security) as channel:
        with CkptdClient(running.address, client_security) as client:
            save_id = client.open_save("bad", 1, world_size=1).save_id
        garbage, silent = (open_upload(channel, save_id, f"f{i}", 1000) for i in range(2))
        with connect(port, tls) as idle, connect(port, tls) as forged:
            forged.sendall(os.urandom(32))
            assert hung_up(forged) and hung_up(idle)
        with connect(port, tls) as conn:
            conn.sendall(garbage.ticket + FRAME_LENGTH.pack(2**32 - 1))
            assert hung_up(conn)
        with connect(port, tls) as conn:
            conn.sendall(silent.ticket)
            assert hung_up(conn)
        reasons = {}
        for name, opened in (("garbage", garbage), ("silent", silent)):
            with pytest.raises(grpc.RpcError) as err:
                finish(channel, opened.ticket, b"x" * 1000)
            reasons[name] = err.value.details()
    assert reasons == {
        "garbage": "f0: data frame of 4294967295 bytes at offset 0; a frame holds 1 to "
        "15728640 bytes",
        "silent": "f1: the data connection went silent for 0.5s after 0 bytes, before the "
        "1000 bytes announced",
    }
    assert refused(running) == {"no_ticket": 1, "bad_ticket": 1, "bad_frame": 1, "cut": 1}


@pytest.fixture
def spy_peer_ranges(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bool]]:
    """Whether each range a ckptd opened on a peer's data socket went over TLS."""
    seen: list[bool] = []
    opened = ckptd.cluster.open_range

    def spy(*args: object, **kwargs: object) -> RangeConnection | None:
        fast = opened(*args, **kwargs)  # type: ignore[arg-type]
        seen.append(fast is not None and isinstance(fast._conn, ssl.SSLSocket))
        return fast

    monkeypatch.setattr(ckptd.cluster, "open_range", spy)
    yield seen


def test_ckptds_copy_a_peers_part_over_its_tls_data_socket_and_clients_read_it_there_directly(
    run_ckptd: RunCkptd,
    certs: TlsFiles,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    spy_peer_ranges: list[bool],
) -> None:
    monkeypatch.setenv(TLS_DIR_ENV, str(certs.root))  # what ckptds greet their peers with
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    nodes = [
        run_ckptd(
            data_dir=tmp_path / f"node{i}",
            listen=addresses[i],
            security=ServerSecurity(tls=certs, client_auth=True),
            cluster=ClusterConfig(node=f"node{i}", peers=(addresses[1 - i],)),
        )
        for i in range(2)
    ]
    for address in addresses:
        wait_until_healthy(address, timeout_s=30, security=ClientSecurity(certs))
    shard = payload((2 << 20) + 9, 5)
    with CkptdClient(addresses[0]) as first, CkptdClient(addresses[1]) as second:
        opened = first.open_save("run", 1, world_size=1, replicas=2)
        first.write_file(opened.save_id, "__0_0.distcp", 0, SHARD, shard)
        first.write_file(opened.save_id, ".metadata", 0, METADATA, b"meta")
        assert first.commit(opened.save_id).committed

        def node_loss_safe() -> bool:
            try:
                return second.get("run", node_loss_safe=True).committed
            except Unavailable:  # not yet
                return False

        wait_for(node_loss_safe, 20, "node1's copy of node0's part")
        assert spy_peer_ranges and all(spy_peer_ranges)  # node1 copied it over TLS
        assert second.read("run", 1, "__0_0.distcp") == shard
        assert second.fast_path
    assert all(refused(node) == {} for node in nodes)
