"""Workloads: traces, synthetic arrivals, prompt synthesis and mixes, as one request stream.

Pure Python (no torch, no engine): the load generator and the simulator both consume it.
"""
from sloserve.workload.arrivals import ArrivalProcess, make_process
from sloserve.workload.build import NAMES, WorkloadSpec, build_stream
from sloserve.workload.mix import ClassSpec, Mix, TenantSpec, assign_mix, load_mix, parse_mix
from sloserve.workload.synth import PromptSynthesizer
from sloserve.workload.types import WorkloadRequest

__all__ = [
    "ArrivalProcess", "ClassSpec", "Mix", "NAMES", "PromptSynthesizer", "TenantSpec", "WorkloadRequest",
    "WorkloadSpec", "assign_mix", "build_stream", "load_mix", "make_process", "parse_mix",
]
