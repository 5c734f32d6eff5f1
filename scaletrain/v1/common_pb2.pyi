from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_MEMORY: _ClassVar[Tier]
    TIER_SSD: _ClassVar[Tier]
    TIER_S3: _ClassVar[Tier]
TIER_UNSPECIFIED: Tier
TIER_MEMORY: Tier
TIER_SSD: Tier
TIER_S3: Tier

class ParallelLayout(_message.Message):
    __slots__ = ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep")
    DP_REPLICATE_FIELD_NUMBER: _ClassVar[int]
    DP_SHARD_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    PP_FIELD_NUMBER: _ClassVar[int]
    CP_FIELD_NUMBER: _ClassVar[int]
    EP_FIELD_NUMBER: _ClassVar[int]
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    cp: int
    ep: int
    def __init__(self, dp_replicate: _Optional[int] = ..., dp_shard: _Optional[int] = ..., tp: _Optional[int] = ..., pp: _Optional[int] = ..., cp: _Optional[int] = ..., ep: _Optional[int] = ...) -> None: ...
