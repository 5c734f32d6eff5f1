"""What the trainer tells telemetry: the run, one record per rank and step, and its events.

Every call but `register_run` returns at once: the telemetry client queues records and sends them in
the background, so a slow or restarting telemetry service never stalls a training step. Without a
telemetry address the reporter does nothing.
"""

from __future__ import annotations

import json
import math
import os
import resource
import socket
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from google.protobuf.timestamp_pb2 import Timestamp

from scaletrain.v1 import common_pb2, telemetry_pb2
from telemetry.client import HOST_ENV, TelemetryClient
from trainer.data.loader import LoaderOffset
from trainer.health.peak import resolve_peak, training_precision

if TYPE_CHECKING:
    from trainer.checkpoint.checkpointer import SaveDone, SaveStarted
    from trainer.config import TrainConfig
    from trainer.health.watchdog import Hang
    from trainer.train import Phases


def _now() -> Timestamp:
    stamp = Timestamp()
    stamp.GetCurrentTime()
    return stamp


class Reporter:
    def __init__(self, address: str | None, run_id: str, rank: int) -> None:
        self.run_id, self.rank = run_id, rank
        self.client = TelemetryClient(address) if address else None
        # Restart generation of this job, stamped on every record (see RegisterRunResponse).
        self.attempt = 0
        # The newest step the run recorded before this job registered (-1: none, or no
        # telemetry): a restarted job computes the steps up to it again.
        self.last_step = -1
        # Each rank's host (`rank_host`), by rank, once registered.
        self.hosts: list[str] = []
        # One device's dense peak FLOP/s in the training precision, as rank 0 registered it
        # (0: not known here), for the MFU of its log lines.
        self.peak_flops = 0.0

    def register_run(
        self,
        cfg: TrainConfig,
        world: int,
        layout: dict[str, int],
        model_params: int,
        hardware: str,
        dataset: dict[str, object],
        *,
        device: torch.device,
        param_dtype: torch.dtype,
        launched_at: Timestamp,
        param_bytes: list[int],
        fp8_unfit: list[str] | None = None,
    ) -> None:
        """Register the run from rank 0 (with what MFU needs: precision, dense peak) and share its
        attempt with every rank; call it on every rank. `launched_at` is when the job started,
        which is where the run's wall time (and start-up badput) begins. `model_params`: the N
        of MFU's 6N (`Transformer.active_params`). `dataset`: what the run
        trains on (digest, tokenizer, tokens), kept in the run's config. `param_bytes`: each
        rank's parameter bytes after the build, by rank, sent with the run-started event, as are the
        linears FP8 left in high precision because the recipe cannot split them (`fp8_unfit`)."""
        if self.client is None:
            return
        # Each rank's host, so telemetry's node views group ranks by machine.
        hosts: list[str | None] = [rank_host()]
        if world > 1:
            hosts = [None] * world
            dist.all_gather_object(hosts, rank_host())
        if self.rank == 0:
            precision = training_precision(param_dtype, device)
            peak, source = resolve_peak(device, precision, cfg.peak_flops)
            self.peak_flops = peak
            # The resolved job config (trainer.options) under "job", beside the dataclass.
            # and the data it trains on (`trainer.data.loader.source_identity`) under "dataset".
            config = cfg.to_json_dict() | {"dataset": dataset}
            reply = self.client.register_run(
                telemetry_pb2.RegisterRunRequest(
                    run_id=self.run_id,
                    name=self.run_id,
                    config_json=json.dumps(config, sort_keys=True),
                    world_size=world,
                    layout=common_pb2.ParallelLayout(**layout),
                    model_params=model_params,
                    hardware=hardware,
                    started_at=launched_at,
                    precision=precision,
                    peak_flops=peak,
                    peak_flops_source=source,
                    # Activation checkpointing recomputes every block's forward once.
                    recompute_fraction=1.0 if cfg.parallel.activation_checkpointing else 0.0,
                    ranks=[
                        telemetry_pb2.RankInfo(rank=rank, host=host or "", device=device.type)
                        for rank, host in enumerate(hosts)
                    ],
                )
            )
            self.attempt, self.last_step = reply.attempt, reply.last_step
            self._event(
                telemetry_pb2.EVENT_KIND_RUN_STARTED,
                0,
                "run started" if not cfg.resume else "run resumed",
                attributes={
                    "param_bytes_per_rank": json.dumps(param_bytes),
                    "fp8_unfit_linears": json.dumps(fp8_unfit or []),
                },
            )
        self.hosts = [host or "" for host in hosts]
        if world > 1:
            shared = [self.attempt, self.last_step]
            dist.broadcast_object_list(shared, src=0)
            self.attempt, self.last_step = shared

    def restarted(self, step: int, restored_from: dict[str, int]) -> None:
        """The job resumed at `step` after an earlier attempt stopped (rank 0 reports it), with
        the bytes its restore read from each copy (`Checkpointer.restored_from`)."""
        if self.rank == 0 and self.attempt > 0:
            self._event(
                telemetry_pb2.EVENT_KIND_RESTART,
                step,
                f"attempt {self.attempt} resumed from step {step}",
                attributes={
                    "attempt": str(self.attempt),
                    "restored_from": json.dumps(restored_from),
                },
            )

    def resized(self, step: int, saved_world: int, world: int) -> None:
        """The job resumed `step`, saved by `saved_world` ranks, on `world` ranks (elastic)."""
        self._event(
            telemetry_pb2.EVENT_KIND_ELASTIC,
            step,
            f"resumed step {step} on {world} ranks (saved by {saved_world})",
            attributes={"world": str(world), "saved_world": str(saved_world)},
        )

    def config_changed(self, step: int, changes: list[str]) -> None:
        """The run resumed at `step` with options that alter results changed, as allowed by
        --allow-config-change: an alert event that lists them."""
        self._event(
            telemetry_pb2.EVENT_KIND_ALERT,
            step,
            f"resumed at step {step} with a changed config: {'; '.join(changes)}",
            attributes={"config_changes": json.dumps(changes)},
        )

    def step(
        self,
        *,
        step: int,
        loss: float,
        grad_norm: float,
        tokens: int,
        phases: Phases,
        step_seconds: float,
        lr: float,
        offset: LoaderOffset,
        device: torch.device,
        compute_seconds: float,
        state_checksum: int | None,
    ) -> None:
        """Queue this rank's record of `step`; `state_checksum` (None: not computed) is the
        checksum of its parameters and optimizer state after the step."""
        if self.client is None:
            return
        memory = peak = 0
        if device.type == "cuda":
            memory = torch.cuda.memory_allocated(device)
            peak = torch.cuda.max_memory_allocated(device)
        self.client.report_step(
            telemetry_pb2.RankStep(
                run_id=self.run_id,
                step=step,
                rank=self.rank,
                loss=loss,
                grad_norm=grad_norm,
                tokens=tokens,
                times=telemetry_pb2.PhaseTimes(
                    step=step_seconds, compute=compute_seconds, **vars(phases)
                ),
                memory_bytes=memory,
                peak_memory_bytes=peak,
                data_offset=telemetry_pb2.DataLoaderOffset(
                    global_sample=offset.global_sample,
                    rank_sample=offset.rank_sample,
                    epoch=offset.epoch,
                ),
                lr=lr,
                time=_now(),
                param_checksum=""
                if state_checksum is None
                else f"{state_checksum & 0xFFFF_FFFF_FFFF_FFFF:016x}",
                attempt=self.attempt,
                dropped_records=self.client.dropped,
            )
        )

    def evaluated(self, step: int, loss: float, batches: int, tokens: int, seconds: float) -> None:
        """The validation loss after `step` (rank 0 reports it): `batches` global batches of
        held-out data, `tokens` in all, taking `seconds`."""
        if self.rank != 0:
            return
        self._event(
            telemetry_pb2.EVENT_KIND_EVAL,
            step,
            f"validation loss {loss:.4f} after step {step}",
            attributes={
                "loss": repr(loss),
                "batches": str(batches),
                "tokens": str(tokens),
                "seconds": f"{seconds:.3f}",
            },
        )

    def health_event(
        self, kind: str, step: int, rank: int, message: str, attributes: dict[str, str]
    ) -> None:
        """An event of the step guard ("sdc", "loss_spike", "replay", "alert") about `rank`."""
        self._event(
            telemetry_pb2.EventKind.Value(f"EVENT_KIND_{kind.upper()}"),
            step,
            message,
            rank=rank,
            attributes=attributes,
        )

    def heartbeat(self, step: int, phase: str) -> None:
        """This rank is alive, in `phase` of `step` (the watchdog's thread calls it)."""
        self._event(
            telemetry_pb2.EVENT_KIND_HEARTBEAT,
            step,
            f"rank {self.rank} alive in phase {phase} of step {step}",
            rank=self.rank,
            attributes={"phase": phase},
        )

    def hang(self, hang: Hang, wait_s: float) -> None:
        """The watchdog fired on this rank: report it, waiting up to `wait_s` for delivery."""
        self._event(
            telemetry_pb2.EVENT_KIND_HANG,
            hang.step,
            hang.message(),
            rank=self.rank,
            attributes={
                "phase": hang.phase,
                "waited_s": f"{hang.waited_s:.3f}",
                "deadline_s": f"{hang.deadline_s:.3f}",
                "stale_peers": "; ".join(hang.stale_peers),
            },
        )
        self.flush(wait_s)

    def flush(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` until telemetry received every record queued so far."""
        if self.client is not None:
            self.client.flush(timeout_s=timeout_s)

    def save_started(self, started: SaveStarted) -> None:
        """The save blocked training for `blocking_s` while its state was staged."""
        self._event(
            telemetry_pb2.EVENT_KIND_CHECKPOINT_STAGED,
            started.step,
            f"checkpoint of step {started.step}: {started.staged_bytes / 1e6:.1f} MB staged "
            f"in {started.blocking_s:.3f}s",
            checkpoint=telemetry_pb2.CheckpointEvent(
                bytes=started.staged_bytes, seconds=started.blocking_s
            ),
        )

    def save_skipped(self, step: int) -> None:
        self._event(
            telemetry_pb2.EVENT_KIND_CHECKPOINT_SKIPPED,
            step,
            f"checkpoint of step {step} skipped: the previous save is still streaming",
        )

    def save_abandoned(self, step: int) -> None:
        """The rank was stopped with the durable save of `step` in flight (the job re-forms, as
        when a machine joins during a save, or it stops): that save will not commit."""
        self._event(
            telemetry_pb2.EVENT_KIND_CHECKPOINT_FAILED,
            step,
            f"checkpoint of step {step} abandoned: the ranks were stopped before it committed "
            "(the job re-forms or stops); the run goes on from its newest committed step",
        )

    def save_done(self, done: SaveDone) -> None:
        """A background save ended; ckptd reports each tier's commit itself."""
        if done.error is not None:
            self._event(
                telemetry_pb2.EVENT_KIND_CHECKPOINT_FAILED,
                done.step,
                f"checkpoint of step {done.step} failed: {done.error}",
                checkpoint=telemetry_pb2.CheckpointEvent(seconds=done.background_s),
            )
            return
        total = done.info.total_bytes if done.info is not None else done.staged_bytes
        self._event(
            telemetry_pb2.EVENT_KIND_CHECKPOINT_SAVED,
            done.step,
            f"checkpoint of step {done.step} saved in the background in {done.background_s:.2f}s",
            checkpoint=telemetry_pb2.CheckpointEvent(bytes=total, seconds=done.background_s),
        )

    def run_finished(
        self, step: int, loss: float, params_sha256: str, logits_sha256: str, seconds: float
    ) -> None:
        self._event(
            telemetry_pb2.EVENT_KIND_RUN_FINISHED,
            step,
            f"finished at step {step} with loss {loss:.4f}",
            attributes={
                "final_loss": "nan" if math.isnan(loss) else repr(loss),
                "params_sha256": params_sha256,
                "probe_logits_sha256": logits_sha256,
                "train_seconds": f"{seconds:.3f}",
            },
        )

    def resume_offsets(self, step: int) -> dict[int, LoaderOffset] | None:
        """Per-rank loader offsets telemetry recorded at `step`; None without telemetry."""
        if self.client is None:
            return None
        point = self.client.resume_point(self.run_id, step)
        return {
            item.rank: LoaderOffset(
                item.offset.global_sample, item.offset.rank_sample, item.offset.epoch
            )
            for item in point.offsets
        }

    def close(self) -> None:
        if self.client is not None:
            self.client.close()

    def _event(
        self, kind: int, step: int, message: str, *, rank: int = -1, **fields: object
    ) -> None:
        if self.client is None:
            return
        self.client.report_event(
            telemetry_pb2.Event(
                run_id=self.run_id,
                step=step,
                rank=rank,
                kind=kind,
                message=message,
                time=_now(),
                **fields,
            )
        )


def rank_host() -> str:
    """The host this rank reports (telemetry groups ranks into nodes by it): the machine's
    name, or the simulated node's ($SCALETRAIN_HOST) when several share one machine."""
    return os.environ.get(HOST_ENV) or socket.gethostname()


def peak_memory(device: torch.device) -> int:
    """The most memory this rank has held: the device's allocations on an accelerator, the
    process's resident set on CPU (where tensors live in it)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux counts KiB
