"""The training loop, readable top to bottom.

One process per rank (torchrun). Gloo on CPU, NCCL on CUDA, the same code otherwise. Each step:
read this rank's slice of the global batch, forward, backward, clip, optimizer step (under the step
guard, which replays the step when it looks corrupted), report the step's record to telemetry; every
`ckpt_every` steps save the whole state to ckptd through DCP.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from google.protobuf.timestamp_pb2 import Timestamp

from ckptd.readpath import describe_sources
from scaletrain.errors import NotFound, ScaletrainError, UserError
from trainer import options
from trainer.checkpoint.checkpointer import (
    Checkpointer,
    SaveDone,
    SavePolicy,
    SaveStarted,
)
from trainer.checkpoint.digest import probe_logits_sha256, state_sha256
from trainer.config import TrainConfig
from trainer.data.loader import (
    DeterministicLoader,
    LoaderOffset,
    Source,
    open_source,
    source_identity,
)
from trainer.fp8 import Fp8Training
from trainer.health.guard import StepGuard, replica_groups
from trainer.health.inject import FaultInjector
from trainer.health.preflight import check_ranks
from trainer.health.watchdog import REPORT_WAIT_S, PeerBoard, Watchdog
from trainer.interop.hf_import import load_hf_weights
from trainer.model.llama import Transformer
from trainer.optim import build_optimizer, build_scheduler
from trainer.parallel.dims import MESH_DIMS, ParallelMesh, validate_layout
from trainer.parallel.parallelize import ParallelModel, build_model
from trainer.reporting import Reporter

# Global batches the loader reads ahead in a background thread while a step trains.
PREFETCH_BATCHES = 2


@dataclass
class Phases:
    """Seconds spent in each phase of the current step."""

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
    """After a restart, the agent's store seen under a prefix of its own for this attempt.

    torchrun's agent keeps one key-value store across restarts, where the earlier attempt left
    its ranks' addresses: read them and the new ranks try to reach dead ones ("Connection refused").
    Without the agent's store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, which `scaletrain run
    --nodes N` sets for N > 1) every attempt gets a fresh store of its own, hosted by rank 0, and
    agents may count restarts differently (a replaced node's agent starts again at 0): no prefix.
    """
    restarts = restart_count()
    if restarts == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )
    return {
        "store": dist.PrefixStore(f"scaletrain/attempt-{restarts}", store),
        "rank": int(os.environ["RANK"]),
        "world_size": int(os.environ["WORLD_SIZE"]),
    }


def restart_count() -> int:
    """How many times torchrun's elastic agent restarted this job (0 on the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def build(
    cfg: TrainConfig, mesh: ParallelMesh, device: torch.device, rank: int
) -> tuple[ParallelModel, Fp8Training | None, int, list[int]]:
    """The laid-out model with only this rank's shards allocated (`build_model`), its FP8 side,
    its parameter count, and every rank's parameter bytes after the build (a collective), which
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
    return parallel, fp8, whole.num_params(), param_bytes


def train(cfg: TrainConfig) -> None:
    launched_at = Timestamp()
    launched_at.GetCurrentTime()
    # The layout is checked against the model and data before any process group exists.
    dims = validate_layout(cfg, int(os.environ.get("WORLD_SIZE", "1")))
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
        source, cfg.seq_len, cfg.global_batch, mesh.dp_rank, dims.dp_size, seed=cfg.seed,
        prefetch=PREFETCH_BATCHES,
    )  # fmt: skip
    held_out = open_held_out(cfg, source, mesh.dp_rank, dims.dp_size)
    reporter = Reporter(cfg.telemetry, cfg.run_id, rank)
    reporter.register_run(
        cfg, world, dims.layout(), n_params, _hardware(device), source_identity(source),
        device=device, param_dtype=next(model.parameters()).dtype, launched_at=launched_at,
        param_bytes=param_bytes, fp8_unfit=fp8.unfit if fp8 is not None else None,
    )  # fmt: skip
    _flush_on_termination(reporter)
    faults = FaultInjector(cfg.faults, rank, cfg.model.vocab_size, device)
    guard = StepGuard(
        cfg.health_policy, model, optimizer,
        replica_groups=replica_groups(mesh.world.mesh, MESH_DIMS.index("dp_replicate")),
        faults=faults, report=reporter.health_event, device=device,
    )  # fmt: skip
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
        )
        if cfg.ckptd
        else None
    )

    start_step = 0
    # After torchrun restarted the job, every rank resumes from the latest committed checkpoint.
    if cfg.resume or restart_count() > 0:
        start_step = resume(cfg, checkpointer, reporter, loader, rank, required=cfg.resume)
        reporter.restarted(start_step, checkpointer.restored_from if checkpointer else {})
    if cfg.init_from_hf and start_step == 0:
        # A fine-tuning run starts from published weights (a resumed one from its checkpoint).
        load_hf_weights(model, Path(cfg.init_from_hf), cfg.model)
    watchdog = Watchdog(
        cfg.watchdog, rank, heartbeat=reporter.heartbeat,
        on_hang=lambda hang: reporter.hang(hang, REPORT_WAIT_S), peers=_peer_board(rank, world),
    ).start()  # fmt: skip

    # Every rank probes its FP8 paths now: under --compile, a probe inside a step breaks its graph.
    compute_dtype = torch.bfloat16 if cfg.parallel.mixed_precision else torch.float32
    fp8_paths = fp8.describe(device, compute_dtype) if fp8 is not None else None
    if rank == 0:
        print(
            f"[trainer] run {cfg.run_id}: {world} ranks, {n_params:,} parameters, "
            f"steps {start_step + 1}..{cfg.steps}",
            flush=True,
        )
        if fp8_paths is not None:
            print(f"[trainer] {fp8_paths}", flush=True)
    tokens_per_step = cfg.global_batch * cfg.seq_len
    accum = cfg.grad_accum_steps
    # Each rank reports its share, so the tokens of all ranks add up to the global batch's.
    local_tokens = tokens_per_step // world
    global_loss = float("nan")
    run_start = time.perf_counter()
    for step in range(start_step + 1, cfg.steps + 1):
        phases = Phases()
        watchdog.enter(step, "data")
        t = time.perf_counter()
        inputs, targets = (x.to(device) for x in loader.next_batch())
        inputs, targets = faults.corrupt_batch(step, inputs, targets)
        phases.data, t = _lap(t)
        if fp8 is not None:
            fp8.begin_step(step)

        for attempt in guard.attempts(step, phases):  # once; twice if the step is replayed
            t = time.perf_counter()
            phases.forward = phases.backward = 0.0
            # Gradient accumulation: FSDP reduces gradients in the last micro-batch's backward.
            losses = []
            for micro_inputs, micro_targets in parallel.micro_batches(inputs, targets, accum):
                watchdog.enter(step, "forward")
                # Under pipeline parallelism forward runs the whole schedule, backward included.
                losses.append(parallel.forward(micro_inputs, micro_targets))
                elapsed, t = _lap(t)
                phases.forward += elapsed
                watchdog.enter(step, "backward")
                parallel.backward(losses[-1], accum)
                elapsed, t = _lap(t)
                phases.backward += elapsed
            loss = parallel.mean_of(losses)
            attempt.gradients_ready()
            watchdog.enter(step, "optimizer")
            grad_norm = parallel.clip_grad_norm_(cfg.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            phases.optimizer, t = _lap(t)
            watchdog.enter(step, "loss all-reduce")

            # The mean loss over ranks is what the run reports; its all-reduce is our comm wait.
            global_loss = parallel.mean_loss(loss)
            phases.comm_wait, t = _lap(t)
            attempt.finished(global_loss if loss is None else float(loss), global_loss, grad_norm)
        t = time.perf_counter()
        lr = scheduler.get_last_lr()[0]
        scheduler.step()
        expert_load = parallel.after_optimizer_step()

        saved = None
        watchdog.enter(step, "checkpoint")
        if checkpointer:
            # Background saves that ended are reported (and their failures surfaced) here.
            _report_saves(checkpointer.poll(), reporter, rank)
            if cfg.ckpt_every and (step % cfg.ckpt_every == 0 or step == cfg.steps):
                saved = checkpointer.save(step, labels={"layout": json.dumps(dims.layout())})
                _report_save_start(saved, step, reporter, rank)
                phases.checkpoint, t = _lap(t)

        step_seconds = sum(vars(phases).values())
        watchdog.step_done(step_seconds)
        reporter.step(
            step=step,
            # Pipeline ranks without the last stage have no loss of their own.
            loss=global_loss if loss is None else float(loss),
            grad_norm=grad_norm,
            tokens=local_tokens,
            phases=phases,
            step_seconds=step_seconds,
            lr=lr,
            offset=loader.offset(),
            device=device,
            compute_seconds=guard.compute_s,
            state_checksum=guard.state_checksum if guard.enabled else None,
        )
        if held_out is not None and (step % cfg.eval_every == 0 or step == cfg.steps):
            progress = functools.partial(watchdog.enter, step, "evaluate")
            eval_loss = evaluate(parallel, held_out, cfg.eval_batches, device, progress)
            reporter.evaluated(step, eval_loss.loss, cfg.eval_batches, eval_loss.tokens,
                               eval_loss.seconds)  # fmt: skip
            if rank == 0:
                print(f"[trainer] step {step} validation loss {eval_loss.loss:.4f} "
                      f"({eval_loss.seconds:.2f}s)", flush=True)  # fmt: skip
        if rank == 0 and (step % cfg.log_every == 0 or step == cfg.steps or saved):
            elapsed = time.perf_counter() - run_start
            done = step - start_step
            note = f" | checkpoint staged in {saved.blocking_s:.3f}s" if saved else ""
            if expert_load is not None:
                note += f" | expert load max/mean {expert_load.imbalance:.2f}"
            if parallel.pipeline is not None:
                note += f" | pipeline bubble {parallel.pipeline.bubble_report()}"
            note += f" | fp8 on rank 0: {fp8.summary()}" if fp8 is not None else ""
            print(
                f"[trainer] step {step} loss {global_loss:.4f} "
                f"tok/s {done * tokens_per_step / elapsed:,.0f}{note}",
                flush=True,
            )

    watchdog.enter(cfg.steps, "finish")
    if checkpointer:
        final = checkpointer.finish()
        _report_saves(final, reporter, rank)
        checkpointer.close()
        if any(done.error for done in final):
            raise ScaletrainError(f"the final checkpoint failed: {final[-1].error}")

    full_state = parallel.full_state()  # a collective: every rank takes part
    if rank == 0:
        elapsed = time.perf_counter() - run_start
        digest = state_sha256(full_state)
        logits_digest = probe_logits_sha256(full_state, cfg.model)
        reporter.run_finished(cfg.steps, global_loss, digest, logits_digest, elapsed)
        print(
            f"[trainer] done: final loss {global_loss:.4f}, params sha256 {digest[:16]}", flush=True
        )
    watchdog.stop()
    loader.close()
    reporter.close()
    dist.barrier()
    dist.destroy_process_group()


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


def _flush_on_termination(reporter: Reporter) -> None:
    """When one rank fails, torchrun's agent stops the others with SIGTERM: first hand telemetry
    the records it has not received yet (waiting briefly), so the steps before the failure keep
    their records."""

    def stop(signum: int, _frame: object) -> None:
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


def resume(
    cfg: TrainConfig,
    checkpointer: Checkpointer | None,
    reporter: Reporter,
    loader: DeterministicLoader,
    rank: int,
    required: bool = True,
) -> int:
    """Restore the latest committed checkpoint; refuse if telemetry disagrees with it.

    ckptd serves it from its fastest tier with a verified copy: memory first, then SSD, then S3.
    Not `required` (a restart by torchrun), a run without a checkpoint yet starts over at step 0.
    """
    if checkpointer is None:
        if not required:
            return 0
        raise UserError("--resume needs --ckptd: there is no checkpoint store to resume from")
    step, none_because = _latest_step(cfg, rank)
    if step < 0:
        if required:
            raise NotFound(none_because)
        if rank == 0:
            print(f"[trainer] run {cfg.run_id}: no checkpoint yet, starting over", flush=True)
        return 0
    train_state = checkpointer.load(step)
    check_config(cfg, step, train_state.get("config", ""), reporter, rank)
    expected = loader.offset()
    recorded = reporter.resume_offsets(step)
    if recorded is not None and (recorded or required):
        check_offsets(cfg.run_id, step, rank, expected, recorded, loader.dp_size)
    elif recorded is not None and rank == 0:
        # A rank killed right after the save took its unsent records of the step with it.
        print(
            f"[trainer] telemetry has no record of step {step} (lost with the failed attempt): "
            "resuming at the checkpoint's own data-loader offsets",
            flush=True,
        )
    if rank == 0:
        print(
            f"[trainer] resumed run {cfg.run_id} from step {train_state['step']} "
            f"(global sample {expected.global_sample}); read "
            f"{describe_sources(checkpointer.restored_from)}",
            flush=True,
        )
    return int(train_state["step"])


def check_config(
    cfg: TrainConfig, step: int, saved_toml: str, reporter: Reporter, rank: int
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
        reporter.config_changed(step, changed)


def _latest_step(cfg: TrainConfig, rank: int) -> tuple[int, str]:
    """The step every rank restores, or -1 and ckptd's reason there is none: rank 0 asks its
    node's ckptd and tells the others, so that ranks on nodes whose ckptds learned of a commit at
    different instants still restore the same step."""
    from ckptd.client import CkptdClient

    step, none_because, error = -1, "", ""
    if rank == 0:
        assert cfg.ckptd is not None
        with CkptdClient(cfg.ckptd) as client:
            try:
                step = int(client.get(cfg.run_id).ref.step)
            except NotFound as exc:
                none_because = str(exc)
            except ScaletrainError as exc:
                error = str(exc)
    shared: list[object] = [step, none_because, error]
    dist.broadcast_object_list(shared, src=0)
    if shared[2]:
        raise ScaletrainError(str(shared[2]))
    return int(shared[0]), str(shared[1])  # type: ignore[call-overload]


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


def _lap(start: float) -> tuple[float, float]:
    now = time.perf_counter()
    return now - start, now


def _hardware(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({socket.gethostname()})"
