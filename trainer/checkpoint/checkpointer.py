"""The training state as one DCP state dict, saved to and restored from ckptd.

The state holds the model and optimizer (sharded DTensors, so DCP reshards them on load), the LR
schedule, the step and the data loader's global sample index. Loading goes through the same
`CkptdStorageReader` any PyTorch program can use.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ckptd.dcp import CkptdStorageReader, CkptdStorageWriter, first_cause
from scaletrain.errors import ScaletrainError
from scaletrain.v1 import checkpoint_pb2
from trainer.data.loader import DeterministicLoader


@dataclass(frozen=True)
class SaveResult:
    step: int
    seconds: float
    info: checkpoint_pb2.CheckpointInfo | None  # set on the coordinator


class Checkpointer:
    def __init__(
        self,
        address: str,
        run_id: str,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        loader: DeterministicLoader,
    ) -> None:
        self.address, self.run_id = address, run_id
        self.model, self.optimizer = model, optimizer
        self.scheduler, self.loader = scheduler, loader

    def _state(self, step: int) -> dict[str, Any]:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {
            "model": model_state,
            "optim": optim_state,
            "train": {
                "step": step,
                "loader": self.loader.state_dict(),
                "scheduler": self.scheduler.state_dict(),
            },
        }

    def save(self, step: int, labels: dict[str, str]) -> SaveResult:
        """Save synchronously; every rank streams its own shard to ckptd."""
        start = time.perf_counter()
        writer = CkptdStorageWriter(self.address, self.run_id, step, labels=labels)
        try:
            dcp.save(self._state(step), storage_writer=writer)
        except CheckpointException as exc:
            writer.abort(f"save of step {step} failed")
            cause = first_cause(exc)
            raise ScaletrainError(f"checkpoint of step {step} failed: {cause}") from cause
        finally:
            writer.close()
        return SaveResult(step, time.perf_counter() - start, writer.committed)

    def load(self, step: int) -> dict[str, Any]:
        """Restore every part of the state saved at `step`; returns the `train` entry."""
        state = self._state(step)
        reader = CkptdStorageReader(self.address, self.run_id, step)
        try:
            dcp.load(state, storage_reader=reader)
        except CheckpointException as exc:
            cause = first_cause(exc)
            raise ScaletrainError(f"restoring step {step} failed: {cause}") from cause
        finally:
            reader.close()
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        train = state["train"]
        self.scheduler.load_state_dict(train["scheduler"])
        self.loader.load_state_dict(train["loader"])
        return train
