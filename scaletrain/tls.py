"""TLS for scaletrain's raw sockets (ckptd's data socket), from the files and rules of its gRPC.

gRPC gets its credentials in `scaletrain.transport`; a socket that carries bytes beside a gRPC
service (ckptd's data socket, `ckptd.datapath`) gets an `ssl.SSLContext` here, built from the same
`TlsFiles` with the same rules, so that turning TLS on protects both or neither:

- The server shows `server.pem`; with client auth it requires a client certificate that chains to
  `ca.pem` (as `ssl_server_credentials(require_client_auth=...)`).
- The client checks the server's certificate against `ca.pem` and the host name it connects to
  (as a gRPC channel checks its target), and shows `client.pem` when the directory has one.
- TLS 1.3 only: its ciphers are all AEAD (AES-GCM, ChaCha20-Poly1305) and its handshake is one
  round trip; both ends are scaletrain, so no older peer needs 1.2. No compression (CRIME).
- A server re-reads its files when they change (`scaletrain.filewatch`): a renewed certificate
  serves new connections, open ones keep theirs.

With mutual TLS a ticket handed out over gRPC must be spent by the same client: `call_identity`
(the gRPC call's certificate) and `socket_identity` (the socket's) name a certificate the same
way, so the two compare.
"""

from __future__ import annotations

import ipaddress
import ssl
from typing import Any, NamedTuple

import grpc

from scaletrain.errors import UserError
from scaletrain.filewatch import Reloaded
from scaletrain.security import TlsFiles


def _hardened(context: ssl.SSLContext) -> ssl.SSLContext:
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.options |= ssl.OP_NO_COMPRESSION
    return context


def _load(what: str, load: Any, *args: Any) -> None:
    """Run an SSLContext loader, turning its errors into one line that names the files."""
    try:
        load(*args)
    except ssl.SSLError as exc:
        raise UserError(f"TLS: cannot load {what}: {exc.reason or exc}") from None
    except OSError as exc:
        raise UserError(
            f"TLS: cannot read {what}: {exc.strerror}; make the files with `scaletrain certs`"
        ) from None


def server_context(files: TlsFiles, client_auth: bool) -> ssl.SSLContext:
    """The server side of a raw socket: `files`' server certificate, and with `client_auth` a
    client certificate signed by its CA required. Raises UserError in one line."""
    context = _hardened(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER))
    context.num_tickets = 0  # nobody resumes a session: each connection carries its own ticket
    chain = f"{files.server_cert} and {files.server_key}"
    _load(chain, context.load_cert_chain, files.server_cert, files.server_key)
    if client_auth:
        _load(str(files.ca), context.load_verify_locations, files.ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def reloading_server_context(files: TlsFiles, client_auth: bool) -> Reloaded[ssl.SSLContext]:
    """`server_context`, made anew by `refresh()` once its files have changed and load (a key
    that is not the certificate's does not: the last good context stays)."""
    paths = [files.server_key, files.server_cert, *([files.ca] if client_auth else [])]
    return Reloaded(paths, lambda: server_context(files, client_auth))


def client_context(files: TlsFiles) -> ssl.SSLContext:
    """The client side of a raw socket: the server's certificate checked against `files.ca` and
    the host name connected to, the client certificate shown when the directory has one (the
    rule of `scaletrain.transport.make_channel`). Raises UserError in one line."""
    context = _hardened(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT))
    _load(str(files.ca), context.load_verify_locations, files.ca)
    if files.client_cert.is_file() and files.client_key.is_file():
        chain = f"{files.client_cert} and {files.client_key}"
        _load(chain, context.load_cert_chain, files.client_cert, files.client_key)
    return context


class Identity(NamedTuple):
    """Whom a client certificate names: its subject's common name and its subject alternative
    names (IP addresses in one spelling), which gRPC and `ssl` both report."""

    common_name: str
    alt_names: tuple[str, ...]

    def __str__(self) -> str:
        names = f" ({', '.join(self.alt_names)})" if self.alt_names else ""
        return f"{self.common_name!r}{names}"


def _identity(common_names: list[str], alt_names: list[str]) -> Identity | None:
    def canonical(name: str) -> str:
        try:
            return ipaddress.ip_address(name.strip()).compressed
        except ValueError:
            return name.strip()

    if not common_names and not alt_names:
        return None
    return Identity(
        common_names[0] if common_names else "", tuple(sorted({canonical(n) for n in alt_names}))
    )


def call_identity(context: grpc.ServicerContext) -> Identity | None:
    """The identity of a gRPC call's client certificate; None without one (no mutual TLS)."""
    properties = context.auth_context()

    def texts(key: str) -> list[str]:
        return [value.decode(errors="replace") for value in properties.get(key, [])]

    return _identity(texts("x509_common_name"), texts("x509_subject_alternative_name"))


def socket_identity(conn: ssl.SSLSocket) -> Identity | None:
    """The identity of a TLS socket's verified client certificate; None without one."""
    cert = conn.getpeercert() or {}
    common = [value for rdn in cert.get("subject", ()) for key, value in rdn if key == "commonName"]
    return _identity(common, [value for _kind, value in cert.get("subjectAltName", ())])
