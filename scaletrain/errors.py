"""Domain errors shared by every service.

Plain Python classes (the ckptd store, the telemetry store) raise these; a servicer method
decorated with `maps_errors` answers each with its status code, and a client turns the status back
into the error (`error_from_rpc`), so the classes stay testable without a network and every service
reports the same problem with the same code.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import grpc


class ScaletrainError(Exception):
    """Base of the errors a service reports to its client; the message names the problem."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidArgument(ScaletrainError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ScaletrainError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(ScaletrainError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(ScaletrainError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class DataLoss(ScaletrainError):
    """Every copy of some data failed its checksum."""

    code = grpc.StatusCode.DATA_LOSS


class Unavailable(ScaletrainError):
    code = grpc.StatusCode.UNAVAILABLE


class UserError(Exception):
    """A problem on the command line or in the environment, printed as one line by the CLI."""


class Unauthenticated(ScaletrainError):
    """A call without a token, or with one the service does not know."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(ScaletrainError):
    """A known token asked for more than its role and run allow."""

    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(ScaletrainError):
    """A limit was reached: calls of one client, the size of a checkpoint."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


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
