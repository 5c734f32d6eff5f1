"""What an operator sees: Prometheus metrics over HTTP, gRPC health, JSON log lines."""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import urllib.request
from collections.abc import Callable

from ckptd_testing import SHARD, checkpoint_files, payload

from ckptd.client import CkptdClient
from ckptd.logs import JsonFormatter
from ckptd.server import SERVICE_NAME, RunningCkptd
from scaletrain.errors import FailedPrecondition, InvalidArgument
from scaletrain.transport import wait_until_healthy

RunCkptd = Callable[..., RunningCkptd]


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text format (0 if absent)."""
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        series, _, value = line.rpartition(" ")
        if series == (f"{name}{{{wanted}}}" if labels else name):
            return float(value)
    return 0.0


def test_metrics_count_bytes_seconds_failures_and_the_queue_per_tier_and_health_serves(
    run_ckptd: RunCkptd,
) -> None:
    running = run_ckptd(metrics_listen="127.0.0.1:0")
    wait_until_healthy(running.address, timeout_s=10, service=SERVICE_NAME)
    files = checkpoint_files(world_size=1, shard_bytes=1 << 20)
    with CkptdClient(running.address) as client:
        save_id = client.open_save("run", 1, world_size=1).save_id
        for path, (rank, kind, data) in files.items():
            client.write_file(save_id, path, rank, kind, data)
        client.commit(save_id)
        client.read("run", 1, "__0_0.distcp")
        with contextlib.suppress(FailedPrecondition):  # the save is committed
            client.write_file(save_id, "__0_1.distcp", 0, SHARD, payload(10, 0))
    url = f"http://127.0.0.1:{running.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    total = sum(len(data) for _, _, data in files.values())
    assert metric(text, "ckptd_tier_bytes_total", tier="SSD", op="write") == total
    assert metric(text, "ckptd_tier_bytes_total", tier="memory", op="read") > 0
    assert metric(text, "ckptd_tier_seconds_count", tier="SSD", op="commit") == 1
    assert metric(text, "ckptd_commits_total", tier="memory") == 1
    assert "ckptd_s3_queue_depth 0.0" in text
    assert "ckptd_failures_total" in text
    assert metric(text, "ckptd_memory_used_bytes") == total


def test_log_lines_are_json_objects_carrying_their_fields() -> None:
    record = logging.LogRecord(
        "ckptd.store", logging.INFO, __file__, 1, "committed %s", ("r/1",), None
    )
    record.run, record.bytes = "r", 123
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "committed r/1" and line["level"] == "INFO"
    assert (line["run"], line["bytes"]) == ("r", 123)
    try:
        raise InvalidArgument("bad")
    except InvalidArgument:
        record.exc_info = sys.exc_info()
    assert "InvalidArgument: bad" in json.loads(JsonFormatter().format(record))["exception"]
