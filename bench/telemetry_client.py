"""What does reporting to telemetry cost a training step, as a fraction of the step?

Trains the trainer's default model (one rank's share of the default batch: 4 x 128 tokens) on the
CPU for some steps, reporting every step through the trainer's own Reporter to a `scaletrain
telemetry` service running as its own process, as deployed. The client's cost per step is
  (time inside Reporter.step: building the record, queueing it)
  + (CPU time of the client's background sender thread: batching, serialising, sending) / steps,
and the figure printed is that over the mean step time (forward, backward, optimizer). Also printed,
for reference: what the step guard's per-step checks (state copy and checksums) cost, timed the same
way on the same state. Run: `.venv/bin/python bench/telemetry_client.py [--steps 100]`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from scaletrain.v1 import telemetry_pb2
from trainer.data.loader import LoaderOffset
from trainer.health.snapshot import StateSnapshot, checksum
from trainer.model.llama import ModelArgs, Transformer
from trainer.reporting import Reporter
from trainer.train import Phases

sys.path.insert(0, str(Path(__file__).resolve().parent))
from telemetry_ingest import service


def thread_cpu_seconds(name: str) -> float:
    """CPU seconds the live thread called `name` has used so far."""
    thread = next(t for t in threading.enumerate() if t.name == name)
    assert thread.ident is not None
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Transformer(ModelArgs())
    model.init_weights(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs = torch.randint(0, 256, (4, 128))
    device = torch.device("cpu")
    with tempfile.TemporaryDirectory(prefix="telemetry-client-") as tmp:
        with service(f"sqlite:///{Path(tmp) / 'telemetry.db'}") as (address, _):
            reporter = Reporter(address, "bench", 0)
            assert reporter.client is not None
            reporter.client.register_run(
                telemetry_pb2.RegisterRunRequest(run_id="bench", world_size=1)
            )
            step_s = report_s = 0.0
            sender_before = 0.0
            for step in range(1, args.warmup + args.steps + 1):
                if step == args.warmup + 1:
                    step_s = report_s = 0.0
                    sender_before = thread_cpu_seconds("telemetry-sender")
                started = time.perf_counter()
                loss = F.cross_entropy(model(inputs).flatten(0, 1), inputs.flatten())
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                stepped = time.perf_counter()
                reporter.step(
                    step=step,
                    loss=loss.item(),
                    grad_norm=1.0,
                    tokens=inputs.numel(),
                    phases=Phases(forward=0.01, backward=0.02, optimizer=0.01),
                    step_seconds=stepped - started,
                    lr=1e-3,
                    offset=LoaderOffset(step * 16, step * 16, 0),
                    device=device,
                    compute_seconds=stepped - started,
                    state_checksum=step,
                )
                report_s += time.perf_counter() - stepped
                step_s += stepped - started
            if not reporter.client.flush(timeout_s=60):
                raise SystemExit("the service did not acknowledge every record")
            sender_s = thread_cpu_seconds("telemetry-sender") - sender_before
            reporter.close()
        guard_s = guard_checks_seconds(model, optimizer, args.steps)
    steps = args.steps
    client = (report_s + sender_s) / steps
    print(f"mean step time (1 rank, 4x128 tokens, CPU): {step_s / steps * 1e3:8.2f} ms")
    print(f"Reporter.step in the loop:                  {report_s / steps * 1e6:8.1f} us/step")
    print(f"sender thread CPU:                          {sender_s / steps * 1e6:8.1f} us/step")
    print(f"ratio telemetry client cost/step time: {client / (step_s / steps):.4%}")
    print(
        f"for reference, step guard checks: {guard_s * 1e3:.2f} ms/step, "
        f"{guard_s / (step_s / steps):.2%} of the step"
    )


def guard_checks_seconds(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, repeats: int
) -> float:
    """Seconds per step of the guard's checks on a normal step: verify the state at rest, checksum
    the gradients and the new state, keep it (the gather of a few integers excluded)."""
    snapshot = StateSnapshot(model, optimizer)
    snapshot.capture()
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    started = time.perf_counter()
    for _ in range(repeats):
        snapshot.unchanged()
        checksum(p.grad for p in model.parameters() if p.grad is not None)
        snapshot.stage()
        snapshot.commit()
    return (time.perf_counter() - started) / repeats


if __name__ == "__main__":
    main()
