"""Peak resident memory a rank adds while building and sharding a model over gloo ranks (FSDP).

Two paths, each in its own torchrun job of the same command (a process's peak RSS never goes
down, so they cannot share processes), on the same model and layout:
- old: every rank builds the whole model on the CPU, initialises every element, then FSDP2
  shards it (what the trainer did before it built on the meta device; the initialisation is
  today's counter-based one, which needs less scratch memory than the old full-tensor draws);
- new: `build_model`, as the trainer does: the model on the meta device, laid out, then only
  this rank's shards allocated and initialised.
A rank's figure is its peak RSS (getrusage) after the build minus its RSS just before it; the
ratio is old / new of the largest figure over ranks.

Run: `.venv/bin/python bench/model_build_memory.py [--ranks 4] [--dim 1024] [--layers 20]
[--vocab 32768]` (about 300M parameters by default).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.config import TrainConfig
from trainer.model.llama import ModelArgs, Transformer
from trainer.parallel.dims import validate_layout
from trainer.parallel.fsdp import apply_fsdp
from trainer.parallel.parallelize import build_model


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3  # KiB on Linux


def worker(path: str, args: ModelArgs, out: str) -> None:
    """One rank of one path: build, then report (RSS added, seconds, parameter bytes)."""
    dist.init_process_group("gloo")
    cfg = TrainConfig(run_id="bench", model=args, seq_len=16, global_batch=dist.get_world_size())
    mesh = validate_layout(cfg, dist.get_world_size()).build_mesh("cpu")
    before, start = _rss_mb(), time.perf_counter()
    if path == "old":
        model = Transformer(cfg.model)
        model.init_weights(cfg.seed)
        apply_fsdp([model], mesh.fsdp)
    else:
        model = build_model(cfg, mesh, torch.device("cpu"))[0].model
    seconds = time.perf_counter() - start
    mine = {"added_mb": _peak_rss_mb() - before, "seconds": seconds}
    every: list[dict[str, float] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(every))
    del model
    dist.barrier()
    dist.destroy_process_group()


def run(path: str, ranks: int, dims: list[int]) -> list[dict[str, float]]:
    with tempfile.TemporaryDirectory(prefix="build-memory-") as tmp:
        out = Path(tmp) / "ranks.json"
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(ranks), __file__, "--worker", path, "--out", str(out),
                "--dims", ",".join(map(str, dims))]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"the {path} path failed on {ranks} ranks:\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())


def model_args(dims: list[int]) -> ModelArgs:
    dim, layers, heads, kv_heads, vocab = dims
    return ModelArgs(dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv_heads,
                     vocab_size=vocab)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--worker", choices=("old", "new"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--dims", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, model_args([int(d) for d in args.dims.split(",")]), args.out)
        # Its figures are written: skip the interpreter's teardown, where torch's threads once
        # aborted a rank ("terminate called without an active exception") and failed the run.
        sys.stdout.flush()
        os._exit(0)
    dims = [args.dim, args.layers, args.heads, args.kv_heads, args.vocab]
    with torch.device("meta"):
        n = Transformer(model_args(dims)).num_params(exclude_embedding=False)
    print(f"{n / 1e6:,.0f}M parameters ({4 * n / 1e6:,.0f} MB in fp32), FSDP over {args.ranks} "
          "gloo ranks; peak RSS added by the build, largest over ranks")  # fmt: skip
    figures = {}
    for path, what in (("old", "whole model on every rank, then sharded"),
                       ("new", "meta device, local shards only")):  # fmt: skip
        ranks = run(path, args.ranks, dims)
        figures[path] = max(r["added_mb"] for r in ranks)
        seconds = max(r["seconds"] for r in ranks)
        print(f"{path} path ({what}): {figures[path]:,.0f} MB, build {seconds:.1f} s")
    print(f"ratio old/new peak RSS added: {figures['old'] / max(figures['new'], 1e-9):.2f}x")


if __name__ == "__main__":
    main()
