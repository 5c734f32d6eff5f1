"""Helpers for the tests of the ranks' copies in shared memory (own and peer copies): damage
them in place, and run a function on gloo ranks against one ckptd."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from fp8_testing import TinyTrainer, tiny_model

from ckptd.config import CkptdConfig
from ckptd.server import RunningCkptd, start
from telemetry.client import HOST_ENV
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.checkpoint.own_copy import remove_copies, sealed_step


def damage_copies(directory: Path) -> None:
    """Flip the first byte of every buffer of the copies under `directory` (their manifests,
    and the CRCs they record, stay as they were)."""
    for buffer in directory.rglob("*.bin"):
        if buffer.stat().st_size:
            with buffer.open("r+b") as f:
                first = f.read(1)
                f.seek(0)
                f.write(bytes([first[0] ^ 0xFF]))


def run_ranks(
    rank_fn: Callable[..., None], world: int, tmp_path: Path, run_id: str, *args: object
) -> RunningCkptd:
    """Run `rank_fn(rank, port, ckptd address, tmp_path, *args)` on `world` spawned gloo ranks
    against a ckptd of its own, stopped afterwards (returned for what it served); the run's
    copies are removed after."""
    server = start(CkptdConfig(data_dir=tmp_path / "ckptd", listen="127.0.0.1:0"))
    try:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        mp.spawn(rank_fn, args=(port, server.address, str(tmp_path), *args), nprocs=world)
    finally:
        server.stop(grace=1)
        remove_copies(run_id)
    return server


def machine_rank(
    rank: int, port: int, world: int, steps: int
) -> tuple[torch.nn.Module, TinyTrainer]:
    """Join the gloo group of `run_ranks` as a simulated machine of its own ("machine{rank}");
    a tiny model and its trainer for `steps` steps. Every rank trains the same batches: the
    state is the same on all, as DCP assumes of parameters that are not sharded."""
    os.environ[HOST_ENV] = f"machine{rank}"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)  # fmt: skip
    model, _ = tiny_model(None)
    return model, TinyTrainer(model, steps=steps)


class NoRecords:
    """Telemetry that knows nothing of the run: a resume goes by the checkpoint alone."""

    def resume_offsets(self, step: int) -> None:
        return None

    def config_changed(self, step: int, changes: list[str]) -> None:
        raise AssertionError("the config did not change")

    def resized(self, step: int, saved_world: int, world: int) -> None:
        raise AssertionError("the job resumed at the size it saved at")


def resume(saver: Checkpointer, run_id: str) -> int:
    """`saver.resume` as the trainer calls it, with a config that only names the run."""
    cfg = SimpleNamespace(resume=False, resume_wait_s=5.0, job=None, run_id=run_id)
    return saver.resume(cfg, NoRecords())  # type: ignore[arg-type]


def own_steps(saver: Checkpointer) -> set[int | None]:
    """The steps the rank's own copies hold sealed (None for a set holding none)."""
    return {sealed_step(slot.own.directory) for slot in saver._slots if slot.own is not None}
