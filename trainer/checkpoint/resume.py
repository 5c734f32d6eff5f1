"""The checks a resume makes before training goes on from a checkpoint (`Checkpointer.resume`).

Which step every rank restores (rank 0 asks ckptd and tells the others), whether the job config
changed in ways that alter results since the save, and whether telemetry's record of the step
agrees with the checkpoint's data-loader offsets.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch.distributed as dist

from scaletrain.errors import NotFound, ScaletrainError, Unavailable, UserError
from trainer import options
from trainer.config import TrainConfig
from trainer.data.loader import LoaderOffset

# Pause between two asks for a restorable checkpoint while none is.
RETRY_S = 1.0


class ResumeRecords(Protocol):
    """What a resume reads from and tells telemetry (the trainer's `Reporter`)."""

    def resume_offsets(self, step: int) -> dict[int, LoaderOffset] | None: ...

    def config_changed(self, step: int, changes: list[str]) -> None: ...

    def resized(self, step: int, saved_world: int, world: int) -> None: ...


def latest_step(
    address: str, run_id: str, rank: int, wait_s: float, required: bool, in_memory: int = -1
) -> int:
    """The step every rank restores, or -1 when the run has no committed checkpoint at all (an
    error if `required`): rank 0 asks its node's ckptd and tells the others, so that ranks on
    nodes whose ckptds learned of a commit at different instants still restore the same step,
    and every rank goes on or stops together.

    A run that has commits none of which can be restored now (a node holding a part is down or
    behind, S3 lacks it) is never taken for a new run: rank 0 waits up to `wait_s` for a
    restorable step, saying so once, then stops every rank with ckptd's account of the newest
    committed step and what it lacks.

    `in_memory`: the newest step every rank can restore from memory (its own copy or a peer
    node's, `peer_copy`), -1 if none. It is taken unless ckptd can restore a newer step right
    now, without waiting for one.
    """
    answer: list[object] = [-1, ""]
    if rank == 0 and in_memory >= 0:
        durable = _ask_latest(address, run_id, 0.0)[0]
        answer = [max(durable, in_memory), ""]
    elif rank == 0:
        step, none_because, error = _ask_latest(address, run_id, wait_s)
        answer = [step, error or (none_because if required else "")]
    dist.broadcast_object_list(answer, src=0)
    if answer[1]:
        raise ScaletrainError(str(answer[1]))
    return int(answer[0])  # type: ignore[call-overload]


def _ask_latest(address: str, run_id: str, wait_s: float) -> tuple[int, str, str]:
    """(step, why there is none, error) as ckptd answers, waiting out Unavailable."""
    from ckptd.client import CkptdClient

    deadline = time.monotonic() + wait_s
    waiting = False
    with CkptdClient(address) as client:
        while True:
            try:
                return int(client.get(run_id).ref.step), "", ""
            except NotFound as exc:
                return -1, str(exc), ""
            except Unavailable as exc:
                if time.monotonic() >= deadline:
                    return (
                        -1,
                        "",
                        (
                            f"run {run_id} has committed checkpoints but none could be restored "
                            f"within --resume-wait-s {wait_s:g}: {exc}"
                        ),
                    )
                if not waiting:
                    waiting = True
                    print(
                        f"[trainer] run {run_id}: waiting up to {wait_s:g}s for a restorable "
                        f"checkpoint (never starting over): {exc}",
                        flush=True,
                    )
                time.sleep(RETRY_S)
            except ScaletrainError as exc:
                return -1, "", str(exc)


def check_config(
    cfg: TrainConfig, step: int, saved_toml: str, records: ResumeRecords, rank: int
) -> None:
    """Refuse to resume with options that alter results changed since the checkpoint (model
    shape, seed, data, optimizer, schedule), listing them; with --allow-config-change, go on and
    record the changes in telemetry. A checkpoint saved without its config is not compared."""
    if not saved_toml or not cfg.job:
        return
    changed = options.differences(options.from_toml(saved_toml), cfg.job)
    if not changed:
        return
    listed = "; ".join(changed)
    if not cfg.allow_config_change:
        raise UserError(
            f"refusing to resume run {cfg.run_id} at step {step}: the job config changed in "
            f"ways that alter results: {listed} (--allow-config-change accepts them)"
        )
    if rank == 0:
        print(f"[trainer] resuming with a changed config (--allow-config-change): {listed}")
        records.config_changed(step, changed)


def check_world(step: int, saved_world: int, records: ResumeRecords, rank: int) -> None:
    """A job that resumes at another number of ranks than `step` was saved by (elastic: a node
    lost with no spare left, or one that joined) reshards it and goes on: not a config change
    (the global batch, the data order and the schedule stay), but an event of its own."""
    world = dist.get_world_size()
    if not saved_world or saved_world == world or rank != 0:
        return
    print(
        f"[trainer] elastic: resuming step {step}, saved by {saved_world} ranks, on {world} "
        "ranks (resharded; the global batch and the data order stay)",
        flush=True,
    )
    records.resized(step, saved_world, world)


def check_offsets(
    run_id: str,
    step: int,
    rank: int,
    expected: LoaderOffset,
    recorded: dict[int, LoaderOffset],
    same_slices: bool,
) -> None:
    """Refuse to resume unless telemetry's record of `step` agrees with the checkpoint.

    Every recorded rank must have been at the checkpoint's global sample. A rank's own slice is
    compared too when each rank reads the slice it read when the step was saved (`same_slices`:
    the same size and data-parallel degree), where telemetry has its record; at another size or
    degree the slices differ by design while the global order stays the same.
    """
    refuse = f"refusing to resume run {run_id} at step {step}"
    if not recorded:
        raise UserError(f"{refuse}: telemetry has no data-loader offsets for that step")
    for other, offset in sorted(recorded.items()):
        if offset.global_sample != expected.global_sample:
            raise UserError(
                f"{refuse}: the checkpoint resumes at global sample {expected.global_sample}, "
                f"telemetry recorded {offset.global_sample} for rank {other}"
            )
    if same_slices and rank in recorded and recorded[rank] != expected:
        raise UserError(
            f"{refuse}: rank {rank}'s data-loader offset in the checkpoint is {expected}, "
            f"telemetry recorded {recorded.get(rank)}"
        )
