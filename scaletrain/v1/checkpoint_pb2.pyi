import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from scaletrain.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FileKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FILE_KIND_UNSPECIFIED: _ClassVar[FileKind]
    FILE_KIND_SHARD: _ClassVar[FileKind]
    FILE_KIND_METADATA: _ClassVar[FileKind]

class TierState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_STATE_UNSPECIFIED: _ClassVar[TierState]
    TIER_STATE_ABSENT: _ClassVar[TierState]
    TIER_STATE_PENDING: _ClassVar[TierState]
    TIER_STATE_COMMITTED: _ClassVar[TierState]
    TIER_STATE_FAILED: _ClassVar[TierState]

class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTCOME_UNSPECIFIED: _ClassVar[Outcome]
    OUTCOME_IN_PROGRESS: _ClassVar[Outcome]
    OUTCOME_COMMITTED: _ClassVar[Outcome]
    OUTCOME_ABORTED: _ClassVar[Outcome]
    OUTCOME_UNKNOWN: _ClassVar[Outcome]
FILE_KIND_UNSPECIFIED: FileKind
FILE_KIND_SHARD: FileKind
FILE_KIND_METADATA: FileKind
TIER_STATE_UNSPECIFIED: TierState
TIER_STATE_ABSENT: TierState
TIER_STATE_PENDING: TierState
TIER_STATE_COMMITTED: TierState
TIER_STATE_FAILED: TierState
OUTCOME_UNSPECIFIED: Outcome
OUTCOME_IN_PROGRESS: Outcome
OUTCOME_COMMITTED: Outcome
OUTCOME_ABORTED: Outcome
OUTCOME_UNKNOWN: Outcome

class CheckpointRef(_message.Message):
    __slots__ = ("run", "step")
    RUN_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    run: str
    step: int
    def __init__(self, run: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class OpenSaveRequest(_message.Message):
    __slots__ = ("ref", "world_size", "labels", "retention", "replicas", "memory_only")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REF_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    RETENTION_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_ONLY_FIELD_NUMBER: _ClassVar[int]
    ref: CheckpointRef
    world_size: int
    labels: _containers.ScalarMap[str, str]
    retention: RetentionPolicy
    replicas: int
    memory_only: bool
    def __init__(self, ref: _Optional[_Union[CheckpointRef, _Mapping]] = ..., world_size: _Optional[int] = ..., labels: _Optional[_Mapping[str, str]] = ..., retention: _Optional[_Union[RetentionPolicy, _Mapping]] = ..., replicas: _Optional[int] = ..., memory_only: _Optional[bool] = ...) -> None: ...

class RetentionPolicy(_message.Message):
    __slots__ = ("memory_last", "ssd_last", "s3_every", "replicas")
    MEMORY_LAST_FIELD_NUMBER: _ClassVar[int]
    SSD_LAST_FIELD_NUMBER: _ClassVar[int]
    S3_EVERY_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    memory_last: int
    ssd_last: int
    s3_every: int
    replicas: int
    def __init__(self, memory_last: _Optional[int] = ..., ssd_last: _Optional[int] = ..., s3_every: _Optional[int] = ..., replicas: _Optional[int] = ...) -> None: ...

class OpenSaveResponse(_message.Message):
    __slots__ = ("save_id", "epoch", "coordinator", "coordinator_address")
    SAVE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    save_id: str
    epoch: int
    coordinator: str
    coordinator_address: str
    def __init__(self, save_id: _Optional[str] = ..., epoch: _Optional[int] = ..., coordinator: _Optional[str] = ..., coordinator_address: _Optional[str] = ...) -> None: ...

class JoinSaveRequest(_message.Message):
    __slots__ = ("save_id", "ref", "world_size", "epoch", "coordinator", "coordinator_address", "memory_only")
    SAVE_ID_FIELD_NUMBER: _ClassVar[int]
    REF_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_ONLY_FIELD_NUMBER: _ClassVar[int]
    save_id: str
    ref: CheckpointRef
    world_size: int
    epoch: int
    coordinator: str
    coordinator_address: str
    memory_only: bool
    def __init__(self, save_id: _Optional[str] = ..., ref: _Optional[_Union[CheckpointRef, _Mapping]] = ..., world_size: _Optional[int] = ..., epoch: _Optional[int] = ..., coordinator: _Optional[str] = ..., coordinator_address: _Optional[str] = ..., memory_only: _Optional[bool] = ...) -> None: ...

class JoinSaveResponse(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: str
    def __init__(self, node: _Optional[str] = ...) -> None: ...

class FileHeader(_message.Message):
    __slots__ = ("save_id", "path", "rank", "kind")
    SAVE_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    save_id: str
    path: str
    rank: int
    kind: FileKind
    def __init__(self, save_id: _Optional[str] = ..., path: _Optional[str] = ..., rank: _Optional[int] = ..., kind: _Optional[_Union[FileKind, str]] = ...) -> None: ...

class FileChunk(_message.Message):
    __slots__ = ("offset", "data", "crc32c")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    crc32c: int
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32c: _Optional[int] = ...) -> None: ...

class FileTrailer(_message.Message):
    __slots__ = ("size", "crc32c")
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    size: int
    crc32c: int
    def __init__(self, size: _Optional[int] = ..., crc32c: _Optional[int] = ...) -> None: ...

class WriteFileRequest(_message.Message):
    __slots__ = ("header", "chunk", "trailer")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    header: FileHeader
    chunk: FileChunk
    trailer: FileTrailer
    def __init__(self, header: _Optional[_Union[FileHeader, _Mapping]] = ..., chunk: _Optional[_Union[FileChunk, _Mapping]] = ..., trailer: _Optional[_Union[FileTrailer, _Mapping]] = ...) -> None: ...

class WriteFileResponse(_message.Message):
    __slots__ = ("path", "size", "crc32c")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    path: str
    size: int
    crc32c: int
    def __init__(self, path: _Optional[str] = ..., size: _Optional[int] = ..., crc32c: _Optional[int] = ...) -> None: ...

class OpenUploadRequest(_message.Message):
    __slots__ = ("header", "size")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    header: FileHeader
    size: int
    def __init__(self, header: _Optional[_Union[FileHeader, _Mapping]] = ..., size: _Optional[int] = ...) -> None: ...

class OpenUploadResponse(_message.Message):
    __slots__ = ("ticket", "data_host", "data_port", "ticket_ttl_s")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    DATA_HOST_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    TICKET_TTL_S_FIELD_NUMBER: _ClassVar[int]
    ticket: bytes
    data_host: str
    data_port: int
    ticket_ttl_s: float
    def __init__(self, ticket: _Optional[bytes] = ..., data_host: _Optional[str] = ..., data_port: _Optional[int] = ..., ticket_ttl_s: _Optional[float] = ...) -> None: ...

class FinishUploadRequest(_message.Message):
    __slots__ = ("ticket", "trailer")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    ticket: bytes
    trailer: FileTrailer
    def __init__(self, ticket: _Optional[bytes] = ..., trailer: _Optional[_Union[FileTrailer, _Mapping]] = ...) -> None: ...

class CommitSaveRequest(_message.Message):
    __slots__ = ("save_id",)
    SAVE_ID_FIELD_NUMBER: _ClassVar[int]
    save_id: str
    def __init__(self, save_id: _Optional[str] = ...) -> None: ...

class AbortSaveRequest(_message.Message):
    __slots__ = ("save_id", "reason")
    SAVE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    save_id: str
    reason: str
    def __init__(self, save_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class AbortSaveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStatus(_message.Message):
    __slots__ = ("tier", "state", "bytes", "updated_at", "error")
    TIER_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    tier: _common_pb2.Tier
    state: TierState
    bytes: int
    updated_at: _timestamp_pb2.Timestamp
    error: str
    def __init__(self, tier: _Optional[_Union[_common_pb2.Tier, str]] = ..., state: _Optional[_Union[TierState, str]] = ..., bytes: _Optional[int] = ..., updated_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., error: _Optional[str] = ...) -> None: ...

class FileInfo(_message.Message):
    __slots__ = ("path", "rank", "kind", "size", "crc32c", "node")
    PATH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    path: str
    rank: int
    kind: FileKind
    size: int
    crc32c: int
    node: str
    def __init__(self, path: _Optional[str] = ..., rank: _Optional[int] = ..., kind: _Optional[_Union[FileKind, str]] = ..., size: _Optional[int] = ..., crc32c: _Optional[int] = ..., node: _Optional[str] = ...) -> None: ...

class CheckpointInfo(_message.Message):
    __slots__ = ("ref", "world_size", "committed", "tiers", "files", "total_bytes", "created_at", "committed_at", "labels", "retention", "node", "parts", "node_loss_safe", "memory_only")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REF_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_AT_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    RETENTION_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    NODE_LOSS_SAFE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_ONLY_FIELD_NUMBER: _ClassVar[int]
    ref: CheckpointRef
    world_size: int
    committed: bool
    tiers: _containers.RepeatedCompositeFieldContainer[TierStatus]
    files: _containers.RepeatedCompositeFieldContainer[FileInfo]
    total_bytes: int
    created_at: _timestamp_pb2.Timestamp
    committed_at: _timestamp_pb2.Timestamp
    labels: _containers.ScalarMap[str, str]
    retention: RetentionPolicy
    node: str
    parts: _containers.RepeatedCompositeFieldContainer[NodePart]
    node_loss_safe: bool
    memory_only: bool
    def __init__(self, ref: _Optional[_Union[CheckpointRef, _Mapping]] = ..., world_size: _Optional[int] = ..., committed: _Optional[bool] = ..., tiers: _Optional[_Iterable[_Union[TierStatus, _Mapping]]] = ..., files: _Optional[_Iterable[_Union[FileInfo, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., committed_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., labels: _Optional[_Mapping[str, str]] = ..., retention: _Optional[_Union[RetentionPolicy, _Mapping]] = ..., node: _Optional[str] = ..., parts: _Optional[_Iterable[_Union[NodePart, _Mapping]]] = ..., node_loss_safe: _Optional[bool] = ..., memory_only: _Optional[bool] = ...) -> None: ...

class NodePart(_message.Message):
    __slots__ = ("node", "address", "files", "bytes", "tiers", "reachable", "error", "replicas", "copies", "latest_safe_step")
    NODE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    LATEST_SAFE_STEP_FIELD_NUMBER: _ClassVar[int]
    node: str
    address: str
    files: int
    bytes: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierStatus]
    reachable: bool
    error: str
    replicas: _containers.RepeatedCompositeFieldContainer[PartCopy]
    copies: int
    latest_safe_step: int
    def __init__(self, node: _Optional[str] = ..., address: _Optional[str] = ..., files: _Optional[int] = ..., bytes: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierStatus, _Mapping]]] = ..., reachable: _Optional[bool] = ..., error: _Optional[str] = ..., replicas: _Optional[_Iterable[_Union[PartCopy, _Mapping]]] = ..., copies: _Optional[int] = ..., latest_safe_step: _Optional[int] = ...) -> None: ...

class PartCopy(_message.Message):
    __slots__ = ("node", "tiers")
    NODE_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    node: str
    tiers: _containers.RepeatedCompositeFieldContainer[TierStatus]
    def __init__(self, node: _Optional[str] = ..., tiers: _Optional[_Iterable[_Union[TierStatus, _Mapping]]] = ...) -> None: ...

class ListCheckpointsRequest(_message.Message):
    __slots__ = ("run", "include_uncommitted", "nodes")
    RUN_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_UNCOMMITTED_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    run: str
    include_uncommitted: bool
    nodes: bool
    def __init__(self, run: _Optional[str] = ..., include_uncommitted: _Optional[bool] = ..., nodes: _Optional[bool] = ...) -> None: ...

class ListCheckpointsResponse(_message.Message):
    __slots__ = ("checkpoints",)
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    checkpoints: _containers.RepeatedCompositeFieldContainer[CheckpointInfo]
    def __init__(self, checkpoints: _Optional[_Iterable[_Union[CheckpointInfo, _Mapping]]] = ...) -> None: ...

class GetCheckpointRequest(_message.Message):
    __slots__ = ("ref", "latest", "node_loss_safe")
    REF_FIELD_NUMBER: _ClassVar[int]
    LATEST_FIELD_NUMBER: _ClassVar[int]
    NODE_LOSS_SAFE_FIELD_NUMBER: _ClassVar[int]
    ref: CheckpointRef
    latest: bool
    node_loss_safe: bool
    def __init__(self, ref: _Optional[_Union[CheckpointRef, _Mapping]] = ..., latest: _Optional[bool] = ..., node_loss_safe: _Optional[bool] = ...) -> None: ...

class ReadFileRequest(_message.Message):
    __slots__ = ("ref", "path", "offset", "length", "tier", "local_only")
    REF_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    LOCAL_ONLY_FIELD_NUMBER: _ClassVar[int]
    ref: CheckpointRef
    path: str
    offset: int
    length: int
    tier: _common_pb2.Tier
    local_only: bool
    def __init__(self, ref: _Optional[_Union[CheckpointRef, _Mapping]] = ..., path: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., tier: _Optional[_Union[_common_pb2.Tier, str]] = ..., local_only: _Optional[bool] = ...) -> None: ...

class ReadFileResponse(_message.Message):
    __slots__ = ("offset", "data", "crc32c", "tier", "node")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    crc32c: int
    tier: _common_pb2.Tier
    node: str
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32c: _Optional[int] = ..., tier: _Optional[_Union[_common_pb2.Tier, str]] = ..., node: _Optional[str] = ...) -> None: ...

class OpenReadRequest(_message.Message):
    __slots__ = ("ref", "path", "offset", "length", "tier", "local_only", "direct")
    REF_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    LOCAL_ONLY_FIELD_NUMBER: _ClassVar[int]
    DIRECT_FIELD_NUMBER: _ClassVar[int]
    ref: CheckpointRef
    path: str
    offset: int
    length: int
    tier: _common_pb2.Tier
    local_only: bool
    direct: bool
    def __init__(self, ref: _Optional[_Union[CheckpointRef, _Mapping]] = ..., path: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., tier: _Optional[_Union[_common_pb2.Tier, str]] = ..., local_only: _Optional[bool] = ..., direct: _Optional[bool] = ...) -> None: ...

class OpenReadResponse(_message.Message):
    __slots__ = ("ticket", "data_host", "data_port", "ticket_ttl_s", "offset", "length", "node")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    DATA_HOST_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    TICKET_TTL_S_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    ticket: bytes
    data_host: str
    data_port: int
    ticket_ttl_s: float
    offset: int
    length: int
    node: str
    def __init__(self, ticket: _Optional[bytes] = ..., data_host: _Optional[str] = ..., data_port: _Optional[int] = ..., ticket_ttl_s: _Optional[float] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., node: _Optional[str] = ...) -> None: ...

class DeleteCheckpointRequest(_message.Message):
    __slots__ = ("ref", "local_only")
    REF_FIELD_NUMBER: _ClassVar[int]
    LOCAL_ONLY_FIELD_NUMBER: _ClassVar[int]
    ref: CheckpointRef
    local_only: bool
    def __init__(self, ref: _Optional[_Union[CheckpointRef, _Mapping]] = ..., local_only: _Optional[bool] = ...) -> None: ...

class DeleteCheckpointResponse(_message.Message):
    __slots__ = ("tiers", "pending")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedScalarFieldContainer[_common_pb2.Tier]
    pending: _containers.RepeatedScalarFieldContainer[_common_pb2.Tier]
    def __init__(self, tiers: _Optional[_Iterable[_Union[_common_pb2.Tier, str]]] = ..., pending: _Optional[_Iterable[_Union[_common_pb2.Tier, str]]] = ...) -> None: ...

class SetReplicaRateRequest(_message.Message):
    __slots__ = ("bytes_per_s",)
    BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    bytes_per_s: float
    def __init__(self, bytes_per_s: _Optional[float] = ...) -> None: ...

class SetReplicaRateResponse(_message.Message):
    __slots__ = ("previous_bytes_per_s",)
    PREVIOUS_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    previous_bytes_per_s: float
    def __init__(self, previous_bytes_per_s: _Optional[float] = ...) -> None: ...

class HelloRequest(_message.Message):
    __slots__ = ("node", "address", "instance", "zone")
    NODE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    ZONE_FIELD_NUMBER: _ClassVar[int]
    node: str
    address: str
    instance: str
    zone: str
    def __init__(self, node: _Optional[str] = ..., address: _Optional[str] = ..., instance: _Optional[str] = ..., zone: _Optional[str] = ...) -> None: ...

class HelloResponse(_message.Message):
    __slots__ = ("node", "address", "instance", "zone")
    NODE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    ZONE_FIELD_NUMBER: _ClassVar[int]
    node: str
    address: str
    instance: str
    zone: str
    def __init__(self, node: _Optional[str] = ..., address: _Optional[str] = ..., instance: _Optional[str] = ..., zone: _Optional[str] = ...) -> None: ...

class PartFile(_message.Message):
    __slots__ = ("path", "rank", "kind", "size", "block_crcs", "node")
    PATH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_CRCS_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    path: str
    rank: int
    kind: FileKind
    size: int
    block_crcs: bytes
    node: str
    def __init__(self, path: _Optional[str] = ..., rank: _Optional[int] = ..., kind: _Optional[_Union[FileKind, str]] = ..., size: _Optional[int] = ..., block_crcs: _Optional[bytes] = ..., node: _Optional[str] = ...) -> None: ...

class Manifest(_message.Message):
    __slots__ = ("ref", "world_size", "files", "labels", "created_at", "committed_at", "epoch", "coordinator", "memory_only")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REF_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_AT_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_FIELD_NUMBER: _ClassVar[int]
    MEMORY_ONLY_FIELD_NUMBER: _ClassVar[int]
    ref: CheckpointRef
    world_size: int
    files: _containers.RepeatedCompositeFieldContainer[PartFile]
    labels: _containers.ScalarMap[str, str]
    created_at: float
    committed_at: float
    epoch: int
    coordinator: str
    memory_only: bool
    def __init__(self, ref: _Optional[_Union[CheckpointRef, _Mapping]] = ..., world_size: _Optional[int] = ..., files: _Optional[_Iterable[_Union[PartFile, _Mapping]]] = ..., labels: _Optional[_Mapping[str, str]] = ..., created_at: _Optional[float] = ..., committed_at: _Optional[float] = ..., epoch: _Optional[int] = ..., coordinator: _Optional[str] = ..., memory_only: _Optional[bool] = ...) -> None: ...

class PrepareRequest(_message.Message):
    __slots__ = ("save_id", "ref", "epoch", "coordinator")
    SAVE_ID_FIELD_NUMBER: _ClassVar[int]
    REF_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_FIELD_NUMBER: _ClassVar[int]
    save_id: str
    ref: CheckpointRef
    epoch: int
    coordinator: str
    def __init__(self, save_id: _Optional[str] = ..., ref: _Optional[_Union[CheckpointRef, _Mapping]] = ..., epoch: _Optional[int] = ..., coordinator: _Optional[str] = ...) -> None: ...

class PrepareResponse(_message.Message):
    __slots__ = ("node", "world_size", "files")
    NODE_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    node: str
    world_size: int
    files: _containers.RepeatedCompositeFieldContainer[PartFile]
    def __init__(self, node: _Optional[str] = ..., world_size: _Optional[int] = ..., files: _Optional[_Iterable[_Union[PartFile, _Mapping]]] = ...) -> None: ...

class DecideRequest(_message.Message):
    __slots__ = ("save_id", "epoch", "coordinator", "commit", "manifest", "reason", "ref", "retention")
    SAVE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REF_FIELD_NUMBER: _ClassVar[int]
    RETENTION_FIELD_NUMBER: _ClassVar[int]
    save_id: str
    epoch: int
    coordinator: str
    commit: bool
    manifest: Manifest
    reason: str
    ref: CheckpointRef
    retention: RetentionPolicy
    def __init__(self, save_id: _Optional[str] = ..., epoch: _Optional[int] = ..., coordinator: _Optional[str] = ..., commit: _Optional[bool] = ..., manifest: _Optional[_Union[Manifest, _Mapping]] = ..., reason: _Optional[str] = ..., ref: _Optional[_Union[CheckpointRef, _Mapping]] = ..., retention: _Optional[_Union[RetentionPolicy, _Mapping]] = ...) -> None: ...

class DecideResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class OutcomeRequest(_message.Message):
    __slots__ = ("save_id", "ref", "epoch")
    SAVE_ID_FIELD_NUMBER: _ClassVar[int]
    REF_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    save_id: str
    ref: CheckpointRef
    epoch: int
    def __init__(self, save_id: _Optional[str] = ..., ref: _Optional[_Union[CheckpointRef, _Mapping]] = ..., epoch: _Optional[int] = ...) -> None: ...

class OutcomeResponse(_message.Message):
    __slots__ = ("outcome", "manifest")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    outcome: Outcome
    manifest: Manifest
    def __init__(self, outcome: _Optional[_Union[Outcome, str]] = ..., manifest: _Optional[_Union[Manifest, _Mapping]] = ...) -> None: ...

class CatalogRequest(_message.Message):
    __slots__ = ("run",)
    RUN_FIELD_NUMBER: _ClassVar[int]
    run: str
    def __init__(self, run: _Optional[str] = ...) -> None: ...

class CatalogEntry(_message.Message):
    __slots__ = ("manifest", "tiers", "replicas")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    manifest: Manifest
    tiers: _containers.RepeatedCompositeFieldContainer[TierStatus]
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaHeld]
    def __init__(self, manifest: _Optional[_Union[Manifest, _Mapping]] = ..., tiers: _Optional[_Iterable[_Union[TierStatus, _Mapping]]] = ..., replicas: _Optional[_Iterable[_Union[ReplicaHeld, _Mapping]]] = ...) -> None: ...

class ReplicaHeld(_message.Message):
    __slots__ = ("owner", "tiers")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    owner: str
    tiers: _containers.RepeatedCompositeFieldContainer[TierStatus]
    def __init__(self, owner: _Optional[str] = ..., tiers: _Optional[_Iterable[_Union[TierStatus, _Mapping]]] = ...) -> None: ...

class OfferReplicaRequest(_message.Message):
    __slots__ = ("ref", "owner", "sender")
    REF_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    ref: CheckpointRef
    owner: str
    sender: str
    def __init__(self, ref: _Optional[_Union[CheckpointRef, _Mapping]] = ..., owner: _Optional[str] = ..., sender: _Optional[str] = ...) -> None: ...

class OfferReplicaResponse(_message.Message):
    __slots__ = ("queued",)
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    queued: bool
    def __init__(self, queued: _Optional[bool] = ...) -> None: ...

class CatalogResponse(_message.Message):
    __slots__ = ("node", "entries", "latest_safe", "policies")
    class LatestSafeEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class PoliciesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: RetentionPolicy
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[RetentionPolicy, _Mapping]] = ...) -> None: ...
    NODE_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    LATEST_SAFE_FIELD_NUMBER: _ClassVar[int]
    POLICIES_FIELD_NUMBER: _ClassVar[int]
    node: str
    entries: _containers.RepeatedCompositeFieldContainer[CatalogEntry]
    latest_safe: _containers.ScalarMap[str, int]
    policies: _containers.MessageMap[str, RetentionPolicy]
    def __init__(self, node: _Optional[str] = ..., entries: _Optional[_Iterable[_Union[CatalogEntry, _Mapping]]] = ..., latest_safe: _Optional[_Mapping[str, int]] = ..., policies: _Optional[_Mapping[str, RetentionPolicy]] = ...) -> None: ...
