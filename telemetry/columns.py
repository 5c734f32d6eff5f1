"""Rank-step records as columns (StepColumns): the compact form clients send and the service reads.

Reading a protobuf message field by field costs the service microseconds per record; reading a
repeated column costs one call for all records. So each client, which queues only its own rank's
records, turns them into columns before sending, and the service, which receives every rank's,
reads whole columns. Only protobuf here: clients import it without the database layers.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

from scaletrain.v1 import telemetry_pb2

PHASES = (
    "step",
    "data",
    "forward",
    "backward",
    "optimizer",
    "comm_wait",
    "checkpoint",
    "compute",
    "replay",
)
# The fields of StepColumns, in order; READ gets them from a RankStep in the same order.
COLUMN_NAMES = (
    "run_id",
    "step",
    "rank",
    "attempt",
    "loss",
    "grad_norm",
    "tokens",
    *(f"{phase}_s" for phase in PHASES),
    "memory_bytes",
    "peak_memory_bytes",
    "lr",
    "time_seconds",
    "time_nanos",
    "param_checksum",
    "global_sample",
    "rank_sample",
    "epoch",
    "dropped_records",
)
READ = operator.attrgetter(
    "run_id",
    "step",
    "rank",
    "attempt",
    "loss",
    "grad_norm",
    "tokens",
    *(f"times.{phase}" for phase in PHASES),
    "memory_bytes",
    "peak_memory_bytes",
    "lr",
    "time.seconds",
    "time.nanos",
    "param_checksum",
    "data_offset.global_sample",
    "data_offset.rank_sample",
    "data_offset.epoch",
    "dropped_records",
)


_TIME_SECONDS = COLUMN_NAMES.index("time_seconds")


def columns_of(records: Sequence[telemetry_pb2.RankStep]) -> telemetry_pb2.StepColumns:
    """The records as columns (a C-level read of each record, then one extend per column)."""
    return columns_of_values(list(map(READ, records)))


def columns_of_values(rows: Sequence[tuple[Any, ...]]) -> telemetry_pb2.StepColumns:
    """Records given as READ's tuples, as columns (one extend per column)."""
    columns = telemetry_pb2.StepColumns()
    if rows:
        for name, values in zip(COLUMN_NAMES, zip(*rows, strict=True), strict=True):
            getattr(columns, name).extend(values)
    return columns


def stamped(values: tuple[Any, ...], seconds: int, nanos: int) -> tuple[Any, ...]:
    """READ's tuple of a record with its time replaced."""
    return (*values[:_TIME_SECONDS], seconds, nanos, *values[_TIME_SECONDS + 2 :])


def records_of(columns: telemetry_pb2.StepColumns) -> list[telemetry_pb2.RankStep]:
    """The columns as records again (all columns must have the same length)."""
    values = dict(zip(COLUMN_NAMES, (getattr(columns, name) for name in COLUMN_NAMES), strict=True))
    records = []
    for i in range(len(columns.run_id)):
        record = telemetry_pb2.RankStep(
            run_id=values["run_id"][i],
            step=values["step"][i],
            rank=values["rank"][i],
            attempt=values["attempt"][i],
            loss=values["loss"][i],
            grad_norm=values["grad_norm"][i],
            tokens=values["tokens"][i],
            times=telemetry_pb2.PhaseTimes(**{phase: values[f"{phase}_s"][i] for phase in PHASES}),
            memory_bytes=values["memory_bytes"][i],
            peak_memory_bytes=values["peak_memory_bytes"][i],
            lr=values["lr"][i],
            param_checksum=values["param_checksum"][i],
            data_offset=telemetry_pb2.DataLoaderOffset(
                global_sample=values["global_sample"][i],
                rank_sample=values["rank_sample"][i],
                epoch=values["epoch"][i],
            ),
            dropped_records=values["dropped_records"][i],
        )
        seconds, nanos = values["time_seconds"][i], values["time_nanos"][i]
        if seconds or nanos:  # (0, 0) is "not stamped", as an unset time is
            record.time.seconds, record.time.nanos = seconds, nanos
        records.append(record)
    return records
