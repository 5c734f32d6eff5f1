"""How long does a checkpoint stop training? Our async save against stock PyTorch, one state.

In one process (world 1: gloo on CPU, NCCL on a GPU), on one FSDP2-wrapped Llama-style model
with its AdamW state:
  floor          copy of every tensor of the state into preallocated host buffers (pinned from a
                 GPU)
  ours           scaletrain's async save to ckptd (a real `scaletrain ckptd` child process):
                 blocking time = staging into reused buffers (its lazy part waited for at
                 once, as if no forward and backward hid it); background = streaming + commit
  dcp.save       synchronous save to local disk
  dcp.async_save stock asynchronous save to local disk (blocking part)
and the training throughput while our saves stream in the background against none.

    .venv/bin/python bench/ckpt_stall.py [--dim 768 --layers 8 --steps 12]
    python bench/ckpt_stall.py --device cuda --dim 3072 --layers 8   # ~9.6 GB of state, the size
        # ../shared/bench/h200_ckpt_baseline.py saves (DL=4096,12): run both in one command

Prints one JSON object. Targets (issue 6): ours <= 1.5x floor, >= 10x below dcp.save, and
throughput while saving >= 0.95 of throughput without saves.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict

from scaletrain.app.stack import free_port
from scaletrain.transport import wait_until_healthy
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.data.corpus import stdlib_corpus
from trainer.data.loader import DeterministicLoader
from trainer.model.llama import ModelArgs, Transformer
from trainer.parallel.dims import ParallelDims
from trainer.parallel.fsdp import apply_fsdp


def _local_tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, dict):
        return [t for v in state.values() for t in _local_tensors(v)]
    if isinstance(state, list):
        return [t for v in state for t in _local_tensors(v)]
    if isinstance(state, torch.Tensor):
        return [state.to_local() if hasattr(state, "to_local") else state]
    return []


def _best(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args()

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    device = torch.device(args.device)
    if device.type == "cuda":  # as the trainer does
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, rank=0, world_size=1)
    else:
        dist.init_process_group("gloo", rank=0, world_size=1)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=args.dim, n_layers=args.layers, n_heads=12, n_kv_heads=4))
    model.init_weights(0)
    model.to(device)
    apply_fsdp([model], ParallelDims(1).build_mesh(device.type).fsdp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    loader = DeterministicLoader(stdlib_corpus(2 << 20), 128, 8, 0, 1, seed=0)

    def train_step(before_update: Callable[[], None] = lambda: None) -> None:
        inputs, targets = (t.to(device) for t in loader.next_batch())
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        before_update()  # a lazy save's copy of the state waits here, as in trainer.step
        optimizer.step()
        optimizer.zero_grad()

    train_step()  # materialises the optimizer state
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    tensors = _local_tensors(state)
    state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda) for t in tensors]

    def copy_floor() -> None:
        for buf, t in zip(buffers, tensors, strict=True):
            buf.copy_(t, non_blocking=t.is_cuda)
        sync()

    floor = _best(copy_floor)

    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        sync_s = _best(lambda: dcp.save(state, checkpoint_id=str(tmp_path / "sync")), repeats=2)
        start = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=str(tmp_path / "async"))
        async_blocking = time.perf_counter() - start
        future.result()

        address = f"127.0.0.1:{free_port()}"
        ckptd = subprocess.Popen(
            [sys.executable, "-m", "scaletrain", "ckptd", "--listen", address,
             "--data-dir", str(tmp_path / "ckptd"),
             "--memory-budget-mb", str(max(4096, 3 * state_bytes >> 20))],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            wait_until_healthy(address, timeout_s=60)
            checkpointer = Checkpointer(address, "bench", model, optimizer, scheduler, loader)
            blocking, background = [], []
            for step in range(1, 4):
                started = checkpointer.save(step, labels={})
                # The staging is lazy: the loop waits for the copy before its next optimizer
                # step. Waited for at once here (no forward and backward to hide it behind),
                # so this is the most a save can stop training.
                wait_start = time.perf_counter()
                checkpointer.wait_staged()
                blocking.append(started.blocking_s + time.perf_counter() - wait_start)
                (done,) = checkpointer.finish()
                assert done.error is None, done.error
                background.append(done.background_s)

            # Throughput: the same steps without saves, then with a save streaming throughout.
            start = time.perf_counter()
            for _ in range(args.steps):
                train_step()
            sync()
            plain = args.steps / (time.perf_counter() - start)
            start = time.perf_counter()
            for i in range(args.steps):
                if checkpointer.poll() or i == 0:
                    checkpointer.save(100 + i, labels={})
                train_step(checkpointer.wait_staged)
            sync()
            saving = args.steps / (time.perf_counter() - start)
            checkpointer.close()
        finally:
            ckptd.terminate()
            ckptd.wait()

    ours = min(blocking[1:])  # buffers are allocated at the first save and reused after
    print(json.dumps({
        "device": str(device),
        "state_mb": round(state_bytes / 1e6, 1),
        "floor_copy_s": round(floor, 4),
        "ours_blocking_s": round(ours, 4),
        "ours_first_save_blocking_s": round(blocking[0], 4),
        "ours_background_s": round(min(background), 3),
        "dcp_save_s": round(sync_s, 3),
        "dcp_async_save_blocking_s": round(async_blocking, 3),
        "ours_over_floor": round(ours / floor, 2),
        "dcp_save_over_ours": round(sync_s / ours, 1),
        "dcp_async_save_over_ours": round(async_blocking / ours, 1),
        "steps_per_s_plain": round(plain, 3),
        "steps_per_s_while_saving": round(saving, 3),
        "throughput_ratio_while_saving": round(saving / plain, 3),
    }, indent=2))  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
