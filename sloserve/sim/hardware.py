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
    # bytes/s of the host's local NVMe, which the prefix cache's disk tier reads and writes: one
    # PCIe Gen4 x4 data-centre SSD reads ~7 GB/s sequentially (Samsung PM9A3 / Micron 7450 class
    # datasheets: 6.5-7 GB/s read, 3.5-5 GB/s write). One instance per SSD is assumed.
    disk_bandwidth: float = 6.5e9


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
    # NVIDIA A10 Tensor Core GPU datasheet: BF16 Tensor Core 125 TFLOPS dense (250 with sparsity), 24 GB GDDR6 at
    # 600 GB/s, PCIe Gen4 x16 64 GB/s (both directions together; 32 GB/s each way), no NVLink. The datasheet was
    # cited from memory and cross-checked against third-party spec listings (600.2 GB/s, 24 GB, PCIe 4.0 x16).
    # The Llumnix (OSDI '24) evaluation's GPU: LLaMA-7B on one A10 leaves little room for KV.
    "a10-24g": HardwareSpec("a10-24g", 125e12, 600e9, 24e9, 32e9, 32e9),
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


# Links between instances, one direction, in bytes/s: what a migration's KV copy runs over. These are
# signalling rates of the link; a real copy reaches perhaps 70-90% of them (protocol, packetisation).
LINKS: dict[str, float] = {
    # NVLink, per GPU, one direction (the datasheets quote both directions added): A100 NVLink 3,
    # 600 GB/s total (12 links x 25 GB/s each way); H100 / H200 NVLink 4, 900 GB/s total (18 links x 25 GB/s).
    "nvlink-a100": 300e9,
    "nvlink-h100": 450e9,
    "nvlink-h200": 450e9,
    # InfiniBand NDR: 400 Gb/s per port (one ConnectX-7 NIC per GPU in DGX/HGX H100 systems).
    "infiniband-ndr": 400e9 / 8,
    # RoCE over 200 and 100 Gb/s Ethernet NICs (ConnectX-6 class).
    "roce-200g": 200e9 / 8,
    "roce-100g": 100e9 / 8,
    # PCIe x16, one direction: Gen4 16 GT/s x 16 lanes (128b/130b) ~ 32 GB/s (NVIDIA's "64 GB/s" counts both
    # directions); Gen5 32 GT/s ~ 64 GB/s. Two GPUs in one host copying peer to peer through the switch.
    "pcie-gen4": 32e9,
    "pcie-gen5": 64e9,
    # Plain Ethernet, TCP: 25 GbE and 100 GbE line rates.
    "ethernet-25g": 25e9 / 8,
    "ethernet-100g": 100e9 / 8,
}

DEFAULT_LINK = "infiniband-ndr"  # instances on different hosts, one NDR NIC per GPU


def get_link(name: str) -> float:
    """Bytes/s of a named link, one direction."""
    try:
        return LINKS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown link {name!r}; choose from {sorted(LINKS)}") from None
