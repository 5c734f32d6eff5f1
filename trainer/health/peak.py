"""The dense peak FLOP/s of one device in the training precision: what MFU divides by.

On an accelerator the peak comes from the datasheet table in `telemetry.mfu` (or `--peak-flops`).
A CPU has no datasheet figure that means anything for one rank among others on shared cores, so
the peak is measured: a calibration GEMM in the training precision with the rank's own threads,
and the figure says so ("calibrated: ...").
"""

from __future__ import annotations

import time

import torch

from telemetry import mfu

_PRECISIONS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def training_precision(param_dtype: torch.dtype, device: torch.device) -> str:
    """The precision the matrix multiplications run in: fp32 matmuls are "tf32" on CUDA when
    PyTorch allows TF32 for them."""
    precision = _PRECISIONS.get(param_dtype)
    if precision is None:
        raise ValueError(f"no MFU precision for parameters of {param_dtype}")
    if precision == "fp32" and device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return precision


def resolve_peak(
    device: torch.device, precision: str, override: float | None, *, calibrate_s: float = 0.3
) -> tuple[float, str]:
    """(dense peak FLOP/s of one device, where it comes from); (0.0, why) when unknown."""
    if override is not None:
        return override, "--peak-flops"
    if device.type == "cpu":
        dtype = {v: k for k, v in _PRECISIONS.items()}[precision]
        size = 512
        flops = calibrate_gemm(size, dtype, calibrate_s)
        threads = torch.get_num_threads()
        return flops, f"calibrated: {size}x{size} {precision} GEMM, {threads} thread(s) per rank"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    peak = mfu.dense_peak(name, precision)
    if peak is None:
        return 0.0, f"unknown: no dense {precision} peak for {name}; pass --peak-flops"
    return peak, f"datasheet: {mfu.device_key(name)} dense {precision}"


def calibrate_gemm(size: int, dtype: torch.dtype, seconds: float) -> float:
    """FLOP/s of a size x size GEMM on the CPU: the best of repeated timings over `seconds`."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    out = torch.empty(size, size, dtype=dtype)
    torch.mm(a, b, out=out)
    best = float("inf")
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or best == float("inf"):
        started = time.perf_counter()
        torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - started)
    return 2.0 * size**3 / best
