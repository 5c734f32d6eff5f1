"""Domain errors shared by every service.

Plain Python classes (the ckptd store, the telemetry store) raise these; the gRPC layer in
`scaletrain.rpc` maps each to its status code, so the classes stay testable without a network
and every service reports the same problem with the same code.
"""

from __future__ import annotations

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
