"""Asynchronous checkpoints of the whole training state, saved to and restored from ckptd, and
the policy of when to save and where to resume.

A save copies the state into reused host buffers (`HostStager`) and a background thread runs DCP
with scaletrain's storage writer, on a process group of its own so its collectives never
interleave with the training loop's. The copy is lazy, as DataStates-LLM's: the model and
optimizer state change only in the next optimizer step, so the background thread copies them
while the next step's forward and backward run, and the loop waits for that copy only before the
optimizer step (`wait_staged`, which `train_step` calls); the small parts that change before it
(step, data loader, LR schedule, RNGs, FP8 histories) are copied at once. At most one save is in
flight: a new durable request waits for it (policy "wait") or is skipped on every rank alike
(policy "skip"). A background failure is never swallowed: `poll` hands it to the loop at the
next step.

Two kinds of save: durable every `every` steps and at the last (ckptd's memory, SSD and S3
tiers), and with `mem_every` K a memory-only one every K-th step in between (ckptd keeps it in
its node's memory and one peer's, and drops it once a newer durable step exists), so that a lost
rank or node costs at most K steps. A memory save never stalls the loop: one due while the
previous save still streams is skipped on every rank alike, whatever the policy.

DCP serializes each tensor with `torch.save`, which by default computes a CRC-32 of every record
of its zip format: a pass over every byte, under the GIL of the training process. ckptd already
checks a CRC-32C of every 256 KiB block on the wire and at rest, so the background save turns
the zip CRC off (`torch.utils.serialization.config.save.compute_crc32`; torch.load reads such
files as any other), and torch.save then hands the storages over as they are, without a copy.

The state holds the model and optimizer (sharded DTensors, so DCP reshards them on load), the LR
schedule, the step, the data loader's global sample index, each rank's RNG states, and with FP8
delayed scaling the amax histories (replicated on every rank, so saved once).
"""

from __future__ import annotations

import contextlib
import enum
import math
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor
from torch.utils.serialization import config as serialization_config

from ckptd.dcp import CkptdStorageReader, CkptdStorageWriter, first_cause
from ckptd.readpath import describe_sources
from scaletrain.errors import ScaletrainError
from scaletrain.v1 import checkpoint_pb2
from trainer.checkpoint import rng
from trainer.checkpoint.own_copy import (
    OWN_MEMORY,
    Damaged,
    OwnCopy,
    Unusable,
    copy_dir,
    sealed_step,
)
from trainer.checkpoint.peer_copy import PEER_MEMORY, PeerCopies
from trainer.checkpoint.resume import (
    ResumeRecords,
    check_config,
    check_offsets,
    check_world,
    latest_step,
)
from trainer.checkpoint.stager import HostStager, tensor_bytes
from trainer.config import TrainConfig
from trainer.data.loader import DeterministicLoader
from trainer.fp8 import Fp8Training
from trainer.reporting import rank_host


@contextlib.contextmanager
def _without_zip_crc32() -> Iterator[None]:
    """torch.save without the CRC-32 of its zip records, for the span of a save (module doc)."""
    before = serialization_config.save.compute_crc32
    serialization_config.save.compute_crc32 = False
    try:
        yield
    finally:
        serialization_config.save.compute_crc32 = before


class SavePolicy(enum.StrEnum):
    """What a save request does while the previous save is still streaming."""

    WAIT = "wait"
    SKIP = "skip"


class SaveKind(enum.StrEnum):
    """Where a save goes: every tier of ckptd, or its memory only (see the module doc)."""

    DURABLE = "durable"
    MEMORY = "memory"


# The parts of the state that change only in the optimizer step: staged in the background.
_LAZY_PARTS = ("model", "optim")


@dataclass(frozen=True)
class SaveStarted:
    step: int
    # The synchronous part: the small parts of the state, copied at once (module doc).
    blocking_s: float
    staged_bytes: int
    kind: SaveKind = SaveKind.DURABLE


@dataclass(frozen=True)
class SaveDone:
    """A background save that ended; `error` is set when it failed."""

    step: int
    blocking_s: float
    background_s: float
    staged_bytes: int
    info: checkpoint_pb2.CheckpointInfo | None  # set on the coordinator
    error: BaseException | None = None


class _Slot:
    """A set of staging buffers and the own copy they make (None: no shared memory here)."""

    def __init__(self, own: OwnCopy | None) -> None:
        self.own = own
        self.stager = HostStager(own.allocate if own is not None else None)


class Checkpointer:
    """Saves this rank's part of the training state every `every` steps and at `last_step` (never
    when `every` is 0), memory-only every `mem_every` steps in between (never when 0), and
    restores it."""

    def __init__(
        self,
        address: str,
        run_id: str,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        loader: DeterministicLoader,
        policy: SavePolicy = SavePolicy.WAIT,
        replicas: int = 0,
        fp8: Fp8Training | None = None,
        timeout: timedelta | None = None,
        config: str = "",
        every: int = 0,
        last_step: int = 0,
        mem_every: int = 0,
    ) -> None:
        self.address, self.run_id = address, run_id
        self.every, self.last_step, self.mem_every = every, last_step, mem_every
        # Memory saves due and skipped because the previous save still streamed.
        self.memory_due = self.memory_skipped = 0
        # The run's resolved job config (TOML), saved in every checkpoint for resume to compare.
        self.config = config
        self.model, self.optimizer = model, optimizer
        self.scheduler, self.loader = scheduler, loader
        self.policy = policy
        self.replicas = replicas
        # Bytes the last restore read from each copy, over every rank ("memory@node0", "s3").
        self.restored_from: dict[str, int] = {}
        self.fp8 = fp8
        self.rank = dist.get_rank()
        # Background saves run their collectives here, never on the training loop's group.
        self._group = dist.new_group(backend="gloo", timeout=timeout)
        self._timeout = timeout
        # Staging buffers, each set also the rank's own copy of the step it holds, which
        # outlives this process (own_copy). On CPU two sets take turns, so that while a save
        # streams the copy of the step before it, likely the latest committed, stays whole; on
        # a GPU the buffers are pinned host memory, no copy: one set.
        own_dir = copy_dir(run_id, rank_host(), self.rank, dist.get_world_size())
        sets = 1 if own_dir is None or torch.cuda.is_available() else 2
        self._slots = [
            _Slot(OwnCopy(own_dir / f"slot{i}") if own_dir is not None else None)
            for i in range(sets)
        ]
        # With memory saves, each own copy is mirrored into a peer node's memory (peer_copy).
        self._peers = (
            PeerCopies(run_id, rank_host(), self._group) if mem_every and own_dir else None
        )
        # The host whose memory the last restore brought this rank's state back from.
        self._brought_from = ""
        # get_state_dict's model and optimizer state, reused (`_model_and_optim`).
        self._live: tuple[dict[str, Any], dict[str, Any]] | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self._inflight: Future[SaveDone] | None = None
        self._inflight_started: SaveStarted | None = None
        # Set once the save in flight has copied the model and optimizer (`wait_staged`).
        self._staged = threading.Event()
        self._staged.set()
        # The device copies of the lazy staging run on a stream of their own.
        self._stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        self._done: list[SaveDone] = []

    def _state(self, step: int) -> dict[str, Any]:
        model_state, optim_state = self._model_and_optim()
        state = {
            "model": model_state,
            "optim": optim_state,
            "train": {
                "step": step,
                "loader": self.loader.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "config": self.config,
                # The ranks it was saved by: a resume at another number (elastic) says so.
                "world": dist.get_world_size(),
            },
            "rng": {rng.key(self.rank): rng.capture()},
        }
        fp8_state = self.fp8.state_dict() if self.fp8 is not None else {}
        if fp8_state:
            state["fp8"] = fp8_state
        return state

    def _model_and_optim(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """`get_state_dict` of the model and optimizer, from the first call that holds only live
        tensors on reused at every save with the optimizer's hyperparameters read anew.

        get_state_dict walks every parameter and every optimizer state to key them by name, on
        the training thread, at every save: with a memory save at every step that walk is most
        of what the save costs the loop (bench/mem_ckpt.py). Its tensors are the live ones (the
        sharded parameters, the optimizer's states, updated in place), so the same dictionary
        holds each later step's values; what it copies (the param groups' hyperparameters) is
        read again. It is reused only once every tensor in it is checked to be live, and the
        hyperparameters read again to equal what it gave; a restore, which replaces the
        optimizer's states, drops it."""
        if self._live is not None:
            model_state, optim_state = self._live
            return model_state, {**optim_state, "param_groups": self._groups(optim_state)}
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        if self._all_live(model_state, optim_state):
            with contextlib.suppress(RuntimeError):  # a tensor hyperparameter: never reused
                if self._groups(optim_state) == optim_state["param_groups"]:
                    self._live = (model_state, optim_state)
        return model_state, optim_state

    def _groups(self, optim_state: dict[str, Any]) -> list[dict[str, Any]]:
        """The optimizer's param groups now, keyed as `optim_state`'s (parameters by name)."""
        return [
            {**{k: v for k, v in live.items() if k != "params"}, "params": named["params"]}
            for live, named in zip(
                self.optimizer.param_groups, optim_state["param_groups"], strict=True
            )
        ]

    def _all_live(self, model_state: dict[str, Any], optim_state: dict[str, Any]) -> bool:
        """Whether every tensor of the state is a live parameter, buffer or optimizer state
        (its storage theirs), and the optimizer has a state for every parameter it steps."""
        stepped = [p for group in self.optimizer.param_groups for p in group["params"]]
        if len(self.optimizer.state) < len(stepped):
            return False  # states are made at the first step: not yet
        live = {_storage(t) for t in (*self.model.parameters(), *self.model.buffers())}
        for state in self.optimizer.state.values():
            live.update(_storage(t) for t in state.values() if isinstance(t, torch.Tensor))
        return all(_storage(t) in live for t in _tensors(model_state)) and all(
            _storage(t) in live for t in _tensors(optim_state["state"])
        )

    def kind(self, step: int) -> SaveKind | None:
        """The save due after `step`: durable every `every` steps and at the last step,
        memory-only every `mem_every` steps in between; None when none is."""
        if self.every and (step % self.every == 0 or step == self.last_step):
            return SaveKind.DURABLE
        if self.mem_every and step % self.mem_every == 0:
            return SaveKind.MEMORY
        return None

    def _slot(self, step: int) -> _Slot:
        """The staging buffers a save of `step` uses: the sets take turns by the save's place in
        the run (`_ordinal`), the same on every rank and in every generation of the job. A save
        after a restore of step s then never overwrites s's copies, own or a peer's: until it is
        sealed, s stays whole for a failure during it (a count of saves since the process
        started would reuse s's set half the time)."""
        return self._slots[self._ordinal(step) % len(self._slots)]

    def _ordinal(self, step: int) -> int:
        """How many saves are due at steps 1..`step` (`kind`), skipped ones included."""
        durable = step // self.every if self.every else 0
        memory = step // self.mem_every if self.mem_every else 0
        both = step // math.lcm(self.every, self.mem_every) if durable and memory else 0
        last = self.every and self.last_step <= step and self.last_step % self.every != 0
        last = last and not (self.mem_every and self.last_step % self.mem_every == 0)
        return durable + memory - both + int(bool(last))

    def should_save(self, step: int) -> bool:
        """Whether the loop saves after `step` (`kind`). A memory save due while the previous
        save still streams on some rank is not: every rank decides it together (a collective,
        at every step a memory save is due), so the loop never waits for one."""
        kind = self.kind(step)
        if kind is SaveKind.MEMORY:
            self.memory_due += 1
            if self._any_rank_busy():
                self.memory_skipped += 1
                return False
        return kind is not None

    def save(self, step: int, labels: dict[str, str]) -> SaveStarted | None:
        """Copy the small parts of the state, start the background copy of the model and
        optimizer and the streaming; None when skipped by policy (on every rank)."""
        kind = self.kind(step) or SaveKind.DURABLE
        if kind is SaveKind.DURABLE and self.policy is SavePolicy.SKIP and self._any_rank_busy():
            return None
        self._collect(block=True)
        start = time.perf_counter()
        slot = self._slot(step)
        state = self._state(step)
        if slot.own is not None:
            slot.own.invalidate()  # its buffers are about to hold another step
            if not slot.own.reserved:
                slot.own.reserve(tensor_bytes(state))
        lazy = {part: state.pop(part) for part in _LAZY_PARTS}
        staged = slot.stager.stage(state)
        nbytes = slot.stager.staged_bytes + tensor_bytes(lazy)
        ready = None
        if self._stream is not None:  # the copies wait for the optimizer step's kernels
            ready = torch.cuda.Event()
            ready.record()
        self._staged.clear()
        started = SaveStarted(step, time.perf_counter() - start, nbytes, kind)
        self._inflight = self._executor.submit(
            self._stage_and_write, slot, staged, lazy, ready, started, labels
        )
        self._inflight_started = started
        return started

    def unfinished(self) -> SaveStarted | None:
        """The save in flight (started, not ended yet), if any."""
        if self._inflight is None or self._inflight.done():
            return None
        return self._inflight_started

    def wait_staged(self) -> None:
        """Block until the save in flight has copied the model and optimizer state: the loop
        calls it before anything changes that state (the next optimizer step, a restore)."""
        self._staged.wait()

    def _stage_and_write(
        self,
        slot: _Slot,
        staged: dict[str, Any],
        lazy: dict[str, Any],
        ready: torch.cuda.Event | None,
        started: SaveStarted,
        labels: dict[str, str],
    ) -> SaveDone:
        """The background half of a save: copy `lazy` (the model and optimizer) beside the
        `staged` small parts, let the loop go on to its optimizer step, then stream it all."""
        try:
            if self._stream is not None and ready is not None:
                self._stream.wait_event(ready)
                with torch.cuda.stream(self._stream):
                    staged |= slot.stager.stage(lazy, self._stream)
            else:
                staged |= slot.stager.stage(lazy)
            sealed = slot.own is not None and slot.own.seal(
                started.step, staged, slot.stager.buffers
            )
        except Exception as exc:  # the loop hears of it at the next poll, as of a failed write
            return SaveDone(started.step, started.blocking_s, 0.0, started.staged_bytes, None, exc)
        finally:
            self._staged.set()  # the loop may change the live state from now on
        if started.kind is SaveKind.MEMORY or self._peers is not None:
            start = time.perf_counter()
            try:
                if self._peers is not None and slot.own is not None:
                    self._peers.mirror(slot.own.directory if sealed else None, slot.own.name)
                in_memory = self._all(sealed)
            except Exception as exc:  # a peer lost mid-copy: the step is not in its memory
                took = time.perf_counter() - start
                return SaveDone(started.step, started.blocking_s, took, started.staged_bytes,
                                None, exc)  # fmt: skip
            if started.kind is SaveKind.MEMORY and in_memory:
                # Every rank's copy is in its node's memory and a peer node's: done, without
                # ckptd. Without one (no shared memory here), ckptd keeps it in memory.
                took = time.perf_counter() - start
                return SaveDone(started.step, started.blocking_s, took, started.staged_bytes, None)
        return self._write(staged, started, labels)

    def _all(self, sealed: bool) -> bool:
        """Whether every rank sealed its own copy: a collective of the background saves' group
        (the thread that runs it owns that group)."""
        flag = torch.tensor([int(sealed)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._group)
        return bool(flag.item())

    def _any_rank_busy(self) -> bool:
        busy = torch.tensor([int(self._inflight is not None and not self._inflight.done())])
        # The training loop's group (never the background saves' group, which a save may be
        # using right now from its thread); NCCL reduces only device tensors.
        if dist.get_backend() == "nccl":
            busy = busy.cuda()
        dist.all_reduce(busy, op=dist.ReduceOp.MAX)
        return bool(busy.item())

    def _write(
        self,
        staged: dict[str, Any],
        started: SaveStarted,
        labels: dict[str, str],
    ) -> SaveDone:
        start, step = time.perf_counter(), started.step
        memory_only = started.kind is SaveKind.MEMORY
        writer = CkptdStorageWriter(
            self.address,
            self.run_id,
            step,
            labels=labels,
            replicas=0 if memory_only else self.replicas,
            memory_only=memory_only,
        )
        error: BaseException | None = None
        try:
            with _without_zip_crc32():
                dcp.save(staged, storage_writer=writer, process_group=self._group)
        # CheckpointException derives from BaseException: name it, or it escapes into the loop.
        except (Exception, CheckpointException) as exc:  # the loop hears of any failure, later
            error = first_cause(exc) if isinstance(exc, CheckpointException) else exc
            with contextlib.suppress(ScaletrainError):  # ckptd collects abandoned saves anyway
                writer.abort(f"save of step {step} failed: {error}")
        finally:
            writer.close()
        info = writer.committed if error is None else None
        background = time.perf_counter() - start
        return SaveDone(step, started.blocking_s, background, started.staged_bytes, info, error)

    def _collect(self, block: bool) -> None:
        if self._inflight is not None and (block or self._inflight.done()):
            self._done.append(self._inflight.result())
            self._inflight = None

    def poll(self) -> list[SaveDone]:
        """Saves that ended since the last call (successes and failures), without waiting."""
        self._collect(block=False)
        done, self._done = self._done, []
        return done

    def finish(self) -> list[SaveDone]:
        """Wait for the save in flight; returns every save that ended since the last poll."""
        self._collect(block=True)
        return self.poll()

    def close(self) -> None:
        self._collect(block=True)
        self._executor.shutdown(wait=True)
        dist.destroy_process_group(self._group)
        for slot in self._slots:
            if slot.own is not None:
                slot.own.remove()  # the run's last step is committed: nothing to restart from
        if self._peers is not None:
            self._peers.remove()
        if self.memory_due and self.rank == 0:
            print(
                f"[trainer] memory checkpoints: {self.memory_skipped} of {self.memory_due} "
                "skipped, the previous save still streaming (--mem-ckpt-every)",
                flush=True,
            )

    def load(self, step: int) -> dict[str, Any]:
        """Restore every part of the state saved at `step`; returns the `train` entry. Each rank
        whose own copy holds `step` intact restores from it; the others (a replaced node's, a
        damaged copy's) read ckptd together, resharding, and only they."""
        state = self._state(step)
        own, copied = self._restore_own(step, state)
        intact: list[bool | None] = [None] * dist.get_world_size(self._group)
        dist.all_gather_object(intact, own is not None, group=self._group)
        readers = [rank for rank, ok in enumerate(intact) if not ok]
        # Only they read, in a group of their own (DCP's load is a collective of its readers;
        # made by every rank, as any group is). Each rank's own copy holds exactly its shards.
        group = self._group
        if readers and len(readers) < len(intact):
            group = dist.new_group(ranks=readers, backend="gloo", timeout=self._timeout)
        if own is not None and self._brought_from:
            state, served = own, {f"{PEER_MEMORY}@{self._brought_from}": copied}
        elif own is not None:
            state, served = own, {f"{OWN_MEMORY}@{rank_host()}": copied}
        else:
            served = self._read(step, state, group)
            if group is not self._group:
                dist.destroy_process_group(group)
        self.restored_from = _summed(served, self._group)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        self._live = None  # the optimizer's states are new tensors now
        train = state["train"]
        self.scheduler.load_state_dict(train["scheduler"])
        self.loader.load_state_dict(train["loader"])
        if "rng" in state:
            rng.restore(state["rng"][rng.key(self.rank)])
        if "fp8" in state:
            self.fp8.load_state_dict(state["fp8"])
        return train

    def _restore_own(self, step: int, state: dict[str, Any]) -> tuple[dict[str, Any] | None, int]:
        """`state` filled from this rank's own copy of `step` and the bytes it copied, or None
        when no copy holds `step` intact. A copy that fails a check is never loaded, and its
        rank says why."""
        for own in (slot.own for slot in self._slots if slot.own is not None):
            try:
                return own.restore_into(step, state)
            except Damaged as exc:
                print(
                    f"[trainer] rank {self.rank}: its own copy of step {step} is not used: "
                    f"{exc}; restoring from another copy",
                    flush=True,
                )
            except Unusable:
                continue  # none sealed, or another step's: the other copy may hold it
        return None, 0

    def _read(
        self, step: int, state: dict[str, Any], group: dist.ProcessGroup | None
    ) -> dict[str, int]:
        """Fill `state` in place with checkpoint `step` from ckptd (DCP, resharding), a collective
        of `group`; returns the bytes read per copy."""
        reader = CkptdStorageReader(self.address, self.run_id, step)
        try:
            saved_keys = reader.read_metadata().state_dict_metadata
            if f"rng.{rng.key(self.rank)}" not in saved_keys:
                # A rank the saving job did not have (a larger world): its generators start fresh.
                del state["rng"]
            if "train.config" not in saved_keys:
                del state["train"]["config"]  # saved before checkpoints kept their config
            if "train.world" not in saved_keys:
                del state["train"]["world"]  # saved before checkpoints kept their world size
            if "fp8" in state and not any(key.startswith("fp8.") for key in saved_keys):
                # Saved without delayed scaling: the histories start empty, as in a new run.
                del state["fp8"]
            dcp.load(state, storage_reader=reader, process_group=group)
        except CheckpointException as exc:
            cause = first_cause(exc)
            raise ScaletrainError(f"restoring step {step} failed: {cause}") from cause
        finally:
            reader.close()
        return dict(reader.client.served)

    def resume(self, cfg: TrainConfig, records: ResumeRecords) -> int:
        """Restore the run's latest committed checkpoint and return its step (0: the run has
        none, and starts at step 0); refuse if the job config changed in ways that alter
        results, or telemetry's `records` disagree with it.

        The one decision for the whole job, made from what ckptd knows of the run id: every
        start of the job asks, whatever torchrun's restart count on this agent says (it counts
        from 0 again on a replaced node or a restarted pod). ckptd serves the step from its
        fastest tier with a verified copy: memory first, then SSD, then S3. With --resume a run
        without a checkpoint is refused.
        """
        required = cfg.resume
        in_memory = None
        if self._peers is not None:
            own_steps = {sealed_step(s.own.directory, verify=True) for s in self._slots if s.own}
            in_memory = self._peers.newest_in_memory(own_steps - {None})  # type: ignore[arg-type]
        step = latest_step(
            self.address,
            self.run_id,
            self.rank,
            cfg.resume_wait_s,
            required,
            in_memory.step if in_memory is not None else -1,
        )
        if self._peers is not None and in_memory is None and step >= 0 and self.rank == 0:
            print(
                f"[trainer] no step every rank can restore from memory ({self._peers.missing}); "
                f"restoring step {step} through ckptd",
                flush=True,
            )
        if in_memory is not None and step == in_memory.step:
            # The ranks without their own copy get it from the peer node that holds it, into
            # the slot a save of that step uses, whence `load` restores it as every rank's own
            # (and the next save leaves it whole).
            into = self._slot(in_memory.step).own
            assert into is not None  # peers exist only with own copies
            self._peers.bring_back(in_memory, into.directory)  # type: ignore[union-attr]
            if self.rank in in_memory.senders:
                self._brought_from = in_memory.hosts[self.rank]
        if step < 0:
            if self.rank == 0:
                print(
                    f"[trainer] run {self.run_id}: no checkpoint yet, starting at step 0",
                    flush=True,
                )
            return 0
        train_state = self.load(step)
        self._brought_from = ""
        check_config(cfg, step, train_state.get("config", ""), records, self.rank)
        saved_world = int(train_state.get("world", 0))
        check_world(step, saved_world, records, self.rank)
        expected = self.loader.offset()
        recorded = records.resume_offsets(step)
        if recorded is not None and (recorded or required):
            # The slices are the same at the same size and data-parallel degree (a record per
            # data-parallel rank). The size first: a node lost after the save took its ranks'
            # records with it, and fewer records can pass for a smaller degree.
            same = saved_world in (0, dist.get_world_size())  # 0: saved before it was kept
            same = same and len(recorded) == self.loader.dp_size
            check_offsets(self.run_id, step, self.rank, expected, recorded, same)
        elif recorded is not None and self.rank == 0:
            # A rank killed right after the save took its unsent records of the step with it.
            print(
                f"[trainer] telemetry has no record of step {step} (lost with the failed "
                "attempt): resuming at the checkpoint's own data-loader offsets",
                flush=True,
            )
        if self.rank == 0:
            print(
                f"[trainer] resumed run {self.run_id} from step {train_state['step']} "
                f"(global sample {expected.global_sample}); read "
                f"{describe_sources(self.restored_from)}",
                flush=True,
            )
        return int(train_state["step"])


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a nested state (a DTensor's local shard)."""
    if isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, list):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, torch.Tensor):
        yield value


def _storage(tensor: torch.Tensor) -> int:
    """Where a tensor's bytes live (a DTensor's local shard's)."""
    with torch.no_grad():
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.untyped_storage().data_ptr()


def _summed(counts: Mapping[str, int], group: dist.ProcessGroup) -> dict[str, int]:
    """`counts` added up over every rank of `group` (each rank read its own ranges)."""
    gathered: list[dict[str, int] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, dict(counts), group=group)
    total: Counter[str] = Counter()
    for one in gathered:
        total.update(one or {})
    return dict(sorted(total.items()))
