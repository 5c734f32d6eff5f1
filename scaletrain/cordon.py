"""Cordoning a machine whose ranks keep failing: the one policy, and what a machine does about it.

A rank that fails again and again on the same machine (a bad GPU, flaky memory, a broken NIC)
costs the job an in-job restart each time. After `CORDON_AFTER` failures in a row the machine is
taken out: a waiting hot spare takes its place and the machine is not used again. Failures count
"in a row" only when each comes within `CORDON_WITHIN_STEPS` steps of the one before: independent
faults spread over a run are not the machine's fault, and the count starts again.

Two observers apply the policy (`FailureStreak`):
- the embedded stack (`scaletrain.app.stack.Job`), from rank 0's keeper's lines, stops the
  machine's agent for good once a spare waits to take its place;
- on a cluster (the Helm chart's pods) every keeper appends its own rank's failures to a file of
  its machine (`FAILURES_ENV`, `record_failure`), and the machine's agent (`scaletrain.app.agent
  --cordon-after N`) reads them (`FailureWatch`): once due, it marks its Kubernetes node
  unschedulable (`KubeNode`, where the pod may), stops its ranks and exits `CORDONED_EXIT_CODE`,
  so that a spare takes its place in the next rendezvous round and the pod's replacement is
  scheduled on another node.

A machine whose rank the silent-data-corruption checks keep naming is quarantined
(`trainer.health.quarantine`): cordoned at once, not after a streak. The rank says so in the
`quarantine_line` rank 0 prints (the embedded stack reads it) and records a `QUARANTINED` failure
in its machine's file (the agent reads it).
"""

from __future__ import annotations

import json
import os
import re
import ssl
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# A machine whose ranks failed this many times in a row is cordoned (0: never).
CORDON_AFTER = 3
# A machine's ranks failing again within this many steps of their last failure keep failing (the
# count goes on); failures further apart are faults of their own.
CORDON_WITHIN_STEPS = 10
# What a machine's agent exits with once it cordoned its machine (the Helm chart's
# podFailurePolicy ignores it: the machine failed, not the job).
CORDONED_EXIT_CODE = 72
# The file a machine's keepers append their ranks' failures to, set by its agent.
FAILURES_ENV = "SCALETRAIN_FAILURES_FILE"
# The Kubernetes node a pod runs on (the downward API's spec.nodeName).
NODE_NAME_ENV = "NODE_NAME"
# A pod's in-cluster credentials.
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
# How often an agent reads its machine's failures.
WATCH_POLL_S = 0.2
# The cause of a failure record that cordons its machine at once: a quarantined rank's.
QUARANTINED = "quarantined"
# Rank 0's line when the silent-data-corruption checks named a rank too often; "cordon" ends it
# when the rank's machine is to be taken out (--quarantine cordon).
QUARANTINE_LINE = re.compile(r"\[trainer\] quarantine: rank (\d+) \(([^)]*)\) .*; (cordon|alert)")


def quarantine_line(rank: int, host: str, steps: list[int], action: str) -> str:
    """Rank 0's line about rank `rank` (on machine `host`) named by the silent-data-corruption
    checks at `steps`; `action` "cordon" or "alert" (QUARANTINE_LINE reads it)."""
    said = {
        "cordon": "cordon its machine: a waiting spare takes its place",
        "alert": "alert only (--quarantine alert): it stays in the job",
    }[action]
    return (
        f"[trainer] quarantine: rank {rank} ({host or 'host unknown'}) named by the "
        f"silent-data-corruption checks {len(steps)} times (steps "
        f"{', '.join(map(str, steps))}); {action}: {said}"
    )


class FailureStreak:
    """How many times in a row one machine's ranks failed: each failure within `within_steps`
    steps of the one before continues the streak; one further apart starts a new one."""

    def __init__(self, within_steps: int = CORDON_WITHIN_STEPS) -> None:
        self._within, self._count, self._last = within_steps, 0, None

    def add(self, step: int) -> int:
        """A failure after `step`; returns the length of the streak it belongs to."""
        again = self._last is not None and step - self._last <= self._within
        self._count = self._count + 1 if again else 1
        self._last = step
        return self._count


def record_failure(rank: int, step: int, cause: str) -> None:
    """Append rank `rank`'s failure after `step` to its machine's failures file, where its agent
    reads it (nothing when no agent watches: `FAILURES_ENV` unset). One short line, one write:
    the machine's keepers append to it side by side."""
    path = os.environ.get(FAILURES_ENV)
    if not path:
        return
    line = json.dumps({"rank": rank, "step": step, "cause": cause[:200]}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Failure:
    rank: int
    step: int
    cause: str


class FailureWatch:
    """An agent's thread that reads its machine's failures file and calls `on_cordon(why)` once
    the streak reaches `after`, or at once for a quarantined rank (`QUARANTINED`); the file is
    made empty first (an agent's earlier run left nothing)."""

    def __init__(self, path: Path, after: int, on_cordon: Callable[[str], None]) -> None:
        self.path, self._after, self._on_cordon = path, after, on_cordon
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cordon-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        streak, offset = FailureStreak(), 0
        while not self._stop.wait(WATCH_POLL_S):
            with self.path.open("rb") as f:
                f.seek(offset)
                data = f.read()
            complete = data[: data.rfind(b"\n") + 1]
            offset += len(complete)
            for line in complete.decode().splitlines():
                failure = Failure(**json.loads(line))
                last = f"rank {failure.rank} after step {failure.step}: {failure.cause}"
                if failure.cause.startswith(QUARANTINED):
                    self._on_cordon(last)
                    return
                count = streak.add(failure.step)
                if count >= self._after:
                    self._on_cordon(f"its ranks failed {count} times in a row (the last: {last})")
                    return


class KubeNode:
    """The Kubernetes node this pod runs on, marked unschedulable through the API server
    (`kubectl cordon`), so that the pod's replacement goes elsewhere. Needs `get` and `patch` on
    nodes (the chart's `trainer.cordon.markNode` grants them to the trainer's service account)."""

    def __init__(self, api: str, node: str, token: str, context: ssl.SSLContext | None) -> None:
        self.api, self.node, self._token, self._context = api.rstrip("/"), node, token, context

    @classmethod
    def in_cluster(cls) -> KubeNode | None:
        """This pod's node, or None outside a pod that may reach the API (no node name, no
        service account token)."""
        host, port = (
            os.environ.get("KUBERNETES_SERVICE_HOST"),
            os.environ.get("KUBERNETES_SERVICE_PORT", "443"),
        )
        node, token = os.environ.get(NODE_NAME_ENV), SERVICE_ACCOUNT / "token"
        if not (host and node and token.is_file()):
            return None
        context = ssl.create_default_context(cafile=str(SERVICE_ACCOUNT / "ca.crt"))
        api = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
        return cls(api, node, token.read_text().strip(), context)

    def cordon(self) -> None:
        """Mark the node unschedulable; raises OSError (urllib's errors) when the API refuses."""
        request = urllib.request.Request(
            f"{self.api}/api/v1/nodes/{self.node}",
            data=json.dumps({"spec": {"unschedulable": True}}).encode(),
            method="PATCH",
            headers={
                "Authorization": f"Bearer {self._token}",
                "Content-Type": "application/strategic-merge-patch+json",
            },
        )
        with urllib.request.urlopen(request, timeout=10, context=self._context) as response:
            response.read()


def cordon_node(node: KubeNode | None) -> str:
    """Mark `node` unschedulable; returns what became of it, for the agent's line."""
    if node is None:
        return "not on Kubernetes (or no API access): no node marked unschedulable"
    started = time.monotonic()
    try:
        node.cordon()
    except OSError as exc:
        return f"Kubernetes node {node.node} could not be marked unschedulable: {exc}"
    return f"Kubernetes node {node.node} marked unschedulable ({time.monotonic() - started:.2f}s)"
