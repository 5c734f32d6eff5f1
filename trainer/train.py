"""The training loop, readable top to bottom: `train` is `setup`, `run_loop` and `finish`.

One process per rank (torchrun). Gloo on CPU, NCCL on CUDA, the same code otherwise. Each step:
read this rank's slice of the global batch, train it (`trainer.step.train_step`: forward, backward,
clip, optimizer step, under the step guard, which replays the step when it looks corrupted), save
the whole state to ckptd through DCP when the checkpointer's policy says so, report the step's
record to telemetry.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from google.protobuf.timestamp_pb2 import Timestamp

from scaletrain.errors import ScaletrainError, UserError
from telemetry.mfu import model_flops_per_token, utilization
from trainer import keeper, options
from trainer.checkpoint.checkpointer import (
    Checkpointer,
    SaveDone,
    SaveKind,
    SavePolicy,
    SaveStarted,
)
from trainer.checkpoint.digest import probe_logits_sha256, state_sha256
from trainer.config import TrainConfig
from trainer.data.loader import (
    DeterministicLoader,
    Source,
    open_source,
    source_identity,
)
from trainer.fp8 import Fp8Training
from trainer.health.guard import StepGuard, replica_groups
from trainer.health.inject import FaultInjector
from trainer.health.preflight import check_ranks
from trainer.health.quarantine import Quarantine
from trainer.health.watchdog import REPORT_WAIT_S, Hang, PeerBoard, Watchdog
from trainer.interop.hf_import import load_hf_weights
from trainer.model.llama import Transformer
from trainer.optim import build_optimizer, build_scheduler
from trainer.parallel.dims import (
    MESH_DIMS,
    ParallelDims,
    ParallelMesh,
    elastic_accumulation,
    validate_layout,
)
from trainer.parallel.parallelize import ParallelModel, build_model
from trainer.reporting import Reporter, peak_memory
from trainer.step import StepResult, train_step

# Global batches the loader reads ahead in a background thread while a step trains.
PREFETCH_BATCHES = 2


@dataclass
class Phases:
    """Seconds spent in each phase of a step, as telemetry records them."""

    data: float = 0.0
    forward: float = 0.0
    backward: float = 0.0
    optimizer: float = 0.0
    comm_wait: float = 0.0
    checkpoint: float = 0.0
    replay: float = 0.0


def init_distributed(timeout: timedelta) -> tuple[int, int, torch.device]:
    """Join the process group torchrun set up; NCCL with one GPU per rank, else gloo on CPU.

    Every collective on it fails after `timeout` rather than waiting forever for a dead peer.
    """
    options: dict[str, object] = {"timeout": timeout, **_attempt_store(timeout)}
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, **options)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", **options)
    return dist.get_rank(), dist.get_world_size(), device


def _attempt_store(timeout: timedelta) -> dict[str, object]:
    """The job's store under a prefix of this attempt's own, when one is needed.

    Under a keeper (`--in-job-restarts`, trainer.keeper) every generation of ranks meets under the
    prefix its keeper names. Else, after a restart: torchrun's agent keeps one key-value store
    across restarts, where the earlier attempt left its ranks' addresses: read them and the new
    ranks try to reach dead ones ("Connection refused"). Without the agent's store
    (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, which `scaletrain run --nodes N` sets for N > 1) every
    attempt gets a fresh store of its own, hosted by rank 0, and agents may count restarts
    differently (a replaced node's agent starts again at 0): no prefix.
    """
    prefix = os.environ.get(keeper.PREFIX_ENV)
    restarts = keeper.restart_count()
    if prefix is None and (restarts == 0 or not keeper.agent_store()):
        return {}
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )
    return {
        "store": dist.PrefixStore(prefix or f"scaletrain/attempt-{restarts}", store),
        "rank": int(os.environ["RANK"]),
        "world_size": int(os.environ["WORLD_SIZE"]),
    }


class ParamCount(NamedTuple):
    """A model's parameters, the embedding excluded: all of them, and those a token computes
    with (`Transformer.active_params`: fewer in an MoE), which MFU counts."""

    total: int
    active: int


def build(
    cfg: TrainConfig, mesh: ParallelMesh, device: torch.device, rank: int
) -> tuple[ParallelModel, Fp8Training | None, ParamCount, list[int]]:
    """The laid-out model with only this rank's shards allocated (`build_model`), its FP8 side,
    its parameter counts, and every rank's parameter bytes after the build (a collective), which
    rank 0 logs: what each rank holds is what decides whether a model fits."""
    parallel, fp8 = build_model(cfg, mesh, device)
    with torch.device("meta"):
        whole = Transformer(cfg.model)
    param_bytes = [0] * mesh.dims.world_size
    dist.all_gather_object(param_bytes, parallel.param_bytes())
    if rank == 0:
        full_mb = 4 * whole.num_params(exclude_embedding=False) / 1e6
        print(
            f"[trainer] parameters per rank after the build: {min(param_bytes) / 1e6:,.1f}"
            f"..{max(param_bytes) / 1e6:,.1f} MB (the whole model in fp32: {full_mb:,.1f} MB)",
            flush=True,
        )
    return parallel, fp8, ParamCount(whole.num_params(), whole.active_params()), param_bytes


@dataclass
class Run:
    """Everything the loop needs, built by `setup`; the loop updates only `global_loss`."""

    cfg: TrainConfig
    rank: int
    world: int
    device: torch.device
    dims: ParallelDims
    parallel: ParallelModel
    fp8: Fp8Training | None
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loader: DeterministicLoader
    held_out: DeterministicLoader | None
    reporter: Reporter
    faults: FaultInjector
    guard: StepGuard
    checkpointer: Checkpointer | None
    watchdog: Watchdog
    # Steps start_step + 1 .. cfg.steps are left to train (start_step > 0 after a resume).
    start_step: int
    # time.perf_counter() when the first step began.
    started: float = 0.0
    # The mean loss over ranks of the latest step.
    global_loss: float = math.nan
    # FLOPs a token costs the model (6 N), for the MFU of the log lines.
    flops_per_token: float = 0.0


def train(cfg: TrainConfig) -> None:
    """Set up, train, finish. However the run ends, telemetry is handed the records not yet sent
    and the watchdog and the loader's reader stop: a run that fails keeps the records of the
    steps before the failure."""
    with contextlib.ExitStack() as cleanup:
        run = setup(cfg, cleanup)
        run_loop(run)
        finish(run)
    dist.barrier()
    dist.destroy_process_group()


def setup(cfg: TrainConfig, cleanup: contextlib.ExitStack) -> Run:
    """Join the job, build the model, optimizer, data, telemetry, guard and checkpointer, and
    resume where the run left off. What must stop on any exit is pushed on `cleanup`."""
    launched_at = Timestamp()
    launched_at.GetCurrentTime()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    # An elastic job on fewer ranks than its full size keeps each rank's micro-batch.
    accum = elastic_accumulation(cfg, world_size, int(os.environ.get(options.FULL_WORLD_ENV, "0")))
    if accum != cfg.grad_accum_steps:
        if os.environ.get("RANK", "0") == "0":
            print(
                f"[trainer] elastic: {world_size} ranks of {os.environ[options.FULL_WORLD_ENV]}: "
                f"{accum} micro-batches a step (configured {cfg.grad_accum_steps}) keep each "
                "rank's micro-batch and the global batch",
                flush=True,
            )
        cfg = dataclasses.replace(cfg, grad_accum_steps=accum)
    # The layout is checked against the model and data before any process group exists.
    dims = validate_layout(cfg, world_size)
    timeout = timedelta(seconds=cfg.collective_timeout_s)
    rank, world, device = init_distributed(timeout)
    cfg.faults.check_world(world)
    check_ranks(device, corrupt=any(f.rank == rank for f in cfg.faults.bad_devices))
    torch.use_deterministic_algorithms(True)
    mesh = dims.build_mesh(device.type)

    parallel, fp8, n_params, param_bytes = build(cfg, mesh, device, rank)
    model = parallel.model
    optimizer = build_optimizer(model, cfg)
    scheduler = build_scheduler(optimizer, cfg)

    source = open_source(cfg.data, cfg.corpus_bytes)
    loader = DeterministicLoader(
        source,
        cfg.seq_len,
        cfg.global_batch,
        mesh.dp_rank,
        dims.dp_size,
        seed=cfg.seed,
        prefetch=PREFETCH_BATCHES,
    )
    cleanup.callback(loader.close)
    held_out = open_held_out(cfg, source, mesh.dp_rank, dims.dp_size)
    reporter = Reporter(cfg.telemetry, cfg.run_id, rank)
    cleanup.callback(reporter.close)
    reporter.register_run(
        cfg,
        world,
        dims.layout(),
        n_params.active,
        _hardware(device),
        source_identity(source),
        device=device,
        param_dtype=next(model.parameters()).dtype,
        launched_at=launched_at,
        param_bytes=param_bytes,
        fp8_unfit=fp8.unfit if fp8 is not None else None,
    )
    _flush_on_termination(reporter)
    faults = FaultInjector(
        cfg.faults, rank, cfg.model.vocab_size, device, computed_before=reporter.last_step
    )
    guard = StepGuard(
        cfg.health_policy,
        model,
        optimizer,
        replica_groups=replica_groups(mesh.world.mesh, MESH_DIMS.index("dp_replicate")),
        faults=faults,
        report=reporter.health_event,
        device=device,
        check_reductions=cfg.check_reductions,
        quarantine=Quarantine(
            cfg.quarantine, cfg.quarantine_after, reporter.hosts, rank, reporter.health_event
        ),
    )
    checkpointer = (
        Checkpointer(
            cfg.ckptd,
            cfg.run_id,
            model,
            optimizer,
            scheduler,
            loader,
            SavePolicy(cfg.ckpt_policy),
            fp8=fp8,
            replicas=cfg.replicas,
            timeout=timeout,
            config=options.to_toml(cfg.job) if cfg.job else "",
            every=cfg.ckpt_every,
            last_step=cfg.steps,
            mem_every=cfg.mem_ckpt_every,
        )
        if cfg.ckptd
        else None
    )
    _flush_on_termination(reporter, checkpointer)

    start_step = 0
    # A run whose id has committed checkpoints goes on from its latest, however this process
    # was started (torchrun's restart, a replaced node, a restarted pod, --resume).
    if checkpointer is not None:
        start_step = checkpointer.resume(cfg, reporter)
    elif cfg.resume:
        raise UserError("--resume needs --ckptd: there is no checkpoint store to resume from")
    if start_step > 0 or keeper.restart_count() > 0 or keeper.generation() > 0:
        reporter.restarted(start_step, checkpointer.restored_from if checkpointer else {})
    if cfg.init_from_hf and start_step == 0:
        # A fine-tuning run starts from published weights (a resumed one from its checkpoint).
        load_hf_weights(model, Path(cfg.init_from_hf), cfg.model)
    watchdog = Watchdog(
        cfg.watchdog, rank, heartbeat=reporter.heartbeat,
        on_hang=lambda hang: reporter.hang(hang, REPORT_WAIT_S), peers=_peer_board(rank, world),
        alive=keeper.alive,
    ).start()  # fmt: skip
    cleanup.callback(watchdog.stop)
    if (froze := keeper.froze_before()) is not None:  # the rank this one replaces, as a hang
        hang = Hang(rank, froze[0], "frozen", froze[1], keeper.FROZEN_AFTER_S, ())
        reporter.hang(hang, wait_s=0.0)

    # Every rank probes its FP8 paths now: under --compile, a probe inside a step breaks its graph.
    compute_dtype = torch.bfloat16 if cfg.parallel.mixed_precision else torch.float32
    fp8_paths = fp8.describe(device, compute_dtype) if fp8 is not None else None
    if rank == 0:
        in_job = f", in-job restart {keeper.generation()}" if keeper.generation() else ""
        print(
            f"[trainer] run {cfg.run_id}: {world} ranks, {n_params.total:,} parameters, "
            f"steps {start_step + 1}..{cfg.steps}{in_job}",
            flush=True,
        )
        if fp8_paths is not None:
            print(f"[trainer] {fp8_paths}", flush=True)
    return Run(
        cfg=cfg,
        rank=rank,
        world=world,
        device=device,
        dims=dims,
        parallel=parallel,
        fp8=fp8,
        optimizer=optimizer,
        scheduler=scheduler,
        loader=loader,
        held_out=held_out,
        reporter=reporter,
        faults=faults,
        guard=guard,
        checkpointer=checkpointer,
        watchdog=watchdog,
        start_step=start_step,
        flops_per_token=model_flops_per_token(n_params.active),
    )


def run_loop(run: Run) -> None:
    """Train the steps left: read the batch, train a step under the guard, save when due, report
    the step's record, evaluate and log when due."""
    cfg, watchdog = run.cfg, run.watchdog
    # Each rank reports its share, so the tokens of all ranks add up to the global batch's.
    local_tokens = cfg.global_batch * cfg.seq_len // run.world
    run.started = time.perf_counter()
    for step in range(run.start_step + 1, cfg.steps + 1):
        progress = functools.partial(watchdog.enter, step)
        progress("data")
        t = time.perf_counter()
        inputs, targets = (x.to(run.device) for x in run.loader.next_batch())
        batch = run.faults.corrupt_batch(step, inputs, targets)
        data_s = time.perf_counter() - t
        if run.fp8 is not None:
            run.fp8.begin_step(step)

        result = train_step(
            run.parallel,
            run.optimizer,
            batch,
            max_grad_norm=cfg.max_grad_norm,
            grad_accum_steps=cfg.grad_accum_steps,
            guard=run.guard,
            step=step,
            progress=progress,
            before_update=run.checkpointer.wait_staged if run.checkpointer else lambda: None,
        )
        run.global_loss = result.global_loss
        lr = run.scheduler.get_last_lr()[0]
        run.scheduler.step()

        progress("checkpoint")
        saved, checkpoint_s = _save_if_due(run, step)

        health = result.health
        assert health is not None  # the step ran under the guard
        phases = Phases(
            data=data_s, **vars(result.times), checkpoint=checkpoint_s, replay=health.replay_s
        )
        step_seconds = sum(vars(phases).values())
        watchdog.step_done(step_seconds)
        keeper.trained(step)  # where this rank got to, should it fail
        run.reporter.step(
            step=step,
            loss=result.loss,
            grad_norm=result.grad_norm,
            tokens=local_tokens,
            phases=phases,
            step_seconds=step_seconds,
            lr=lr,
            offset=run.loader.offset(),
            device=run.device,
            compute_seconds=health.compute_s,
            state_checksum=health.state_checksum,
        )
        if run.held_out is not None and (step % cfg.eval_every == 0 or step == cfg.steps):
            _evaluate(run, step)
        if run.rank == 0 and (step % cfg.log_every == 0 or step == cfg.steps or saved):
            _log_step(run, step, result, saved)


def _save_if_due(run: Run, step: int) -> tuple[SaveStarted | None, float]:
    """Report the background saves that ended (surfacing their failures) and start this step's
    save when the checkpointer's policy says so; returns the save started (None when not due or
    skipped) and the seconds it blocked the loop."""
    checkpointer = run.checkpointer
    if checkpointer is None:
        return None, 0.0
    t = time.perf_counter()
    _report_saves(checkpointer.poll(), run.reporter, run.rank)
    if not checkpointer.should_save(step):
        return None, 0.0
    run.guard.verify_before_save()
    saved = checkpointer.save(step, labels={"layout": json.dumps(run.dims.layout())})
    _report_save_start(saved, step, run.reporter, run.rank)
    return saved, time.perf_counter() - t


def _evaluate(run: Run, step: int) -> None:
    """The validation loss after `step`, reported; a long evaluation is progress to the watchdog,
    batch by batch."""
    assert run.held_out is not None
    cfg = run.cfg
    progress = functools.partial(run.watchdog.enter, step, "evaluate")
    eval_loss = evaluate(run.parallel, run.held_out, cfg.eval_batches, run.device, progress)
    run.reporter.evaluated(
        step, eval_loss.loss, cfg.eval_batches, eval_loss.tokens, eval_loss.seconds
    )
    if run.rank == 0:
        print(
            f"[trainer] step {step} validation loss {eval_loss.loss:.4f} "
            f"({eval_loss.seconds:.2f}s)",
            flush=True,
        )


def _log_step(run: Run, step: int, result: StepResult, saved: SaveStarted | None) -> None:
    """Rank 0's log line of `step`: the loss, throughput since the loop began, its MFU (against
    the peak rank 0 registered) and rank 0's peak memory, as TorchTitan's line has them, and the
    notes."""
    elapsed = time.perf_counter() - run.started
    tokens = (step - run.start_step) * run.cfg.global_batch * run.cfg.seq_len
    note = f" | checkpoint staged in {saved.blocking_s:.3f}s" if saved else ""
    if result.expert_load is not None:
        note += f" | expert load max/mean {result.expert_load.imbalance:.2f}"
    if run.parallel.pipeline is not None:
        note += f" | pipeline bubble {run.parallel.pipeline.bubble_report()}"
    note += f" | fp8 on rank 0: {run.fp8.summary()}" if run.fp8 is not None else ""
    tokens_s = tokens / elapsed
    used = utilization(run.flops_per_token, tokens_s, run.world, run.reporter.peak_flops)
    mfu = f" mfu {used:.1%}" if math.isfinite(used) else ""
    memory = f" mem {peak_memory(run.device) / 2**30:.2f} GiB"
    print(
        f"[trainer] step {step} loss {result.global_loss:.4f} tok/s {tokens_s:,.0f}{mfu}{memory}"
        f"{note}",
        flush=True,
    )


def finish(run: Run) -> None:
    """Wait for the last checkpoint (refusing to end well if it failed), then rank 0 reports the
    run finished with the digests of its final parameters."""
    run.watchdog.enter(run.cfg.steps, "finish")
    if run.checkpointer:
        final = run.checkpointer.finish()
        _report_saves(final, run.reporter, run.rank)
        run.checkpointer.close()
        if any(done.error for done in final):
            raise ScaletrainError(f"the final checkpoint failed: {final[-1].error}")

    full_state = run.parallel.full_state()  # a collective: every rank takes part
    if run.rank == 0:
        elapsed = time.perf_counter() - run.started
        digest = state_sha256(full_state)
        logits_digest = probe_logits_sha256(full_state, run.cfg.model)
        run.reporter.run_finished(run.cfg.steps, run.global_loss, digest, logits_digest, elapsed)
        print(
            f"[trainer] done: final loss {run.global_loss:.4f}, params sha256 {digest[:16]}",
            flush=True,
        )


@dataclass(frozen=True)
class EvalLoss:
    loss: float
    tokens: int
    seconds: float


def open_held_out(
    cfg: TrainConfig, source: Source, dp_rank: int, dp_size: int
) -> DeterministicLoader | None:
    """The loader of --eval-data (None without --eval-every): the same global batches, from its
    first sample, at every evaluation. Refused in one line when its tokenizer is not the
    training data's (the losses would not be comparable) or it holds less than a global batch."""
    if not cfg.eval_every:
        return None
    held_out = open_source(cfg.eval_data, cfg.corpus_bytes)
    theirs, ours = source_identity(held_out)["tokenizer"], source_identity(source)["tokenizer"]
    if theirs != ours:
        raise UserError(
            f"--eval-data {cfg.eval_data}: tokenizer {str(theirs)[:12]} is not the training "
            f"data's ({str(ours)[:12]}); prepare it with the same tokenizer"
        )
    try:
        return DeterministicLoader(
            held_out, cfg.seq_len, cfg.global_batch, dp_rank, dp_size, seed=cfg.seed
        )
    except ValueError as exc:
        raise UserError(f"--eval-data {cfg.eval_data}: {exc}") from None


def evaluate(
    parallel: ParallelModel,
    held_out: DeterministicLoader,
    batches: int,
    device: torch.device,
    progress: Callable[[], None] = lambda: None,
) -> EvalLoss:
    """The validation loss over the first `batches` global batches of the held-out data (a
    collective: every rank takes part), as the loop and the layout proof take it. `progress` is
    called before each batch: a long evaluation is progress to the watchdog, batch by batch, not
    one phase past its deadline."""
    start = time.perf_counter()
    held_out.load_state_dict({"global_sample": 0})

    def read() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for _ in range(batches):
            progress()
            inputs, targets = held_out.next_batch()
            yield inputs.to(device), targets.to(device)

    loss = parallel.evaluate(read())
    tokens = batches * held_out.global_batch * held_out.seq_len
    return EvalLoss(loss, tokens, time.perf_counter() - start)


def _flush_on_termination(reporter: Reporter, checkpointer: Checkpointer | None = None) -> None:
    """When one rank fails or the job re-forms (a machine lost, or one joining), torchrun's agent
    stops the others with SIGTERM: first hand telemetry the records it has not received yet
    (waiting briefly), so the steps before the failure keep their records, and say that the
    durable save in flight, if any, is abandoned (installed again once `checkpointer` exists)."""

    def stop(signum: int, _frame: object) -> None:
        started = checkpointer.unfinished() if checkpointer is not None else None
        if started is not None and started.kind is SaveKind.DURABLE and reporter.rank == 0:
            reporter.save_abandoned(started.step)
            print(
                f"[trainer] checkpoint of step {started.step} abandoned: the ranks were stopped "
                "before it committed",
                file=sys.stderr,
                flush=True,
            )
        reporter.flush(REPORT_WAIT_S)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


def _peer_board(rank: int, world: int) -> PeerBoard | None:
    """The ranks' heartbeats in torchrun's rendezvous store, when there is one."""
    try:
        return PeerBoard(dist.distributed_c10d._get_default_store(), rank, world)
    except (RuntimeError, ValueError):
        return None


def _report_save_start(
    started: SaveStarted | None, step: int, reporter: Reporter, rank: int
) -> None:
    if rank != 0:
        return
    if started is None:
        print(
            f"[trainer] checkpoint of step {step} skipped: the previous save is still "
            "streaming (--ckpt-policy skip)",
            flush=True,
        )
        reporter.save_skipped(step)
    else:
        reporter.save_started(started)


def _report_saves(done: list[SaveDone], reporter: Reporter, rank: int) -> None:
    """Report ended background saves; a failure is printed on every rank that saw it."""
    for save in done:
        if save.error is not None:
            print(
                f"[trainer] rank {rank}: checkpoint of step {save.step} failed: {save.error}",
                flush=True,
            )
        if rank == 0:
            reporter.save_done(save)


def _hardware(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({socket.gethostname()})"
