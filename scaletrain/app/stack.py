"""The embedded stack: SeaweedFS, ckptd and telemetry as child processes, and a training job.

`scaletrain run` uses it to do on one machine what the Helm chart does on a cluster. Every child
runs in its own process group with its output in `<workdir>/logs/`, so that stopping the stack,
on success, on failure or on Ctrl-C, stops each child and everything it started.

A stack of N nodes (`--nodes N`) simulates N machines on loopback: one ckptd per node (node0 ..
node{N-1}, each told the others' addresses as its peers) and one torchrun agent per node, the
agents joined by c10d rendezvous into one job whose ranks each talk to their own node's ckptd.
One node is the same code with no peers. S3 and telemetry are shared, as on a cluster. With S
hot spares (`--spares S`) S more machines (node{N} ..) run warm: their ckptd is a peer of the
others from the start (it holds replicas) and their agent waits in the rendezvous, python and
torch loaded, to take the place of a lost node. Once there is more than one machine the
rendezvous store is a service of its own (`scaletrain rendezvous`), on no training node.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from scaletrain.app.recovery import STEP_LINE
from scaletrain.app.rendezvous import CAPACITY_WAIT_S, wait_listening
from scaletrain.app.seaweed import SeaweedS3, free_ports
from scaletrain.cordon import CORDON_AFTER, QUARANTINE_LINE, FailureStreak
from scaletrain.errors import UserError
from scaletrain.process import PEER_LOST, children_by_parent, descendants, rank_named
from scaletrain.security import ClientSecurity, EmbeddedCredentials, Role
from scaletrain.transport import wait_until_healthy
from telemetry.client import HOST_ENV
from trainer.options import FULL_WORLD_ENV

S3_BUCKET = "scaletrain"


def node_name(node: int) -> str:
    return f"node{node}"


def ckptd_service(node: int) -> str:
    """The name of node `node`'s ckptd among the stack's children (and of its log file)."""
    return "ckptd" if node == 0 else f"ckptd-{node_name(node)}"


# The stack's rendezvous service, among its children (and its log file).
RENDEZVOUS = "rendezvous"
# A rank's keeper restarting it in the job, as rank 0's keeper says it: the failed rank is group 2
# (one that only lost a peer is not matched: the failure was not its node's).
IN_JOB_FAILURE = re.compile(
    rf"^\[keeper\] in-job restart (\d+): rank (\d+) (?!{re.escape(PEER_LOST)})"
)
# How long a failed rank's node is looked for among the ranks forked again.
_FIND_RANK_S = 10.0


def parse_nodes(text: str) -> tuple[int, int]:
    """`--nodes N` or `--nodes MIN:MAX` (elastic: the job goes on with as few as MIN nodes when
    nodes are lost and no spare is left, and grows back to MAX as they return) as (MIN, MAX)."""
    low, _, high = text.partition(":")
    try:
        least, most = int(low), int(high or low)
    except ValueError:
        raise UserError(f"--nodes takes N or MIN:MAX, got {text!r}") from None
    if least < 1 or most < least:
        raise UserError(f"--nodes {text}: MIN must be at least 1 and at most MAX")
    return least, most


def check_nodes(
    ranks: int, nodes: int, spares: int = 0, memory_budget_mb: int = 512, min_nodes: int = 0
) -> None:
    """Refuse, before anything starts, a number of nodes that cannot split `ranks` evenly, and
    spares that cannot be started: one node has no peer to restore from, and every simulated
    machine must fit in this machine's memory. `ranks` are the ranks of `nodes` nodes; an
    elastic job (`min_nodes` < `nodes`) runs as many per node at every size."""
    if nodes < 1:
        raise UserError(f"--nodes must be at least 1, got {nodes}")
    if min_nodes and not 1 <= min_nodes <= nodes:
        raise UserError(f"--nodes {min_nodes}:{nodes}: MIN must be at least 1 and at most MAX")
    if spares < 0:
        raise UserError(f"--spares must be 0 or more, got {spares}")
    if spares and nodes < 2:
        raise UserError(
            f"--spares {spares} needs --nodes 2 or more: a spare restores a lost node's part "
            "from the copies its peers hold"
        )
    if ranks % nodes:
        lower, upper = ranks // nodes * nodes, (ranks // nodes + 1) * nodes
        nearest = f"{lower} or {upper}" if lower else str(upper)
        raise UserError(
            f"--ranks {ranks} is not a multiple of --nodes {nodes}: every node runs the same "
            f"number of ranks; nearest valid --ranks: {nearest}"
        )
    machines = nodes + spares
    need_mb = machines * (memory_budget_mb + MACHINE_MB + ranks // nodes * RANK_MB)
    have_mb = _available_mb()
    if spares and have_mb is not None and need_mb > have_mb:
        raise UserError(
            f"--spares {spares}: {machines} simulated machines need about {need_mb / 1024:.1f} "
            f"GiB of memory (each a ckptd of up to {memory_budget_mb} MB, an agent and "
            f"{ranks // nodes} rank(s)), and this machine has {have_mb / 1024:.1f} GiB available"
        )


# What a simulated machine needs besides its ckptd's memory budget (the ckptd and agent
# processes), and each of its ranks (the debug model), in MB: the bound `check_nodes` applies.
MACHINE_MB, RANK_MB = 400, 300


def _available_mb() -> float | None:
    """MemAvailable of this machine in MB (None where /proc/meminfo does not say)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


@dataclass(frozen=True)
class Workdir:
    """Where the embedded stack keeps its state; everything `scaletrain` reads offline is here."""

    root: Path

    @property
    def ckptd(self) -> Path:
        """node0's ckptd data dir: what `ckpt ls --workdir` and the other offline commands read."""
        return self.root / "ckptd"

    def ckptd_dir(self, node: int) -> Path:
        """Node `node`'s ckptd data dir (its SSD tier and catalog)."""
        return self.ckptd if node == 0 else self.root / ckptd_service(node)

    def trainer_log(self, node: int) -> Path:
        """What node `node`'s torchrun agent and its ranks printed."""
        return self.logs / ("trainer.log" if node == 0 else f"trainer-{node_name(node)}.log")

    @property
    def s3(self) -> Path:
        return self.root / "s3"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def telemetry_db(self) -> Path:
        return self.root / "telemetry.db"

    @property
    def db_url(self) -> str:
        return f"sqlite:///{self.telemetry_db.resolve()}"

    @property
    def last_run_file(self) -> Path:
        return self.root / "last_run.json"

    def create(self) -> None:
        for path in (self.root, self.ckptd, self.s3, self.logs):
            path.mkdir(parents=True, exist_ok=True)

    def last_run_id(self) -> str | None:
        try:
            return json.loads(self.last_run_file.read_text())["run_id"]
        except (OSError, ValueError, KeyError):
            return None

    def remember_run(self, run_id: str) -> None:
        self.last_run_file.write_text(json.dumps({"run_id": run_id}) + "\n")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _tail(path: Path, lines: int = 5) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(text[-lines:])


class Child:
    """One child process in its own process group, its output appended to a log file."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str]) -> None:
        self.name, self.log = name, log
        self._argv, self._env = argv, env
        self._log_file: IO[bytes] = log.open("ab")
        self.proc = self._spawn()
        self._terminated: subprocess.Popen[bytes] | None = None  # the process sent SIGTERM

    def _spawn(self) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            self._argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=self._env,
            start_new_session=True,
        )

    def kill(self) -> None:
        """SIGKILL the whole group at once: the child dies as in a crash."""
        self.signal(signal.SIGKILL)
        self.proc.wait()

    def signal(self, sig: signal.Signals) -> None:
        """Send `sig` to the whole group (SIGSTOP freezes the child, SIGCONT thaws it)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def restart(self) -> None:
        """Start the same command again (after it died or was killed), logging to the same file."""
        if self.proc.poll() is None:
            raise RuntimeError(f"{self.name} is still running")
        self.proc = self._spawn()

    def failed_message(self) -> str:
        return f"{self.name} exited with code {self.proc.returncode}: {_tail(self.log)}"

    def terminate(self) -> None:
        """SIGTERM the whole group once, without waiting (`stop` waits): a second SIGTERM could
        cut short the clean shutdown the first one started."""
        if self.proc.poll() is None and self._terminated is not self.proc:
            self._terminated = self.proc
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM the whole group, then SIGKILL what is still there after `timeout_s`."""
        if self.proc.poll() is None:
            self.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout_s)
        # The leader may be gone while its children linger: kill the group regardless.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._log_file.close()


def _scaletrain_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "scaletrain", *args]


class Stack:
    """S3, telemetry and one ckptd per node on free loopback ports; `close` stops them in reverse
    order."""

    def __init__(
        self,
        workdir: Workdir,
        memory_budget_mb: int = 512,
        secure: bool = False,
        ckptd_args: tuple[str, ...] = (),
        nodes: int = 1,
        spares: int = 0,
        cordon_after: int = CORDON_AFTER,
        min_nodes: int = 0,
        capacity_wait_s: float = CAPACITY_WAIT_S,
    ) -> None:
        if cordon_after < 0:
            raise UserError(f"--cordon-after must be 0 or more, got {cordon_after}")
        self.workdir = workdir
        self.memory_budget_mb = memory_budget_mb
        self.secure = secure
        # With `secure`: TLS between every part and a token for each (EmbeddedCredentials).
        self.credentials: EmbeddedCredentials | None = None
        # More `scaletrain ckptd` options (retry backoff, retention, ...).
        self.ckptd_args = ckptd_args
        self.nodes = nodes
        # Elastic (below `nodes`): the job goes on with as few nodes when no spare is left.
        self.min_nodes = min_nodes or nodes
        if capacity_wait_s <= 0:
            raise UserError(f"--capacity-wait-s must be more than 0, got {capacity_wait_s:g}")
        # Elastic, fewer than `min_nodes` left: how long the job waits for one to join.
        self.capacity_wait_s = capacity_wait_s
        self.spares = spares
        # With spares: a node whose ranks failed this many times is cordoned (0: never).
        self.cordon_after = cordon_after
        self.children: list[Child] = []
        self.s3: SeaweedS3 | None = None
        # Node i's ckptd listens on ckptd_addresses[i].
        self.ckptd_addresses: list[str] = []
        self.telemetry_address = ""
        # The c10d store the agents meet in, when it is a service of its own.
        self.rendezvous_address = ""
        self._addresses: dict[str, str] = {}  # service name -> address

    @property
    def machines(self) -> int:
        """The simulated machines: the training nodes, then the spares."""
        return self.nodes + self.spares

    @property
    def ckptd_address(self) -> str:
        """node0's ckptd: the one the command line and the summary ask (it asks its peers)."""
        return self.ckptd_addresses[0] if self.ckptd_addresses else ""

    def __enter__(self) -> Stack:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Start S3, telemetry and the ckptds, overlapping their start-ups.

        Telemetry needs nothing else, so it is spawned first and imports while S3 comes up;
        ckptd needs S3's endpoint but not a telemetry that answers yet (its reporting retries),
        so all are waited for together at the end: a run starts ~2 s sooner than when each
        service is waited for before the next is spawned.
        """
        self.workdir.create()
        base_env = dict(os.environ)
        if self.secure:
            self.credentials = EmbeddedCredentials(
                self.workdir.root / "tls", self.workdir.root / "tokens.json"
            )
            base_env |= self.credentials.server_env()
        # Every port at once, and S3 told to keep off them: a service spawned here binds its
        # port only once it has imported, while the others are being given theirs.
        telemetry_port, rendezvous_port, *ckptd_ports = free_ports(2 + self.machines)
        self.telemetry_address = f"127.0.0.1:{telemetry_port}"
        self.ckptd_addresses = [f"127.0.0.1:{port}" for port in ckptd_ports]
        rendezvous = None
        if self.machines > 1:
            self.rendezvous_address = f"127.0.0.1:{rendezvous_port}"
            rendezvous = self._spawn(
                RENDEZVOUS,
                _scaletrain_argv("rendezvous", "--listen", self.rendezvous_address),
                base_env,
                self.rendezvous_address,
            )
        telemetry = self._spawn(
            "telemetry",
            _scaletrain_argv(
                "telemetry", "--listen", self.telemetry_address, "--db", self.workdir.db_url
            ),
            base_env,
            self.telemetry_address,
        )
        self.s3 = SeaweedS3(
            self.workdir.s3, avoid_ports=frozenset([telemetry_port, rendezvous_port, *ckptd_ports])
        )
        self.s3.start()
        ckptd_env = base_env | {
            "AWS_ACCESS_KEY_ID": self.s3.access_key_id,
            "AWS_SECRET_ACCESS_KEY": self.s3.secret_access_key,
        }
        if self.credentials is not None:
            ckptd_env |= self.credentials.client_env(self.credentials.service_token)
        ckptds = [
            self._spawn(ckptd_service(node), self._ckptd_argv(node), ckptd_env, address)
            for node, address in enumerate(self.ckptd_addresses)
        ]
        self._wait_healthy(telemetry)
        for ckptd in ckptds:
            self._wait_healthy(ckptd)
        if rendezvous is not None:
            wait_listening(self.rendezvous_address, timeout_s=60)

    def _ckptd_argv(self, node: int) -> list[str]:
        assert self.s3 is not None
        data_dir = self.workdir.ckptd_dir(node)
        data_dir.mkdir(parents=True, exist_ok=True)
        peers = [a for i, a in enumerate(self.ckptd_addresses) if i != node]
        return _scaletrain_argv(
            "ckptd",
            "--listen",
            self.ckptd_addresses[node],
            "--node",
            node_name(node),
            *(["--peers", ",".join(peers)] if peers else []),
            "--data-dir",
            str(data_dir),
            "--memory-budget-mb",
            str(self.memory_budget_mb),
            "--s3-endpoint",
            self.s3.endpoint_url,
            "--s3-bucket",
            S3_BUCKET,
            "--telemetry",
            self.telemetry_address,
            *self.ckptd_args,
        )

    def _spawn(self, name: str, argv: list[str], env: dict, address: str) -> Child:
        """Start service `name` (logging to logs/<name>.log); `close` stops it from now on."""
        child = Child(name, argv, self.workdir.logs / f"{name}.log", env)
        self.children.append(child)
        self._addresses[name] = address
        return child

    def service(self, name: str) -> Child:
        """The running child `name` ("telemetry", or `ckptd_service(node)`: "ckptd" is node0's)."""
        return next(child for child in self.children if child.name == name)

    def restart_service(self, name: str) -> None:
        """Start service `name` again at its address (it died or was killed), wait until healthy."""
        child = self.service(name)
        child.restart()
        if name == RENDEZVOUS:  # a TCP store, no gRPC health service
            wait_listening(self.rendezvous_address, timeout_s=60)
        else:
            self._wait_healthy(child)

    def rendezvous_lost(self) -> bool:
        """Whether the rendezvous service (several machines) has died."""
        return bool(self.rendezvous_address) and self.service(RENDEZVOUS).proc.poll() is not None

    def _wait_healthy(self, child: Child) -> None:
        name, address = child.name, self._addresses[child.name]
        deadline = time.monotonic() + 60
        while True:
            if child.proc.poll() is not None:
                raise UserError(f"could not start {child.failed_message()}")
            try:
                wait_until_healthy(address, timeout_s=1.0, security=self.client_security())
                return
            except UserError:
                if time.monotonic() > deadline:
                    raise UserError(
                        f"{name} did not become healthy at {address} within 60 s; see {child.log}"
                    ) from None

    def client_security(self, role: Role | None = None, run: str = "*") -> ClientSecurity | None:
        """How this process talks to the stack: with a new `role` token on `run` when secure
        (none: TLS alone, for health checks); None (the environment's) when not."""
        if self.credentials is None:
            return None
        return self.credentials.client(self.credentials.mint(role, run) if role else None)

    def train(
        self,
        run_id: str,
        ranks: int,
        trainer_args: list[str],
        out: IO[str],
        max_restarts: int = 0,
        on_start: Callable[[Job], None] | None = None,
    ) -> int:
        """Run the training job, `ranks` split evenly over the nodes; its output goes to `out`
        and to each node's log. Returns its exit code.

        torchrun's elastic agents restart every rank up to `max_restarts` times after any rank
        fails; the ranks then resume from the latest committed checkpoint. `on_start` is handed
        the job once its agents run.
        """
        check_nodes(ranks, self.nodes, self.spares, self.memory_budget_mb, self.min_nodes)
        env = dict(os.environ) | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        if self.min_nodes < self.nodes:  # each rank knows the full size (its micro-batch)
            env[FULL_WORLD_ENV] = str(ranks)
        if self.credentials is not None:
            # The run's own token: it may write this run's checkpoints and telemetry only.
            token = self.credentials.mint(Role.TRAINER, run_id, f"trainer of {run_id}")
            env |= self.credentials.client_env(token)
        job = Job(self, run_id, ranks // self.nodes, trainer_args, out, max_restarts, env)
        try:
            for node in range(self.nodes):
                job.start_agent(node)
            job.start_spares()
            if on_start is not None:
                on_start(job)
            return job.wait()
        finally:
            job.stop()

    def close(self) -> None:
        """Stop every service, then S3. All are sent SIGTERM first, so a shutdown takes as long
        as the slowest service's, not the sum of their grace periods (over a minute at worst)."""
        for child in self.children:
            child.terminate()
        while self.children:
            self.children.pop().stop()
        if self.s3 is not None:
            self.s3.stop()
            self.s3 = None


def worker_pids(agent_pid: int) -> dict[int, int]:
    """RANK -> pid of the process that trains as that rank, under torchrun's agent `agent_pid`.

    Found by its name (`RANK_PROCESS`), which it sets itself: torchrun forks the trainer's ranks
    from a warm process (`scaletrain.app.agent`), whose command line and environment they keep,
    and under `--in-job-restarts` the rank is a fork of its keeper (named `KEEPER_PROCESS`).
    """
    children, pids, queue = children_by_parent(), {}, [agent_pid]
    while queue:
        for child in children.get(queue.pop(), []):
            rank = rank_named(_comm(child))
            if rank is not None:
                pids[rank] = int(child.name)  # what it forks is not a rank
            else:
                queue.append(int(child.name))
    return pids


def _comm(proc: Path) -> str:
    try:
        return (proc / "comm").read_text().strip()
    except OSError:
        return ""


class Job:
    """A training job: one torchrun agent per machine of the stack, joined by c10d rendezvous.

    On one machine its agent hosts the rendezvous store (`is_host`); on several the store is the
    stack's rendezvous service. c10d ranks the agents by process id, so node0's agent, started
    first, is group rank 0: its ranks are 0..k-1 and rank 0 talks to node0's ckptd. The spares'
    agents start once the job has formed: with every place taken (`--nnodes N`), c10d keeps them
    in its redundancy list, and when a node is lost the next round takes a spare in its place.
    torch 2.13 lets such an agent exit 1 when the job ends without it (an AttributeError on the
    rendezvous' graceful exit), so what an agent that never ran a rank exits with is not the
    job's result. A node's agent may be killed and started again (`kill_agent`, `start_agent`:
    a replaced machine); the others then restart their ranks and the job re-forms once the new
    agent (or a spare) joins. An agent that fails for good after running ranks ends the job:
    its peers would wait for it in the rendezvous for ten minutes, so they are stopped at once.
    """

    def __init__(
        self,
        stack: Stack,
        run_id: str,
        per_node: int,
        trainer_args: list[str],
        out: IO[str],
        max_restarts: int,
        env: dict[str, str],
    ) -> None:
        self.stack, self.run_id, self.per_node = stack, run_id, per_node
        self.trainer_args, self.max_restarts = trainer_args, max_restarts
        self._out = out
        self._env = env
        if stack.machines > 1:
            # torch 2.13's agents share one store with the ranks, and the rank-0 agent tells only
            # the agents of its first round where it is: an agent started later (a replaced node,
            # a spare) waits for that address forever. Unshared, each attempt gets a fresh store
            # (hosted by rank 0), announced in every round.
            self._env = env | {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        self._rendezvous = stack.rendezvous_address or f"127.0.0.1:{free_port()}"
        self.agents: list[subprocess.Popen[str] | None] = [None] * stack.machines
        self._logs = [stack.workdir.trainer_log(node).open("a") for node in range(stack.machines)]
        self._readers: list[threading.Thread] = []
        self._lock = threading.Lock()  # the agents and `_replacing`
        self._out_lock = threading.Lock()  # one line at a time on `out` and the logs
        self._replacing: set[int] = set()  # nodes whose agent was killed, to be started again
        self._served: set[int] = set()  # pids of the agents that have run ranks
        self._stopped = False
        # Rank failures seen per node (in-job restarts); nodes cordoned for them, for good; the
        # spares that are to take their places, until they run ranks.
        self._streaks: dict[int, FailureStreak] = {}
        self._step = 0  # the last step the job's output showed
        self.cordoned: set[int] = set()
        self._claimed: set[int] = set()
        # Nodes lost while the job went on without them (elastic), until one is started again.
        self.left: set[int] = set()
        # Elastic, fewer than MIN nodes left: the job waits for one to join (`_shrink`).
        self.short_of_nodes = False

    def agent_argv(self, node: int) -> list[str]:
        # No --node-rank: c10d assigns node ranks itself (by process id) and torchrun warns
        # that it ignores one given.
        hosts = not self.stack.rendezvous_address and node == 0
        conf = (
            f"is_host={str(hosts).lower()},keep_alive_interval={KEEP_ALIVE_S},"
            f"keep_alive_max_attempt={KEEP_ALIVE_ATTEMPTS}"
        )
        nnodes = str(self.stack.nodes)
        if self.stack.min_nodes < self.stack.nodes:
            nnodes = f"{self.stack.min_nodes}:{self.stack.nodes}"
            conf += (
                f",last_call_timeout={ELASTIC_LAST_CALL_S}"
                f",join_timeout={math.ceil(self.stack.capacity_wait_s)}"
            )
        return [
            sys.executable, "-m", "scaletrain.app.agent",
            "--nnodes", nnodes, "--nproc-per-node", str(self.per_node),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", self._rendezvous,
            "--rdzv-id", self.run_id, "--rdzv-conf", conf, "--local-addr", "127.0.0.1",
            "--max-restarts", str(self.max_restarts),
            "-m", "trainer",
            "--run-id", self.run_id,
            "--ckptd", self.stack.ckptd_addresses[node],
            "--telemetry", self.stack.telemetry_address,
            *self.trainer_args,
        ]  # fmt: skip

    def start_agent(self, node: int) -> bool:
        """Start node `node`'s agent (again, after `kill_agent`: its ranks ask ckptd where the
        run stands, as every rank does); False once the job has ended."""
        with self._lock:
            if self._stopped:
                return False
            # Simulated nodes share the machine: each names its ranks' host (telemetry's nodes).
            host = {HOST_ENV: node_name(node)} if self.stack.machines > 1 else {}
            proc = subprocess.Popen(
                self.agent_argv(node),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=self._env | host,
                text=True,
                start_new_session=True,
            )
            self.agents[node] = proc
            self._replacing.discard(node)
            self.left.discard(node)
            self.short_of_nodes = False  # a machine comes: the job meets again with it
            self._streaks.pop(node, None)  # a new machine in its place
        reader = threading.Thread(target=self._pump, args=(node, proc), name=f"agent-{node}")
        reader.start()
        self._readers.append(reader)
        return True

    def start_spares(self, machines: list[int] | None = None) -> None:
        """Start the spares' agents (of `machines`, or the stack's spares) once every training
        node's agent runs its ranks (the job formed), from a thread of its own: a spare started
        sooner could take a node's place in the first round."""
        if not self.stack.spares:
            return
        if machines is None:
            machines = list(range(self.stack.nodes, self.stack.machines))

        def start() -> None:
            deadline = time.monotonic() + SPARE_START_WAIT_S
            while len(self.serving()) < self.stack.nodes and time.monotonic() < deadline:
                if self._stopped:
                    return
                time.sleep(0.2)
            for node in machines:
                if not self.start_agent(node):
                    return
                self._say(f"spare {node_name(node)} is warm, waiting in the rendezvous")

        starter = threading.Thread(target=start, name="spares", daemon=True)
        starter.start()

    def serving(self) -> set[int]:
        """The machines whose agent runs ranks now."""
        with self._lock:
            agents = {node: a for node, a in enumerate(self.agents) if a and a.poll() is None}
        serving = {node for node, agent in agents.items() if worker_pids(agent.pid)}
        with self._lock:
            self._served |= {agents[node].pid for node in serving}
        return serving

    def _say(self, text: str) -> None:
        with self._out_lock:
            self._out.write(f"[scaletrain] {text}\n")
            self._out.flush()

    def _pump(self, node: int, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            with self._out_lock:
                self._logs[node].write(line)
                self._logs[node].flush()
                self._out.write(line)
                self._out.flush()
            trained = STEP_LINE.match(line)
            if trained is not None:
                self._step = int(trained[1])
            failed = IN_JOB_FAILURE.match(line)
            if failed is not None and self.stack.spares and self.stack.cordon_after:
                cause = line.split(": ", 1)[1].strip()
                threading.Thread(
                    target=self._count_failure,
                    args=(int(failed[2]), cause, self._step),
                    daemon=True,
                ).start()
            quarantined = QUARANTINE_LINE.search(line)
            if quarantined is not None and quarantined[3] == "cordon":
                threading.Thread(
                    target=self._quarantine, args=(int(quarantined[1]), line), daemon=True
                ).start()

    def _node_of(self, rank: int) -> int | None:
        """The node whose agent runs rank `rank` (waiting a while: a keeper may be forking it
        again), or None."""
        node, deadline = None, time.monotonic() + _FIND_RANK_S
        while node is None and time.monotonic() < deadline and not self._stopped:
            node = next((n for n in self.serving() if rank in self.rank_pids(n)), None)
            if node is None:
                time.sleep(0.1)
        return node

    def _count_failure(self, rank: int, cause: str, step: int) -> None:
        """A rank failed after `step` and its keeper restarted it in the job: once the ranks of
        its node failed `cordon_after` times, each within CORDON_WITHIN_STEPS steps of the one
        before (failures further apart are faults of their own, and the count starts again),
        the node is cordoned: its agent stopped for good, so the next rendezvous round takes a
        waiting spare in its place, if a spare waits."""
        node = self._node_of(rank)
        if node is None:
            return
        with self._lock:
            failures = self._streaks.setdefault(node, FailureStreak()).add(step)
        if failures < self.stack.cordon_after or node in self.cordoned:
            return
        why = f"its ranks failed {failures} times (the last: {cause})"
        self._cordon(node, why, say_if_kept=failures == self.stack.cordon_after)

    def _quarantine(self, rank: int, line: str) -> None:
        """Rank 0 said the corruption checks quarantined rank `rank` (--quarantine cordon): its
        node is cordoned at once, if a spare waits to take its place."""
        node = self._node_of(rank)
        if node is None or node in self.cordoned:
            return
        why = "quarantine: " + line.split("quarantine: ", 1)[1].split(";")[0]
        self._cordon(node, why, say_if_kept=True)

    def _cordon(self, node: int, why: str, say_if_kept: bool) -> None:
        """Stop node `node`'s agent for good, so that a waiting spare takes its place in the next
        rendezvous round; with no spare waiting it stays (said once, when `say_if_kept`)."""
        waiting = self.waiting_spares()
        with self._lock:
            waiting = [n for n in waiting if n not in self._claimed]  # claimed meanwhile
            if waiting:
                self.cordoned.add(node)
                self._replacing.add(node)  # never started again; its end is not the job's
                self._claimed.add(waiting[0])
                agent = self.agent(node)
        if not waiting:
            if say_if_kept:
                self._say(f"{node_name(node)}: {why}; no spare waits to take its place: it stays")
            return
        self._say(
            f"{node_name(node)} cordoned: {why}; its agent is stopped, and the waiting spare "
            f"{node_name(waiting[0])} takes its place"
        )
        _kill_agent(agent)

    def rank_pids(self, node: int | None = None) -> dict[int, int]:
        """RANK -> pid of the ranks running now (on node `node`, or on every node)."""
        with self._lock:
            agents = [a for i, a in enumerate(self.agents) if a and node in (None, i)]
        return {rank: pid for agent in agents for rank, pid in worker_pids(agent.pid).items()}

    def machine_pids(self, node: int) -> list[int]:
        """Every process of node `node`'s job: its agent and all below it (a machine frozen)."""
        agent = self.agent(node)
        return [agent.pid, *descendants(agent.pid)]

    def agent(self, node: int) -> subprocess.Popen[str]:
        agent = self.agents[node]
        assert agent is not None
        return agent

    def kill_agent(self, node: int) -> list[int]:
        """SIGKILL node `node`'s agent and its ranks (a machine lost); the job goes on waiting for
        `start_agent(node)`. Returns the pids killed."""
        with self._lock:
            self._replacing.add(node)
        return self.lose(node)

    def lose(self, node: int) -> list[int]:
        """SIGKILL node `node`'s agent and its ranks, and drop the copies its ranks kept: a
        machine lost, as the job sees it (`wait` finds it out). Returns the pids killed."""
        with self._lock:
            agent = self.agent(node)
        ranks = descendants(agent.pid)
        _kill_agent(agent)
        # The machine's memory goes with it: its ranks' own copies too (they load torch, which
        # the stack does not).
        from trainer.checkpoint.own_copy import remove_copies

        remove_copies(self.run_id, node_name(node))
        return [agent.pid, *ranks]

    def wait(self) -> int:
        """Until the job has ended: 0 once every agent that ran ranks has exited 0 (spares still
        waiting are stopped then), or the exit code of the first such agent that failed (the
        others are stopped). A spare that fails before it ran a rank is reported, not fatal."""
        reported: set[int] = set()
        for polls in itertools.count():
            if self.stack.rendezvous_lost():  # before the agents' failures: it caused them
                self._rendezvous_again()
            if self.stack.spares and polls % 5 == 0:  # a scan of /proc: once a second
                self.serving()
            with self._lock:
                live = {
                    n: a
                    for n, a in enumerate(self.agents)
                    if a and n not in self._replacing | self.left
                }
                codes = {node: agent.poll() for node, agent in live.items()}
                served, replacing = set(self._served), bool(self._replacing)
            counts = {
                n: c for n, c in codes.items() if live[n].pid in served or not self.stack.spares
            }
            lost = sorted(n for n, code in counts.items() if code is not None and code < 0)
            if lost and self.stack.spares and self._take_places(lost, counts):
                continue
            if lost and self._shrink(lost, counts):
                continue
            failed = [code for code in counts.values() if code not in (None, 0)]
            ended = all(code is not None for code in codes.values())
            # A machine being replaced holds the end only without spares: with them the job no
            # longer needs it (it comes back as a spare).
            settled = not replacing or bool(self.stack.spares)
            if failed or (settled and counts and all(code == 0 for code in counts.values())):
                self.stop()
                return failed[0] if failed else 0
            if ended and not replacing:
                self.stop()
                return next((c for c in codes.values() if c), 0)
            for node in sorted(set(codes) - set(counts) - reported):
                if codes[node] not in (None, 0):
                    reported.add(node)
                    self._say(f"spare {node_name(node)}'s agent exited ({codes[node]}) unused")
            time.sleep(0.2)

    def waiting_spares(self) -> list[int]:
        """The machines whose agent waits in the rendezvous, running no rank, and that no
        cordon has claimed."""
        serving = self.serving()
        with self._lock:
            self._claimed -= serving  # a spare that took a cordoned node's place runs ranks now
            return [
                n
                for n, agent in enumerate(self.agents)
                if agent and agent.poll() is None and n not in serving | self._claimed
            ]

    def _take_places(self, lost: list[int], codes: dict[int, int | None]) -> bool:
        """Machines whose agent was killed while it ran ranks (lost, as a spare can be while it
        takes over): with a spare waiting, or a machine coming back (being started again), the
        next round takes it in their place, and the job goes on; False when none can."""
        waiting = self.waiting_spares()
        with self._lock:
            coming = self._replacing - self.cordoned - set(lost)
            if not waiting and not coming:
                return False
            self._replacing |= set(lost)
        instead = (
            f"the waiting spare {node_name(waiting[0])}"
            if waiting
            else " or ".join(map(node_name, sorted(coming))) + ", coming back,"
        )
        for node in lost:
            how = signal.Signals(-codes[node]).name  # type: ignore[operator]
            self._say(
                f"{node_name(node)} was lost while it ran ranks (its agent ended by {how}); "
                f"{instead} takes its place"
            )
        return True

    def _shrink(self, lost: list[int], codes: dict[int, int | None]) -> bool:
        """Machines lost while they ran ranks, and no spare took their place: an elastic job
        (`--nodes MIN:MAX`) goes on without them while at least MIN nodes remain (torchrun's
        agents re-form it on the survivors, and a machine that comes back is taken in again).
        With fewer, the survivors' agents wait in the rendezvous for machines to join, up to
        --capacity-wait-s (their join_timeout), then stop with one line and the job ends; a
        machine started again in time lets the job go on. False for a job that is not elastic."""
        if self.stack.min_nodes == self.stack.nodes:
            return False
        with self._lock:
            running = {n for n, code in codes.items() if code is None} - self.left
            self.left |= set(lost)
            self.short_of_nodes = len(running) < self.stack.min_nodes
        sizes = f"--nodes {self.stack.min_nodes}:{self.stack.nodes}"
        for node in lost:
            how = signal.Signals(-codes[node]).name  # type: ignore[operator]
            then = (
                f"the job goes on with {len(running)} node(s) ({sizes})"
                if not self.short_of_nodes
                else f"{len(running)} node(s) left, fewer than {sizes} allows: the job waits up "
                f"to {self.stack.capacity_wait_s:g}s (--capacity-wait-s) for a machine to join, "
                "then stops (it resumes from its newest checkpoint when started again)"
            )
            self._say(
                f"{node_name(node)} was lost while it ran ranks (its agent ended by {how}); no "
                f"spare takes its place: {then}"
            )
        return True

    def _rendezvous_again(self) -> None:
        """The rendezvous service died: torch's agents cannot reconnect to a store, so every
        agent fails. Start the service again at its address, then every agent again (the
        training machines now, the spares once the job has formed): the job resumes from its
        newest checkpoint, from the ranks' own memory where they hold it."""
        serving = self.serving()
        self._say(
            f"the rendezvous at {self.stack.rendezvous_address} was lost: it is started again, "
            "then every agent; the job resumes from its newest checkpoint"
        )
        with self._lock:
            agents = {n: a for n, a in enumerate(self.agents) if a and n not in self.cordoned}
            self._replacing |= set(agents)  # their ends are not the job's
        for agent in agents.values():
            _kill_agent(agent)
        self.stack.restart_service(RENDEZVOUS)
        for node in sorted(serving):
            if not self.start_agent(node):
                return
        spares = sorted(set(agents) - serving)
        if spares:
            self.start_spares(spares)

    def stop(self) -> None:
        """Stop every agent still running (SIGTERM: torchrun stops its ranks; SIGKILL for what is
        left after 15 s), then wait until their output is passed on."""
        with self._lock:
            self._stopped = True
            agents = [a for a in self.agents if a is not None]
        running = [a for a in agents if a.poll() is None]
        for agent in running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for agent in running:
            try:
                agent.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                _kill_agent(agent)
        for reader in self._readers:
            reader.join()
        for log in self._logs:
            log.close()
        self._logs = []


# An agent's heartbeat in the rendezvous, and how many it may miss before the others take it for
# lost (its machine gone): then a spare takes its place. The lost machine costs this much before
# anything is restarted; a live agent's heartbeat thread has nothing else to do.
KEEP_ALIVE_S = 1
KEEP_ALIVE_ATTEMPTS = 3
# An elastic job's rendezvous round, once its MIN nodes have joined, waits this long (seconds)
# for more before it starts: the survivors of a lost node re-form this soon after they meet.
ELASTIC_LAST_CALL_S = 2
# How long the spares wait for the job to form before they start anyway.
SPARE_START_WAIT_S = 300.0


def _kill_agent(agent: subprocess.Popen[str]) -> None:
    """SIGKILL a torchrun agent's group and its ranks (which run in sessions of their own)."""
    ranks = descendants(agent.pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(agent.pid, signal.SIGKILL)
    for pid in ranks:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    agent.wait()


@contextlib.contextmanager
def s3_for_reading(workdir: Workdir) -> Iterator[SeaweedS3]:
    """Start the work directory's S3 server alone, to read what it stores (export, verify)."""
    server = SeaweedS3(workdir.s3)
    server.start()
    try:
        yield server
    finally:
        server.stop()
