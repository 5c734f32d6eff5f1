"""The one place that creates gRPC servers and channels.

Message-size limits, keepalive, deadlines and (later) TLS and auth live here and nowhere else, so
every service and client of scaletrain behaves the same on the wire.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from concurrent import futures
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from scaletrain.errors import (
    AlreadyExists,
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ScaletrainError,
    Unavailable,
    UserError,
)

MiB = 1 << 20
# Payload of one streamed chunk. The message limit leaves room for framing around a chunk.
CHUNK_BYTES = 4 * MiB
MAX_MESSAGE_BYTES = 16 * MiB
# The largest chunk a server accepts: one message, less room for its framing.
MAX_CHUNK_BYTES = MAX_MESSAGE_BYTES - MiB
# Default deadline of a unary call; streams set their own from the bytes they carry.
DEFAULT_TIMEOUT_S = 30.0

_COMMON_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
_SERVER_OPTIONS: list[tuple[str, Any]] = [
    *_COMMON_OPTIONS,
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    # Two servers must never share a port: a second bind of a taken port fails instead.
    ("grpc.so_reuseport", 0),
]


def make_server(max_workers: int = 32) -> grpc.Server:
    """A gRPC server with the project's limits. Add servicers, then call `bind` and `start`."""
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
        options=_SERVER_OPTIONS,
        maximum_concurrent_rpcs=max_workers * 4,
    )


def bind(server: grpc.Server, address: str) -> int:
    """Bind `address` (HOST:PORT, port 0 picks a free one) and return the port.

    Raises UserError with one readable line when the port is taken or the address is invalid.
    """
    try:
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


def make_channel(address: str) -> grpc.Channel:
    """A channel to a scaletrain service with the project's limits."""
    return grpc.insecure_channel(address, options=_COMMON_OPTIONS)


def wait_until_healthy(address: str, timeout_s: float = 30.0, service: str = "") -> None:
    """Block until the service at `address` reports SERVING, or raise UserError."""
    with make_channel(address) as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout_s)
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except (grpc.FutureTimeoutError, grpc.RpcError) as exc:
            raise UserError(f"service at {address} did not become healthy: {exc}") from None
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        raise UserError(f"service at {address} is not serving (status {reply.status})")


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
    for cls in (InvalidArgument, NotFound, AlreadyExists, FailedPrecondition, DataLoss, Unavailable)
}
_ERRORS[grpc.StatusCode.DEADLINE_EXCEEDED] = Unavailable


def error_from_rpc(exc: grpc.RpcError, what: str) -> ScaletrainError:
    """The domain error for a failed call, with a one-line message; unknown codes keep theirs."""
    code = exc.code() if hasattr(exc, "code") else None
    error = _ERRORS.get(code, ScaletrainError)(describe_rpc_error(exc, what))
    if code is not None and type(error) is ScaletrainError:
        error.code = code
    return error
