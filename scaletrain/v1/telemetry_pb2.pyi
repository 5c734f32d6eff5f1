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

class EventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENT_KIND_UNSPECIFIED: _ClassVar[EventKind]
    EVENT_KIND_RUN_STARTED: _ClassVar[EventKind]
    EVENT_KIND_RUN_FINISHED: _ClassVar[EventKind]
    EVENT_KIND_RUN_FAILED: _ClassVar[EventKind]
    EVENT_KIND_CHECKPOINT_STARTED: _ClassVar[EventKind]
    EVENT_KIND_CHECKPOINT_STAGED: _ClassVar[EventKind]
    EVENT_KIND_CHECKPOINT_COMMITTED: _ClassVar[EventKind]
    EVENT_KIND_CHECKPOINT_FAILED: _ClassVar[EventKind]
    EVENT_KIND_RESTART: _ClassVar[EventKind]
    EVENT_KIND_ALERT: _ClassVar[EventKind]
    EVENT_KIND_STRAGGLER: _ClassVar[EventKind]
    EVENT_KIND_LOSS_SPIKE: _ClassVar[EventKind]
    EVENT_KIND_SDC: _ClassVar[EventKind]
    EVENT_KIND_REPLAY: _ClassVar[EventKind]
    EVENT_KIND_CHECKPOINT_SAVED: _ClassVar[EventKind]
    EVENT_KIND_CHECKPOINT_SKIPPED: _ClassVar[EventKind]
    EVENT_KIND_HEARTBEAT: _ClassVar[EventKind]
    EVENT_KIND_HANG: _ClassVar[EventKind]
    EVENT_KIND_FAULT: _ClassVar[EventKind]
    EVENT_KIND_EVAL: _ClassVar[EventKind]
    EVENT_KIND_RECOVERY: _ClassVar[EventKind]
    EVENT_KIND_ELASTIC: _ClassVar[EventKind]
    EVENT_KIND_QUARANTINE: _ClassVar[EventKind]
EVENT_KIND_UNSPECIFIED: EventKind
EVENT_KIND_RUN_STARTED: EventKind
EVENT_KIND_RUN_FINISHED: EventKind
EVENT_KIND_RUN_FAILED: EventKind
EVENT_KIND_CHECKPOINT_STARTED: EventKind
EVENT_KIND_CHECKPOINT_STAGED: EventKind
EVENT_KIND_CHECKPOINT_COMMITTED: EventKind
EVENT_KIND_CHECKPOINT_FAILED: EventKind
EVENT_KIND_RESTART: EventKind
EVENT_KIND_ALERT: EventKind
EVENT_KIND_STRAGGLER: EventKind
EVENT_KIND_LOSS_SPIKE: EventKind
EVENT_KIND_SDC: EventKind
EVENT_KIND_REPLAY: EventKind
EVENT_KIND_CHECKPOINT_SAVED: EventKind
EVENT_KIND_CHECKPOINT_SKIPPED: EventKind
EVENT_KIND_HEARTBEAT: EventKind
EVENT_KIND_HANG: EventKind
EVENT_KIND_FAULT: EventKind
EVENT_KIND_EVAL: EventKind
EVENT_KIND_RECOVERY: EventKind
EVENT_KIND_ELASTIC: EventKind
EVENT_KIND_QUARANTINE: EventKind

class RegisterRunRequest(_message.Message):
    __slots__ = ("run_id", "name", "config_json", "world_size", "layout", "model_params", "hardware", "started_at", "ranks", "precision", "peak_flops", "peak_flops_source", "recompute_fraction")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MODEL_PARAMS_FIELD_NUMBER: _ClassVar[int]
    HARDWARE_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    PEAK_FLOPS_FIELD_NUMBER: _ClassVar[int]
    PEAK_FLOPS_SOURCE_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_FRACTION_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    name: str
    config_json: str
    world_size: int
    layout: _common_pb2.ParallelLayout
    model_params: int
    hardware: str
    started_at: _timestamp_pb2.Timestamp
    ranks: _containers.RepeatedCompositeFieldContainer[RankInfo]
    precision: str
    peak_flops: float
    peak_flops_source: str
    recompute_fraction: float
    def __init__(self, run_id: _Optional[str] = ..., name: _Optional[str] = ..., config_json: _Optional[str] = ..., world_size: _Optional[int] = ..., layout: _Optional[_Union[_common_pb2.ParallelLayout, _Mapping]] = ..., model_params: _Optional[int] = ..., hardware: _Optional[str] = ..., started_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., ranks: _Optional[_Iterable[_Union[RankInfo, _Mapping]]] = ..., precision: _Optional[str] = ..., peak_flops: _Optional[float] = ..., peak_flops_source: _Optional[str] = ..., recompute_fraction: _Optional[float] = ...) -> None: ...

class RankInfo(_message.Message):
    __slots__ = ("rank", "host", "device")
    RANK_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    rank: int
    host: str
    device: str
    def __init__(self, rank: _Optional[int] = ..., host: _Optional[str] = ..., device: _Optional[str] = ...) -> None: ...

class RegisterRunResponse(_message.Message):
    __slots__ = ("created", "attempt", "last_step")
    CREATED_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    created: bool
    attempt: int
    last_step: int
    def __init__(self, created: _Optional[bool] = ..., attempt: _Optional[int] = ..., last_step: _Optional[int] = ...) -> None: ...

class PhaseTimes(_message.Message):
    __slots__ = ("step", "data", "forward", "backward", "optimizer", "comm_wait", "checkpoint", "compute", "replay")
    STEP_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    FORWARD_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    COMM_WAIT_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_FIELD_NUMBER: _ClassVar[int]
    REPLAY_FIELD_NUMBER: _ClassVar[int]
    step: float
    data: float
    forward: float
    backward: float
    optimizer: float
    comm_wait: float
    checkpoint: float
    compute: float
    replay: float
    def __init__(self, step: _Optional[float] = ..., data: _Optional[float] = ..., forward: _Optional[float] = ..., backward: _Optional[float] = ..., optimizer: _Optional[float] = ..., comm_wait: _Optional[float] = ..., checkpoint: _Optional[float] = ..., compute: _Optional[float] = ..., replay: _Optional[float] = ...) -> None: ...

class DataLoaderOffset(_message.Message):
    __slots__ = ("global_sample", "rank_sample", "epoch")
    GLOBAL_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    RANK_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    global_sample: int
    rank_sample: int
    epoch: int
    def __init__(self, global_sample: _Optional[int] = ..., rank_sample: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class RankStep(_message.Message):
    __slots__ = ("run_id", "step", "rank", "loss", "grad_norm", "tokens", "times", "memory_bytes", "peak_memory_bytes", "data_offset", "lr", "time", "param_checksum", "attempt", "dropped_records")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    PARAM_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    DROPPED_RECORDS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    step: int
    rank: int
    loss: float
    grad_norm: float
    tokens: int
    times: PhaseTimes
    memory_bytes: int
    peak_memory_bytes: int
    data_offset: DataLoaderOffset
    lr: float
    time: _timestamp_pb2.Timestamp
    param_checksum: str
    attempt: int
    dropped_records: int
    def __init__(self, run_id: _Optional[str] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ..., loss: _Optional[float] = ..., grad_norm: _Optional[float] = ..., tokens: _Optional[int] = ..., times: _Optional[_Union[PhaseTimes, _Mapping]] = ..., memory_bytes: _Optional[int] = ..., peak_memory_bytes: _Optional[int] = ..., data_offset: _Optional[_Union[DataLoaderOffset, _Mapping]] = ..., lr: _Optional[float] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., param_checksum: _Optional[str] = ..., attempt: _Optional[int] = ..., dropped_records: _Optional[int] = ...) -> None: ...

class StepBatch(_message.Message):
    __slots__ = ("records", "columns")
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    records: _containers.RepeatedCompositeFieldContainer[RankStep]
    columns: StepColumns
    def __init__(self, records: _Optional[_Iterable[_Union[RankStep, _Mapping]]] = ..., columns: _Optional[_Union[StepColumns, _Mapping]] = ...) -> None: ...

class StepColumns(_message.Message):
    __slots__ = ("run_id", "step", "rank", "attempt", "loss", "grad_norm", "tokens", "step_s", "data_s", "forward_s", "backward_s", "optimizer_s", "comm_wait_s", "checkpoint_s", "compute_s", "replay_s", "memory_bytes", "peak_memory_bytes", "lr", "time_seconds", "time_nanos", "param_checksum", "global_sample", "rank_sample", "epoch", "dropped_records")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_S_FIELD_NUMBER: _ClassVar[int]
    DATA_S_FIELD_NUMBER: _ClassVar[int]
    FORWARD_S_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_S_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_S_FIELD_NUMBER: _ClassVar[int]
    COMM_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    REPLAY_S_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    TIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TIME_NANOS_FIELD_NUMBER: _ClassVar[int]
    PARAM_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    RANK_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    DROPPED_RECORDS_FIELD_NUMBER: _ClassVar[int]
    run_id: _containers.RepeatedScalarFieldContainer[str]
    step: _containers.RepeatedScalarFieldContainer[int]
    rank: _containers.RepeatedScalarFieldContainer[int]
    attempt: _containers.RepeatedScalarFieldContainer[int]
    loss: _containers.RepeatedScalarFieldContainer[float]
    grad_norm: _containers.RepeatedScalarFieldContainer[float]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    step_s: _containers.RepeatedScalarFieldContainer[float]
    data_s: _containers.RepeatedScalarFieldContainer[float]
    forward_s: _containers.RepeatedScalarFieldContainer[float]
    backward_s: _containers.RepeatedScalarFieldContainer[float]
    optimizer_s: _containers.RepeatedScalarFieldContainer[float]
    comm_wait_s: _containers.RepeatedScalarFieldContainer[float]
    checkpoint_s: _containers.RepeatedScalarFieldContainer[float]
    compute_s: _containers.RepeatedScalarFieldContainer[float]
    replay_s: _containers.RepeatedScalarFieldContainer[float]
    memory_bytes: _containers.RepeatedScalarFieldContainer[int]
    peak_memory_bytes: _containers.RepeatedScalarFieldContainer[int]
    lr: _containers.RepeatedScalarFieldContainer[float]
    time_seconds: _containers.RepeatedScalarFieldContainer[int]
    time_nanos: _containers.RepeatedScalarFieldContainer[int]
    param_checksum: _containers.RepeatedScalarFieldContainer[str]
    global_sample: _containers.RepeatedScalarFieldContainer[int]
    rank_sample: _containers.RepeatedScalarFieldContainer[int]
    epoch: _containers.RepeatedScalarFieldContainer[int]
    dropped_records: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, run_id: _Optional[_Iterable[str]] = ..., step: _Optional[_Iterable[int]] = ..., rank: _Optional[_Iterable[int]] = ..., attempt: _Optional[_Iterable[int]] = ..., loss: _Optional[_Iterable[float]] = ..., grad_norm: _Optional[_Iterable[float]] = ..., tokens: _Optional[_Iterable[int]] = ..., step_s: _Optional[_Iterable[float]] = ..., data_s: _Optional[_Iterable[float]] = ..., forward_s: _Optional[_Iterable[float]] = ..., backward_s: _Optional[_Iterable[float]] = ..., optimizer_s: _Optional[_Iterable[float]] = ..., comm_wait_s: _Optional[_Iterable[float]] = ..., checkpoint_s: _Optional[_Iterable[float]] = ..., compute_s: _Optional[_Iterable[float]] = ..., replay_s: _Optional[_Iterable[float]] = ..., memory_bytes: _Optional[_Iterable[int]] = ..., peak_memory_bytes: _Optional[_Iterable[int]] = ..., lr: _Optional[_Iterable[float]] = ..., time_seconds: _Optional[_Iterable[int]] = ..., time_nanos: _Optional[_Iterable[int]] = ..., param_checksum: _Optional[_Iterable[str]] = ..., global_sample: _Optional[_Iterable[int]] = ..., rank_sample: _Optional[_Iterable[int]] = ..., epoch: _Optional[_Iterable[int]] = ..., dropped_records: _Optional[_Iterable[int]] = ...) -> None: ...

class ReportStepsResponse(_message.Message):
    __slots__ = ("accepted", "duplicates")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    duplicates: int
    def __init__(self, accepted: _Optional[int] = ..., duplicates: _Optional[int] = ...) -> None: ...

class CheckpointEvent(_message.Message):
    __slots__ = ("tier", "bytes", "seconds", "node", "replica_of")
    TIER_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_OF_FIELD_NUMBER: _ClassVar[int]
    tier: _common_pb2.Tier
    bytes: int
    seconds: float
    node: str
    replica_of: str
    def __init__(self, tier: _Optional[_Union[_common_pb2.Tier, str]] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., node: _Optional[str] = ..., replica_of: _Optional[str] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("run_id", "step", "rank", "kind", "message", "time", "attributes", "checkpoint")
    class AttributesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    step: int
    rank: int
    kind: EventKind
    message: str
    time: _timestamp_pb2.Timestamp
    attributes: _containers.ScalarMap[str, str]
    checkpoint: CheckpointEvent
    def __init__(self, run_id: _Optional[str] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ..., kind: _Optional[_Union[EventKind, str]] = ..., message: _Optional[str] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., attributes: _Optional[_Mapping[str, str]] = ..., checkpoint: _Optional[_Union[CheckpointEvent, _Mapping]] = ...) -> None: ...

class EventBatch(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[Event]
    def __init__(self, events: _Optional[_Iterable[_Union[Event, _Mapping]]] = ...) -> None: ...

class ReportEventsResponse(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    def __init__(self, accepted: _Optional[int] = ...) -> None: ...

class GetResumePointRequest(_message.Message):
    __slots__ = ("run_id", "step")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    step: int
    def __init__(self, run_id: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class RankOffset(_message.Message):
    __slots__ = ("rank", "offset")
    RANK_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    rank: int
    offset: DataLoaderOffset
    def __init__(self, rank: _Optional[int] = ..., offset: _Optional[_Union[DataLoaderOffset, _Mapping]] = ...) -> None: ...

class ResumePoint(_message.Message):
    __slots__ = ("found", "step", "offsets")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    found: bool
    step: int
    offsets: _containers.RepeatedCompositeFieldContainer[RankOffset]
    def __init__(self, found: _Optional[bool] = ..., step: _Optional[int] = ..., offsets: _Optional[_Iterable[_Union[RankOffset, _Mapping]]] = ...) -> None: ...
