"""Cordoning a machine whose ranks keep failing: the policy both observers share, the failures a
pod's keepers record for its agent, and the node marked unschedulable through the Kubernetes API
(a fake API server here: the cluster itself is not available to tests)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from scaletrain.cordon import (
    FAILURES_ENV,
    QUARANTINE_LINE,
    QUARANTINED,
    FailureStreak,
    FailureWatch,
    KubeNode,
    cordon_node,
    quarantine_line,
    record_failure,
)


def test_failures_each_within_ten_steps_of_the_last_make_one_streak():
    streak = FailureStreak()
    assert [streak.add(step) for step in (40, 41, 50)] == [1, 2, 3]


def test_a_failure_far_from_the_last_starts_a_new_streak():
    streak = FailureStreak(within_steps=10)
    assert [streak.add(step) for step in (10, 30, 35, 90)] == [1, 1, 2, 1]


def _watching(path: Path, after: int) -> tuple[list[str], threading.Event, FailureWatch]:
    cordoned: list[str] = []
    done = threading.Event()
    watch = FailureWatch(path, after, lambda why: (cordoned.append(why), done.set()))
    watch.start()
    return cordoned, done, watch


def test_the_agent_cordons_once_its_keepers_record_enough_failures_in_a_row(tmp_path, monkeypatch):
    path = tmp_path / "agent" / "failures"
    cordoned, done, watch = _watching(path, 3)
    monkeypatch.setenv(FAILURES_ENV, str(path))
    record_failure(2, 10, "was killed by SIGKILL")
    record_failure(3, 60, "exited 75")  # a new streak: 50 steps later
    record_failure(2, 61, "was killed by SIGKILL")
    time.sleep(0.5)
    assert cordoned == []
    record_failure(2, 62, "was killed by SIGSEGV")
    assert done.wait(5)
    assert cordoned == [
        "its ranks failed 3 times in a row (the last: rank 2 after step 62: was killed by SIGSEGV)"
    ]
    watch.stop()


def test_the_agent_cordons_a_machine_whose_rank_was_quarantined_at_once(tmp_path, monkeypatch):
    path = tmp_path / "agent" / "failures"
    cordoned, done, watch = _watching(path, 3)
    monkeypatch.setenv(FAILURES_ENV, str(path))
    record_failure(1, 14, f"{QUARANTINED}: named by the silent-data-corruption checks 2 times")
    assert done.wait(5)
    assert cordoned == [
        f"rank 1 after step 14: {QUARANTINED}: named by the silent-data-corruption checks 2 times"
    ]
    watch.stop()


def test_the_quarantine_line_names_the_rank_its_machine_and_the_action():
    line = quarantine_line(3, "node1", [12, 14], "cordon")
    found = QUARANTINE_LINE.match(line)
    assert found is not None and found.groups() == ("3", "node1", "cordon"), line
    assert "steps 12, 14" in line
    found = QUARANTINE_LINE.match(quarantine_line(0, "", [5, 9], "alert"))
    assert found is not None and found.groups() == ("0", "host unknown", "alert")


def test_a_keeper_without_an_agent_watching_records_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv(FAILURES_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    record_failure(0, 5, "was killed by SIGKILL")
    assert list(tmp_path.iterdir()) == []


class _FakeApiServer(BaseHTTPRequestHandler):
    """The part of the Kubernetes API a cordon uses: PATCH /api/v1/nodes/NAME."""

    patches: list[tuple[str, dict[str, str], dict]] = []
    status = 200

    def do_PATCH(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.patches.append((self.path, dict(self.headers), body))
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *_args: object) -> None:
        pass


@pytest.fixture
def api_server():
    _FakeApiServer.patches, _FakeApiServer.status = [], 200
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeApiServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", _FakeApiServer
    server.shutdown()


def test_cordoning_marks_the_pods_node_unschedulable_with_its_token(api_server):
    url, handler = api_server
    said = cordon_node(KubeNode(url, "gpu-node-7", "token-1", None))
    assert said.startswith("Kubernetes node gpu-node-7 marked unschedulable")
    ((path, headers, body),) = handler.patches
    assert path == "/api/v1/nodes/gpu-node-7"
    assert headers["Authorization"] == "Bearer token-1"
    assert headers["Content-Type"] == "application/strategic-merge-patch+json"
    assert body == {"spec": {"unschedulable": True}}


def test_a_refused_cordon_is_said_in_one_line_and_the_pod_still_leaves(api_server):
    url, handler = api_server
    handler.status = 403
    said = cordon_node(KubeNode(url, "gpu-node-7", "token-1", None))
    assert said.startswith("Kubernetes node gpu-node-7 could not be marked unschedulable: ")
    assert "403" in said and "\n" not in said


def test_outside_kubernetes_no_node_is_marked(monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert KubeNode.in_cluster() is None
    assert cordon_node(None).startswith("not on Kubernetes")


def test_a_pod_finds_its_node_and_credentials_in_the_cluster(tmp_path: Path, monkeypatch):
    import scaletrain.cordon as cordon

    (tmp_path / "token").write_text("token-2\n")
    monkeypatch.setattr(cordon, "SERVICE_ACCOUNT", tmp_path)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "6443")
    monkeypatch.setenv("NODE_NAME", "gpu-node-3")
    monkeypatch.setattr(cordon.ssl, "create_default_context", lambda cafile: cafile)
    node = KubeNode.in_cluster()
    assert node is not None
    assert (node.api, node.node) == ("https://[fd00::1]:6443", "gpu-node-3")
    assert node._token == "token-2" and node._context == str(tmp_path / "ca.crt")
