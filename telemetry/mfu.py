"""Model and hardware FLOPs utilisation: dense peaks per device and precision, and the formulas.

MFU = 6 * N * tokens/s / (devices * dense peak in the training precision), N the parameters without
the embedding (PaLM's definition, without the attention term). HFU counts the FLOPs the hardware
really did: recomputing a fraction r of the forward pass in backward (activation checkpointing)
adds 2 * N * r per token. Peaks are the datasheet's dense figures (no 2:4 sparsity): sparse
figures would halve every MFU.
"""

from __future__ import annotations

import math

TERA = 1e12
# Dense peak FLOP/s of one device per precision, from NVIDIA's datasheets. "fp32" is the CUDA-core
# rate (PyTorch's default: TF32 off for matmuls), "tf32" the tensor-core rate with TF32 allowed.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "a100": {"fp32": 19.5 * TERA, "tf32": 156 * TERA, "bf16": 312 * TERA, "fp16": 312 * TERA},
    "h100-sxm": {
        "fp32": 66.9 * TERA,
        "tf32": 494.7 * TERA,
        "bf16": 989.4 * TERA,
        "fp16": 989.4 * TERA,
        "fp8": 1978.9 * TERA,
    },
    "h100-pcie": {
        "fp32": 51.2 * TERA,
        "tf32": 378 * TERA,
        "bf16": 756 * TERA,
        "fp16": 756 * TERA,
        "fp8": 1513 * TERA,
    },
    # The H200 is an H100 SXM die with more and faster memory: the same compute peaks.
    "h200": {
        "fp32": 66.9 * TERA,
        "tf32": 494.7 * TERA,
        "bf16": 989.4 * TERA,
        "fp16": 989.4 * TERA,
        "fp8": 1978.9 * TERA,
    },
    # HGX B200 at 1000 W.
    "b200": {
        "fp32": 80 * TERA,
        "tf32": 1100 * TERA,
        "bf16": 2250 * TERA,
        "fp16": 2250 * TERA,
        "fp8": 4500 * TERA,
    },
}
# Substrings of device names (as torch.cuda.get_device_name gives them, lower-cased) and the table
# entry they mean, most specific first: "NVIDIA H100 PCIe" must not read as an H100 SXM.
_DEVICE_PATTERNS = (
    ("h100 pcie", "h100-pcie"),
    ("h100", "h100-sxm"),
    ("gh200", "h200"),
    ("h200", "h200"),
    ("a100", "a100"),
    ("b200", "b200"),
)


def device_key(device_name: str) -> str | None:
    """The PEAK_FLOPS entry of a device name ("NVIDIA H100 80GB HBM3" -> "h100-sxm"), or None."""
    name = device_name.lower()
    for pattern, key in _DEVICE_PATTERNS:
        if pattern in name:
            return key
    return None


# Memory of one device in bytes (the datasheet's GB, 10^9 bytes): what a rank's planned memory
# must fit in (`scaletrain plan`).
DEVICE_MEMORY: dict[str, float] = {
    "a100": 80e9,
    "h100-sxm": 80e9,
    "h100-pcie": 80e9,
    "h200": 141e9,
    "b200": 180e9,
}


def device_memory(device_name: str) -> float | None:
    """The memory of one such device in bytes; None when the table lacks it."""
    key = device_key(device_name)
    return None if key is None else DEVICE_MEMORY.get(key)


def dense_peak(device_name: str, precision: str) -> float | None:
    """The dense peak FLOP/s of one such device in `precision`; None when the table lacks it."""
    key = device_key(device_name)
    return None if key is None else PEAK_FLOPS[key].get(precision)


def model_flops_per_token(params: int) -> float:
    """FLOPs one token costs the model in forward and backward: 6 N (2 N forward, 4 N backward)."""
    return 6.0 * params


def hardware_flops_per_token(params: int, recompute_fraction: float) -> float:
    """FLOPs one token costs the hardware: a recomputed fraction r of the forward adds 2 N r."""
    return (6.0 + 2.0 * recompute_fraction) * params


def utilization(
    flops_per_token: float, tokens_per_s: float, devices: int, peak_flops: float
) -> float:
    """Achieved FLOP/s over what `devices` devices of `peak_flops` each could do; NaN if unknown."""
    if not (peak_flops > 0 and devices > 0 and math.isfinite(tokens_per_s)):
        return math.nan
    return flops_per_token * tokens_per_s / (devices * peak_flops)
