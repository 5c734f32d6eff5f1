"""Credentials of scaletrain: development certificates, per-run tokens and secrets from files.

`scaletrain.transport` turns what is here into TLS credentials and `scaletrain.guard` into an
authorizing interceptor; this module only makes and reads the material, so the command line, the
embedded stack and tests share it.

- **Certificates.** `generate_certs(DIR)` writes a development CA and a server and a client
  certificate signed by it (`ca.pem`, `server.pem`/`server.key`, `client.pem`/`client.key`).
  A process finds them through `SCALETRAIN_TLS_DIR`.
- **Tokens.** A token is 32 random bytes, URL-safe; a tokens file (`SCALETRAIN_TOKENS_FILE`) holds
  only their SHA-256, each with a role and the run it is good for (`*`: every run). Tokens are
  high-entropy random strings, so a plain SHA-256 is as good as a slow password hash here, and a
  stolen file reveals no token. A client sends its token from `SCALETRAIN_TOKEN` (or the file
  named by `SCALETRAIN_TOKEN_FILE`), never on a command line.
- **Secrets.** `secret_from_env(NAME)` reads `NAME`, or the file named by `NAME_FILE` (how
  Kubernetes and Docker mount secrets).
"""

from __future__ import annotations

import datetime
import enum
import hashlib
import ipaddress
import json
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from scaletrain.errors import UserError

TLS_DIR_ENV = "SCALETRAIN_TLS_DIR"
TLS_CLIENT_AUTH_ENV = "SCALETRAIN_TLS_CLIENT_AUTH"
TOKENS_FILE_ENV = "SCALETRAIN_TOKENS_FILE"
TOKEN_ENV = "SCALETRAIN_TOKEN"
ALLOW_PLAINTEXT_ENV = "SCALETRAIN_ALLOW_PLAINTEXT"
# A grant for every run (the service token ckptd reports tier commits with, an admin).
ALL_RUNS = "*"


def secret_from_env(name: str) -> str | None:
    """The secret in `$NAME`, else the content of the file named by `$NAME_FILE`, else None."""
    value = os.environ.get(name)
    if value:
        return value
    path = os.environ.get(f"{name}_FILE")
    if not path:
        return None
    try:
        return Path(path).read_text().strip() or None
    except OSError as exc:
        raise UserError(f"cannot read {name}_FILE ({path}): {exc.strerror}") from None


DB_URL_ENV = "SCALETRAIN_DB_URL"
DB_PASSWORD_ENV = "SCALETRAIN_DB_PASSWORD"


def database_url(given: str | None, default: str) -> str:
    """The telemetry database URL: `given` (a command-line argument, so it must carry no
    password: `ps` shows it to everyone), else $SCALETRAIN_DB_URL or the file named by
    $SCALETRAIN_DB_URL_FILE, else `default`; with the password of $SCALETRAIN_DB_PASSWORD or
    the file named by $SCALETRAIN_DB_PASSWORD_FILE put in."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    if given is not None and _has_password(given):
        raise UserError(
            f"--db must not carry a password (command lines are visible to every user): put it "
            f"in ${DB_PASSWORD_ENV} or a file named by ${DB_PASSWORD_ENV}_FILE, or the whole "
            f"URL in ${DB_URL_ENV} / ${DB_URL_ENV}_FILE"
        )
    url = given or secret_from_env(DB_URL_ENV) or default
    password = secret_from_env(DB_PASSWORD_ENV)
    if password is None:
        return url
    try:
        return make_url(url).set(password=password).render_as_string(hide_password=False)
    except (ArgumentError, ValueError):
        return url  # `telemetry.db.connect` reports the bad URL, without its password


def _has_password(url: str) -> bool:
    return redact_url(url) != url


def redact_url(url: str) -> str:
    """`url` with the password of its user:password@ part replaced by ***."""
    return re.sub(r"(://[^:/@]*:)[^/]*@", r"\1***@", url)


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


# -- certificates ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TlsFiles:
    """The files of a certificate directory made by `generate_certs`."""

    root: Path

    @property
    def ca(self) -> Path:
        return self.root / "ca.pem"

    @property
    def server_cert(self) -> Path:
        return self.root / "server.pem"

    @property
    def server_key(self) -> Path:
        return self.root / "server.key"

    @property
    def client_cert(self) -> Path:
        return self.root / "client.pem"

    @property
    def client_key(self) -> Path:
        return self.root / "client.key"

    def read(self, path: Path) -> bytes:
        try:
            return path.read_bytes()
        except OSError as exc:
            raise UserError(
                f"TLS: cannot read {path}: {exc.strerror}; make the files with `scaletrain certs`"
            ) from None


def generate_certs(directory: Path, hosts: tuple[str, ...] = (), days: int = 365) -> TlsFiles:
    """Write a development CA and a server and a client certificate it signs into `directory`.

    The server certificate is good for localhost, 127.0.0.1, ::1 and `hosts`. Private keys are
    written with mode 0600. Not for production: a real deployment brings its own PKI.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    files = TlsFiles(Path(directory))
    files.root.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)

    def name(common: str) -> x509.Name:
        return x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "scaletrain development"),
                x509.NameAttribute(NameOID.COMMON_NAME, common),
            ]
        )

    def builder(subject: str, issuer: x509.Name, key: ec.EllipticCurvePrivateKey):
        return (
            x509.CertificateBuilder()
            .subject_name(name(subject))
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    signs_certificates = x509.KeyUsage(
        digital_signature=True,
        key_cert_sign=True,
        crl_sign=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        encipher_only=False,
        decipher_only=False,
    )
    ca_cert = (
        builder("scaletrain development CA", name("scaletrain development CA"), ca_key)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(signs_certificates, critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    names: list[x509.GeneralName] = []
    for host in ("localhost", "127.0.0.1", "::1", *hosts):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))

    def leaf(subject: str, usage: x509.ObjectIdentifier, sans: list[x509.GeneralName]):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = builder(subject, ca_cert.subject, key).add_extension(
            x509.BasicConstraints(ca=False, path_length=None), critical=True
        )
        cert = cert.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        if sans:
            cert = cert.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return key, cert.sign(ca_key, hashes.SHA256())

    server_key, server_cert = leaf("scaletrain server", ExtendedKeyUsageOID.SERVER_AUTH, names)
    client_key, client_cert = leaf("scaletrain client", ExtendedKeyUsageOID.CLIENT_AUTH, [])

    def write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
        pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(pem)

    files.ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    files.server_cert.write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    files.client_cert.write_bytes(client_cert.public_bytes(serialization.Encoding.PEM))
    write_key(files.server_key, server_key)
    write_key(files.client_key, client_key)
    return files


# -- tokens ----------------------------------------------------------------------------------------


class Role(enum.StrEnum):
    """What a token may do; each role includes the rights of the ones before it."""

    # Read checkpoints and resume points (the UI, a restore, `scaletrain ckpt` listings).
    READER = "reader"
    # Also write checkpoints and telemetry (a trainer, and ckptd reporting tier commits).
    TRAINER = "trainer"
    # Also delete checkpoints.
    ADMIN = "admin"

    @property
    def rank(self) -> int:
        return list(Role).index(self)


@dataclass(frozen=True)
class Grant:
    """What one token is good for: a role over one run, or over every run (`ALL_RUNS`)."""

    role: Role
    run: str
    # A label for audit lines ("trainer of run-7"); never the token.
    name: str = ""

    def allows(self, role: Role, run: str) -> bool:
        """Whether this grant may act as `role` on `run` (`ALL_RUNS`: on every run at once)."""
        return self.role.rank >= role.rank and self.run in (ALL_RUNS, run)


def new_token() -> str:
    return secrets.token_urlsafe(32)


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _parse_grants(path: Path) -> dict[str, Grant]:
    try:
        entries = json.loads(path.read_text() or "[]")
    except OSError as exc:
        raise UserError(f"cannot read the tokens file {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise UserError(f"tokens file {path} is not JSON: {exc}") from None
    grants = {}
    for i, entry in enumerate(entries if isinstance(entries, list) else [None]):
        try:
            digest, role, run = entry["sha256"], Role(entry["role"]), entry["run"]
            if len(digest) != 64 or not isinstance(run, str) or not run:
                raise ValueError
        except (TypeError, KeyError, ValueError):
            raise UserError(
                f"tokens file {path}: entry {i} must be "
                '{"sha256": 64 hex digits, "role": reader|trainer|admin, "run": RUN or "*"}'
            ) from None
        grants[digest.lower()] = Grant(role, run, str(entry.get("name", "")))
    return grants


def add_token(path: Path, role: Role | str, run: str, name: str = "") -> str:
    """Mint a token for `role` on `run`, record its hash in the tokens file, return the token.

    The file is rewritten under a temporary name and renamed, so a server reading it concurrently
    sees either the old or the new list.
    """
    path = Path(path)
    entries = []
    if path.exists():
        _parse_grants(path)  # refuse to extend a damaged file
        entries = json.loads(path.read_text() or "[]")
    token = new_token()
    entries.append({"sha256": token_hash(token), "role": str(Role(role)), "run": run, "name": name})
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.tmp")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(entries, out, indent=1)
    os.replace(partial, path)
    return token


class TokenTable:
    """The grants of a tokens file, re-read when the file changes (new runs get new tokens)."""

    def __init__(self, path: Path, recheck_s: float = 1.0) -> None:
        self.path = Path(path)
        self._recheck_s = recheck_s
        self._lock = threading.Lock()
        self._mtime = self._stat()
        self._grants = _parse_grants(self.path)
        self._checked = time.monotonic()

    def _stat(self) -> tuple[int, int]:
        try:
            st = self.path.stat()
        except OSError as exc:
            raise UserError(f"cannot read the tokens file {self.path}: {exc.strerror}") from None
        return st.st_mtime_ns, st.st_size

    def grant(self, token: str) -> Grant | None:
        """The grant of `token`, or None for a token the file does not know."""
        with self._lock:
            if time.monotonic() - self._checked >= self._recheck_s:
                self._checked = time.monotonic()
                try:
                    mtime = self._stat()
                    if mtime != self._mtime:
                        self._grants, self._mtime = _parse_grants(self.path), mtime
                except UserError:
                    pass  # keep the last good list while the file is being replaced or is bad
            return self._grants.get(token_hash(token))


def client_token() -> str | None:
    """This process's token for outgoing calls: `$SCALETRAIN_TOKEN` or `$SCALETRAIN_TOKEN_FILE`."""
    return secret_from_env(TOKEN_ENV)


# -- what a process uses ---------------------------------------------------------------------------


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address, IPv6 in brackets or not) is this machine's loopback:
    the only place a server accepts plaintext unless allowed."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ServerSecurity:
    """How a server protects itself: TLS (mutual with `client_auth`), tokens, plaintext policy.

    Without `tls` a server listens in plaintext, which it accepts only on a loopback address
    unless `allow_plaintext` (a private network, a sidecar that terminates TLS). Without `tokens`
    every caller may do everything: the default for one machine's embedded stack and tests.
    """

    tls: TlsFiles | None = None
    client_auth: bool = False
    tokens: TokenTable | None = None
    allow_plaintext: bool = False

    @classmethod
    def from_env(cls, allow_plaintext: bool = False) -> ServerSecurity:
        """From SCALETRAIN_TLS_DIR, SCALETRAIN_TLS_CLIENT_AUTH, SCALETRAIN_TOKENS_FILE and
        SCALETRAIN_ALLOW_PLAINTEXT."""
        tls_dir = os.environ.get(TLS_DIR_ENV)
        tokens = os.environ.get(TOKENS_FILE_ENV)
        client_auth = env_flag(TLS_CLIENT_AUTH_ENV)
        if client_auth and not tls_dir:
            raise UserError(f"{TLS_CLIENT_AUTH_ENV} needs {TLS_DIR_ENV} (mutual TLS is TLS)")
        return cls(
            tls=TlsFiles(Path(tls_dir)) if tls_dir else None,
            client_auth=client_auth,
            tokens=TokenTable(Path(tokens)) if tokens else None,
            allow_plaintext=allow_plaintext or env_flag(ALLOW_PLAINTEXT_ENV),
        )


@dataclass(frozen=True)
class ClientSecurity:
    """How a client connects: trusting `tls.ca` (and showing the client certificate when the
    directory has one), and sending `token` with every call."""

    tls: TlsFiles | None = None
    token: str | None = None

    @classmethod
    def from_env(cls) -> ClientSecurity:
        """From SCALETRAIN_TLS_DIR and SCALETRAIN_TOKEN (or SCALETRAIN_TOKEN_FILE)."""
        tls_dir = os.environ.get(TLS_DIR_ENV)
        return cls(tls=TlsFiles(Path(tls_dir)) if tls_dir else None, token=client_token())

    def __repr__(self) -> str:
        return f"ClientSecurity(tls={self.tls!r}, token={'***' if self.token else None})"


class EmbeddedCredentials:
    """TLS and tokens of one secure embedded stack (`scaletrain run --secure`).

    The development certificates stay in the work directory (made once); the tokens file is
    written anew for every stack, so a token of an earlier run is worth nothing. Tokens live only
    in this process and in the environment of the children that need them.
    """

    def __init__(self, tls_dir: Path, tokens_file: Path) -> None:
        self.tls = TlsFiles(Path(tls_dir))
        if not self.tls.ca.is_file():
            generate_certs(self.tls.root)
        self.tokens_file = Path(tokens_file)
        self.tokens_file.unlink(missing_ok=True)
        # ckptd reports every run's tier commits to telemetry: a trainer grant over every run.
        self.service_token = add_token(self.tokens_file, Role.TRAINER, ALL_RUNS, "ckptd")

    def mint(self, role: Role, run: str = ALL_RUNS, name: str = "") -> str:
        return add_token(self.tokens_file, role, run, name or f"{role} of {run}")

    def server_env(self) -> dict[str, str]:
        return {TLS_DIR_ENV: str(self.tls.root.resolve()), TOKENS_FILE_ENV: str(self.tokens_file)}

    def client_env(self, token: str) -> dict[str, str]:
        return {TLS_DIR_ENV: str(self.tls.root.resolve()), TOKEN_ENV: token}

    def client(self, token: str | None = None) -> ClientSecurity:
        return ClientSecurity(tls=self.tls, token=token)
