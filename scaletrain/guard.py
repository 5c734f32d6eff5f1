"""The guard in front of every service: who is calling, and whether they may.

`scaletrain.transport.make_server` puts a `Guard` in front of every servicer:

- it authenticates the bearer token of each call against the tokens file, then authorizes every
  request message against the service's `Rule` for the method (the role it needs, and the runs the
  message touches), so a trainer's token writes only its own run and a reader's writes nothing;
- it caps the calls one client runs at once and cancels a client stream that goes quiet
  (`Limits`, the `IdleStreamReaper`);
- it answers a request message that does not parse with INVALID_ARGUMENT (`Malformed`) instead of
  gRPC's INTERNAL.

The health service needs no token, so that probes work. `caller_of` tells a servicer who called,
as the guard counted them.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import grpc

from scaletrain.security import (
    ALL_RUNS,
    Grant,
    Role,
    ServerSecurity,
    TokenTable,
    token_hash,
)
from scaletrain.throttle import Throttled

log = logging.getLogger(__name__)

_HEALTH_PREFIX = "/grpc.health.v1.Health/"


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


class IdleStreamReaper:
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
                self._thread = threading.Thread(target=self._run, name="idle-streams", daemon=True)
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


_REAPER = IdleStreamReaper()


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


class Guard(grpc.ServerInterceptor):
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
        activity = _REAPER.watch(context, self._limits.idle_stream_s)

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
