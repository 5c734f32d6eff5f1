"""Configuration of ckptd: where its tiers live and how big they may grow.

Plain dataclasses so that the CLI, the embedded stack and tests build the same objects; S3
credentials come from the environment (never from command lines, which `ps` shows to everyone)
and are hidden from `repr`, so a logged config never leaks them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ckptd.retention import RetentionPolicy
from scaletrain.security import ServerSecurity, secret_from_env

MiB = 1 << 20


@dataclass(frozen=True)
class S3Config:
    """An S3-compatible bucket that holds the slowest, most durable copy of every checkpoint."""

    endpoint_url: str
    bucket: str = "scaletrain"
    region: str = "us-east-1"
    access_key_id: str = ""
    secret_access_key: str = ""
    # Each request is tried this many times, waiting a random 0..min(backoff_max_s,
    # backoff_s * 2**n) between tries; a failed upload is retried as a whole after the same kind
    # of wait, for as long as the checkpoint is wanted on S3.
    attempts: int = 5
    backoff_s: float = 0.5
    backoff_max_s: float = 30.0
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0
    # Multipart uploads: part size (S3 wants >= 5 MiB) and parts in flight at once.
    part_bytes: int = 16 * MiB
    parallel_parts: int = 4

    @classmethod
    def from_env(cls, endpoint_url: str, bucket: str = "scaletrain") -> S3Config:
        """Credentials from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY as S3 tools read them, or
        from the files named by AWS_ACCESS_KEY_ID_FILE / AWS_SECRET_ACCESS_KEY_FILE."""
        return cls(
            endpoint_url=endpoint_url,
            bucket=bucket,
            access_key_id=secret_from_env("AWS_ACCESS_KEY_ID") or "",
            secret_access_key=secret_from_env("AWS_SECRET_ACCESS_KEY") or "",
        )

    def __repr__(self) -> str:
        secret = "***" if self.secret_access_key else "''"
        return (
            f"S3Config(endpoint_url={self.endpoint_url!r}, bucket={self.bucket!r}, "
            f"region={self.region!r}, access_key_id={self.access_key_id!r}, "
            f"secret_access_key={secret})"
        )


@dataclass(frozen=True)
class CkptdConfig:
    """One ckptd: its data dir holds the SSD tier and the catalog, so it can be listed offline."""

    data_dir: Path
    listen: str = "127.0.0.1:0"
    # Memory for the memory tier and for the chunks in flight, together.
    memory_budget_bytes: int = 1 << 30
    s3: S3Config | None = None
    # HOST:PORT of the telemetry service that receives one event per tier commit; None: no events.
    telemetry: str | None = None
    # Retention of a run that never sent a policy with OpenSave.
    retention: RetentionPolicy = field(default_factory=RetentionPolicy)
    # An open save with no write for this long is aborted and its files removed.
    abandon_after_s: float = 600.0
    # HOST:PORT for the Prometheus metrics endpoint; None: no endpoint.
    metrics_listen: str | None = None
    # Apply retention, upload what S3 lacks and abort abandoned saves. The command line's offline
    # store turns it off, so that listing, verifying or exporting never changes what is stored.
    maintain: bool = True
    # The most bytes one checkpoint may hold (all its files together): a client writing more is
    # refused with RESOURCE_EXHAUSTED, so one misbehaving writer cannot fill the disk.
    max_checkpoint_bytes: int = 1 << 40
    # TLS and tokens of the gRPC server; None: from the environment (ServerSecurity.from_env).
    security: ServerSecurity | None = None
    # Serve the same-host fast path of WriteFile: a data socket beside the gRPC port (on the
    # gRPC host; on loopback only when TLS is on), see ckptd.datapath. Off: clients use WriteFile.
    data_socket: bool = True
    # How long an upload ticket waits for its data connection, and an upload for its trailer.
    upload_ticket_ttl_s: float = 30.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "data_dir", Path(self.data_dir))
        if self.memory_budget_bytes < 0:
            raise ValueError(f"memory_budget_bytes must be >= 0, got {self.memory_budget_bytes}")
        if self.max_checkpoint_bytes <= 0:
            raise ValueError(f"max_checkpoint_bytes must be > 0, got {self.max_checkpoint_bytes}")
        if self.abandon_after_s <= 0:
            raise ValueError(f"abandon_after_s must be > 0, got {self.abandon_after_s}")
