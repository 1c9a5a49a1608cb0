"""Accelerator specs for the analytical cost model. Each number cites its public source.

Peak FLOP/s are dense (no structured sparsity) for the dtype the fleet serves in (bf16).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HardwareSpec:
    name: str
    peak_flops: float  # dense bf16 FLOP/s
    mem_bandwidth: float  # bytes/s of device memory
    mem_bytes: float  # device memory capacity
    interconnect_bandwidth: float  # bytes/s per device for tensor-parallel all-reduce (NVLink / PCIe)
    host_link_bandwidth: float  # bytes/s between device and host memory (swap / offload)


HARDWARE: dict[str, HardwareSpec] = {
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): BF16 312 TFLOPS dense, HBM2e 2,039 GB/s,
    # NVLink 600 GB/s, PCIe Gen4 64 GB/s.
    "a100-80g": HardwareSpec("a100-80g", 312e12, 2039e9, 80e9, 600e9, 32e9),
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): BF16 1,979 TFLOPS with sparsity = 989 dense,
    # HBM3 3.35 TB/s, 80 GB, NVLink 900 GB/s, PCIe Gen5 128 GB/s.
    "h100-80g": HardwareSpec("h100-80g", 989e12, 3.35e12, 80e9, 900e9, 64e9),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): BF16 989 TFLOPS dense, HBM3e 4.8 TB/s, 141 GB,
    # NVLink 900 GB/s, PCIe Gen5 128 GB/s.
    "h200": HardwareSpec("h200", 989e12, 4.8e12, 141e9, 900e9, 64e9),
    # NVIDIA L40S datasheet: BF16 362.05 TFLOPS dense (733 with sparsity), GDDR6 864 GB/s, 48 GB,
    # PCIe Gen4 x16 64 GB/s (no NVLink: tensor parallelism crosses PCIe).
    "l40s": HardwareSpec("l40s", 362e12, 864e9, 48e9, 32e9, 32e9),
    # The 2-vCPU AVX2 development machine this project is tested on, measured here: fp32 GEMM peak
    # from a 2048^3 torch.mm, bandwidth from a large torch copy (see BENCHMARKS.md). Use the profiled
    # cost model (`sloserve profile`) for anything that must match the real engine closely.
    "cpu": HardwareSpec("cpu", 90e9, 12e9, 24e9, 12e9, 12e9),
}


def get_hardware(name: str) -> HardwareSpec:
    try:
        return HARDWARE[name.lower()]
    except KeyError:
        raise ValueError(f"unknown hardware {name!r}; choose from {sorted(HARDWARE)}") from None
