"""Hugging Face export and import, each beside its stock DCP baseline in the same command.

- export: `scaletrain ckpt export --format hf` of a trainer-style checkpoint (model, AdamW's two
  moments, the job config) held by a real ckptd on loopback (memory tier) ÷ the stock DCP export
  (`scaletrain ckpt export`) of the same checkpoint; throughput ratio = DCP seconds / HF seconds.
  The HF export reads only the model's third of the checkpoint, maps it and writes safetensors;
  the DCP export copies every byte.
- import: `--init-from-hf` (`load_hf_weights`) into an FSDP layout over gloo ranks ÷ `dcp.load`
  of the same weights, saved by DCP, into the same layout: DCP seconds / HF seconds, the slowest
  rank's time, best of --runs, in one torchrun job.

Run: `OMP_NUM_THREADS=1 .venv/bin/python bench/hf_interop.py [--dim 1024] [--layers 4]
[--vocab 32768] [--ranks 2] [--runs 3]` (113M parameters, 0.45 GB in fp32, by default).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from ckptd.config import CkptdConfig
from ckptd.dcp import CkptdStorageWriter
from ckptd.server import start
from scaletrain.app import checkpoints
from trainer import options
from trainer.config import from_values
from trainer.interop.hf_export import export_hf
from trainer.interop.hf_import import load_hf_weights
from trainer.model.llama import Transformer
from trainer.parallel.dims import validate_layout
from trainer.parallel.parallelize import build_model


def job(dims: list[int]) -> dict[str, options.Value]:
    dim, layers, vocab = dims
    return options.resolve({"run_id": "bench", "dim": dim, "n_layers": layers,
                            "n_heads": max(dim // 64, 1),
                            "n_kv_heads": max(dim // 128, 1),
                            "vocab_size": vocab, "seq_len": 16})  # fmt: skip


def best(seconds: list[float]) -> float:
    return min(seconds)


def bench_export(work: Path, values: dict, runs: int) -> tuple[float, float, int, int]:
    """(DCP export seconds, HF export seconds, checkpoint bytes, HF weight bytes), best of runs."""
    cfg = from_values(values)
    model = Transformer(cfg.model)
    model.init_weights(cfg.seed)
    # AdamW's two moments, as in every trainer checkpoint: the bytes the stock export copies too.
    moments = {k: {"exp_avg": torch.randn_like(v), "exp_avg_sq": torch.rand_like(v)}
               for k, v in model.state_dict().items()}  # fmt: skip
    state = {"model": model.state_dict(), "optim": moments,
             "train": {"config": options.to_toml(values)}}  # fmt: skip
    ckptd = start(CkptdConfig(data_dir=work / "ckptd", memory_budget_bytes=8 << 30))
    try:
        writer = CkptdStorageWriter(ckptd.address, "bench", 1)
        dcp.save(state, storage_writer=writer, no_dist=True)
        writer.close()
        del state, moments
        info = checkpoints.show(work, ckptd.address, "bench", 1)
        dcp_s, hf_s, hf_bytes = [], [], 0
        for run in range(runs):
            start_s = time.perf_counter()
            checkpoints.export(work, ckptd.address, "bench", 1, work / f"dcp{run}",
                               out=io.StringIO())  # fmt: skip
            dcp_s.append(time.perf_counter() - start_s)
            start_s = time.perf_counter()
            hf_bytes = checkpoints.export_hf(work, ckptd.address, "bench", 1,
                                             work / f"hf{run}").weight_bytes  # fmt: skip
            hf_s.append(time.perf_counter() - start_s)
    finally:
        ckptd.stop()
    return best(dcp_s), best(hf_s), int(info["bytes"]), hf_bytes


def worker(dims: list[int], hf_dir: str, dcp_dir: str, runs: int, out: str) -> None:
    """One rank: the FSDP model loaded by dcp.load and by load_hf_weights, each timed."""
    dist.init_process_group("gloo")
    cfg = from_values(job(dims))
    mesh = validate_layout(cfg, dist.get_world_size()).build_mesh("cpu")
    model = build_model(cfg, mesh, torch.device("cpu"))[0].model
    times: dict[str, list[float]] = {"dcp": [], "hf": []}
    for _ in range(runs):
        for how in ("dcp", "hf"):
            dist.barrier()
            start_s = time.perf_counter()
            if how == "dcp":
                dcp.load({"model": get_model_state_dict(model)},
                         storage_reader=dcp.FileSystemReader(dcp_dir))  # fmt: skip
            else:
                load_hf_weights(model, Path(hf_dir), cfg.model)
            dist.barrier()
            times[how].append(time.perf_counter() - start_s)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({how: best(t) for how, t in times.items()}))
    dist.destroy_process_group()


def bench_import(work: Path, values: dict, dims: list[int], ranks: int, runs: int) -> dict:
    """{"dcp": seconds, "hf": seconds} of the slowest rank, best of runs."""
    cfg = from_values(values)
    model = Transformer(cfg.model)
    model.init_weights(cfg.seed)
    state = {"model": model.state_dict(), "train": {"config": options.to_toml(values)}}
    dcp.save(state, checkpoint_id=work / "weights", no_dist=True)
    (work / "hf-weights").mkdir()
    export_hf(dcp.FileSystemReader(work / "weights"), work / "hf-weights")
    out = work / "import.json"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(ranks), __file__, "--worker", "--dims", ",".join(map(str, dims)),
            "--hf-dir", str(work / "hf-weights"), "--dcp-dir", str(work / "weights"),
            "--runs", str(runs), "--out", str(out)]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"the import job failed on {ranks} ranks:\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dims", help=argparse.SUPPRESS)
    parser.add_argument("--hf-dir", help=argparse.SUPPRESS)
    parser.add_argument("--dcp-dir", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        dims = [int(d) for d in args.dims.split(",")]
        worker(dims, args.hf_dir, args.dcp_dir, args.runs, args.out)
        return
    dims = [args.dim, args.layers, args.vocab]
    values = job(dims)
    with torch.device("meta"):
        n = Transformer(from_values(values).model).num_params(exclude_embedding=False)
    print(f"{n / 1e6:,.0f}M parameters ({4 * n / 1e6:,.0f} MB in fp32), best of {args.runs}")
    with tempfile.TemporaryDirectory(prefix="hf-interop-") as tmp:
        dcp_s, hf_s, ckpt_bytes, hf_bytes = bench_export(Path(tmp) / "export", values, args.runs)
        print(f"stock DCP export: {dcp_s:.2f} s ({ckpt_bytes / 1e6:,.0f} MB, "
              f"{ckpt_bytes / dcp_s / 1e6:,.0f} MB/s); HF export: {hf_s:.2f} s "
              f"({hf_bytes / 1e6:,.0f} MB of weights)")  # fmt: skip
        print(f"ratio HF export / DCP export (throughput, DCP s / HF s): {dcp_s / hf_s:.2f}")
        (Path(tmp) / "import").mkdir()
        loads = bench_import(Path(tmp) / "import", values, dims, args.ranks, args.runs)
        print(f"into FSDP over {args.ranks} gloo ranks: dcp.load {loads['dcp']:.2f} s, "
              f"--init-from-hf {loads['hf']:.2f} s")  # fmt: skip
        print(f"ratio HF import / dcp.load (DCP s / HF s): {loads['dcp'] / loads['hf']:.2f}")


if __name__ == "__main__":
    main()
