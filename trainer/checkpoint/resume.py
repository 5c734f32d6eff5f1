"""The checks a resume makes before training goes on from a checkpoint (`Checkpointer.resume`).

Which step every rank restores (rank 0 asks ckptd and tells the others), whether the job config
changed in ways that alter results since the save, and whether telemetry's record of the step
agrees with the checkpoint's data-loader offsets.
"""

from __future__ import annotations

from typing import Protocol

import torch.distributed as dist

from scaletrain.errors import NotFound, ScaletrainError, UserError
from trainer import options
from trainer.config import TrainConfig
from trainer.data.loader import LoaderOffset


class ResumeRecords(Protocol):
    """What a resume reads from and tells telemetry (the trainer's `Reporter`)."""

    def resume_offsets(self, step: int) -> dict[int, LoaderOffset] | None: ...

    def config_changed(self, step: int, changes: list[str]) -> None: ...


def latest_step(address: str, run_id: str, rank: int) -> tuple[int, str]:
    """The step every rank restores, or -1 and ckptd's reason there is none: rank 0 asks its
    node's ckptd and tells the others, so that ranks on nodes whose ckptds learned of a commit at
    different instants still restore the same step."""
    from ckptd.client import CkptdClient

    step, none_because, error = -1, "", ""
    if rank == 0:
        with CkptdClient(address) as client:
            try:
                step = int(client.get(run_id).ref.step)
            except NotFound as exc:
                none_because = str(exc)
            except ScaletrainError as exc:
                error = str(exc)
    shared: list[object] = [step, none_because, error]
    dist.broadcast_object_list(shared, src=0)
    if shared[2]:
        raise ScaletrainError(str(shared[2]))
    return int(shared[0]), str(shared[1])  # type: ignore[call-overload]


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


def check_offsets(
    run_id: str,
    step: int,
    rank: int,
    expected: LoaderOffset,
    recorded: dict[int, LoaderOffset],
    dp_size: int,
) -> None:
    """Refuse to resume unless telemetry's record of `step` agrees with the checkpoint.

    Every recorded rank must have been at the checkpoint's global sample. A rank's own slice is
    compared too when the data-parallel degree is unchanged; at another degree the slices differ
    by design while the global order stays the same.
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
    if len(recorded) == dp_size and recorded.get(rank) != expected:
        raise UserError(
            f"{refuse}: rank {rank}'s data-loader offset in the checkpoint is {expected}, "
            f"telemetry recorded {recorded.get(rank)}"
        )
