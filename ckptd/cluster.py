"""The cluster: one ckptd per node, and how they agree on which checkpoints are committed.

Every rank streams its files to its own node's ckptd; a checkpoint is therefore spread over
nodes, each holding the part its ranks wrote. This module is what a ckptd knows of the others
and how it talks to them (`Peers`), and the coordinator's half of the two-phase commit
(`Coordinator`); the participant's half is `ckptd.member`, a part of the store, next to the
saves it acts on.

    coordinator (the ckptd of the saving job's coordinator rank)       participant (each peer)
      own files durable                                                   .
      Prepare(save, epoch) ----------------------------------------------> part durable, vote
      votes: every rank's shard and the metadata somewhere?  <----------- recorded; its files
      yes: write own part's commit marker  <- the decision, durable
      Decide(commit, manifest) ------------------------------------------> own part's marker
      (a peer that missed it asks Outcome; a coordinator without a marker presumes abort)

A peer that holds none of a save's files answers NOT_FOUND to Prepare ("unknown save"): a save
needs only the nodes its ranks wrote to, so a peer that is down fails only the saves whose files
it holds. N = 1 is the same code with no peers to ask.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from ckptd.catalog import SaveRecord
from ckptd.config import ClusterConfig, names_itself
from ckptd.manifest import FileRecord, Manifest
from ckptd.names import manifest_from_peer
from ckptd.readpath import RangeConnection, open_range
from ckptd.states import (
    METADATA,
    OUTCOME_ABORTED,
    OUTCOME_COMMITTED,
    OUTCOME_IN_PROGRESS,
    OUTCOME_UNKNOWN,
    SHARD,
)
from ckptd.tiers import CheckpointKey
from scaletrain.errors import (
    FailedPrecondition,
    InvalidArgument,
    Unavailable,
    UserError,
    error_from_rpc,
)
from scaletrain.security import ClientSecurity
from scaletrain.tls import client_context
from scaletrain.transport import DEFAULT_TIMEOUT_S, make_channel
from scaletrain.v1 import checkpoint_pb2, checkpoint_pb2_grpc

log = logging.getLogger(__name__)

# How long a peer's answer to a read or a question may take.
_PEER_TIMEOUT_S = 10.0


def new_epoch(newest_seen: int) -> int:
    """An epoch above `newest_seen`: microseconds of the wall clock, so that an attempt opened
    later on another node (a restarted job's new coordinator) is very likely newer too."""
    return max(newest_seen + 1, time.time_ns() // 1000)


def check_epoch(key: CheckpointKey, epoch: int, current: int, who: str) -> None:
    """Refuse a message of an attempt older than the newest this node saw of `key`."""
    if epoch < current:
        raise FailedPrecondition(
            f"stale coordinator: {who} for {key} carries epoch {epoch}, older than epoch "
            f"{current} of the newest attempt this node saw; refused"
        )


class PeerUnreachable(Exception):
    """A peer's ckptd could not be connected to."""


@dataclass
class Peer:
    """Another node's ckptd as this one knows it."""

    address: str
    node: str = ""
    zone: str = ""
    reachable: bool = False
    error: str = ""
    channel: grpc.Channel | None = field(default=None, repr=False)
    # Its data socket's TLS, as the channel has it (None: plaintext).
    tls: ssl.SSLContext | None = field(default=None, repr=False)

    def connect(self, timeout_s: float) -> None:
        """Wait for a connection (a peer just restarted may take a reconnect backoff), or raise
        PeerUnreachable: so that a peer that is down costs a call seconds, not its deadline."""
        assert self.channel is not None
        ready = grpc.channel_ready_future(self.channel)
        try:
            ready.result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            ready.cancel()  # its polling thread stops here, not on a channel closed under it
            raise PeerUnreachable(f"{self.address}: no connection within {timeout_s:g}s") from None

    @property
    def name(self) -> str:
        """Its node name, or its address until it has told its name."""
        return self.node or self.address

    def cluster(self) -> checkpoint_pb2_grpc.ClusterServiceStub:
        assert self.channel is not None
        return checkpoint_pb2_grpc.ClusterServiceStub(self.channel)

    def checkpoints(self) -> checkpoint_pb2_grpc.CheckpointServiceStub:
        assert self.channel is not None
        return checkpoint_pb2_grpc.CheckpointServiceStub(self.channel)


def _resolve(host_port: str) -> list[str]:
    """Every address `host` resolves to, as HOST:PORT (a headless Service: one per pod)."""
    host, _, port = host_port.rpartition(":")
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except OSError as exc:
        log.warning("cannot resolve peers %s: %s", host_port, exc)
        return []
    found = []
    for _family, _type, _proto, _name, sockaddr in infos:
        address = f"[{sockaddr[0]}]:{port}" if ":" in sockaddr[0] else f"{sockaddr[0]}:{port}"
        if address not in found:
            found.append(address)
    return found


class Peers:
    """The other nodes' ckptds: a static list and/or every address of a DNS name.

    Each peer is greeted (`Hello`) to learn its node name: a peer answering with this process's
    own instance id is this ckptd itself (a peer list naming its own node), one answering with
    this node's name is a second live ckptd claiming it; both refuse the start.
    """

    def __init__(
        self,
        config: ClusterConfig,
        node: str,
        security: ClientSecurity | None = None,
        on_reachable: Callable[[Peer], None] | None = None,
    ) -> None:
        self.config = config
        self._on_reachable = on_reachable
        self.node = node
        self.instance = uuid.uuid4().hex
        self.zone = config.zone
        self.address = config.advertise or ""
        self._security = security
        self._lock = threading.Lock()
        self._peers: dict[str, Peer] = {}
        # Addresses that turned out to be this ckptd (a DNS name resolves to every node).
        self._selves: set[str] = set()

    @property
    def enabled(self) -> bool:
        return bool(self.config.peers or self.config.peers_dns)

    def set_address(self, address: str) -> None:
        """The address peers reach this ckptd at, once its port is bound."""
        if not self.address:
            self.address = address

    def _addresses(self) -> list[str]:
        found = list(self.config.peers)
        if self.config.peers_dns:
            found += [a for a in _resolve(self.config.peers_dns) if a not in found]
        return [a for a in found if a != self.address and a not in self._selves]

    def all(self) -> list[Peer]:
        """Every peer, (re)resolving DNS membership; new ones get a channel."""
        with self._lock:
            for address in self._addresses():
                if address not in self._peers:
                    security = self._security or ClientSecurity.from_env()
                    tls = client_context(security.tls) if security.tls is not None else None
                    channel = make_channel(address, security)
                    self._peers[address] = Peer(address, channel=channel, tls=tls)
            return list(self._peers.values())

    def greet(self, strict: bool) -> None:
        """Say hello to every peer; with `strict` (at start) a conflict is an error."""
        for peer in self.all():
            request = checkpoint_pb2.HelloRequest(
                node=self.node, address=self.address, instance=self.instance, zone=self.zone
            )
            try:
                peer.connect(self.config.connect_timeout_s)
                reply = peer.cluster().Hello(request, timeout=DEFAULT_TIMEOUT_S)
            except (grpc.RpcError, PeerUnreachable) as exc:
                self._mark(peer, False, _describe(exc))
                continue
            if reply.instance == self.instance and peer.address not in self.config.peers:
                self._forget_self(peer)  # DNS names every node: this one under another address
                continue
            problem = self.conflict(reply.node, reply.instance, peer.address)
            if problem:
                if strict:
                    raise UserError(problem)
                log.error("%s", problem)
                continue
            peer.node, peer.zone = reply.node, reply.zone
            self._mark(peer, True, "")

    def conflict(self, node: str, instance: str, address: str) -> str:
        """What is wrong with a peer that says it is `node` (instance `instance`), or ""."""
        if instance == self.instance:
            return names_itself(address)
        if node == self.node:
            return (
                f"node name {node!r} is already used by the live ckptd at {address}; "
                "give each node's ckptd a name of its own (--node)"
            )
        return ""

    def _forget_self(self, peer: Peer) -> None:
        with self._lock:
            self._selves.add(peer.address)
            self._peers.pop(peer.address, None)
        if peer.channel is not None:
            peer.channel.close()

    def _mark(self, peer: Peer, reachable: bool, error: str) -> None:
        peer.reachable, peer.error = reachable, error
        if self._on_reachable is not None:
            self._on_reachable(peer)

    def heard(self, node: str, address: str, zone: str) -> None:
        """A peer said hello: remember its name and zone (DNS membership learns addresses this
        way too)."""
        with self._lock:
            for peer in self._peers.values():
                if peer.address == address:
                    peer.node, peer.zone, peer.reachable = node, zone, True

    def call(
        self,
        peers: list[Peer],
        fn: Callable[[Peer], object],
        brief: Collection[str] = (),
    ) -> dict[str, object | BaseException]:
        """`fn(peer)` on every peer at once: address -> its result, or the exception raised.
        The peers at the addresses `brief` get no wait for a connection (`fn` bounds the call)."""
        if not peers:
            return {}
        results: dict[str, object | BaseException] = {}
        timeout = self.config.connect_timeout_s

        def connected(peer: Peer) -> object:
            try:
                if peer.address not in brief:
                    peer.connect(timeout)
                result = fn(peer)
            except BaseException as exc:
                if _unreachable(exc):
                    self._mark(peer, False, _describe(exc))
                raise
            self._mark(peer, True, "")
            return result

        with ThreadPoolExecutor(max_workers=min(16, len(peers))) as pool:
            futures = {peer.address: pool.submit(connected, peer) for peer in peers}
            for address, future in futures.items():
                try:
                    results[address] = future.result()
                except BaseException as exc:  # a peer's failure is data here
                    results[address] = exc
        return results

    def close(self) -> None:
        with self._lock:
            for peer in self._peers.values():
                if peer.channel is not None:
                    peer.channel.close()
            self._peers.clear()


def _describe(exc: BaseException) -> str:
    if not isinstance(exc, grpc.RpcError):
        return " ".join(str(exc).split())[:200]
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return f"{code.name if code else 'error'}: {' '.join(str(details).split())[:200]}"


def _unreachable(exc: BaseException) -> bool:
    return isinstance(exc, PeerUnreachable) or (
        isinstance(exc, grpc.RpcError)
        and exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    )


# -- the coordinator's half of the commit ----------------------------------------------------------


@dataclass(frozen=True)
class Votes:
    """What the peers answered to Prepare: their files, and who could not be asked (by name,
    else address)."""

    files: list[FileRecord]
    world_sizes: dict[str, int]
    unreachable: dict[str, str]

    def merged(self, later: Votes, asked: Collection[str]) -> Votes:
        """These votes with `later`, the answers of the peers `asked` (by name) once more."""
        unreachable = {n: e for n, e in self.unreachable.items() if n not in asked}
        return Votes(
            [*self.files, *later.files],
            {**self.world_sizes, **later.world_sizes},
            {**unreachable, **later.unreachable},
        )


class Coordinator:
    """Asks the peers to prepare a save and tells them the decision."""

    def __init__(self, peers: Peers) -> None:
        self.peers = peers

    def prepare(self, save: SaveRecord, complete: Callable[[Votes], bool]) -> Votes:
        """Every peer's part of `save`, made durable there. A peer that holds none of it answers
        NOT_FOUND; an unreachable one is listed (the save fails only if it needed that peer);
        any other refusal (a stale epoch, an aborted save) raises.

        A peer known down (its last call or greeting failed: a node lost for good) is not
        waited for: it is asked once within the connect timeout, where it could otherwise hold
        the save of the live nodes' ranks for a connection (or, frozen, for the whole
        prepare_timeout_s). Only if the votes are then not `complete` (it may be back, with
        ranks that wrote to it) is it asked again, as patiently as any peer."""
        request = checkpoint_pb2.PrepareRequest(
            save_id=save.save_id,
            ref=checkpoint_pb2.CheckpointRef(run=save.key.run, step=save.key.step),
            epoch=save.coordination.epoch,
            coordinator=self.peers.node,
        )
        peers = self.peers.all()
        down = {p.address for p in peers if not p.reachable}
        votes = self._ask(request, peers, down)
        late = [p for p in peers if p.address in down and p.name in votes.unreachable]
        if late and not complete(votes):
            votes = votes.merged(self._ask(request, late, set()), {p.name for p in late})
        return votes

    def _ask(
        self, request: checkpoint_pb2.PrepareRequest, peers: list[Peer], brief: set[str]
    ) -> Votes:
        """The votes of `peers`; those at the addresses `brief` get the connect timeout."""
        config = self.peers.config

        def vote(peer: Peer) -> checkpoint_pb2.PrepareResponse:
            brief_one = peer.address in brief
            timeout = config.connect_timeout_s if brief_one else config.prepare_timeout_s
            return peer.cluster().Prepare(request, timeout=timeout)

        answers = self.peers.call(peers, vote, brief)
        files: list[FileRecord] = []
        sizes: dict[str, int] = {}
        unreachable: dict[str, str] = {}
        for peer in peers:
            answer = answers[peer.address]
            if _unreachable(answer):
                assert isinstance(answer, BaseException)
                unreachable[peer.name] = f"{peer.address}: {_describe(answer)}"
                continue
            if isinstance(answer, grpc.RpcError):
                if answer.code() == grpc.StatusCode.NOT_FOUND:
                    continue  # no rank wrote to that node: it holds nothing of this save
                raise error_from_rpc(answer, f"vote of node {peer.name}")
            if isinstance(answer, BaseException):
                raise answer
            assert isinstance(answer, checkpoint_pb2.PrepareResponse)
            sizes[answer.node] = answer.world_size
            files += [FileRecord.from_wire(f) for f in answer.files]
        return Votes(files, sizes, unreachable)

    def decide(
        self,
        save: SaveRecord,
        manifest: Manifest | None,
        reason: str = "",
        retention: checkpoint_pb2.RetentionPolicy | None = None,
        unreachable: Collection[str] = (),
    ) -> None:
        """Tell every peer the outcome (commit with `manifest` and the run's `retention`, else
        abort); a peer that does not hear it asks for it later (Outcome), so failures here are
        only logged, and the peers the vote found `unreachable` (by name) are not waited for."""
        request = checkpoint_pb2.DecideRequest(
            save_id=save.save_id,
            ref=checkpoint_pb2.CheckpointRef(run=save.key.run, step=save.key.step),
            epoch=save.coordination.epoch,
            coordinator=self.peers.node,
            commit=manifest is not None,
            manifest=manifest.to_wire() if manifest is not None else None,
            reason=reason,
            retention=retention,
        )
        peers = [p for p in self.peers.all() if p.name not in unreachable]
        answers = self.peers.call(
            peers, lambda p: p.cluster().Decide(request, timeout=DEFAULT_TIMEOUT_S)
        )
        for peer in peers:
            answer = answers[peer.address]
            if isinstance(answer, BaseException):
                log.warning(
                    "node %s did not take the decision on %s (it will ask): %s",
                    peer.name,
                    save.key,
                    answer,
                )


def check_votes(
    key: CheckpointKey,
    world_size: int,
    files: list[FileRecord],
    votes: Votes,
) -> None:
    """Refuse to commit unless the votes are complete (`vote_problems`)."""
    problems = vote_problems(world_size, files, votes)
    if problems and votes.unreachable:
        problems.append(
            "unreachable: " + "; ".join(f"node {n} ({e})" for n, e in votes.unreachable.items())
        )
    if problems:
        raise FailedPrecondition(f"cannot commit {key}: " + "; ".join(problems))


def vote_problems(world_size: int, files: list[FileRecord], votes: Votes) -> list[str]:
    """What keeps a save of `files` (every node's) from committing: the parts together must hold
    the metadata and every rank's shard, every node agree on the world size, and no file be on
    two nodes."""
    problems = []
    for node, size in sorted(votes.world_sizes.items()):
        if size != world_size:
            problems.append(f"node {node} was told world size {size}, the coordinator {world_size}")
    seen: dict[str, str] = {}
    for f in files:
        if f.path in seen and seen[f.path] != f.node:
            problems.append(f"file {f.path} was written to nodes {seen[f.path]} and {f.node}")
        seen[f.path] = f.node
    if not any(f.kind == METADATA for f in files):
        problems.append("no metadata file")
    ranks = {f.rank for f in files if f.kind == SHARD}
    missing = [r for r in range(world_size) if r not in ranks]
    if missing:
        shown = ", ".join(map(str, missing[:16])) + (" ..." if len(missing) > 16 else "")
        problems.append(f"no shard file from rank(s) {shown} of world size {world_size}")
    return problems


# -- asking peers ----------------------------------------------------------------------------------


def outcome(peers: Peers, save: SaveRecord) -> tuple[int, Manifest | None]:
    """What became of an in-doubt save: its coordinator's word, else any peer's commit.

    A coordinator that answers but knows nothing of it presumes abort; with the coordinator
    unreachable, only a peer that committed it decides (OUTCOME_IN_PROGRESS: keep waiting).
    """
    request = checkpoint_pb2.OutcomeRequest(
        save_id=save.save_id,
        ref=checkpoint_pb2.CheckpointRef(run=save.key.run, step=save.key.step),
        epoch=save.coordination.epoch,
    )
    coordinator = save.coordination
    peers_now = peers.all()
    answers = peers.call(peers_now, lambda p: p.cluster().Outcome(request, timeout=_PEER_TIMEOUT_S))
    for peer in peers_now:
        answer = answers[peer.address]
        if not isinstance(answer, checkpoint_pb2.OutcomeResponse):
            continue
        is_coordinator = peer.address == coordinator.coordinator_address or (
            peer.node and peer.node == coordinator.coordinator
        )
        if answer.outcome == OUTCOME_COMMITTED:
            try:
                return OUTCOME_COMMITTED, manifest_from_peer(
                    answer.manifest, f"peer {peer.address}"
                )
            except InvalidArgument as exc:
                log.warning("%s", exc)  # another peer may answer it well
                continue
        if is_coordinator and answer.outcome in (OUTCOME_ABORTED, OUTCOME_UNKNOWN):
            return OUTCOME_ABORTED, None
    return OUTCOME_IN_PROGRESS, None


def catalogs(peers: Peers, run: str = "") -> dict[str, checkpoint_pb2.CatalogResponse | str]:
    """Every peer's catalog (of `run`): node (or address) -> its answer, or why it has none. A
    peer already known down gets one try, no wait for a connection: a lost node must not cost
    every restore's `latest` the connect timeout (a peer back up is reached within gRPC's
    reconnect backoff, a second)."""
    request = checkpoint_pb2.CatalogRequest(run=run)
    peers_now = peers.all()
    down = {p.address for p in peers_now if not p.reachable}
    answers = peers.call(
        peers_now, lambda p: p.cluster().Catalog(request, timeout=_PEER_TIMEOUT_S), brief=down
    )
    found: dict[str, checkpoint_pb2.CatalogResponse | str] = {}
    for peer in peers_now:
        answer = answers[peer.address]
        if isinstance(answer, checkpoint_pb2.CatalogResponse):
            peer.node = answer.node
            found[answer.node] = answer
        else:
            found[peer.name] = _describe(answer)  # type: ignore[arg-type]
    return found


def read_from_peer(
    peer: Peer, key: CheckpointKey, path: str, offset: int, length: int, peer_connect_timeout: float
) -> tuple[int, bytes]:
    """Bytes [offset, offset+length) of a file as `peer` serves them from its own tiers, and the
    tier that served them: over the peer's data socket when it offers it, else through ReadFile.

    A read is one piece of a restore: it waits for a connection to the peer (`Peer.connect`) only
    when the first try finds none, rather than paying for that check on every piece.
    """
    what = f"read {key}/{path} from node {peer.node}"
    try:
        try:
            return _read_peer_range(peer, key, path, offset, length, what)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE:
                raise
        peer.connect(peer_connect_timeout)  # a peer just restarted: wait out the backoff
        return _read_peer_range(peer, key, path, offset, length, what)
    except grpc.RpcError as exc:
        raise error_from_rpc(exc, what) from None
    except PeerUnreachable as exc:
        raise Unavailable(f"{what}: {exc}") from None


def open_peer_range(
    peer: Peer, key: CheckpointKey, path: str, offset: int, length: int, what: str
) -> RangeConnection | None:
    """A range of a file that `peer` serves from its own tiers, on its way over the peer's data
    socket; None when the peer does not offer it (ReadFile must serve it). Raises grpc.RpcError
    for a refusal (NOT_FOUND: the peer holds no copy)."""
    request = checkpoint_pb2.OpenReadRequest(
        ref=checkpoint_pb2.CheckpointRef(run=key.run, step=key.step),
        path=path,
        offset=offset,
        length=length,
        local_only=True,
    )
    return open_range(peer.checkpoints(), request, _host_of(peer), _PEER_TIMEOUT_S, what, peer.tls)


def open_peer_read(
    peer: Peer, request: checkpoint_pb2.OpenReadRequest
) -> checkpoint_pb2.OpenReadResponse:
    """`peer`'s ticket for the range of `request` from its own copy of the file, with the node
    and the address of its data socket filled in, for a caller that connects to it itself
    (OpenReadRequest.direct). Raises grpc.RpcError for a refusal (NOT_FOUND: no copy there;
    UNIMPLEMENTED: it runs without a data socket)."""
    asked = checkpoint_pb2.OpenReadRequest()
    asked.CopyFrom(request)
    asked.local_only, asked.direct = True, False
    opened = peer.checkpoints().OpenRead(asked, timeout=_PEER_TIMEOUT_S)
    opened.data_host = opened.data_host or _host_of(peer)
    opened.node = peer.node
    return opened


def _host_of(peer: Peer) -> str:
    return peer.address.rsplit(":", 1)[0].strip("[]")


def _read_peer_range(
    peer: Peer, key: CheckpointKey, path: str, offset: int, length: int, what: str
) -> tuple[int, bytes]:
    ref = checkpoint_pb2.CheckpointRef(run=key.run, step=key.step)
    fast = open_peer_range(peer, key, path, offset, length, what)
    if fast is not None:
        with fast:  # one frame for a range within one of the peer's pieces: no copy
            data = b"".join(fast.pieces())
        return fast.tier, data
    fallback = checkpoint_pb2.ReadFileRequest(
        ref=ref, path=path, offset=offset, length=length, local_only=True
    )
    pieces, tier = [], 0
    for reply in peer.checkpoints().ReadFile(fallback, timeout=_PEER_TIMEOUT_S + length / 8e6):
        pieces.append(reply.data)
        tier = reply.tier
    return tier, b"".join(pieces)
