"""Asynchronous checkpoints of the whole training state, saved to and restored from ckptd, and
the policy of when to save and where to resume.

A save blocks training only while the state is copied into reused host buffers (`HostStager`);
a background thread then runs DCP with scaletrain's storage writer, on a process group of its own
so its collectives never interleave with the training loop's. At most one save is in flight: a new
request waits for it (policy "wait") or is skipped on every rank alike (policy "skip"). A
background failure is never swallowed: `poll` hands it to the loop at the next step.

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
from torch.utils.serialization import config as serialization_config

from ckptd.dcp import CkptdStorageReader, CkptdStorageWriter, first_cause
from ckptd.readpath import describe_sources
from scaletrain.errors import ScaletrainError
from scaletrain.v1 import checkpoint_pb2
from trainer.checkpoint import rng
from trainer.checkpoint.resume import ResumeRecords, check_config, check_offsets, latest_step
from trainer.checkpoint.stager import HostStager
from trainer.config import TrainConfig
from trainer.data.loader import DeterministicLoader
from trainer.fp8 import Fp8Training


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


@dataclass(frozen=True)
class SaveStarted:
    step: int
    blocking_s: float
    staged_bytes: int


@dataclass(frozen=True)
class SaveDone:
    """A background save that ended; `error` is set when it failed."""

    step: int
    blocking_s: float
    background_s: float
    staged_bytes: int
    info: checkpoint_pb2.CheckpointInfo | None  # set on the coordinator
    error: BaseException | None = None


class Checkpointer:
    """Saves this rank's part of the training state every `every` steps and at `last_step` (never
    when `every` is 0), and restores it."""

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
    ) -> None:
        self.address, self.run_id = address, run_id
        self.every, self.last_step = every, last_step
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
        self._stager = HostStager()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self._inflight: Future[SaveDone] | None = None
        self._done: list[SaveDone] = []

    def _state(self, step: int) -> dict[str, Any]:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        state = {
            "model": model_state,
            "optim": optim_state,
            "train": {
                "step": step,
                "loader": self.loader.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "config": self.config,
            },
            "rng": {rng.key(self.rank): rng.capture()},
        }
        fp8_state = self.fp8.state_dict() if self.fp8 is not None else {}
        if fp8_state:
            state["fp8"] = fp8_state
        return state

    def should_save(self, step: int) -> bool:
        """Whether the loop saves after `step`: every `every` steps, and the last step."""
        return bool(self.every) and (step % self.every == 0 or step == self.last_step)

    def save(self, step: int, labels: dict[str, str]) -> SaveStarted | None:
        """Stage the state and start streaming it; None when skipped by policy (on every rank)."""
        if self.policy is SavePolicy.SKIP and self._any_rank_busy():
            return None
        self._collect(block=True)
        start = time.perf_counter()
        staged = self._stager.stage(self._state(step))
        blocking = time.perf_counter() - start
        nbytes = self._stager.staged_bytes
        self._inflight = self._executor.submit(self._write, staged, step, labels, blocking, nbytes)
        return SaveStarted(step, blocking, nbytes)

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
        step: int,
        labels: dict[str, str],
        blocking: float,
        nbytes: int,
    ) -> SaveDone:
        start = time.perf_counter()
        writer = CkptdStorageWriter(
            self.address, self.run_id, step, labels=labels, replicas=self.replicas
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
        return SaveDone(step, blocking, time.perf_counter() - start, nbytes, info, error)

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

    def load(self, step: int) -> dict[str, Any]:
        """Restore every part of the state saved at `step`; returns the `train` entry."""
        state = self._state(step)
        reader = CkptdStorageReader(self.address, self.run_id, step)
        try:
            saved_keys = reader.read_metadata().state_dict_metadata
            if f"rng.{rng.key(self.rank)}" not in saved_keys:
                # A rank the saving job did not have (a larger world): its generators start fresh.
                del state["rng"]
            if "train.config" not in saved_keys:
                del state["train"]["config"]  # saved before checkpoints kept their config
            if "fp8" in state and not any(key.startswith("fp8.") for key in saved_keys):
                # Saved without delayed scaling: the histories start empty, as in a new run.
                del state["fp8"]
            dcp.load(state, storage_reader=reader)
        except CheckpointException as exc:
            cause = first_cause(exc)
            raise ScaletrainError(f"restoring step {step} failed: {cause}") from cause
        finally:
            reader.close()
        self.restored_from = _summed(reader.client.served, self._group)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        train = state["train"]
        self.scheduler.load_state_dict(train["scheduler"])
        self.loader.load_state_dict(train["loader"])
        if "rng" in state:
            rng.restore(state["rng"][rng.key(self.rank)])
        if "fp8" in state:
            self.fp8.load_state_dict(state["fp8"])
        return train

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
        step = latest_step(self.address, self.run_id, self.rank, cfg.resume_wait_s, required)
        if step < 0:
            if self.rank == 0:
                print(
                    f"[trainer] run {self.run_id}: no checkpoint yet, starting at step 0",
                    flush=True,
                )
            return 0
        train_state = self.load(step)
        check_config(cfg, step, train_state.get("config", ""), records, self.rank)
        expected = self.loader.offset()
        recorded = records.resume_offsets(step)
        if recorded is not None and (recorded or required):
            check_offsets(self.run_id, step, self.rank, expected, recorded, self.loader.dp_size)
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


def _summed(counts: Mapping[str, int], group: dist.ProcessGroup) -> dict[str, int]:
    """`counts` added up over every rank of `group` (each rank read its own ranges)."""
    gathered: list[dict[str, int] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, dict(counts), group=group)
    total: Counter[str] = Counter()
    for one in gathered:
        total.update(one or {})
    return dict(sorted(total.items()))
