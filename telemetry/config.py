"""Configuration of the telemetry service."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from scaletrain.errors import UserError
from scaletrain.security import ServerSecurity, redact_url
from telemetry.partitions import DEFAULT_PARTITION_STEPS
from telemetry.retention import RetentionPolicy

# Where a deployment (the Helm chart, a systemd unit) sets the per-rank-row window without flags.
KEEP_STEPS_ENV = "SCALETRAIN_TELEMETRY_KEEP_STEPS"
# Steps per range partition of rank_steps on PostgreSQL (`telemetry.partitions`).
PARTITION_STEPS_ENV = "SCALETRAIN_TELEMETRY_PARTITION_STEPS"


def partition_steps() -> int:
    """Steps per range partition: $SCALETRAIN_TELEMETRY_PARTITION_STEPS, else the default.

    Retention drops a range once all its steps are past the window, so a range of a tenth of the
    window keeps at most a tenth more rows than the window; a smaller one means more tables.
    Raises UserError (one line naming the variable) for anything but a whole number >= 1.
    """
    value = os.environ.get(PARTITION_STEPS_ENV)
    if not value:
        return DEFAULT_PARTITION_STEPS
    return _whole_steps(f"${PARTITION_STEPS_ENV}", value, "steps per range partition")


@dataclass(frozen=True)
class TelemetryConfig:
    """Where the service keeps its data and where it listens.

    `db_url` is an SQLAlchemy URL: `sqlite:///path/telemetry.db` for one machine, or
    `postgresql+psycopg://user@host/db` when several services or a UI elsewhere share it.
    Port 0 in `listen` picks a free port; `RunningTelemetry.address` tells which one.
    `metrics_listen` (HOST:PORT) serves Prometheus metrics of the runs over HTTP; None: no endpoint.
    `retention` says how many recent steps keep their per-rank rows (rollups are kept for the
    whole run; `retention_policy` reads the window from the command line or the environment).
    `db_url` may hold a password: it is never logged, and the command line reads it from the
    environment or a file, never from its arguments.
    """

    db_url: str
    listen: str = "127.0.0.1:0"
    metrics_listen: str | None = None
    # TLS and tokens of the gRPC server; None: from the environment (ServerSecurity.from_env).
    security: ServerSecurity | None = None
    retention: RetentionPolicy = field(default_factory=RetentionPolicy)
    # Steps per range partition of rank_steps (PostgreSQL only; see `partition_steps`).
    partition_steps: int = field(default_factory=partition_steps)

    def __repr__(self) -> str:
        return (
            f"TelemetryConfig(db_url={redact_url(self.db_url)!r}, listen={self.listen!r}, "
            f"metrics_listen={self.metrics_listen!r}, security={self.security!r}, "
            f"retention={self.retention!r}, partition_steps={self.partition_steps})"
        )


def retention_policy(keep_steps: str | None) -> RetentionPolicy:
    """The retention `scaletrain telemetry --keep-steps N` asks for; without the flag, what
    $SCALETRAIN_TELEMETRY_KEEP_STEPS says; without either, the default (RetentionPolicy).

    Raises UserError (one line naming the flag or variable) for anything but a whole number >= 1:
    a window of 0 steps would delete rows the moment their step is rolled up.
    """
    source, value = "--keep-steps", keep_steps
    if value is None:
        source, value = f"${KEEP_STEPS_ENV}", os.environ.get(KEEP_STEPS_ENV)
    if value is None or value == "":
        return RetentionPolicy()
    return RetentionPolicy(keep_steps=_whole_steps(source, value, "per-rank rows kept per run"))


def _whole_steps(source: str, value: str, meaning: str) -> int:
    """`value` as a number of steps >= 1, or UserError with one line naming `source`."""
    try:
        steps = int(value)
    except ValueError:
        steps = 0
    if steps < 1:
        raise UserError(f"{source} must be a whole number of steps >= 1 ({meaning}), got {value!r}")
    return steps
