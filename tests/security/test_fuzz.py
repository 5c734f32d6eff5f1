"""A property-based fuzzer (Hypothesis) against every RPC of ckptd and telemetry, over real gRPC.

Each case sends one hostile call: random bytes as the serialized request, a valid message cut
short or with flipped bytes, or a well-formed message with hostile fields (names from random text
and path traversal attempts, huge or negative numbers, unknown enum values, columns of unequal
length, WriteFile parts in any order). Every case must be answered within its deadline with a
status, never UNKNOWN (an exception the service did not expect); a refused case must carry an
error status. The services must stay up, nothing may appear outside the store, and every
checkpoint and telemetry record committed before the fuzzing must be intact and verifiable
afterwards.

Cases per test: SCALETRAIN_FUZZ_EXAMPLES (default 60; six tests). The status codes seen are
printed at the end of the module (`pytest -s`) and written as JSON to SCALETRAIN_FUZZ_REPORT
when set.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import google_crc32c
import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from security_testing import (
    METADATA,
    SHARD,
    Services,
    running_services,
    save_checkpoint,
    step_record,
)

from ckptd.manifest import data_crc32c
from scaletrain.security import ClientSecurity
from scaletrain.transport import make_channel, wait_until_healthy
from scaletrain.v1 import checkpoint_pb2, common_pb2, telemetry_pb2

EXAMPLES = int(os.environ.get("SCALETRAIN_FUZZ_EXAMPLES", "60"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
CALL_TIMEOUT_S = 10.0
BASELINE = "baseline-run"
FUZZ_RUN = "fuzz-run"
CKPT = "/scaletrain.v1.CheckpointService/"
TEL = "/scaletrain.v1.TelemetryService/"
CKPT_METHODS = {
    "OpenSave": (False, False, checkpoint_pb2.OpenSaveRequest),
    "WriteFile": (True, False, checkpoint_pb2.WriteFileRequest),
    "CommitSave": (False, False, checkpoint_pb2.CommitSaveRequest),
    "AbortSave": (False, False, checkpoint_pb2.AbortSaveRequest),
    "ListCheckpoints": (False, False, checkpoint_pb2.ListCheckpointsRequest),
    "GetCheckpoint": (False, False, checkpoint_pb2.GetCheckpointRequest),
    "ReadFile": (False, True, checkpoint_pb2.ReadFileRequest),
    "DeleteCheckpoint": (False, False, checkpoint_pb2.DeleteCheckpointRequest),
}
TEL_METHODS = {
    "RegisterRun": (False, False, telemetry_pb2.RegisterRunRequest),
    "ReportSteps": (True, False, telemetry_pb2.StepBatch),
    "ReportEvents": (False, False, telemetry_pb2.EventBatch),
    "GetResumePoint": (False, False, telemetry_pb2.GetResumePointRequest),
}
METHODS = {CKPT + m: spec for m, spec in CKPT_METHODS.items()} | {
    TEL + m: spec for m, spec in TEL_METHODS.items()
}

# -- strategies ------------------------------------------------------------------------------------

TRAVERSALS = [
    "..", "../..", "../../etc/passwd", "/etc/passwd", "a/../../b", ".", "", "x\x00y",
    "..\\..\\windows", "%2e%2e/escaped", "ssd/../../outside", "~", "a/./b", "a//b", " ",
    "../" * 40 + "deep", "canary/../../canary", "C:\\canary", "\u202e..", "a/" * 600,
]  # fmt: skip
VALID_NAME = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:+=@-]{0,20}", fullmatch=True)
NAMES = st.one_of(
    st.sampled_from(TRAVERSALS),
    VALID_NAME,
    st.text(max_size=64),
    st.text(min_size=200, max_size=2000),
).filter(lambda name: name != BASELINE)
PATHS = st.one_of(
    st.sampled_from(TRAVERSALS),
    st.sampled_from(["__0_0.distcp", ".metadata", "_COMMITTED", "_COMMITTED.tmp", "x/y.distcp"]),
    st.text(max_size=64),
)
INTS64 = st.one_of(
    st.integers(-3, 3), st.integers(-(2**63), 2**63 - 1), st.sampled_from([2**31 - 1, 2**62])
)
INTS32 = st.one_of(st.integers(-3, 5), st.integers(-(2**31), 2**31 - 1))
FLOATS = st.floats(allow_nan=True, allow_infinity=True)
TOKENS = st.sampled_from(["admin", "admin", "admin", "fuzz", "reader", "none", "unknown"])


@dataclass
class Fuzzed:
    """The services under fuzzing, their tokens, and what was committed before."""

    services: Services
    tokens: dict[str, str | None]
    checkpoints: dict[tuple[int, str], int]  # (step, path) -> the file's checksum
    telemetry_rows: tuple
    outside: Path
    codes: Counter[str]

    def call(self, token: str, method: str, payload: bytes | list[bytes]) -> grpc.StatusCode:
        """Send serialized request(s) to `method` with the named token; its status code."""
        address = self.services.ckptd if method.startswith(CKPT) else self.services.telemetry
        request_streaming, response_streaming, _ = METHODS[method]
        security = ClientSecurity(token=self.tokens[token])
        with make_channel(address.address, security) as channel:
            if request_streaming:
                rpc: Callable = channel.stream_unary(method)
                requests = payload if isinstance(payload, list) else [payload]
                call = lambda: rpc(iter(requests), timeout=CALL_TIMEOUT_S)  # noqa: E731
            elif response_streaming:
                rpc = channel.unary_stream(method)
                call = lambda: list(rpc(payload, timeout=CALL_TIMEOUT_S))  # noqa: E731
            else:
                rpc = channel.unary_unary(method)
                call = lambda: rpc(payload, timeout=CALL_TIMEOUT_S)  # noqa: E731
            try:
                call()
                code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                code = exc.code()
                # UNKNOWN: an exception the service did not expect; INTERNAL: one in gRPC's
                # handling (a message that did not parse must be INVALID_ARGUMENT instead).
                assert code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), (
                    f"{method}: {code.name}: {exc.details()}"
                )
                assert code != grpc.StatusCode.DEADLINE_EXCEEDED, f"{method} hung"
        self.codes[code.name] += 1
        return code

    def verify(self) -> None:
        """Both services answer, and everything committed before the fuzzing reads back intact."""
        for running in (self.services.ckptd, self.services.telemetry):
            wait_until_healthy(running.address, timeout_s=5, security=ClientSecurity())
        with self.services.ckptd_client(self.services.tokens.reader) as reader:
            listed = {
                (c.ref.step, f.path): f.crc32c for c in reader.list(BASELINE) for f in c.files
            }
            assert listed == self.checkpoints
            for (step, path), checksum in self.checkpoints.items():
                assert data_crc32c(reader.read(BASELINE, step, path)) == checksum
        assert _baseline_rows(self.services) == self.telemetry_rows
        assert not any(self.outside.iterdir()), "something was written outside the store"
        assert sorted(p.name for p in self.services.tokens.path.parent.iterdir()) == [
            "canary", "ckptd", "telemetry.db", "telemetry.db-shm", "telemetry.db-wal",
            "tokens.json",
        ]  # fmt: skip


def _baseline_rows(services: Services) -> tuple:
    _infos, _files, rows = services.snapshot()
    return tuple(tuple(row for row in table if BASELINE in row) for table in rows)


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fuzzed]:
    root = tmp_path_factory.mktemp("fuzz")
    outside = root / "canary"  # a directory beside the store that must stay empty
    outside.mkdir()
    with running_services(
        root, trainers_of=(FUZZ_RUN, BASELINE), max_checkpoint_bytes=8 << 20
    ) as services:
        fuzz_token, baseline = services.trainers[FUZZ_RUN], services.trainers[BASELINE]
        with services.ckptd_client(baseline) as client:
            for step in (1, 2, 3):
                save_checkpoint(client, BASELINE, step, size=300_000 + step)
        with services.telemetry_stub(baseline) as stub:
            stub.RegisterRun(telemetry_pb2.RegisterRunRequest(run_id=BASELINE, world_size=2))
            records = [step_record(BASELINE, s, r) for s in range(1, 6) for r in range(2)]
            stub.ReportSteps(iter([telemetry_pb2.StepBatch(records=records)]))
            event = telemetry_pb2.Event(
                run_id=BASELINE, step=3, kind=telemetry_pb2.EVENT_KIND_CHECKPOINT_COMMITTED
            )
            stub.ReportEvents(telemetry_pb2.EventBatch(events=[event]))
        with services.ckptd_client(services.tokens.reader) as reader:
            checkpoints = {
                (c.ref.step, f.path): f.crc32c for c in reader.list(BASELINE) for f in c.files
            }
        assert len(checkpoints) == 6
        tokens = {
            "admin": services.tokens.admin,
            "fuzz": fuzz_token,
            "reader": services.tokens.reader,
            "none": None,
            "unknown": "a-token-nobody-minted",
        }
        state = Fuzzed(services, tokens, checkpoints, _baseline_rows(services), outside, Counter())
        state.verify()
        yield state
        total = sum(state.codes.values())
        report = {"cases": total, "examples_per_test": EXAMPLES, "codes": dict(state.codes)}
        print(f"\nfuzz: {json.dumps(report)}")
        if os.environ.get("SCALETRAIN_FUZZ_REPORT"):
            Path(os.environ["SCALETRAIN_FUZZ_REPORT"]).write_text(json.dumps(report, indent=1))


# -- the fuzz tests --------------------------------------------------------------------------------


def test_random_bytes_sent_to_every_method_are_answered_with_an_error_status(fuzzed: Fuzzed):
    @FUZZ
    @given(
        token=TOKENS,
        method=st.sampled_from(sorted(METHODS)),
        payloads=st.lists(st.binary(max_size=512), min_size=1, max_size=4),
    )
    def case(token: str, method: str, payloads: list[bytes]) -> None:
        fuzzed.call(token, method, payloads if METHODS[method][0] else payloads[0])

    case()
    fuzzed.verify()


@st.composite
def checkpoint_requests(draw: st.DrawFn) -> tuple[str, bytes]:
    """A well-formed request of a unary ckptd method with hostile fields."""
    ref = checkpoint_pb2.CheckpointRef(run=draw(NAMES), step=draw(INTS64))
    method = draw(st.sampled_from(["OpenSave", "CommitSave", "AbortSave", "ListCheckpoints",
                                   "GetCheckpoint", "ReadFile", "DeleteCheckpoint"]))  # fmt: skip
    save_id = draw(st.one_of(st.text(max_size=40), st.uuids().map(lambda u: u.hex)))
    message = {
        "OpenSave": lambda: checkpoint_pb2.OpenSaveRequest(
            ref=ref,
            world_size=draw(INTS32),
            labels=draw(st.dictionaries(st.text(max_size=20), st.text(max_size=50), max_size=5)),
            retention=checkpoint_pb2.RetentionPolicy(
                memory_last=draw(INTS32), ssd_last=draw(INTS32), s3_every=draw(INTS32)
            ),
        ),
        "CommitSave": lambda: checkpoint_pb2.CommitSaveRequest(save_id=save_id),
        "AbortSave": lambda: checkpoint_pb2.AbortSaveRequest(
            save_id=save_id, reason=draw(st.text(max_size=100))
        ),
        "ListCheckpoints": lambda: checkpoint_pb2.ListCheckpointsRequest(
            run=draw(NAMES), include_uncommitted=draw(st.booleans())
        ),
        "GetCheckpoint": lambda: checkpoint_pb2.GetCheckpointRequest(
            ref=ref, latest=draw(st.booleans())
        ),
        "ReadFile": lambda: checkpoint_pb2.ReadFileRequest(
            ref=draw(
                st.one_of(
                    st.just(ref),
                    st.builds(
                        checkpoint_pb2.CheckpointRef, run=st.just(BASELINE), step=st.integers(0, 4)
                    ),
                )
            ),
            path=draw(PATHS),
            offset=draw(INTS64),
            length=draw(INTS64),
            tier=draw(st.integers(-5, 10)),
        ),
        "DeleteCheckpoint": lambda: checkpoint_pb2.DeleteCheckpointRequest(ref=ref),
    }[method]()
    return method, draw(_damaged(message.SerializeToString()))


def _damaged(raw: bytes) -> st.SearchStrategy[bytes]:
    """The serialized message as it is, cut short, or with a few bytes changed."""
    if not raw:
        return st.just(raw)
    cut = st.integers(0, len(raw) - 1).map(lambda n: raw[:n])
    flipped = st.lists(
        st.tuples(st.integers(0, len(raw) - 1), st.integers(0, 255)), min_size=1, max_size=4
    ).map(lambda edits: _edit(raw, edits))
    return st.one_of(st.just(raw), st.just(raw), cut, flipped)


def _edit(raw: bytes, edits: list[tuple[int, int]]) -> bytes:
    out = bytearray(raw)
    for at, value in edits:
        out[at] = value
    return bytes(out)


def test_hostile_unary_checkpoint_requests_leave_committed_checkpoints_intact(fuzzed: Fuzzed):
    @FUZZ
    @given(token=TOKENS, request=checkpoint_requests())
    def case(token: str, request: tuple[str, bytes]) -> None:
        method, payload = request
        fuzzed.call(token, CKPT + method, payload)

    case()
    fuzzed.verify()


@st.composite
def write_streams(draw: st.DrawFn) -> list[bytes]:
    """A WriteFile stream: headers, chunks and trailers in any order, with hostile fields."""
    data = draw(st.binary(max_size=2048))
    good_crc = google_crc32c.value(data)
    parts = st.one_of(
        st.builds(
            lambda save_id, path, rank, kind: checkpoint_pb2.WriteFileRequest(
                header=checkpoint_pb2.FileHeader(save_id=save_id, path=path, rank=rank, kind=kind)
            ),
            st.sampled_from(draw(st.just(OPEN_SAVES)) or [""]) | st.text(max_size=40),
            PATHS,
            INTS32,
            st.sampled_from([SHARD, METADATA, 0, 7, -1]),
        ),
        st.builds(
            lambda offset, crc: checkpoint_pb2.WriteFileRequest(
                chunk=checkpoint_pb2.FileChunk(offset=offset, data=data, crc32c=crc)
            ),
            st.one_of(st.just(0), INTS64),
            st.one_of(st.just(good_crc), st.integers(0, 2**32 - 1)),
        ),
        st.builds(
            lambda size, checksum: checkpoint_pb2.WriteFileRequest(
                trailer=checkpoint_pb2.FileTrailer(size=size, crc32c=checksum)
            ),
            st.one_of(st.just(len(data)), INTS64),
            st.one_of(st.just(data_crc32c(data)), st.integers(0, 2**32 - 1)),
        ),
        st.just(checkpoint_pb2.WriteFileRequest()),
    )
    messages = draw(st.lists(parts, min_size=0, max_size=6))
    raw = [m.SerializeToString() for m in messages]
    if raw and draw(st.booleans()):
        at = draw(st.integers(0, len(raw) - 1))
        raw[at] = draw(_damaged(raw[at]))
    return raw


# Save ids of saves the fuzzer opened on its own run, so WriteFile streams can name real ones.
OPEN_SAVES: list[str] = []


def test_hostile_write_streams_in_any_order_store_nothing_outside_their_save(fuzzed: Fuzzed):
    with fuzzed.services.ckptd_client(fuzzed.tokens["fuzz"]) as client:
        OPEN_SAVES[:] = [client.open_save(FUZZ_RUN, step, 2).save_id for step in (1, 2)]

    @FUZZ
    @given(token=TOKENS, stream=write_streams())
    def case(token: str, stream: list[bytes]) -> None:
        fuzzed.call(token, CKPT + "WriteFile", stream)

    case()
    fuzzed.verify()


@st.composite
def telemetry_requests(draw: st.DrawFn) -> tuple[str, bytes | list[bytes]]:
    """A well-formed telemetry request with hostile fields (or a stream of batches)."""
    method = draw(st.sampled_from(sorted(TEL_METHODS)))
    run = draw(st.one_of(st.just(FUZZ_RUN), NAMES))
    if method == "RegisterRun":
        message = telemetry_pb2.RegisterRunRequest(
            run_id=run,
            name=draw(st.text(max_size=100)),
            config_json=draw(st.one_of(st.text(max_size=200), st.just('{"a": [1, 2]}'))),
            world_size=draw(INTS32),
            layout=common_pb2.ParallelLayout(
                dp_replicate=draw(INTS32), dp_shard=draw(INTS32), tp=draw(INTS32)
            ),
            model_params=draw(INTS64),
            precision=draw(st.one_of(st.sampled_from(["bf16", "fp8"]), st.text(max_size=10))),
            peak_flops=draw(FLOATS),
            recompute_fraction=draw(FLOATS),
            ranks=[telemetry_pb2.RankInfo(rank=draw(INTS32), host=draw(st.text(max_size=20)))],
        )
        return method, draw(_damaged(message.SerializeToString()))
    if method == "ReportEvents":
        events = draw(
            st.lists(
                st.builds(
                    telemetry_pb2.Event,
                    run_id=st.one_of(st.just(run), NAMES),
                    step=INTS64,
                    rank=INTS32,
                    kind=st.integers(-2, 40),
                    message=st.text(max_size=100),
                    attributes=st.dictionaries(st.text(max_size=10), st.text(max_size=30)),
                ),
                max_size=4,
            )
        )
        message = telemetry_pb2.EventBatch(events=events)
        return method, draw(_damaged(message.SerializeToString()))
    if method == "GetResumePoint":
        request = telemetry_pb2.GetResumePointRequest(run_id=run)
        if draw(st.booleans()):
            request.step = draw(INTS64)
        return method, draw(_damaged(request.SerializeToString()))
    batches = []
    for _ in range(draw(st.integers(0, 3))):
        batch = telemetry_pb2.StepBatch(
            records=[
                telemetry_pb2.RankStep(
                    run_id=run,
                    step=draw(INTS64),
                    rank=draw(INTS32),
                    loss=draw(FLOATS),
                    tokens=draw(INTS64),
                    attempt=draw(INTS32),
                )
                for _ in range(draw(st.integers(0, 3)))
            ]
        )
        if draw(st.booleans()):
            # Columns of unequal length, as a broken client would send them.
            columns = batch.columns
            columns.run_id.extend([run] * draw(st.integers(0, 3)))
            columns.step.extend(draw(st.lists(INTS64, max_size=3)))
            columns.rank.extend(draw(st.lists(INTS32, max_size=3)))
            columns.loss.extend(draw(st.lists(FLOATS, max_size=3)))
            columns.time_nanos.extend(draw(st.lists(INTS32, max_size=3)))
        batches.append(draw(_damaged(batch.SerializeToString())))
    return method, batches


def test_hostile_telemetry_requests_leave_recorded_runs_intact(fuzzed: Fuzzed):
    with fuzzed.services.telemetry_stub(fuzzed.tokens["fuzz"]) as stub:
        stub.RegisterRun(telemetry_pb2.RegisterRunRequest(run_id=FUZZ_RUN, world_size=4))

    @FUZZ
    @given(token=TOKENS, request=telemetry_requests())
    def case(token: str, request: tuple[str, bytes | list[bytes]]) -> None:
        method, payload = request
        fuzzed.call(token, TEL + method, payload)

    case()
    fuzzed.verify()


def test_oversized_messages_are_refused_and_the_service_stays_up(fuzzed: Fuzzed):
    @settings(FUZZ, max_examples=max(3, EXAMPLES // 20))
    @given(
        method=st.sampled_from(sorted(METHODS)),
        extra=st.integers(1, 1 << 20),
        token=TOKENS,
    )
    def case(method: str, extra: int, token: str) -> None:
        # Over the 16 MiB message limit: refused by gRPC before any service code runs.
        payload = b"\x0a" + b"\xff" * 3 + b"\x07" + b"x" * ((16 << 20) + extra)
        code = fuzzed.call(token, method, payload)
        refused = {grpc.StatusCode.RESOURCE_EXHAUSTED}
        if METHODS[method][0] and token in ("none", "unknown"):
            # A client stream without a good token may be refused before its message arrives.
            refused.add(grpc.StatusCode.UNAUTHENTICATED)
        assert code in refused

    case()
    fuzzed.verify()


def _escapes(path: str) -> bool:
    """Whether a path would leave its directory if joined as it is (or is no name at all)."""
    parts = path.replace("\\", "/").split("/")
    return path.startswith("/") or "\x00" in path or any(p in ("", ".", "..") for p in parts)


@pytest.mark.parametrize("run", TRAVERSALS)
def test_path_traversal_in_run_and_file_names_is_refused_and_touches_nothing_outside(
    fuzzed: Fuzzed, run: str
):
    with fuzzed.services.ckptd_client(fuzzed.tokens["admin"]) as admin:
        ref = checkpoint_pb2.CheckpointRef(run=run, step=1)
        open_code = fuzzed.call(
            "admin",
            CKPT + "OpenSave",
            checkpoint_pb2.OpenSaveRequest(ref=ref, world_size=1).SerializeToString(),
        )
        assert open_code == grpc.StatusCode.INVALID_ARGUMENT
        save_id = admin.open_save(FUZZ_RUN, 100, 1).save_id
        header = checkpoint_pb2.FileHeader(save_id=save_id, path=run, rank=0, kind=SHARD)
        stream = [
            checkpoint_pb2.WriteFileRequest(header=header).SerializeToString(),
            checkpoint_pb2.WriteFileRequest(
                chunk=checkpoint_pb2.FileChunk(data=b"pwned", crc32c=google_crc32c.value(b"pwned"))
            ).SerializeToString(),
            checkpoint_pb2.WriteFileRequest(
                trailer=checkpoint_pb2.FileTrailer(size=5, crc32c=data_crc32c(b"pwned"))
            ).SerializeToString(),
        ]
        code = fuzzed.call("admin", CKPT + "WriteFile", stream)
        if _escapes(run):
            assert code == grpc.StatusCode.INVALID_ARGUMENT
        else:  # a literal odd name ("%2e%2e", "~") is a file inside the checkpoint
            assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT)
        admin.abort(save_id)
        for request in (
            checkpoint_pb2.ReadFileRequest(
                ref=checkpoint_pb2.CheckpointRef(run=BASELINE, step=1), path=run
            ),
            checkpoint_pb2.ReadFileRequest(ref=ref, path="__0_0.distcp"),
        ):
            code = fuzzed.call("admin", CKPT + "ReadFile", request.SerializeToString())
            assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
        delete = checkpoint_pb2.DeleteCheckpointRequest(ref=ref).SerializeToString()
        assert fuzzed.call("admin", CKPT + "DeleteCheckpoint", delete) == (
            grpc.StatusCode.INVALID_ARGUMENT
        )
    fuzzed.verify()
