"""The telemetry client every training rank uses.

Reporting must never slow training down or stop it: `report_step` and `report_event` only append
to a bounded in-process queue, and a background thread sends what is queued in batches. While the
service is down or slow the thread keeps the records and retries with backoff, so memory stays
bounded however long the outage lasts. What a full queue does is the caller's choice
(`when_full`): a trainer's client drops the oldest records, counting them (every later record
carries the count, so the database says what never arrived) and logging it, because a stalled
step costs more than a lost record; a client that must lose nothing (a load generator, a
backfill) waits for room instead, which pushes the service's pace back onto the caller.
Every report is idempotent on the service side (a record is identified by its run, step, rank and
attempt, and a resent one is skipped), so resending after an unclear failure is safe.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from typing import Any, Generic, Literal, TypeVar

import grpc
from google.protobuf.message import Message

from scaletrain.errors import describe_rpc_error, error_from_rpc
from scaletrain.security import ClientSecurity
from scaletrain.transport import make_channel
from scaletrain.v1 import common_pb2, telemetry_pb2, telemetry_pb2_grpc
from telemetry.columns import READ, columns_of_values, stamped

# The host a rank registers with (RankInfo.host), where the machine's own name would not do:
# `scaletrain run --nodes N` puts N simulated nodes on one machine.
HOST_ENV = "SCALETRAIN_HOST"

_log = logging.getLogger(__name__)

# Codes that resending the same records cannot fix: such records are rejected, not retried.
_PERMANENT = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.DATA_LOSS,
    }
)
# Deadline of one background report call: a base, plus time for every record it carries, so that
# a service storing a few thousand records a second still acknowledges a catch-up call of tens of
# thousands in time; a fixed deadline would expire under load, and every expiry resends the call.
_SEND_TIMEOUT_S = 10.0
_SEND_TIMEOUT_PER_RECORD_S = 0.002
# Batches per client stream: enough to catch up quickly after an outage, small enough to retry.
BATCHES_PER_CALL = 16
_BACKOFF_MIN_S = 0.05
# Short, so that records flow again soon after the service comes back.
_BACKOFF_MAX_S = 2.0

M = TypeVar("M", bound=Message)
# What a full queue does to a new record: evict the oldest (counted and logged), or wait for room.
WhenFull = Literal["drop_oldest", "wait"]


class _Outbox(Generic[M]):
    """A bounded FIFO of records awaiting acknowledgement; not thread-safe (the client locks).

    Records are numbered, so the sender retires exactly the ones the service acknowledged even when
    the queue evicted some of them during the call. An evicted record counts as dropped only if it
    never reached the service.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.full = False
        self.items: deque[tuple[int, M]] = deque()
        self.next_seq = 0
        self.dropped = 0
        self._in_flight_through = -1
        self._evicted_in_flight = 0

    def put(self, record: M) -> None:
        if len(self.items) >= self.capacity:
            evicted_seq, _ = self.items.popleft()
            if evicted_seq <= self._in_flight_through:
                self._evicted_in_flight += 1
            else:
                self.dropped += 1
        self.items.append((self.next_seq, record))
        self.next_seq += 1

    def take(self, limit: int) -> list[M]:
        """The oldest `limit` records, which stay queued until `settle`."""
        taken = list(itertools.islice(self.items, limit))
        self._in_flight_through = taken[-1][0] if taken else -1
        return [record for _, record in taken]

    def has_room(self) -> bool:
        return len(self.items) < self.capacity

    def settle(self, delivered: bool) -> None:
        """Retire the records of the last `take` when they were delivered (or rejected)."""
        if delivered:
            while self.items and self.items[0][0] <= self._in_flight_through:
                self.items.popleft()
        else:
            self.dropped += self._evicted_in_flight
        self._evicted_in_flight = 0
        self._in_flight_through = -1

    def done_through(self, seq: int) -> bool:
        """Whether every record numbered up to `seq` was delivered, rejected or dropped."""
        return not self.items or self.items[0][0] > seq


class TelemetryClient:
    """Reports one rank's steps and events to the telemetry service at `address`.

    `report_step` and `report_event` return at once; `flush` waits for delivery. Use as a context
    manager, or call `close`, so the last records are sent before the process exits.

    With `when_full="wait"`, a report finding `max_queue` records unacknowledged waits until the
    service acknowledged some, instead of dropping the oldest: nothing is ever lost, and a caller
    faster than the service is slowed to its pace.
    """

    def __init__(
        self,
        address: str,
        *,
        max_queue: int = 10_000,
        batch_size: int = 256,
        flush_interval_s: float = 0.5,
        security: ClientSecurity | None = None,
        when_full: WhenFull = "drop_oldest",
    ) -> None:
        if max_queue < 1 or batch_size < 1 or not flush_interval_s > 0:
            raise ValueError(
                f"max_queue ({max_queue}), batch_size ({batch_size}) and flush_interval_s "
                f"({flush_interval_s}) must be positive"
            )
        if when_full not in ("drop_oldest", "wait"):
            raise ValueError(f"when_full must be 'drop_oldest' or 'wait', got {when_full!r}")
        self._when_full = when_full
        self._address = address
        self._batch_size = batch_size
        self._flush_interval_s = flush_interval_s
        self._channel = make_channel(address, security)
        self._stub = telemetry_pb2_grpc.TelemetryServiceStub(self._channel)
        self._cond = threading.Condition()
        # Step records wait as tuples of their values (telemetry.columns.READ): a snapshot the
        # caller cannot change afterwards, and what their columns are made of when sent.
        self._steps: _Outbox[tuple[Any, ...]] = _Outbox(max_queue)
        self._events: _Outbox[telemetry_pb2.Event] = _Outbox(max_queue)
        self._flush_waiters = 0
        self._closed = False
        self._stop = threading.Event()
        self._rejected = 0
        self._last_error: str | None = None
        self._unreachable = False
        self._thread = threading.Thread(target=self._run, name="telemetry-sender", daemon=True)
        self._thread.start()

    def __enter__(self) -> TelemetryClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    @property
    def dropped(self) -> int:
        """Records evicted from the full queue before they reached the service."""
        with self._cond:
            return self._steps.dropped + self._events.dropped

    @property
    def rejected(self) -> int:
        """Records the service refused as invalid (logged, never resent)."""
        with self._cond:
            return self._rejected

    @property
    def pending(self) -> int:
        """Records queued or in flight, not yet acknowledged."""
        with self._cond:
            return len(self._steps.items) + len(self._events.items)

    @property
    def last_error(self) -> str | None:
        """The latest failed report, as one line; None while every report succeeded."""
        with self._cond:
            return self._last_error

    def register_run(
        self, request: telemetry_pb2.RegisterRunRequest, *, timeout_s: float = 30.0
    ) -> telemetry_pb2.RegisterRunResponse:
        """Register the run (again, when resuming): whether it is new, and its attempt (restart
        generation) to stamp on records. Retries until timeout_s.

        Call it before reporting: reports of an unregistered run are rejected. An unset
        `started_at` becomes now.
        """
        if not request.HasField("started_at"):
            stamped = telemetry_pb2.RegisterRunRequest()
            stamped.CopyFrom(request)
            stamped.started_at.FromDatetime(_now())
            request = stamped
        return self._call("register run", self._stub.RegisterRun, request, timeout_s)

    def resume_point(
        self, run_id: str, step: int | None = None, *, timeout_s: float = 30.0
    ) -> telemetry_pb2.ResumePoint:
        """The step to resume `run_id` from (`step`, or the latest committed one) and each rank's
        data-loader offsets there. Call `flush` first if this process reported that step."""
        request = telemetry_pb2.GetResumePointRequest(run_id=run_id, step=step)
        return self._call("get resume point", self._stub.GetResumePoint, request, timeout_s)

    def report_step(self, record: telemetry_pb2.RankStep) -> None:
        """Queue one step record without blocking; an unset `time` becomes now."""
        values = READ(record)
        if not record.HasField("time"):
            now = time.time_ns()
            values = stamped(values, now // 1_000_000_000, now % 1_000_000_000)
        self._put(self._steps, values)

    def report_event(self, event: telemetry_pb2.Event) -> None:
        """Queue one event without blocking; an unset `time` becomes now.

        The time is what identifies a resent event, so stamp it when the event happens.
        """
        self._enqueue(self._events, event)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every record reported so far was acknowledged (or rejected or dropped).

        Returns False when timeout_s passed first, e.g. because the service is down.
        """
        with self._cond:
            targets = (self._steps.next_seq - 1, self._events.next_seq - 1)
            self._flush_waiters += 1
            self._cond.notify_all()
            try:
                return self._cond.wait_for(lambda: self._done_through(*targets), timeout_s)
            finally:
                self._flush_waiters -= 1

    def close(self, timeout_s: float = 30.0) -> bool:
        """Flush for up to timeout_s, then stop sending; True when nothing was left unsent."""
        with self._cond:
            if self._closed:
                return self._done_through(self._steps.next_seq - 1, self._events.next_seq - 1)
            self._closed = True
        delivered = self.flush(timeout_s)
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self._thread.join(timeout=1.0)
        # Cancels a call still in flight to a service that hangs, so the thread ends too.
        self._channel.close()
        self._thread.join()
        if not delivered:
            _log.warning(
                "telemetry: closed with %d records unsent to %s", self.pending, self._address
            )
        return delivered

    def _enqueue(self, outbox: _Outbox[Any], message: Message) -> None:
        # A copy: the caller may reuse and change its message while this one waits in the queue.
        queued = type(message)()
        queued.CopyFrom(message)
        if not queued.HasField("time"):
            queued.time.FromDatetime(_now())
        self._put(outbox, queued)

    def _put(self, outbox: _Outbox[Any], queued: Any) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("telemetry client is closed")
            if self._when_full == "wait" and not outbox.has_room():
                # The sender sends at once what a full queue holds, and wakes us when acknowledged.
                outbox.full = True
                self._cond.notify_all()
                self._cond.wait_for(lambda: outbox.has_room() or self._closed)
                outbox.full = False
                if self._closed:
                    raise RuntimeError("telemetry client was closed while a report waited")
            dropped = outbox.dropped
            outbox.put(queued)
            if outbox.dropped != dropped:
                self._note_dropped(outbox.dropped)
            if len(outbox.items) >= self._batch_size:
                self._cond.notify_all()

    def _done_through(self, steps_seq: int, events_seq: int) -> bool:
        return self._steps.done_through(steps_seq) and self._events.done_through(events_seq)

    def _call(
        self, what: str, method: Callable[..., Any], request: Message, timeout_s: float
    ) -> Any:
        """A unary call that waits for the service and retries transient failures until timeout_s.

        Raises the scaletrain error matching the status (NotFound, InvalidArgument, Unavailable...).
        """
        deadline = time.monotonic() + timeout_s
        backoff = _BACKOFF_MIN_S
        while True:
            remaining = max(deadline - time.monotonic(), 0.001)
            try:
                return method(request, timeout=remaining, wait_for_ready=True)
            except grpc.RpcError as exc:
                code = exc.code()
                if code in _PERMANENT or time.monotonic() + backoff >= deadline:
                    raise error_from_rpc(exc, f"{what} at {self._address}") from None
            time.sleep(backoff)
            backoff = min(backoff * 2, _BACKOFF_MAX_S)

    def _run(self) -> None:
        """The sender thread: sends what is queued every flush interval, or sooner when a batch is
        full or someone flushes; backs off while the service is unreachable."""
        backoff = _BACKOFF_MIN_S
        limit = self._batch_size * BATCHES_PER_CALL
        while True:
            with self._cond:
                if not self._urgent():
                    self._cond.wait(self._flush_interval_s)
                if self._stop.is_set():
                    return
                events = self._events.take(limit)
                steps = self._steps.take(limit)
            try:
                events_sent = self._deliver(events, self._send_events)
                steps_sent = events_sent and self._deliver(steps, self._send_steps)
            except ValueError:
                # close() closed the channel under a call that had not started yet.
                if not self._stop.is_set():
                    raise
                events_sent = steps_sent = False
            with self._cond:
                self._events.settle(events_sent)
                self._steps.settle(steps_sent)
                self._cond.notify_all()
            if events_sent and steps_sent:
                backoff = _BACKOFF_MIN_S
            else:
                self._stop.wait(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX_S)

    def _urgent(self) -> bool:
        """Whether to send now instead of waiting for the flush interval."""
        if self._stop.is_set():
            return True
        steps, events = len(self._steps.items), len(self._events.items)
        if (self._flush_waiters or self._steps.full or self._events.full) and (steps or events):
            return True
        return max(steps, events) >= self._batch_size

    def _deliver(self, records: list[M], send: Callable[[list[M]], None]) -> bool:
        """Send records; False when the service is unreachable and they must wait for a retry.

        When the service refuses a group as invalid, halves of it are resent until the refused
        records are isolated: those are rejected and logged, the others get through.
        """
        if not records:
            return True
        try:
            send(records)
        except grpc.RpcError as exc:
            error = describe_rpc_error(exc, f"report to telemetry at {self._address}")
            if exc.code() not in _PERMANENT:
                self._note_unreachable(error)
                return False
            if len(records) > 1:
                middle = len(records) // 2
                return self._deliver(records[:middle], send) and self._deliver(
                    records[middle:], send
                )
            self._note_rejected(error)
            return True
        self._note_delivered()
        return True

    def _send_steps(self, records: list[tuple[Any, ...]]) -> None:
        # As columns: the service then reads a column at a time instead of every field of every
        # record; this thread, which has one rank's records to turn, has time to spare.
        size = self._batch_size
        batches: Iterable[telemetry_pb2.StepBatch] = (
            telemetry_pb2.StepBatch(columns=columns_of_values(records[start : start + size]))
            for start in range(0, len(records), size)
        )
        self._stub.ReportSteps(batches, timeout=_send_timeout(len(records)))

    def _send_events(self, events: list[telemetry_pb2.Event]) -> None:
        for start in range(0, len(events), self._batch_size):
            batch = telemetry_pb2.EventBatch(events=events[start : start + self._batch_size])
            self._stub.ReportEvents(batch, timeout=_send_timeout(len(batch.events)))

    def _note_unreachable(self, error: str) -> None:
        with self._cond:
            first = not self._unreachable
            self._unreachable = True
            self._last_error = error
            queued = len(self._steps.items) + len(self._events.items)
        if first:
            _log.warning("telemetry: keeping %d records to send later: %s", queued, error)

    def _note_rejected(self, error: str) -> None:
        with self._cond:
            self._rejected += 1
            rejected = self._rejected
            self._last_error = error
        # Log the 1st, 2nd, 4th, 8th... rejection: a broken reporter must not flood the log.
        if rejected & (rejected - 1) == 0:
            _log.warning("telemetry: rejected record (%d so far): %s", rejected, error)

    def _note_dropped(self, dropped: int) -> None:
        """Log the 1st, 2nd, 4th, 8th... record dropped from the full queue (called locked)."""
        if dropped & (dropped - 1) == 0:
            _log.warning(
                "telemetry: queue full (%d records unacknowledged by %s): dropped the oldest "
                "record (%d so far); later records carry the count",
                len(self._steps.items) + len(self._events.items),
                self._address,
                self._steps.dropped + self._events.dropped,
            )

    def _note_delivered(self) -> None:
        with self._cond:
            recovered = self._unreachable
            self._unreachable = False
            self._last_error = None
        if recovered:
            _log.info("telemetry: reports to %s get through again", self._address)


def _send_timeout(records: int) -> float:
    return _SEND_TIMEOUT_S + records * _SEND_TIMEOUT_PER_RECORD_S


def rank_step(
    run_id: str,
    step: int,
    rank: int,
    *,
    loss: float = math.nan,
    grad_norm: float = 0.0,
    tokens: int = 0,
    lr: float = 0.0,
    times: Mapping[str, float] | None = None,
    offset: tuple[int, int, int] | None = None,
    memory_bytes: int = 0,
    peak_memory_bytes: int = 0,
    param_checksum: str = "",
    attempt: int = 0,
    dropped_records: int = 0,
) -> telemetry_pb2.RankStep:
    """A step record in one call, stamped with the current time.

    The loss defaults to NaN, "not measured" (say, on a pipeline stage without the loss), which
    the queries leave out of means; 0.0 would read as a real loss.

    `times` maps phase names of PhaseTimes ("step", "forward", "comm_wait", ...) to seconds;
    `offset` is (global_sample, rank_sample, epoch) where the next step starts.
    """
    record = telemetry_pb2.RankStep(
        run_id=run_id,
        step=step,
        rank=rank,
        loss=loss,
        grad_norm=grad_norm,
        tokens=tokens,
        lr=lr,
        times=telemetry_pb2.PhaseTimes(**(times or {})),
        memory_bytes=memory_bytes,
        peak_memory_bytes=peak_memory_bytes,
        param_checksum=param_checksum,
        attempt=attempt,
        dropped_records=dropped_records,
    )
    if offset is not None:
        global_sample, rank_sample, epoch = offset
        record.data_offset.CopyFrom(
            telemetry_pb2.DataLoaderOffset(
                global_sample=global_sample, rank_sample=rank_sample, epoch=epoch
            )
        )
    record.time.FromDatetime(_now())
    return record


def event(
    run_id: str,
    kind: str | int,
    *,
    step: int = 0,
    rank: int = -1,
    message: str = "",
    attributes: Mapping[str, str] | None = None,
    tier: str | int | None = None,
    bytes: int = 0,
    seconds: float = 0.0,
    node: str = "",
    replica_of: str = "",
) -> telemetry_pb2.Event:
    """An event stamped with the current time; `kind` as "checkpoint_committed" or an EventKind.

    Giving `tier` ("memory", "ssd", "s3" or a Tier), `bytes`, `seconds` or `node` (the node whose
    copy it is; with `replica_of`, a copy of that node's part) makes it a checkpoint event;
    without a tier it describes the save as the trainer saw it.
    """
    if isinstance(kind, str):
        kind = telemetry_pb2.EventKind.Value(f"EVENT_KIND_{kind.upper()}")
    result = telemetry_pb2.Event(
        run_id=run_id,
        step=step,
        rank=rank,
        kind=kind,
        message=message,
        attributes=dict(attributes or {}),
    )
    if tier is not None or bytes or seconds or node:
        if isinstance(tier, str):
            tier = common_pb2.Tier.Value(f"TIER_{tier.upper()}")
        result.checkpoint.CopyFrom(
            telemetry_pb2.CheckpointEvent(
                tier=tier or common_pb2.TIER_UNSPECIFIED,
                bytes=bytes,
                seconds=seconds,
                node=node,
                replica_of=replica_of,
            )
        )
    result.time.FromDatetime(_now())
    return result


def _now() -> datetime:
    return datetime.now(UTC)
