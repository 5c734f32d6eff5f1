"""Configuration of the telemetry service."""

from __future__ import annotations

from dataclasses import dataclass, field

from scaletrain.security import ServerSecurity, redact_url
from telemetry.retention import RetentionPolicy


@dataclass(frozen=True)
class TelemetryConfig:
    """Where the service keeps its data and where it listens.

    `db_url` is an SQLAlchemy URL: `sqlite:///path/telemetry.db` for one machine, or
    `postgresql+psycopg://user@host/db` when several services or a UI elsewhere share it.
    Port 0 in `listen` picks a free port; `RunningTelemetry.address` tells which one.
    `metrics_listen` (HOST:PORT) serves Prometheus metrics of the runs over HTTP; None: no endpoint.
    `retention` says how many recent steps keep their per-rank rows (rollups are kept for the
    whole run). `db_url` may hold a password: it is never logged, and the command line reads it
    from the environment or a file, never from its arguments.
    """

    db_url: str
    listen: str = "127.0.0.1:0"
    metrics_listen: str | None = None
    # TLS and tokens of the gRPC server; None: from the environment (ServerSecurity.from_env).
    security: ServerSecurity | None = None
    retention: RetentionPolicy = field(default_factory=RetentionPolicy)

    def __repr__(self) -> str:
        return (
            f"TelemetryConfig(db_url={redact_url(self.db_url)!r}, listen={self.listen!r}, "
            f"metrics_listen={self.metrics_listen!r}, security={self.security!r}, "
            f"retention={self.retention!r})"
        )
