"""The one place that creates gRPC servers and channels.

Message-size limits, keepalive, deadlines and TLS live here and nowhere else, so every service and
client of scaletrain behaves the same on the wire:

- TLS (mutual TLS as an option) from `ServerSecurity` / `ClientSecurity` (`scaletrain.security`,
  read from the environment by default); plaintext only on loopback unless explicitly allowed.
  A server re-reads its certificate files when they change (a renewed certificate in a
  Kubernetes Secret volume): new connections get the new certificate, open ones keep theirs, and
  nothing restarts. A channel reads the files when it is made.
- Every server has the guard (`scaletrain.guard`) in front of its services: authentication,
  authorization and per-client limits.
- Clients send their token as `authorization: Bearer ...` metadata, never on a command line.
- `python -m scaletrain.transport HOST:PORT` checks a service's gRPC health through the same
  channel and credentials: the Helm chart's probes under TLS.

A status code and the domain error it stands for map both ways in `scaletrain.errors`.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Mapping
from concurrent import futures
from typing import Any, NamedTuple

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from scaletrain.errors import UserError
from scaletrain.filewatch import Reloaded
from scaletrain.guard import Guard, Limits, Rule
from scaletrain.security import ClientSecurity, ServerSecurity, TlsFiles, is_loopback

MiB = 1 << 20
# Payload of one streamed chunk. The message limit leaves room for framing around a chunk.
CHUNK_BYTES = 4 * MiB
MAX_MESSAGE_BYTES = 16 * MiB
# The largest chunk a server accepts: one message, less room for its framing.
MAX_CHUNK_BYTES = MAX_MESSAGE_BYTES - MiB
# Default deadline of a unary call; streams set their own from the bytes they carry.
DEFAULT_TIMEOUT_S = 30.0
# How long `probe` waits: under the probes' timeoutSeconds (5) in the Helm chart.
PROBE_TIMEOUT_S = 3.0

_COMMON_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # A service that restarts is reached again within seconds (gRPC's default backoff grows to
    # two minutes): ckptds reconnect to a peer back from a crash, clients to a restarted ckptd.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1_000),
]
_SERVER_OPTIONS: list[tuple[str, Any]] = [
    *_COMMON_OPTIONS,
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    # Two servers must never share a port: a second bind of a taken port fails instead.
    ("grpc.so_reuseport", 0),
]


# Servers made by make_server, with the security `bind` must listen with.
_SECURITY: weakref.WeakKeyDictionary[grpc.Server, ServerSecurity] = weakref.WeakKeyDictionary()


def make_server(
    max_workers: int = 32,
    *,
    policy: Mapping[str, Rule] | None = None,
    security: ServerSecurity | None = None,
    limits: Limits | None = None,
) -> grpc.Server:
    """A gRPC server with the project's limits, TLS and auth. Add servicers, `bind`, `start`.

    `policy` maps full method names (`/pkg.Service/Method`) to their Rule (`scaletrain.guard`);
    with tokens on, a method without a rule is refused. `security` defaults to
    `ServerSecurity.from_env()`.
    """
    security = security if security is not None else ServerSecurity.from_env()
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
        options=_SERVER_OPTIONS,
        maximum_concurrent_rpcs=max_workers * 4,
        interceptors=[Guard(dict(policy or {}), security, limits or Limits())],
    )
    _SECURITY[server] = security
    return server


def bind(server: grpc.Server, address: str) -> int:
    """Bind `address` (HOST:PORT, port 0 picks a free one) and return the port.

    Listens with TLS when the server's security has it; refuses plaintext on an address other
    than loopback unless allowed. Raises UserError with one readable line when the port is
    taken, the address is invalid or plaintext is refused.
    """
    security = _SECURITY.get(server) or ServerSecurity()
    try:
        if security.tls is not None:
            credentials = _server_credentials(security.tls, security.client_auth)
            port = server.add_secure_port(address, credentials)
        else:
            if not is_loopback(address.rpartition(":")[0]) and not security.allow_plaintext:
                raise UserError(
                    f"refusing to listen on {address} in plaintext: give it TLS "
                    "(SCALETRAIN_TLS_DIR, see `scaletrain certs`), or allow plaintext "
                    "explicitly (--allow-plaintext or SCALETRAIN_ALLOW_PLAINTEXT=1)"
                )
            port = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise UserError(f"cannot listen on {address}: {exc}; is the port in use?") from None
    if port == 0:
        raise UserError(f"cannot listen on {address}: the port is in use or the host is not local")
    return port


def _certificate_configuration(
    tls: TlsFiles, client_auth: bool
) -> grpc.ServerCertificateConfiguration:
    """The server's key and certificate (and, with `client_auth`, the CA its clients' certificates
    must chain to). Raises UserError for a key that is not the certificate's: gRPC would only fail
    each handshake, so a rotation caught between its key and its certificate is not taken."""
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import (
        Encoding,
        PublicFormat,
        load_pem_private_key,
    )

    key, chain = tls.read(tls.server_key), tls.read(tls.server_cert)

    def public(k: Any) -> bytes:
        return k.public_key().public_bytes(Encoding.DER, PublicFormat.SubjectPublicKeyInfo)

    try:
        matched = public(load_pem_private_key(key, None)) == public(
            x509.load_pem_x509_certificate(chain)
        )
    except ValueError as exc:
        raise UserError(f"TLS: cannot load {tls.server_key} or {tls.server_cert}: {exc}") from None
    if not matched:
        raise UserError(f"TLS: {tls.server_key} is not the key of {tls.server_cert}")
    return grpc.ssl_server_certificate_configuration(
        [(key, chain)], root_certificates=tls.read(tls.ca) if client_auth else None
    )


def _server_credentials(tls: TlsFiles, client_auth: bool) -> grpc.ServerCredentials:
    """TLS credentials of a server whose certificate files are re-read when they change.

    gRPC asks for the configuration before every new connection's handshake; it gets a new one
    only when a file has changed and the new files load (key and certificate match), so renewing a
    certificate in place (cert-manager, a Secret volume) needs no restart and open connections go
    on.
    """
    paths = [tls.server_key, tls.server_cert, *([tls.ca] if client_auth else [])]
    config = Reloaded(paths, lambda: _certificate_configuration(tls, client_auth))
    return grpc.dynamic_ssl_server_credentials(
        config.value, config.refresh, require_client_authentication=client_auth
    )


def add_health(server: grpc.Server, *service_names: str) -> health.HealthServicer:
    """Register the standard gRPC health service, SERVING for the overall server and each name."""
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    for name in ("", *service_names):
        servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return servicer


class _CallDetails(
    NamedTuple(
        "_CallDetails",
        [
            ("method", str),
            ("timeout", float | None),
            ("metadata", Any),
            ("credentials", Any),
            ("wait_for_ready", Any),
            ("compression", Any),
        ],
    ),
    grpc.ClientCallDetails,
):
    pass


class _Bearer(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the token to every call's metadata."""

    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    def _with_token(self, details: grpc.ClientCallDetails) -> _CallDetails:
        return _CallDetails(
            details.method,
            details.timeout,
            (*(details.metadata or ()), self._header),
            details.credentials,
            details.wait_for_ready,
            details.compression,
        )

    def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return continuation(self._with_token(details), request)

    def intercept_stream_unary(self, continuation, details, requests):  # type: ignore[no-untyped-def]
        return continuation(self._with_token(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):  # type: ignore[no-untyped-def]
        return continuation(self._with_token(details), requests)


def make_channel(address: str, security: ClientSecurity | None = None) -> grpc.Channel:
    """A channel to a scaletrain service with the project's limits, TLS and token.

    `security` defaults to `ClientSecurity.from_env()`.
    """
    security = security if security is not None else ClientSecurity.from_env()
    tls = security.tls
    if tls is None:
        channel = grpc.insecure_channel(address, options=_COMMON_OPTIONS)
    else:
        mine = tls.client_cert.is_file() and tls.client_key.is_file()
        credentials = grpc.ssl_channel_credentials(
            root_certificates=tls.read(tls.ca),
            private_key=tls.read(tls.client_key) if mine else None,
            certificate_chain=tls.read(tls.client_cert) if mine else None,
        )
        channel = grpc.secure_channel(address, credentials, options=_COMMON_OPTIONS)
    if security.token:
        return grpc.intercept_channel(channel, _Bearer(security.token))
    return channel


def wait_until_healthy(
    address: str,
    timeout_s: float = 30.0,
    service: str = "",
    security: ClientSecurity | None = None,
) -> None:
    """Block until the service at `address` reports SERVING, or raise UserError."""
    with make_channel(address, security) as channel:
        ready = grpc.channel_ready_future(channel)
        try:
            ready.result(timeout=timeout_s)
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except (grpc.FutureTimeoutError, grpc.RpcError) as exc:
            ready.cancel()  # its polling thread stops before the channel closes
            raise UserError(f"service at {address} did not become healthy: {exc}") from None
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        raise UserError(f"service at {address} is not serving (status {reply.status})")


def probe(argv: list[str]) -> int:
    """`python -m scaletrain.transport HOST:PORT`: exit 0 when the gRPC service there is SERVING,
    1 with one line why otherwise. Kubernetes' native gRPC probes speak only plaintext: a pod whose
    service has TLS runs this as an exec probe, with its own certificates from the environment
    (SCALETRAIN_TLS_DIR: the CA, and the client certificate mutual TLS asks for)."""
    if len(argv) != 1:
        print("usage: python -m scaletrain.transport HOST:PORT", file=sys.stderr)
        return 2
    try:
        wait_until_healthy(argv[0], timeout_s=PROBE_TIMEOUT_S)
    except UserError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(probe(sys.argv[1:]))
