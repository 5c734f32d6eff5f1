"""The rank's own copy mirrored into a peer node's memory at every save, and brought back from
there to a rank that lost its own (--mem-ckpt-every), as Gemini keeps checkpoints in CPU memory
of other machines.

Each rank has a buddy: the rank at its place among the next node's ranks (ranks grouped by
host, the nodes in the order of their first rank, cyclic). Once a save has sealed the rank's own
copy (`own_copy`), the rank sends it to its buddy and receives its ward's (the rank whose buddy
it is), over gloo point-to-point on the checkpointer's own group, straight from and into files
in /dev/shm: no serialization, no ckptd, no commit protocol, no copy beyond the socket's. The
ward's copy is kept as a copy directory of the same format on this node (`peer_dir`), sealed
only once every byte has arrived. A lost node takes its ranks' own copies and the peer copies
it held with it; every rank's state is then still whole on some node.

A restore (`newest_in_memory`) asks every rank which steps its own copies hold and every node
which other copies it holds (peer copies, and own copies that ranks now running elsewhere left
behind: a job re-formed with a spare may number its machines' ranks anew), each verified against
its CRCs; the newest step that every rank can have is chosen, and a rank without its own copy
of it gets it from the node holding one (copied locally when that is its own node).
Point-to-point traffic is bytes that DCP would also have to move; what a memory save
saves is DCP's planning, the gRPC calls and the commit, which cost more than the copy itself
on a small model (bench/mem_ckpt.py).
"""

from __future__ import annotations

import contextlib
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.checkpoint.own_copy import MANIFEST, files_of, sealed_step, world_dir

# What a restore from a peer's memory read, in `Checkpointer.restored_from` ("peer memory@node1").
PEER_MEMORY = "peer memory"
_PEER = "peer"


def peer_dir(run_id: str, host: str, owner: int, world: int) -> Path:
    """Where `host` keeps its peer copies of rank `owner`'s state in a job of `world` ranks (a
    slot directory each)."""
    return world_dir(run_id, host, world) / f"rank{owner}" / _PEER


def buddies(hosts: list[str], rank: int) -> tuple[int | None, int | None]:
    """(the rank this rank mirrors its copy to, the rank whose copy it keeps): the same place
    among the next node's ranks and among the previous node's; None where there is none (one
    node, or a node with fewer ranks)."""
    nodes: dict[str, list[int]] = {}
    for r, host in enumerate(hosts):
        nodes.setdefault(host, []).append(r)
    order = list(nodes.values())
    if len(order) < 2:
        return None, None
    node = next(i for i, ranks in enumerate(order) if rank in ranks)
    place = order[node].index(rank)
    after, before = order[(node + 1) % len(order)], order[node - 1]
    return (
        after[place] if place < len(after) else None,
        before[place] if place < len(before) else None,
    )


@dataclass(frozen=True)
class MemoryRestore:
    """The newest step every rank can restore from memory, and who sends whom its copy."""

    step: int
    # rank without its own copy of `step` -> the rank that sends it the peer copy it holds
    senders: dict[int, int]
    # rank -> the host whose memory its state comes from
    hosts: dict[int, str]


def _survey(owns: list[set[int]], holders: dict[tuple[int, int], int], hosts: list[str]) -> str:
    """One line: the steps each rank's own copies hold and where peer copies of which ranks'
    steps are, for a restart that found no step every rank can have from memory."""
    own = "; ".join(f"rank {r}: {sorted(steps) or 'none'}" for r, steps in enumerate(owns))
    peers = ", ".join(f"rank {r} step {s} on {hosts[h]}" for (r, s), h in sorted(holders.items()))
    return f"own copies {own}; peer copies {peers or 'none'}"


class PeerCopies:
    """This rank's side of the mirror: sends its own copy to its buddy, keeps its ward's, and
    serves the peer copies its node holds to a rank that needs one."""

    def __init__(self, run_id: str, host: str, group: dist.ProcessGroup) -> None:
        self.run_id, self.host, self._group = run_id, host, group
        self.rank = dist.get_rank()
        hosts: list[str | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(hosts, host, group=group)
        self.hosts = [str(h) for h in hosts]
        self.world = len(hosts)
        self.buddy, self.ward = buddies(self.hosts, self.rank)
        # The rank on each host that reports its node's peer copies and sends them.
        self._scanner = min(r for r, h in enumerate(self.hosts) if h == host) == self.rank
        # Peer copies this rank found on its node at the last `newest_in_memory`.
        self._held: dict[tuple[int, int], Path] = {}
        # What every rank held in memory at the last `newest_in_memory`, when no step was whole.
        self.missing = ""
        # Files mapped once and reused by every mirror (path -> tensor).
        self._maps: dict[Path, torch.Tensor] = {}

    def mirror(self, own: Path | None, slot: str) -> int:
        """Send the copy sealed in `own` (None: this rank sealed none) to the buddy and receive
        the ward's into this node's slot `slot` of its peer copies (both at once: every rank
        does both, sealed or not); bytes received."""
        sends = [(self.buddy, own)] if self.buddy is not None else []
        recvs = []
        if self.ward is not None:
            recvs = [(self.ward, peer_dir(self.run_id, self.host, self.ward, self.world) / slot)]
        return self._transfer(sends, recvs, reuse=True)

    def newest_in_memory(self, own_steps: set[int]) -> MemoryRestore | None:
        """The newest step every rank can restore from memory (its own copies, `own_steps` here,
        or a peer copy on another node), or None; a collective of every rank."""
        held: dict[tuple[int, int], Path] = {}
        if self._scanner:
            here = world_dir(self.run_id, self.host, self.world)
            slots = sorted(here.glob(f"rank*/{_PEER}/slot*")) + sorted(here.glob("rank*/slot*"))
            for slot in slots:
                rank_dir = slot.parent.parent if slot.parent.name == _PEER else slot.parent
                step = sealed_step(slot, verify=True)
                if step is not None:
                    held.setdefault((int(rank_dir.name.removeprefix("rank")), step), slot)
        self._held = held
        mine = (sorted(own_steps), sorted(held))
        gathered: list[tuple[list[int], list[tuple[int, int]]] | None] = [None] * self.world
        dist.all_gather_object(gathered, mine, group=self._group)
        owns = [set(g[0]) if g else set() for g in gathered]
        holders: dict[tuple[int, int], int] = {}
        for holder, g in enumerate(gathered):
            for key in map(tuple, g[1] if g else []):
                holders.setdefault(key, holder)  # type: ignore[arg-type]
        for step in sorted(set().union(*owns), reverse=True):
            senders, hosts = {}, {}
            for rank, own in enumerate(owns):
                holder = holders.get((rank, step))
                if step in own:
                    hosts[rank] = self.hosts[rank]
                elif holder is not None:
                    senders[rank], hosts[rank] = holder, self.hosts[holder]
                else:
                    break
            else:
                return MemoryRestore(step, senders, hosts)
        self.missing = _survey(owns, holders, self.hosts)
        return None

    def bring_back(self, plan: MemoryRestore, into: Path) -> int:
        """Send the peer copies of `plan` this rank serves; receive this rank's own into `into`
        (a slot of its own copy) if it lacks it; bytes received. A collective of every rank."""
        if plan.senders.get(self.rank) == self.rank:  # a copy on this rank's own node, found here
            return _copy_sealed(self._held[(self.rank, plan.step)], into)
        sends = [
            (rank, self._held[(rank, plan.step)])
            for rank, sender in plan.senders.items()
            if sender == self.rank and rank != self.rank
        ]
        sender = plan.senders.get(self.rank)
        recvs = [(sender, into)] if sender is not None else []
        return self._transfer(sends, recvs, reuse=False)

    def remove(self) -> None:
        """Free the ward's peer copies (the run ended)."""
        if self.ward is not None:
            with contextlib.suppress(OSError):
                shutil.rmtree(peer_dir(self.run_id, self.host, self.ward, self.world).parent)

    def _transfer(
        self, sends: list[tuple[int, Path | None]], recvs: list[tuple[int, Path]], reuse: bool
    ) -> int:
        """Send each sealed copy directory of `sends` to its rank and receive one from each rank
        of `recvs` into its directory, which is unsealed first and sealed once whole: the
        manifest's size, the manifest, then every file its buffers are in; bytes received. A
        directory of None, or one not sealed, sends a size of 0 and nothing else."""
        outgoing = [(dst, src, _manifest(src)) for dst, src in sends]
        for _, into in recvs:
            into.mkdir(parents=True, exist_ok=True)
            (into / MANIFEST).unlink(missing_ok=True)
        group = self._group
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in recvs]
        _wait(
            [dist.isend(torch.tensor([len(m)]), dst, group=group) for dst, _, m in outgoing]
            + [dist.irecv(n, src, group=group) for n, (src, _) in zip(sizes, recvs, strict=True)]
        )
        manifests = [torch.empty(int(n.item()), dtype=torch.uint8) for n in sizes]
        _wait(
            [dist.isend(_as_tensor(m), dst, group=group) for dst, _, m in outgoing if m]
            + [
                dist.irecv(m, src, group=group)
                for m, (src, _) in zip(manifests, recvs, strict=True)
                if m.numel()
            ]
        )
        works, nbytes = [], 0
        for dst, src, manifest in outgoing:
            if not manifest or src is None:
                continue
            for name, size in files_of(pickle.loads(manifest)[1]):
                works.append(dist.isend(self._map(src / name, size, reuse, create=False), dst,
                                        group=group))  # fmt: skip
        received = [m.numpy().tobytes() for m in manifests]
        for (src, into), manifest in zip(recvs, received, strict=True):
            if not manifest:
                continue
            for name, size in files_of(pickle.loads(manifest)[1]):
                works.append(dist.irecv(self._map(into / name, size, reuse, create=True), src,
                                        group=group))  # fmt: skip
                nbytes += size
        _wait(works)
        for (_, into), manifest in zip(recvs, received, strict=True):
            if not manifest:
                continue
            temp = into / f"{MANIFEST}.tmp"
            temp.write_bytes(manifest)
            temp.rename(into / MANIFEST)
        return nbytes

    def _map(self, path: Path, size: int, reuse: bool, create: bool) -> torch.Tensor:
        """The first `size` bytes of the file at `path`, mapped shared (writes reach the file);
        created anew when `create` (the bytes to come replace it)."""
        mapped = self._maps.get(path) if reuse else None
        if mapped is not None and mapped.numel() == size:
            return mapped
        if create:
            path.unlink(missing_ok=True)
        tensor = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
        if reuse:
            self._maps[path] = tensor
        return tensor


def _copy_sealed(source: Path, into: Path) -> int:
    """Copy the sealed copy in `source` into `into` (unsealed first, sealed once whole, as a
    transfer does); bytes copied."""
    manifest = _manifest(source)
    into.mkdir(parents=True, exist_ok=True)
    (into / MANIFEST).unlink(missing_ok=True)
    nbytes = 0
    for name, size in files_of(pickle.loads(manifest)[1]):
        (into / name).unlink(missing_ok=True)  # another process may have it mapped
        shutil.copyfile(source / name, into / name)
        nbytes += size
    temp = into / f"{MANIFEST}.tmp"
    temp.write_bytes(manifest)
    temp.rename(into / MANIFEST)
    return nbytes


def _manifest(directory: Path | None) -> bytes:
    """The sealed manifest of the copy in `directory`; empty when there is none."""
    if directory is None:
        return b""
    try:
        return (directory / MANIFEST).read_bytes()
    except OSError:
        return b""


def _as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _wait(works: list[dist.Work | None]) -> None:
    for work in works:
        if work is not None:
            work.wait()
