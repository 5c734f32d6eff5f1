"""Configuration of ckptd: where its tiers live and how big they may grow.

Plain dataclasses so that the CLI, the embedded stack and tests build the same objects; S3
credentials come from the environment (never from command lines, which `ps` shows to everyone)
and are hidden from `repr`, so a logged config never leaks them.
"""

from __future__ import annotations

import re
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


_NODE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


def check_address(address: str, what: str) -> str:
    """HOST:PORT with a port number: a peer list entry, as a user may mistype it."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} {address!r} is not HOST:PORT")
    return address


def names_itself(address: str) -> str:
    """The error for a peer list that names this node's own ckptd (at `address`)."""
    return f"peer list names this node itself ({address}); list the other nodes only"


@dataclass(frozen=True)
class ClusterConfig:
    """Which node this ckptd is and who its peers are (one ckptd per node).

    With no peers it is a cluster of one: the same protocol, with nobody else to ask.
    """

    # None: the name the data dir was given when new (ckptd.datadir.node_of).
    node: str | None = None
    # HOST:PORT of every other node's ckptd: a static membership.
    peers: tuple[str, ...] = ()
    # HOST:PORT whose HOST resolves to every node's ckptd (a headless Service), this one too.
    peers_dns: str | None = None
    # The address peers reach this ckptd at; None: its listen address.
    advertise: str | None = None
    # How often in-doubt saves are resolved and the catalog is compared with the peers'.
    sync_interval_s: float = 5.0
    # How long a peer may take to answer a vote (it fsyncs its part first).
    prepare_timeout_s: float = 120.0
    # How long to wait for a connection to a peer before counting it unreachable.
    # (gRPC retries a refused connection within a second: scaletrain.transport's reconnect backoff.)
    connect_timeout_s: float = 1.5
    # This node's failure domain (a zone or rack; "" none): replicas go to other domains first.
    zone: str = ""
    # R of a run that does not ask: copies of each node's part on distinct nodes, at most the
    # number of nodes (ckptd.replicas). 1: no replicas.
    replicas: int = 2
    # The most bytes a second this node copies from its peers to make replicas (0: no limit).
    replica_bytes_s: float = 256 * MiB

    def __post_init__(self) -> None:
        if self.node is not None and not _NODE_RE.fullmatch(self.node):
            raise ValueError(
                f"node name {self.node!r} is invalid: use 1-63 letters, digits and . _ -, "
                "starting with a letter or digit"
            )
        for peer in self.peers:
            check_address(peer, "peer")
        if len(set(self.peers)) != len(self.peers):
            raise ValueError(f"peer list {','.join(self.peers)} names a peer twice")
        if self.advertise is not None:
            check_address(self.advertise, "advertise address")
            if self.advertise in self.peers:
                raise ValueError(names_itself(self.advertise))
        if self.peers_dns is not None:
            check_address(self.peers_dns, "--peers-dns")
        if min(self.sync_interval_s, self.prepare_timeout_s, self.connect_timeout_s) <= 0:
            raise ValueError("sync_interval_s, prepare_timeout_s and connect_timeout_s must be > 0")
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1 (1: no replicas), got {self.replicas}")
        if self.replica_bytes_s < 0:
            raise ValueError(f"replica rate must be >= 0 (0: no limit), got {self.replica_bytes_s}")


@dataclass(frozen=True)
class DataLimits:
    """What one caller, one run and the whole node may hold of ckptd, so that one bad client (or
    one broken run) cannot stall the other runs on its node: each resource is counted per caller
    (its token; without tokens, its peer host), per run and in all, and a caller over its share is
    refused with RESOURCE_EXHAUSTED naming its own count and limit while the others go on.

    The defaults fit 64 ranks per node with a few files each in flight, and two such jobs'
    worth on the node. README, "Security", lists them with their flags.
    """

    # Uploads issued (OpenUpload) and not yet ended (FinishUpload, or their data connection
    # failed): each holds a ticket and, once presented, one data connection.
    uploads_per_caller: int = 512
    uploads_per_run: int = 256
    uploads: int = 1024
    # Bytes received on the data socket and not yet checked and written: a caller over its share
    # waits (backpressure on its own connections), the others' bytes go on.
    flight_bytes_per_caller: int = 768 * MiB
    flight_bytes_per_run: int = 512 * MiB
    flight_bytes: int = 1024 * MiB
    # Data connections that have not presented a ticket yet, per peer host and in all: past
    # either, the oldest of them is closed (a client sends its ticket as soon as it connects).
    waiting_connections_per_host: int = 256
    waiting_connections: int = 1024
    # A data connection that brings no ticket for this long is closed.
    ticket_wait_s: float = 5.0
    # An upload whose connection is silent this long fails (its slot is free at once).
    read_timeout_s: float = 10.0
    # Reads opened on the data socket (OpenRead) and not yet sent in full (or their ticket
    # expired unused): per caller, per run and in all, as uploads are.
    reads_per_caller: int = 256
    reads_per_run: int = 512
    reads: int = 1024
    # gRPC calls one client (its token on its host; without tokens, its host) runs at once.
    calls_per_client: int = 64
    # Repeated warnings of one kind (refused data connections): the first, then one line per
    # this many seconds with the count.
    log_every_s: float = 10.0

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        ordered = (
            ("uploads_per_run", "uploads"),
            ("uploads_per_caller", "uploads"),
            ("flight_bytes_per_run", "flight_bytes"),
            ("flight_bytes_per_caller", "flight_bytes"),
            ("waiting_connections_per_host", "waiting_connections"),
            ("reads_per_run", "reads"),
            ("reads_per_caller", "reads"),
        )
        for part, whole in ordered:
            share, total = getattr(self, part), getattr(self, whole)
            if share > total:
                raise ValueError(f"{part} ({share}) must not exceed {whole} ({total})")


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
    # Fair shares of the data socket and the RPCs per caller, per run and in all.
    limits: DataLimits = field(default_factory=DataLimits)
    # This node's name and its peers.
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def __post_init__(self) -> None:
        object.__setattr__(self, "data_dir", Path(self.data_dir))
        if self.cluster.advertise is None and self.listen in self.cluster.peers:
            raise ValueError(names_itself(self.listen))
        if self.memory_budget_bytes < 0:
            raise ValueError(f"memory_budget_bytes must be >= 0, got {self.memory_budget_bytes}")
        if self.max_checkpoint_bytes <= 0:
            raise ValueError(f"max_checkpoint_bytes must be > 0, got {self.max_checkpoint_bytes}")
        if self.abandon_after_s <= 0:
            raise ValueError(f"abandon_after_s must be > 0, got {self.abandon_after_s}")
