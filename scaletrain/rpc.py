"""The one place that creates gRPC servers and channels.

Message-size limits, keepalive, deadlines, TLS and auth live here and nowhere else, so every
service and client of scaletrain behaves the same on the wire:

- TLS (mutual TLS as an option) from `ServerSecurity` / `ClientSecurity` (`scaletrain.security`,
  read from the environment by default); plaintext only on loopback unless explicitly allowed.
- A server interceptor (`_Guard`) in front of every service: it authenticates the bearer token of
  each call against the tokens file, then authorizes every request message against the service's
  `Rule` for the method (the role it needs, and the runs the message touches), so a trainer's token
  writes only its own run and a reader's writes nothing. It also caps the calls one client runs at
  once and cancels a client stream that goes quiet (`Limits`). The health service needs no token,
  so that probes work.
- Clients send their token as `authorization: Bearer ...` metadata, never on a command line.
"""

from __future__ import annotations

import functools
import inspect
import ipaddress
import logging
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent import futures
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from scaletrain.errors import (
    AlreadyExists,
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    ScaletrainError,
    Unauthenticated,
    Unavailable,
    UserError,
)
from scaletrain.security import (
    ALL_RUNS,
    ClientSecurity,
    Grant,
    Role,
    ServerSecurity,
    TokenTable,
    token_hash,
)
from scaletrain.throttle import Throttled

log = logging.getLogger(__name__)

MiB = 1 << 20
# Payload of one streamed chunk. The message limit leaves room for framing around a chunk.
CHUNK_BYTES = 4 * MiB
MAX_MESSAGE_BYTES = 16 * MiB
# The largest chunk a server accepts: one message, less room for its framing.
MAX_CHUNK_BYTES = MAX_MESSAGE_BYTES - MiB
# Default deadline of a unary call; streams set their own from the bytes they carry.
DEFAULT_TIMEOUT_S = 30.0
_HEALTH_PREFIX = "/grpc.health.v1.Health/"

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


@dataclass(frozen=True)
class Limits:
    """What one client may hold of a server, so that a misbehaving one cannot exhaust it."""

    # Calls one client (one token; without tokens, one host) runs at once; more are refused
    # with RESOURCE_EXHAUSTED until one ends.
    calls_per_client: int = 64
    # A client stream (WriteFile, ReportSteps) with no message for this long is cancelled, so a
    # client that goes quiet cannot hold a server thread and its reservations forever.
    idle_stream_s: float = 120.0
    # Refusals of one kind (a status code) are logged once per this many seconds, with a count.
    log_every_s: float = 10.0


class Rule(NamedTuple):
    """Who may call a method: the role it needs over every run a request message touches.

    `runs(message)` names those runs: `ALL_RUNS` for "every run" (a listing of all runs), none
    for a message that touches no run by itself (a chunk after its header).
    """

    role: Role
    runs: Callable[[Any], Iterable[str]]


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

    `policy` maps full method names (`/pkg.Service/Method`) to their Rule; with tokens on, a
    method without a rule is refused. `security` defaults to `ServerSecurity.from_env()`.
    """
    security = security if security is not None else ServerSecurity.from_env()
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
        options=_SERVER_OPTIONS,
        maximum_concurrent_rpcs=max_workers * 4,
        interceptors=[_Guard(dict(policy or {}), security, limits or Limits())],
    )
    _SECURITY[server] = security
    return server


def _loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(server: grpc.Server, address: str) -> int:
    """Bind `address` (HOST:PORT, port 0 picks a free one) and return the port.

    Listens with TLS when the server's security has it; refuses plaintext on an address other
    than loopback unless allowed. Raises UserError with one readable line when the port is
    taken, the address is invalid or plaintext is refused.
    """
    security = _SECURITY.get(server) or ServerSecurity()
    try:
        if security.tls is not None:
            tls = security.tls
            credentials = grpc.ssl_server_credentials(
                [(tls.read(tls.server_key), tls.read(tls.server_cert))],
                root_certificates=tls.read(tls.ca) if security.client_auth else None,
                require_client_auth=security.client_auth,
            )
            port = server.add_secure_port(address, credentials)
        else:
            if not _loopback(address.rpartition(":")[0]) and not security.allow_plaintext:
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
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout_s)
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except (grpc.FutureTimeoutError, grpc.RpcError) as exc:
            raise UserError(f"service at {address} did not become healthy: {exc}") from None
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        raise UserError(f"service at {address} is not serving (status {reply.status})")


class _Watchdog:
    """One thread per process that cancels client streams idle for longer than their limit."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streams: dict[int, tuple[grpc.ServicerContext, float, list[float]]] = {}
        self._thread: threading.Thread | None = None

    def watch(self, context: grpc.ServicerContext, idle_s: float) -> list[float]:
        """Watch a stream; the caller stores time.monotonic() in the returned cell on activity."""
        cell = [time.monotonic()]
        with self._lock:
            self._streams[id(cell)] = (context, idle_s, cell)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="rpc-idle", daemon=True)
                self._thread.start()
        if not context.add_callback(lambda: self._forget(cell)):
            self._forget(cell)
        return cell

    def _forget(self, cell: list[float]) -> None:
        with self._lock:
            self._streams.pop(id(cell), None)

    def _run(self) -> None:
        while True:
            time.sleep(0.2)
            now = time.monotonic()
            with self._lock:
                idle = [key for key, (_, limit, cell) in self._streams.items()
                        if now - cell[0] > limit]  # fmt: skip
                contexts = [self._streams.pop(key)[0] for key in idle]
            for context in contexts:
                log.warning("cancelling a client stream from %s: idle too long", context.peer())
                context.cancel()


_WATCHDOG = _Watchdog()


def _bearer(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return value.removeprefix("Bearer ").strip()
    return None


class _Call(NamedTuple):
    """What the guard decided about a call before its first message."""

    method: str
    # Its client's key (a token's hash prefix; empty without tokens), the host is added later.
    client: str
    grant: Grant | None
    rule: Rule | None
    refusal: tuple[grpc.StatusCode, str] | None


class _Guard(grpc.ServerInterceptor):
    """Authentication, authorization and per-client limits in front of every method.

    A refusal is decided before the servicer sees a message: UNAUTHENTICATED without a known
    token, PERMISSION_DENIED when a message asks for more than the token's grant, so nothing
    the servicer would have done happens. Refusals are logged with the grant's name, never the
    token.
    """

    def __init__(self, policy: dict[str, Rule], security: ServerSecurity, limits: Limits) -> None:
        self._policy = policy
        self._tokens = security.tokens
        self._limits = limits
        self._lock = threading.Lock()
        self._calls: Counter[str] = Counter()
        # A client calling in a loop with a bad token must not write a line per call.
        self._refusals = Throttled(log, limits.log_every_s)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if handler is None or details.method.startswith(_HEALTH_PREFIX):
            return handler
        grant: Grant | None = None
        refusal: tuple[grpc.StatusCode, str] | None = None
        rule = self._policy.get(details.method)
        token = _bearer(details.invocation_metadata)
        if self._tokens is not None:
            grant = self._tokens.grant(token) if token else None
            if token is None:
                refusal = (grpc.StatusCode.UNAUTHENTICATED, "no token: set SCALETRAIN_TOKEN")
            elif grant is None:
                refusal = (grpc.StatusCode.UNAUTHENTICATED, "unknown token")
            elif rule is None:
                refusal = (grpc.StatusCode.PERMISSION_DENIED, f"{details.method} is not allowed")
        # One client: one token on one host (a job's ranks share their run's token, so its
        # nodes count apart); one host without tokens.
        client = token_hash(token)[:16] if grant is not None and token else ""
        call = _Call(details.method, client, grant, rule, refusal)
        return _wrap(handler, functools.partial(self._behave, call))

    def _refuse(
        self, context: grpc.ServicerContext, call: _Call, why: tuple[grpc.StatusCode, str]
    ) -> None:
        grant = call.grant
        who = (grant.name or f"{grant.role} of {grant.run}") if grant else "an anonymous caller"
        self._refusals.warning(
            why[0].name, "refused %s to %s from %s: %s", call.method, who, context.peer(), why[1]
        )
        context.abort(*why)

    def _authorize(self, context: grpc.ServicerContext, call: _Call, message: Any) -> None:
        """Refuse a message that did not parse, or that asks for more than the call's grant."""
        if isinstance(message, Malformed):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"malformed request message ({message.error})"
            )
        grant, rule = call.grant, call.rule
        if grant is None or rule is None:
            return  # no tokens configured: every caller may do everything
        for run in rule.runs(message):
            if not grant.allows(rule.role, run):
                what = "every run" if run == ALL_RUNS else f"run {run[:80]!r}"
                denied = (
                    f"a {grant.role} token of {grant.run[:80]!r} may not "
                    f"{rule.role.value}-access {what}"
                )
                self._refuse(context, call, (grpc.StatusCode.PERMISSION_DENIED, denied))

    def _admit(self, context: grpc.ServicerContext, call: _Call) -> None:
        """Count the call against its client's limit until it ends, or refuse it."""
        client = f"{call.client}@{_host(context.peer())}"
        limit = self._limits.calls_per_client
        with self._lock:
            full = self._calls[client] >= limit
            if not full:
                self._calls[client] += 1
        if full:
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"too many calls at once from this client (limit {limit})",
            )

        def leave() -> None:
            with self._lock:
                self._calls[client] -= 1
                if self._calls[client] <= 0:
                    del self._calls[client]

        if not context.add_callback(leave):
            leave()

    def _behave(
        self,
        call: _Call,
        behavior: Callable[[Any, grpc.ServicerContext], Any],
        request_streaming: bool,
        request: Any,
        context: grpc.ServicerContext,
    ) -> Any:
        if call.refusal is not None:
            self._refuse(context, call, call.refusal)
        self._admit(context, call)
        if not request_streaming:
            self._authorize(context, call, request)
            return behavior(request, context)
        activity = _WATCHDOG.watch(context, self._limits.idle_stream_s)

        def checked() -> Iterator[Any]:
            for message in request:
                activity[0] = time.monotonic()
                self._authorize(context, call, message)
                yield message

        return behavior(checked(), context)


def _host(peer: str) -> str:
    """The host of a gRPC peer string (`ipv4:127.0.0.1:5555`, `ipv6:[::1]:5555`)."""
    return peer.rpartition(":")[0] or peer


class Caller(NamedTuple):
    """Whom a server counts a call's shares against (`ckptd.limits`): `key`, and `label` to
    name it in a refusal (never the token)."""

    key: str
    label: str


def caller_of(context: grpc.ServicerContext, tokens: TokenTable | None) -> Caller:
    """The caller of a call: its token when the server checks tokens (the guard let the call
    through, so the token is known), else its peer host (anyone on a host is one caller)."""
    token = _bearer(context.invocation_metadata())
    grant = tokens.grant(token) if tokens is not None and token else None
    if grant is not None and token is not None:
        name = grant.name or f"the {grant.role.value} token of {grant.run!r}"
        return Caller(f"token:{token_hash(token)[:16]}", name)
    host = _host(context.peer()).partition(":")[2]  # "ipv4:127.0.0.1" -> "127.0.0.1"
    return Caller(f"host:{host}", f"host {host}")


def peer_is_loopback(peer: str) -> bool:
    """Whether a gRPC peer string names a loopback address (the caller is on this host)."""
    return _loopback(_host(peer).partition(":")[2])


_HANDLER_KINDS = {
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
}


class Malformed(NamedTuple):
    """A request message that did not parse; the guard answers it with INVALID_ARGUMENT."""

    error: str


def _parse_or_flag(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """`deserializer` that returns Malformed instead of raising (gRPC would answer INTERNAL)."""
    if deserializer is None:
        return None

    def parse(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except Exception as exc:  # any parse failure is the sender's
            return Malformed(f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}")

    return parse


def _wrap(handler: grpc.RpcMethodHandler, around: Callable[..., Any]) -> grpc.RpcMethodHandler:
    """`handler` with its behaviour called through `around(behavior, request_streaming, ...)`."""
    kind = (bool(handler.request_streaming), bool(handler.response_streaming))
    attribute, make = _HANDLER_KINDS[kind]
    behavior = getattr(handler, attribute)
    if kind[1]:

        def streaming(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            yield from around(behavior, kind[0], request, context)

        wrapped: Callable[..., Any] = streaming
    else:

        def wrapped(request: Any, context: grpc.ServicerContext) -> Any:
            return around(behavior, kind[0], request, context)

    return make(
        wrapped,
        request_deserializer=_parse_or_flag(handler.request_deserializer),
        response_serializer=handler.response_serializer,
    )


F = TypeVar("F", bound=Callable[..., Any])


def maps_errors(method: F) -> F:
    """Decorate a servicer method so that ScaletrainError becomes its gRPC status and message.

    Works for unary and server-streaming methods (generators) alike.
    """
    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def stream_wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Iterable[Any]:
            try:
                yield from method(self, request, context)
            except ScaletrainError as exc:
                context.abort(exc.code, str(exc))

        return stream_wrapper  # type: ignore[return-value]

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except ScaletrainError as exc:
            context.abort(exc.code, str(exc))

    return wrapper  # type: ignore[return-value]


def describe_rpc_error(exc: grpc.RpcError, what: str) -> str:
    """One line for a failed call: what was attempted, the status, and the server's message."""
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    name = code.name if code is not None else "ERROR"
    return f"{what}: {name}: {details}"


# The inverse of `maps_errors`: a client turns a status back into the domain error it stands for.
_ERRORS: dict[grpc.StatusCode, type[ScaletrainError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        AlreadyExists,
        FailedPrecondition,
        DataLoss,
        Unavailable,
        Unauthenticated,
        PermissionDenied,
        ResourceExhausted,
    )
}
_ERRORS[grpc.StatusCode.DEADLINE_EXCEEDED] = Unavailable


def error_from_rpc(exc: grpc.RpcError, what: str) -> ScaletrainError:
    """The domain error for a failed call, with a one-line message; unknown codes keep theirs."""
    code = exc.code() if hasattr(exc, "code") else None
    error = _ERRORS.get(code, ScaletrainError)(describe_rpc_error(exc, what))
    if code is not None and type(error) is ScaletrainError:
        error.code = code
    return error
